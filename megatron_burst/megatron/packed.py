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
* ``--cp-layout balanced`` (either kind of batch): the placement comes from the batch's documents
  (:func:`megatron_burst.documents.balanced_documents`, planned once per batch when it is sliced).
  The returned params are ``qkv_format="sbhd"`` (a THD batch becomes one [1, t] sample whose
  documents are its sequences, each padding tail a document of its own) and carry the balanced
  :class:`~megatron_burst.documents.Documents`: every layer and the model's RoPE read the plan from
  them (:func:`balanced_documents_of`), nothing is re-planned or read back per layer. RoPE runs at
  global positions (exact: attention never crosses a document).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_burst.masks.documents import Documents, THD, balanced_documents, check_cu_seqlens, check_thd
from megatron_burst.masks.layout import BALANCED, plan_rows, thd_indices

# The attribute of a PackedSeqParams that carries a balanced batch's Documents (set where the batch
# is sliced, read by every layer and the model's RoPE).
_BALANCED_ATTR = "_burst_balanced_documents"


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
    return _flat_seq_params(document_boundaries(tokens, eod_token), tokens.shape[1], tokens.device)


def _flat_seq_params(per_sample: list[list[int]], seq_len: int, device: torch.device) -> PackedSeqParams:
    """sbhd PackedSeqParams whose cu_seqlens run over the flattened batch (sample j offset by j*s)."""
    flat = [0]
    for j, bounds in enumerate(per_sample):
        flat += [j * seq_len + x for x in bounds[1:]]
    cu = torch.tensor(flat, dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq_len,
                           max_seqlen_kv=seq_len)


def balanced_seq_params(per_sample: list[list[int]], seq_len: int, world_size: int,
                        device: torch.device, ranks_per_node: Optional[int] = None) -> PackedSeqParams:
    """``PackedSeqParams(qkv_format="sbhd")`` of a ``--cp-layout balanced`` batch of
    ``len(per_sample)`` samples, each with document boundaries [0, ..., seq_len], carrying the
    batch's balanced Documents (planned here, once, on the union of the samples' boundaries).

    Validates before anything else (no collective here): boundaries, and seq_len divisible by
    world_size. Slice the batch with ``balanced_documents_of(params).plan``. ``ranks_per_node``: the
    attention layers' CP ranks per node (None: one node), see
    :func:`megatron_burst.masks.documents.balanced_documents`.
    """
    documents = balanced_documents(per_sample, seq_len, len(per_sample), world_size, ranks_per_node=ranks_per_node)
    params = _flat_seq_params(per_sample, seq_len, device)
    setattr(params, _BALANCED_ATTR, documents)
    return params


def balanced_documents_of(params: Optional[PackedSeqParams]) -> Optional[Documents]:
    """The balanced Documents a batch's ``packed_seq_params`` carries (:func:`balanced_seq_params`),
    or None when it carries none (no params, or a batch not sliced in the balanced layout)."""
    return None if params is None else getattr(params, _BALANCED_ATTR, None)


def slice_balanced(batch: Dict[str, Any], documents: Documents, rank: int,
                   skip: tuple = ()) -> Dict[str, Any]:
    """Every [b, s, ...] entry of ``batch`` cut to this rank's plan rows along dim 1 (one index
    tensor per device, copied there once); None entries and keys in ``skip`` are kept as they are."""
    plan = documents.plan
    if plan.world_size == 1:
        return dict(batch)
    rows = plan_rows(plan)[rank]
    on_device: dict = {}
    out: Dict[str, Any] = {}
    for key, val in batch.items():
        if val is None or key in skip:
            out[key] = val
            continue
        if val.shape[1] != plan.seq_len:
            raise ValueError(f"batch[{key!r}] has {val.shape[1]} tokens but the balanced plan places {plan.seq_len}")
        if val.device not in on_device:
            on_device[val.device] = rows.to(val.device, non_blocking=True)
        out[key] = val.index_select(1, on_device[val.device])
    return out


def get_thd_batch_on_this_cp_rank(batch: Dict[str, Any], cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                                  max_seqlen: torch.Tensor, cp_group: Optional[dist.ProcessGroup] = None,
                                  layout: Optional[str] = None, ranks_per_node: Optional[int] = None
                                  ) -> tuple[Dict[str, Any], PackedSeqParams]:
    """Megatron-Core's ``get_thd_batch_on_this_cp_rank`` without TransformerEngine: [1, t] entries
    sliced to this rank's chunks of every padded sequence; returns (batch, PackedSeqParams("thd")).

    ``layout="balanced"`` (--cp-layout balanced): the entries are sliced with the balanced plan of
    the sequences instead (each padding tail a document of its own; t divisible by the CP size, no
    2 x CP padding needed) and the params are :func:`balanced_seq_params`' (qkv_format "sbhd", one
    sample of t tokens): the model runs the packed batch as one sample of documents. Other layouts
    (and None) keep TransformerEngine's partitioning. ``cp_group=None`` uses
    megatron.core.parallel_state's CP group (or a single rank). ``ranks_per_node`` (balanced only):
    the attention layers' CP ranks per node, as
    :func:`megatron_burst.megatron.batch.get_batch_on_this_cp_rank` takes it (None: the CP group's
    registered node topology, else one node).
    """
    from megatron_burst.megatron.groups import balanced_batch_ranks_per_node, cp_rank_and_size

    rank, size = cp_rank_and_size(cp_group) if cp_group is not None or dist.is_initialized() else (0, 1)
    if layout == BALANCED:
        per_node = balanced_batch_ranks_per_node(cp_group, size, ranks_per_node)
        return _balanced_thd_batch(batch, cu_seqlens, cu_seqlens_padded, rank, size, per_node)
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


def _balanced_thd_batch(batch: Dict[str, Any], cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                        rank: int, size: int, ranks_per_node: int) -> tuple[Dict[str, Any], PackedSeqParams]:
    """A packed [1, t] batch cut with the balanced plan of its (padded) sequences (see
    :func:`get_thd_batch_on_this_cp_rank`)."""
    total = int(cu_seqlens_padded.reshape(-1)[-1])
    # check_thd on one rank: the real sequences and each padding tail as documents, no 2W padding rule
    sequences = check_thd(cu_seqlens.reshape(-1).cpu(), cu_seqlens_padded.reshape(-1).cpu(), total, 1, 1)
    bounds = list(sequences.groups[0][2])
    if total % size:
        raise ValueError(f"the packed batch holds {total} tokens (cu_seqlens_padded[-1]), not divisible by the CP "
                         f"size {size}, which --cp-layout balanced needs (every rank holds t / CP tokens): pad the "
                         f"last sequence to a total multiple of {size}")
    skip = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen")
    for key, val in batch.items():
        if val is not None and key not in skip and val.shape[1] != total:
            raise ValueError(f"batch[{key!r}] has {val.shape[1]} tokens but cu_seqlens_padded ends at {total}")
    params = balanced_seq_params([bounds], total, size, cu_seqlens.device, ranks_per_node)
    return slice_balanced(batch, balanced_documents_of(params), rank, skip), params


def documents_of(params: PackedSeqParams, local_len: int, batch: int, world_size: int) -> tuple[Documents, bool]:
    """(validated documents, is THD) of a layer call's ``packed_seq_params``; computed once per
    batch and kept on the params object, so layers do not read cu_seqlens back every call.
    Params of a balanced batch return the Documents planned when it was sliced (checked against
    this call's sizes)."""
    balanced = balanced_documents_of(params)
    if balanced is not None:
        if (balanced.seq_len, balanced.plan.world_size) != (local_len * world_size, world_size) or \
                balanced.groups[-1][1] != batch:
            raise ValueError(f"packed_seq_params carries a balanced plan of {balanced.groups[-1][1]} samples x "
                             f"{balanced.seq_len} tokens on {balanced.plan.world_size} ranks, but this layer gets "
                             f"{batch} samples x {local_len} local tokens on {world_size} ranks: pass the params "
                             "get_batch_on_this_cp_rank returned with the batch it sliced")
        return balanced, False
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
