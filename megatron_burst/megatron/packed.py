"""Documents in Megatron batches: ``--reset-attention-mask`` batches and packed THD batches.

Both reach :class:`~megatron_burst.megatron.attention.CPCoreAttention` through Megatron's own
``packed_seq_params`` argument, which GPTModel already hands to every layer:

* ``--reset-attention-mask`` ([b, s] batches, any ``--cp-layout``): a document ends after every
  EOD token (Megatron's ``get_ltor_masks_and_position_ids``). :func:`document_seq_params` derives
  the boundaries from the tokens -- never from the dense [b, 1, s, s] mask, which is dropped --
  as ``PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=...)`` whose cu_seqlens run over the
  flattened batch (sample j's boundaries offset by j*s, every sample start a boundary: the THD
  convention) and ``max_seqlen_q = s`` (GPTModel sizes RoPE from it). RoPE stays at global
  positions: attention never crosses a document, and RoPE scores depend only on position
  differences, so resetting RoPE per document (``--reset-position-ids``) would change nothing;
  ``position_ids`` (reset or not) are sliced like every other batch entry.
* Packed THD ([1, t] batches with ``cu_seqlens``/``cu_seqlens_padded``): TransformerEngine cuts
  every padded sequence into 2 x CP chunks and gives rank r chunks r and 2CP-1-r of each.
  :func:`get_thd_batch_on_this_cp_rank` does the same (no TransformerEngine needed), and the
  attention runs in the engine's ``"thd"`` layout (megatron_burst.documents), whatever
  ``--cp-layout`` says for [b, s] batches. Megatron applies THD RoPE itself (per sequence).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_burst.documents import THD, Documents, check_cu_seqlens, check_thd
from megatron_burst.layout import thd_indices


def document_boundaries(tokens: torch.Tensor, eod_token: int) -> list[list[int]]:
    """Per-sample document boundaries [0, ..., s] of [b, s] ``tokens``: a document ends after each EOD."""
    b, s = tokens.shape
    rows, cols = (tokens == eod_token).nonzero(as_tuple=True)
    cuts: list[list[int]] = [[0] for _ in range(b)]
    for row, col in zip(rows.tolist(), cols.tolist()):
        if col + 1 < s:
            cuts[row].append(col + 1)
    return [c + [s] for c in cuts]


def document_seq_params(tokens: torch.Tensor, eod_token: int) -> PackedSeqParams:
    """``PackedSeqParams(qkv_format="sbhd")`` carrying the EOD documents of full [b, s] ``tokens``
    (see the module docstring). Reads the tokens on the host once per batch."""
    b, s = tokens.shape
    flat = [0]
    for j, bounds in enumerate(document_boundaries(tokens, eod_token)):
        flat += [j * s + x for x in bounds[1:]]
    cu = torch.tensor(flat, dtype=torch.int32, device=tokens.device)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)


def get_thd_batch_on_this_cp_rank(batch: Dict[str, Any], cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                                  max_seqlen: torch.Tensor, cp_group: Optional[dist.ProcessGroup] = None
                                  ) -> tuple[Dict[str, Any], PackedSeqParams]:
    """Megatron-Core's ``get_thd_batch_on_this_cp_rank`` without TransformerEngine: [1, t] entries
    sliced to this rank's chunks of every padded sequence; returns (batch, PackedSeqParams("thd")).

    ``cp_group=None`` uses megatron.core.parallel_state's CP group (or a single rank).
    """
    from megatron_burst.megatron.groups import cp_rank_and_size

    rank, size = cp_rank_and_size(cp_group) if cp_group is not None or dist.is_initialized() else (0, 1)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                             max_seqlen_q=int(max_seqlen.reshape(-1)[0]), max_seqlen_kv=int(max_seqlen.reshape(-1)[0]))
    padded = [int(x) for x in cu_seqlens_padded.tolist()]
    for a, b in zip(padded, padded[1:]):
        if size > 1 and (b - a) % (2 * size):
            raise ValueError(f"packed sequence [{a}, {b}) has padded length {b - a}, not divisible by 2 x CP size "
                             f"= {2 * size}: pad every sequence to a multiple of {2 * size} (cu_seqlens_padded)")
    if size == 1:
        return dict(batch), params
    out: Dict[str, Any] = {}
    for key, val in batch.items():
        if val is None or key in ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
            out[key] = val
            continue
        if val.shape[1] != padded[-1]:
            raise ValueError(f"batch[{key!r}] has {val.shape[1]} tokens but cu_seqlens_padded ends at {padded[-1]}")
        out[key] = val.index_select(1, thd_indices(padded, rank, size).to(val.device))
    return out, params


def documents_of(params: PackedSeqParams, local_len: int, batch: int, world_size: int) -> tuple[Documents, bool]:
    """(validated documents, is THD) of a layer call's ``packed_seq_params``; computed once per
    batch and kept on the params object, so layers do not read cu_seqlens back every call."""
    key = (local_len, batch, world_size)
    cached = getattr(params, "_burst_documents", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    if params.qkv_format == THD:
        cu_q = params.cu_seqlens_q
        if params.cu_seqlens_kv is not None and not torch.equal(params.cu_seqlens_kv.cpu(), cu_q.cpu()):
            raise ValueError("packed_seq_params: cu_seqlens_kv differs from cu_seqlens_q; self-attention over "
                             "packed sequences needs the same boundaries")
        docs = check_thd(cu_q.cpu(), None if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded.cpu(),
                         local_len, world_size, batch)
        is_thd = True
    elif params.qkv_format == "sbhd":
        seq = local_len * world_size
        flat = [int(x) for x in params.cu_seqlens_q.tolist()]
        per_sample = []
        for j in range(batch):
            lo, hi = j * seq, (j + 1) * seq
            if lo not in flat or hi not in flat:
                raise ValueError(f"packed_seq_params.cu_seqlens_q={flat} must contain every sample boundary "
                                 f"j x {seq} (documents do not cross samples): missing {lo if lo not in flat else hi}")
            per_sample.append([x - lo for x in flat if lo <= x <= hi])
        docs = check_cu_seqlens(per_sample, seq, batch)
        is_thd = False
    else:
        raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: megatron-burst takes 'thd' (packed "
                         "sequences) or 'sbhd' (documents of [b, s] batches, see document_seq_params)")
    params._burst_documents = (key, docs, is_thd)
    return docs, is_thd
