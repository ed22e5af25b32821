"""Slice a training batch for this context-parallel rank in any layout.

Megatron's own ``get_batch_on_this_cp_rank`` only knows zigzag. This one takes the layout and
uses :func:`megatron_burst.layout.layout_indices`, the same positions the attention engine and
:mod:`megatron_burst.megatron.rope` assume, so tokens, labels, masks and RoPE stay aligned.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron_burst.masks.layout import BALANCED, check_layout, check_seq_len, layout_indices_on
from megatron_burst.megatron.groups import cp_rank_and_size


_cp_rank_size = cp_rank_and_size  # the name this module used


_MASK_ERROR = ("attention_mask is not the plain causal mask (a dense mask is never applied under megatron-burst "
               "attention): for --reset-attention-mask documents pass eod_token (the documents then come from "
               "the EOD tokens); padding masks are not supported: build batches without them, or without an "
               "attention mask at all (create_attention_mask=False / --no-create-attention-mask-in-dataloader)")
# the device-side check's message: CUDA's assert takes fewer than 255 characters
_DEVICE_MASK_ERROR = ("megatron-burst: attention_mask is not the plain causal mask. Pass eod_token for "
                      "--reset-attention-mask documents; padding masks are unsupported "
                      "(--no-create-attention-mask-in-dataloader)")
_MASK_ROWS_PER_CHUNK = 1024


def check_causal_attention_mask(mask: torch.Tensor, seq_len: int) -> None:
    """Raise unless ``mask`` is Megatron's plain causal mask ([b|1, 1, s, s], True = hidden).

    CP attention derives causality from positions and never applies a dense mask: documents reach
    it as boundaries (``eod_token`` below), and any other mask (padding) must not be silently dropped.
    The comparison runs over chunks of rows (no second s x s tensor). A CPU mask raises ValueError
    here; on a GPU the verdict stays on the device (``torch._assert_async``, no host sync): a
    wrong mask stops the job at the next synchronization with a shorter message (CUDA's limit).
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (seq_len, seq_len):
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} is not a [b, 1, {seq_len}, "
                         f"{seq_len}] causal mask")
    cols = torch.arange(seq_len, device=mask.device)
    wrong = torch.zeros((), dtype=torch.bool, device=mask.device)
    for r0 in range(0, seq_len, _MASK_ROWS_PER_CHUNK):
        rows = torch.arange(r0, min(r0 + _MASK_ROWS_PER_CHUNK, seq_len), device=mask.device)
        hidden = cols[None, :] > rows[:, None]  # [rows, s]: the causal mask's rows
        wrong |= (mask[:, 0, r0:r0 + rows.numel()].bool() != hidden).any()
    if mask.device.type == "cpu":
        if bool(wrong):
            raise ValueError(_MASK_ERROR)
    else:
        torch._assert_async(~wrong, _DEVICE_MASK_ERROR)


def get_batch_on_this_cp_rank(batch: Dict[str, Any], layout: str = "zigzag",
                              cp_group: Optional[dist.ProcessGroup] = None,
                              stripe: int = 1, eod_token: Optional[int] = None,
                              ranks_per_node: Optional[int] = None) -> Dict[str, Any]:
    """This CP rank's part of ``batch`` in ``layout``; returns a new dict with the same keys.

    ``batch`` maps names to [b, s, ...] tensors (tokens, labels, loss_mask, position_ids, ...) or
    None; each is sliced along dim 1 to the positions ``layout_indices(s, rank, W, layout)``.
    ``attention_mask`` ([b, 1, s, s], True = hidden) is checked to be the plain causal mask and
    replaced by None: the attention engine applies causality itself, from global positions.
    ``eod_token`` (Megatron's --reset-attention-mask): documents end after each EOD of the full
    ``tokens``; the dense mask is then dropped unread, and the result gains the key
    ``packed_seq_params`` (megatron_burst.megatron.packed.document_seq_params) to pass to the
    model. ``cp_group=None`` uses megatron.core.parallel_state's CP group. Every check runs before
    any slicing, and nothing here communicates.

    ``layout="balanced"``: the placement is planned here, once per batch, from the documents
    (EOD documents of every sample, planned on their union; without ``eod_token`` each sample is
    one document [0, s], which the planner splits over all ranks); every entry is cut to this
    rank's plan rows, and ``packed_seq_params`` is always returned, carrying the plan
    (megatron_burst.megatron.packed.balanced_seq_params) for every layer and the model's RoPE.
    The plan is placed for ``ranks_per_node`` CP ranks per node, which must be the attention
    layers' (:func:`megatron_burst.megatron.groups.layers_ranks_per_node` of their options; the
    layers refuse a plan placed for other nodes). None: the node topology registered for the CP
    group (what the layers look up), else one node
    (:func:`megatron_burst.megatron.groups.balanced_batch_ranks_per_node`). Fixed layouts place
    tokens by position alone and ignore it.
    """
    check_layout(layout, stripe)
    rank, size = _cp_rank_size(cp_group)
    seq_len = None
    for key, val in batch.items():
        if val is None or key in ("attention_mask", "packed_seq_params"):
            continue
        if not isinstance(val, torch.Tensor) or val.dim() < 2:
            raise ValueError(f"batch[{key!r}] must be a [b, s, ...] tensor or None, got "
                             f"{type(val).__name__}{tuple(val.shape) if isinstance(val, torch.Tensor) else ''}")
        if seq_len is None:
            seq_len = val.shape[1]
        elif val.shape[1] != seq_len:
            raise ValueError(f"batch[{key!r}] has sequence length {val.shape[1]}, other entries "
                             f"have {seq_len}")
    mask = batch.get("attention_mask")
    if eod_token is not None:
        if batch.get("tokens") is None:
            raise ValueError("eod_token (--reset-attention-mask) derives documents from batch['tokens'], which is missing")
        mask = None  # the documents come from the tokens; the dense mask says the same
    if mask is not None:
        if seq_len is None:
            seq_len = mask.shape[-1]
        check_causal_attention_mask(mask, seq_len)
    if seq_len is None:
        return dict(batch)
    check_seq_len(seq_len, size, layout, stripe)
    if layout == BALANCED:
        from megatron_burst.megatron.groups import balanced_batch_ranks_per_node

        per_node = balanced_batch_ranks_per_node(cp_group, size, ranks_per_node)
        return _balanced_batch(batch, seq_len, rank, size, eod_token, per_node)

    out: Dict[str, Any] = {}
    for key, val in batch.items():
        if key == "attention_mask":
            out[key] = None
        elif key == "packed_seq_params":
            out[key] = val
        elif val is None or size == 1:
            out[key] = val
        else:
            out[key] = val.index_select(1, layout_indices_on(seq_len, rank, size, layout, stripe, val.device))
    if eod_token is not None:  # last, so the other entries keep their order (Megatron-LM unpacks values)
        from megatron_burst.megatron.packed import document_seq_params

        out["packed_seq_params"] = document_seq_params(batch["tokens"], eod_token)
    return out


def _balanced_batch(batch: Dict[str, Any], seq_len: int, rank: int, size: int,
                    eod_token: Optional[int], ranks_per_node: int) -> Dict[str, Any]:
    """``get_batch_on_this_cp_rank`` for layout "balanced" (checks done): plan for ``ranks_per_node``
    CP ranks per node, then slice."""
    from megatron_burst.megatron.packed import (balanced_documents_of, balanced_seq_params, document_boundaries,
                                                slice_balanced)

    tokens = batch.get("tokens")
    if tokens is None:
        raise ValueError("--cp-layout balanced plans each batch from batch['tokens'] (its samples and documents), "
                         "which is missing")
    if eod_token is not None:
        per_sample = document_boundaries(tokens, eod_token)  # one host read of the tokens per batch
    else:
        per_sample = [[0, seq_len]] * tokens.shape[0]
    params = balanced_seq_params(per_sample, seq_len, size, tokens.device, ranks_per_node)
    entries = {key: val for key, val in batch.items() if key != "packed_seq_params"}
    out = slice_balanced(entries, balanced_documents_of(params), rank, skip=("attention_mask",))
    if "attention_mask" in out:  # checked causal (or superseded by the documents) above
        out["attention_mask"] = None
    out["packed_seq_params"] = params  # last, so the other entries keep their order (Megatron-LM unpacks values)
    return out
