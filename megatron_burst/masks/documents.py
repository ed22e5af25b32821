"""Document masks as data: packed documents, and which part of a block pair each document sees.

A packed sequence of S tokens holds documents [cu[i], cu[i+1]) given by ``cu_seqlens``
``[0, cu[1], ..., S]`` (global positions, the same on every CP rank; Megatron's and flash-attn's
convention). Token t of document i sees token u iff u is in document i too and, when causal,
u <= t. Nothing crosses a document boundary.

The engine's block pair (queries of one rank x keys of another) becomes a list of rectangles, one
per document present on both sides: in every layout a rank's local tokens are in increasing global
order, so the tokens of one document (a global interval) are a contiguous range of local rows.
Inside a rectangle only causality remains, decided by global positions:

* non-causal, or every key of the rectangle at or before its first query -> ``full``;
* the same positions on both sides (a rank's own block) -> ``causal``;
* otherwise -> ``positions`` (row i sees column j iff kv_pos[j] <= q_pos[i]), e.g. striped offsets.

Merging (:data:`MERGE_ROWS`): a run of adjacent rectangles (no row or column between them), each
smaller than ``MERGE_ROWS`` rows and columns, becomes one ``positions`` rectangle with document
ids, however many documents the run holds, so many short documents cost one kernel call, not one
each; the merged mask is still exact. On CUDA such a block runs torch's varlen flash op (all
documents in one call, :mod:`megatron_burst.kernels.cuda_varlen`) or the Triton kernel, which
skips the tiles no document covers; documents of ``MERGE_ROWS`` or more keep their own call (a
causal square runs cuDNN, ~1.7x the flash op).

Causal rectangles are trimmed: query rows before the first key and keys after the last query are
dropped, so every row of every rectangle sees at least one key (kernels never get a fully masked
row, and the lse merge never meets -inf + -inf). A block pair with no document on both sides
(after trimming) is an empty list: no kernel call, by the same skip that causal masks use.

Packed THD batches (Megatron's ``PackedSeqParams``, TransformerEngine's partitioning) are one more
layout, ``"thd"``, derived from the data: every (padded) sequence [cu_padded[i], cu_padded[i+1])
is cut into 2W chunks and rank r holds chunks r and 2W-1-r of each (zigzag per sequence,
:func:`megatron_burst.masks.layout.thd_indices`). Its documents are the real sequences
[cu_padded[i], cu_padded[i] + len_i) plus, where padded, the padding tail as a document of its own
(nothing real sees padding). The engine is unchanged: positions come from ``Documents.partition``.

The ``"balanced"`` layout is derived from the data too: ``Documents.partition`` holds a
:class:`~megatron_burst.masks.dispatch.DispatchPlan` (:func:`balanced_documents`, once per batch) and
:func:`rank_positions` returns its per-rank index lists. The rest is the same document rectangles.

This works on any two increasing position vectors, so an algorithm that gathers K,V
(all-gather: keys in global order) or heads (Ulysses: each source rank's chunk in turn) calls
:func:`document_blocks` with the positions it holds and hands the rectangles to the same kernels.

Sliding windows are :mod:`megatron_burst.masks.window`; a block pair's documents, window and
causal/full mask together are :func:`megatron_burst.masks.visible.visible_blocks`; load balance of
documents under a layout is :func:`megatron_burst.masks.imbalance.document_imbalance`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megatron_burst.masks.block import BlockMask
from megatron_burst.masks.bounds import checked_bounds
from megatron_burst.masks.dispatch import DispatchPlan
from megatron_burst.masks.layout import BALANCED, balanced_plan, layout_indices, plan_rows, thd_indices

__all__ = ["THD", "MERGE_ROWS", "CuSeqlens", "Partition", "Documents", "checked_bounds", "check_cu_seqlens",
           "balanced_documents", "check_thd", "document_blocks", "rank_positions", "layout_document_blocks",
           "document_ids", "dense_document_mask", "merges", "merge_rows_for", "CPU_MERGE_ROWS"]

CuSeqlens = Union[torch.Tensor, Sequence[int], Sequence[torch.Tensor]]
THD = "thd"  # the packed-sequence layout: zigzag per sequence (TransformerEngine's THD partitioning)
# Where a data-derived layout's tokens live: THD's padded sequence boundaries, or a balanced plan.
Partition = Union[tuple[int, ...], DispatchPlan]


@dataclass(frozen=True)
class Documents:
    """Validated document boundaries of a batch.

    ``groups``: ((first sample, end sample, boundaries), ...) -- one group when every sample of
    the batch shares the boundaries, else one per run of samples with equal boundaries.
    ``boundaries`` are the cu_seqlens as a tuple of Python ints [0, ..., seq_len].
    ``partition``: the placement of a layout derived from data, None for the fixed layouts:
    layout "thd": the padded sequence boundaries (a tuple of ints); layout "balanced": the
    :class:`~megatron_burst.masks.dispatch.DispatchPlan` (see :func:`balanced_documents`).
    """

    seq_len: int
    groups: tuple[tuple[int, int, tuple[int, ...]], ...]
    partition: Optional[Partition] = None

    @property
    def layout(self) -> Optional[str]:
        """The data-derived layout these documents place tokens for ("thd", "balanced"), or None."""
        if self.partition is None:
            return None
        return BALANCED if isinstance(self.partition, DispatchPlan) else THD

    @property
    def plan(self) -> Optional[DispatchPlan]:
        """The balanced layout's plan (``plan.indices(rank)``: the rank's global token positions, to
        slice the batch and RoPE positions with), or None for other layouts."""
        return self.partition if isinstance(self.partition, DispatchPlan) else None


def check_cu_seqlens(cu_seqlens: CuSeqlens, seq_len: int, batch: int) -> Documents:
    """Validate document boundaries (local checks only: safe before any collective).

    ``cu_seqlens``: one int tensor (or list of ints) [0, ..., seq_len] shared by all ``batch``
    samples, or a list of ``batch`` of them (one per sample). Raises ValueError naming the value.
    Note: a CUDA tensor is read back to the host here (one small copy per call).
    """
    per_sample = (isinstance(cu_seqlens, (list, tuple)) and len(cu_seqlens) > 0
                  and isinstance(cu_seqlens[0], (torch.Tensor, list, tuple)))
    if not per_sample:
        bounds = checked_bounds(cu_seqlens, seq_len, "cu_seqlens")
        return Documents(seq_len, ((0, batch, bounds),))
    if len(cu_seqlens) != batch:
        raise ValueError(f"cu_seqlens holds {len(cu_seqlens)} per-sample boundary lists but the batch has "
                         f"{batch} samples: pass one per sample, or a single tensor shared by all")
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for i, cu in enumerate(cu_seqlens):
        bounds = checked_bounds(cu, seq_len, f"cu_seqlens[{i}]")
        if groups and groups[-1][2] == bounds:
            groups[-1] = (groups[-1][0], i + 1, bounds)
        else:
            groups.append((i, i + 1, bounds))
    return Documents(seq_len, tuple(groups))


def balanced_documents(cu_seqlens: CuSeqlens, seq_len: int, batch: int, world_size: int, *,
                       causal: bool = True, ranks_per_node: Optional[int] = None) -> Documents:
    """Validated documents of a ``layout="balanced"`` batch, with its placement planned once.

    ``cu_seqlens``: as :func:`check_cu_seqlens` takes it ([0, ..., seq_len], or one per sample of
    the ``batch``); ``seq_len`` the global length S (divisible by ``world_size``). The returned
    :class:`Documents` carries the :class:`~megatron_burst.masks.dispatch.DispatchPlan` in ``partition``
    (also ``.plan``): slice the batch [S, ...] -> [S/W, ...] with ``plan.indices(rank)`` (or
    :func:`megatron_burst.masks.layout.shard` with ``plan=``) and pass the Documents to every layer's
    ``cp_attention(..., layout="balanced", cu_seqlens=documents)``: nothing is re-planned or read
    back per layer. Per-sample boundaries are planned on their union
    (:func:`megatron_burst.masks.layout.balanced_plan`): exact for every sample. ``causal`` only steers
    the balance; cp_attention given raw cu_seqlens plans with the default (causal=True), so the
    same default here gives the same placement. ``ranks_per_node``: the CP topology's ranks per
    node (None: one node); cp_attention plans raw cu_seqlens with its topology's value and refuses
    Documents placed for another, so pass the one the layers' topology has. Local work only (no
    collective): every rank computes the same plan.
    """
    documents = check_cu_seqlens(cu_seqlens, seq_len, batch)
    bounds = [g[2] for g in documents.groups]
    plan = balanced_plan(bounds if len(bounds) > 1 else bounds[0], seq_len, world_size, causal, ranks_per_node)
    return Documents(seq_len, documents.groups, plan)


def check_thd(cu_seqlens: CuSeqlens, cu_seqlens_padded: Optional[CuSeqlens], local_len: int, world_size: int,
              batch: int) -> Documents:
    """Validate a packed (THD) batch's boundaries: this rank holds ``local_len`` tokens of
    cu_seqlens_padded[-1] = local_len * W; every padded length divisible by 2W (W > 1); each real
    sequence fits its padded slot. Local checks only (safe before any collective)."""
    if batch != 1:
        raise ValueError(f"layout 'thd' packs sequences into one: batch must be 1, got {batch}")
    total = local_len * world_size
    padded = checked_bounds(cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens, total,
                        "cu_seqlens_padded" if cu_seqlens_padded is not None else "cu_seqlens")
    for a, b in zip(padded, padded[1:]):
        if world_size > 1 and (b - a) % (2 * world_size):
            raise ValueError(f"packed sequence [{a}, {b}) has length {b - a}, not divisible by 2 x CP size = "
                             f"{2 * world_size}: pad every sequence to a multiple of {2 * world_size} and pass "
                             "cu_seqlens_padded")
    if cu_seqlens_padded is None:
        return Documents(total, ((0, 1, padded),), padded)
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        real = [int(x) for x in cu_seqlens.tolist()]
    else:
        real = [int(x) for x in cu_seqlens]
    if len(real) != len(padded) or real[0] != 0:
        raise ValueError(f"cu_seqlens={real} and cu_seqlens_padded={list(padded)} must describe the same "
                         "sequences (same length, both starting at 0)")
    bounds = [0]
    for i in range(len(padded) - 1):
        length = real[i + 1] - real[i]
        if not 0 < length <= padded[i + 1] - padded[i]:
            raise ValueError(f"sequence {i} has {length} tokens (cu_seqlens={real}) but its padded slot "
                             f"[{padded[i]}, {padded[i + 1]}) holds {padded[i + 1] - padded[i]}: each sequence "
                             "must be non-empty and fit its padded length")
        bounds.append(padded[i] + length)
        if bounds[-1] != padded[i + 1]:
            bounds.append(padded[i + 1])  # the padding tail: a document of its own
    return Documents(total, ((0, 1, tuple(bounds)),), padded)


# Adjacent per-document rectangles smaller than this (rows and columns) merge into one "positions"
# call, a run of any length. Why 8192: below it a document's own causal cuDNN call is short and
# per-call overhead dominates (H100, 32K tokens: 64 documents in one varlen call 4.6 ms vs 29.9 ms
# in 64 calls); above it cuDNN's causal kernel (~1.7x the flash op) pays for its own call.
MERGE_ROWS = 8192
# On CPU the fused op builds a dense [rows, cols] mask and computes every pair of a merged block,
# so merging trades one call for (run length)^2 / sum(doc length^2) more work: there a run merges
# only documents below CPU_MERGE_ROWS and stops at CPU_MERGE_ROWS rows in all.
CPU_MERGE_ROWS = 128
Merge = tuple[int, Optional[int]]  # (merge_rows, run_rows): see document_blocks


def merge_rows_for(device_type: Optional[str]) -> Merge:
    """(merge_rows, run_rows) for blocks that run on ``device_type``: on "cuda" (or None: not known
    yet) documents below MERGE_ROWS, runs of any length (the kernels skip what no document covers);
    elsewhere below CPU_MERGE_ROWS, runs up to CPU_MERGE_ROWS."""
    return (MERGE_ROWS, None) if device_type in (None, "cuda") else (CPU_MERGE_ROWS, CPU_MERGE_ROWS)


def document_blocks(q_pos: torch.Tensor, kv_pos: torch.Tensor, bounds: Sequence[int], causal: bool,
                    merge_rows: int = MERGE_ROWS, run_rows: Optional[int] = None) -> list[BlockMask]:
    """Visible rectangles of queries at ``q_pos`` x keys at ``kv_pos`` under documents ``bounds``.

    q_pos [n], kv_pos [m]: increasing global positions (LongTensor, CPU) of the local rows and
    columns. Returns one BlockMask per document seen on both sides (see the module docstring),
    each run of adjacent ones smaller than ``merge_rows`` rows and columns merged into one
    (:func:`merges`; 0: never) while the run stays within ``run_rows`` rows and columns (None: any
    length), in local row/column coordinates; [] when nothing is visible.
    """
    blocks = _per_document_blocks(q_pos, kv_pos, bounds, causal)
    if merge_rows <= 1 or len(blocks) < 2:
        return blocks
    cuts = torch.tensor(list(bounds[1:-1]), dtype=torch.long)
    q_doc = torch.searchsorted(cuts, q_pos, right=True)
    kv_doc = torch.searchsorted(cuts, kv_pos, right=True)
    merged: list[BlockMask] = []
    run: list[BlockMask] = []

    def flush() -> None:
        if len(run) == 1:
            merged.append(run[0])
        elif run:
            qa, qb, ka, kb = run[0].q_start, run[-1].q_stop, run[0].kv_start, run[-1].kv_stop
            merged.append(BlockMask("positions", qa, qb, ka, kb, 1, q_pos[qa:qb] if causal else None,
                                    kv_pos[ka:kb] if causal else None, q_doc[qa:qb], kv_doc[ka:kb]))
        run.clear()

    for m in blocks:
        small = merges(m, merge_rows)
        adjacent = run and m.q_start == run[-1].q_stop and m.kv_start == run[-1].kv_stop and (
            run_rows is None or (m.q_stop - run[0].q_start <= run_rows and m.kv_stop - run[0].kv_start <= run_rows))
        if not (small and adjacent):
            flush()
        if small:
            run.append(m)
        else:
            merged.append(m)
    flush()
    return merged


def merges(mask: BlockMask, merge_rows: int = MERGE_ROWS) -> bool:
    """The merge policy: whether a per-document rectangle joins a run of adjacent ones (one kernel
    call for the run): fewer than ``merge_rows`` rows and fewer than ``merge_rows`` columns."""
    return mask.q_stop - mask.q_start < merge_rows and mask.kv_stop - mask.kv_start < merge_rows


def _per_document_blocks(q_pos: torch.Tensor, kv_pos: torch.Tensor, bounds: Sequence[int], causal: bool
                         ) -> list[BlockMask]:
    """One trimmed rectangle per document seen on both sides (see :func:`document_blocks`)."""
    cuts = torch.tensor(list(bounds), dtype=torch.long)
    q_cut = torch.searchsorted(q_pos, cuts).tolist()
    kv_cut = torch.searchsorted(kv_pos, cuts).tolist()
    same_positions = q_pos.numel() == kv_pos.numel() and bool(torch.equal(q_pos, kv_pos))
    blocks = []
    for doc in range(len(bounds) - 1):
        qa, qb, ka, kb = q_cut[doc], q_cut[doc + 1], kv_cut[doc], kv_cut[doc + 1]
        if qa == qb or ka == kb:
            continue
        if not causal:
            blocks.append(BlockMask("full", qa, qb, ka, kb))
            continue
        # keys after the last query and queries before the first key see nothing: trim them
        kb = min(kb, int(torch.searchsorted(kv_pos, q_pos[qb - 1:qb], right=True)[0]))
        if kb <= ka:
            continue
        qa = max(qa, int(torch.searchsorted(q_pos, kv_pos[ka:ka + 1])[0]))
        if qa >= qb:
            continue
        if int(kv_pos[kb - 1]) <= int(q_pos[qa]):
            blocks.append(BlockMask("full", qa, qb, ka, kb))
        elif same_positions and qa == ka and qb == kb:
            blocks.append(BlockMask("causal", qa, qb, ka, kb))
        else:
            blocks.append(BlockMask("positions", qa, qb, ka, kb, 1, q_pos[qa:qb], kv_pos[ka:kb]))
    return blocks


def rank_positions(layout: str, rank: int, world_size: int, local_len: int, stripe: int = 1,
                   partition: Optional[Partition] = None) -> torch.Tensor:
    """Global positions of ``rank``'s tokens (LongTensor [local_len], increasing, CPU; read-only for
    balanced): the layout's, THD's from the padded boundaries, or the balanced plan's (cached per plan)."""
    if layout == THD:
        return thd_indices(partition, rank, world_size)
    if layout == BALANCED:
        if not isinstance(partition, DispatchPlan):
            raise ValueError("layout 'balanced' needs its plan: build the documents with "
                             "megatron_burst.documents.balanced_documents (cp_attention does, given cu_seqlens)")
        if (partition.seq_len, partition.world_size) != (local_len * world_size, world_size):
            raise ValueError(f"the balanced plan places {partition.seq_len} tokens on {partition.world_size} ranks, "
                             f"not {local_len * world_size} on {world_size}")
        return plan_rows(partition)[rank]
    return layout_indices(local_len * world_size, rank, world_size, layout, stripe)


@functools.lru_cache(maxsize=1024)
def layout_document_blocks(bounds: tuple[int, ...], layout: str, q_rank: int, kv_rank: int, world_size: int,
                           local_len: int, causal: bool, stripe: int = 1,
                           partition: Optional[Partition] = None,
                           merge_rows: int = MERGE_ROWS, run_rows: Optional[int] = None) -> tuple[BlockMask, ...]:
    """:func:`document_blocks` for the (q_rank, kv_rank) block pair of ``layout`` (cached)."""
    q_pos = rank_positions(layout, q_rank, world_size, local_len, stripe, partition)
    kv_pos = rank_positions(layout, kv_rank, world_size, local_len, stripe, partition)
    return tuple(document_blocks(q_pos, kv_pos, bounds, causal, merge_rows, run_rows))


def document_ids(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Document index of each global position: LongTensor like ``positions`` (any device)."""
    return torch.searchsorted(cu_seqlens.to(positions.device, torch.long), positions, right=True) - 1


def dense_document_mask(bounds: Sequence[int], seq_len: int, causal: bool = True) -> torch.Tensor:
    """Boolean [seq_len, seq_len] visibility of the whole sequence (the definition tests check against)."""
    pos = torch.arange(seq_len)
    doc = document_ids(torch.tensor(list(bounds)), pos)
    vis = doc[:, None] == doc[None, :]
    return vis & (pos[None, :] <= pos[:, None]) if causal else vis
