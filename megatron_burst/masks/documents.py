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

Runs of small adjacent rectangles (no row or column between them; all shorter than
``MERGE_ROWS``) are merged into one ``positions`` rectangle with document ids, so many short
documents cost a few kernel calls, not one each; the merged mask is still exact.

Causal rectangles are trimmed: query rows before the first key and keys after the last query are
dropped, so every row of every rectangle sees at least one key (kernels never get a fully masked
row, and the lse merge never meets -inf + -inf). A block pair with no document on both sides
(after trimming) is an empty list: no kernel call, by the same skip that causal masks use.

Packed THD batches (Megatron's ``PackedSeqParams``, TransformerEngine's partitioning) are one more
layout, ``"thd"``, derived from the data: every (padded) sequence [cu_padded[i], cu_padded[i+1])
is cut into 2W chunks and rank r holds chunks r and 2W-1-r of each (zigzag per sequence,
:func:`megatron_burst.layout.thd_indices`). Its documents are the real sequences
[cu_padded[i], cu_padded[i] + len_i) plus, where padded, the padding tail as a document of its own
(nothing real sees padding). The engine is unchanged: positions come from ``Documents.partition``.

The ``"balanced"`` layout is derived from the data too: ``Documents.partition`` holds a
:class:`~megatron_burst.dispatch.DispatchPlan` (:func:`balanced_documents`, once per batch) and
:func:`rank_positions` returns its per-rank index lists. The rest is the same document rectangles.

This works on any two increasing position vectors, so an algorithm that gathers K,V
(all-gather: keys in global order) or heads (Ulysses: each source rank's chunk in turn) calls
:func:`document_blocks` with the positions it holds and hands the rectangles to the same kernels.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megatron_burst.dispatch import DispatchPlan
from megatron_burst.layout import (BALANCED, BlockMask, balanced_plan, block_mask, layout_indices, plan_rows,
                                   thd_indices)

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
    :class:`~megatron_burst.dispatch.DispatchPlan` (see :func:`balanced_documents`).
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


def _as_bounds(cu: object, seq_len: int, what: str) -> tuple[int, ...]:
    if isinstance(cu, torch.Tensor):
        if cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what} has dtype {cu.dtype}: document boundaries must be an int32 or int64 "
                             f"tensor, e.g. torch.tensor([0, ..., {seq_len}], dtype=torch.int32)")
        if cu.dim() != 1:
            raise ValueError(f"{what} has shape {tuple(cu.shape)}: pass a 1-D tensor [num_docs + 1] "
                             "(or one per sample in a list)")
        bounds = tuple(int(x) for x in cu.tolist())
    else:
        bounds = tuple(cu)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in bounds):
            raise ValueError(f"{what}={list(bounds)!r} must hold ints (global token positions)")
    shown = list(bounds) if len(bounds) <= 12 else list(bounds[:5]) + ["..."] + list(bounds[-5:])
    if len(bounds) < 2:
        raise ValueError(f"{what}={shown} needs at least [0, {seq_len}] (one document)")
    if bounds[0] != 0:
        raise ValueError(f"{what}={shown} starts at {bounds[0]}: the first boundary must be 0")
    if bounds[-1] != seq_len:
        raise ValueError(f"{what}={shown} ends at {bounds[-1]} but the global sequence has {seq_len} tokens "
                         f"(local length x CP size): the last boundary must be {seq_len}; pad the last "
                         "document or add a padding document")
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            raise ValueError(f"{what}={shown} is not strictly increasing ({a} then {b}): drop empty "
                             "documents and sort the boundaries")
    return bounds


def check_cu_seqlens(cu_seqlens: CuSeqlens, seq_len: int, batch: int) -> Documents:
    """Validate document boundaries (local checks only: safe before any collective).

    ``cu_seqlens``: one int tensor (or list of ints) [0, ..., seq_len] shared by all ``batch``
    samples, or a list of ``batch`` of them (one per sample). Raises ValueError naming the value.
    Note: a CUDA tensor is read back to the host here (one small copy per call).
    """
    per_sample = (isinstance(cu_seqlens, (list, tuple)) and len(cu_seqlens) > 0
                  and isinstance(cu_seqlens[0], (torch.Tensor, list, tuple)))
    if not per_sample:
        bounds = _as_bounds(cu_seqlens, seq_len, "cu_seqlens")
        return Documents(seq_len, ((0, batch, bounds),))
    if len(cu_seqlens) != batch:
        raise ValueError(f"cu_seqlens holds {len(cu_seqlens)} per-sample boundary lists but the batch has "
                         f"{batch} samples: pass one per sample, or a single tensor shared by all")
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for i, cu in enumerate(cu_seqlens):
        bounds = _as_bounds(cu, seq_len, f"cu_seqlens[{i}]")
        if groups and groups[-1][2] == bounds:
            groups[-1] = (groups[-1][0], i + 1, bounds)
        else:
            groups.append((i, i + 1, bounds))
    return Documents(seq_len, tuple(groups))


def balanced_documents(cu_seqlens: CuSeqlens, seq_len: int, batch: int, world_size: int, *,
                       causal: bool = True) -> Documents:
    """Validated documents of a ``layout="balanced"`` batch, with its placement planned once.

    ``cu_seqlens``: as :func:`check_cu_seqlens` takes it ([0, ..., seq_len], or one per sample of
    the ``batch``); ``seq_len`` the global length S (divisible by ``world_size``). The returned
    :class:`Documents` carries the :class:`~megatron_burst.dispatch.DispatchPlan` in ``partition``
    (also ``.plan``): slice the batch [S, ...] -> [S/W, ...] with ``plan.indices(rank)`` (or
    :func:`megatron_burst.layout.shard` with ``plan=``) and pass the Documents to every layer's
    ``cp_attention(..., layout="balanced", cu_seqlens=documents)``: nothing is re-planned or read
    back per layer. Per-sample boundaries are planned on their union
    (:func:`megatron_burst.layout.balanced_plan`): exact for every sample. ``causal`` only steers
    the balance; cp_attention given raw cu_seqlens plans with the default (causal=True), so the
    same default here gives the same placement. Local work only (no collective): every rank
    computes the same plan.
    """
    documents = check_cu_seqlens(cu_seqlens, seq_len, batch)
    bounds = [g[2] for g in documents.groups]
    plan = balanced_plan(bounds if len(bounds) > 1 else bounds[0], seq_len, world_size, causal)
    return Documents(seq_len, documents.groups, plan)


def check_thd(cu_seqlens: CuSeqlens, cu_seqlens_padded: Optional[CuSeqlens], local_len: int, world_size: int,
              batch: int) -> Documents:
    """Validate a packed (THD) batch's boundaries: this rank holds ``local_len`` tokens of
    cu_seqlens_padded[-1] = local_len * W; every padded length divisible by 2W (W > 1); each real
    sequence fits its padded slot. Local checks only (safe before any collective)."""
    if batch != 1:
        raise ValueError(f"layout 'thd' packs sequences into one: batch must be 1, got {batch}")
    total = local_len * world_size
    padded = _as_bounds(cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens, total,
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


MERGE_ROWS = 128  # adjacent per-document rectangles merge into one kernel call up to this many rows/columns


def document_blocks(q_pos: torch.Tensor, kv_pos: torch.Tensor, bounds: Sequence[int], causal: bool,
                    merge_rows: int = MERGE_ROWS) -> list[BlockMask]:
    """Visible rectangles of queries at ``q_pos`` x keys at ``kv_pos`` under documents ``bounds``.

    q_pos [n], kv_pos [m]: increasing global positions (LongTensor, CPU) of the local rows and
    columns. Returns one BlockMask per document seen on both sides (see the module docstring),
    runs of small adjacent ones merged up to ``merge_rows`` (0: never), in local row/column
    coordinates; [] when nothing is visible.
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
        small = m.q_stop - m.q_start < merge_rows and m.kv_stop - m.kv_start < merge_rows
        fits = (run and m.q_start == run[-1].q_stop and m.kv_start == run[-1].kv_stop
                and m.q_stop - run[0].q_start <= merge_rows and m.kv_stop - run[0].kv_start <= merge_rows)
        if not (small and fits):
            flush()
        if small:
            run.append(m)
        else:
            merged.append(m)
    flush()
    return merged


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
                           merge_rows: int = MERGE_ROWS) -> tuple[BlockMask, ...]:
    """:func:`document_blocks` for the (q_rank, kv_rank) block pair of ``layout`` (cached)."""
    q_pos = rank_positions(layout, q_rank, world_size, local_len, stripe, partition)
    kv_pos = rank_positions(layout, kv_rank, world_size, local_len, stripe, partition)
    return tuple(document_blocks(q_pos, kv_pos, bounds, causal, merge_rows))


Window = Optional[tuple[Optional[int], Optional[int]]]  # (left, right); None = unbounded


def check_window(window: object) -> Window:
    """Validate a sliding window (Megatron's ``window_size``): (left, right) ints >= 0, -1 (or None)
    meaning unbounded; returns it with None for unbounded, or None for no window at all."""
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window={window!r} must be a pair (left, right), e.g. (4096, 0) for causal sliding-window "
                         "attention (query i sees keys i-left ... i); -1 means unbounded")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None or (isinstance(w, int) and not isinstance(w, bool) and w == -1):
            out.append(None)
        elif isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            out.append(int(w))
        else:
            raise ValueError(f"window={tuple(window)!r}: {side}={w!r} must be an int >= 0, or -1 for unbounded")
    return None if out == [None, None] else (out[0], out[1])


def window_blocks(masks: Sequence[BlockMask], q_pos: torch.Tensor, kv_pos: torch.Tensor, window: Window,
                  causal: bool) -> list[BlockMask]:
    """``masks`` (rectangles of queries at ``q_pos`` x keys at ``kv_pos``, increasing global
    positions) intersected with the sliding window: row i also needs
    q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right (right is 0 when causal).

    A rectangle wholly inside the window is kept; one wholly outside is dropped; any other becomes
    ``positions`` rectangles with the band, one per run of rows that see something (each row's
    visible columns form one interval, so every kept row sees at least one column).
    """
    if window is None:
        return list(masks)
    left, right = window[0], (0 if causal else window[1])
    out: list[BlockMask] = []
    for m in masks:
        if m.kind == "empty":
            continue
        qp, kp = q_pos[m.q_slice], kv_pos[m.kv_slice]
        q_lo, q_hi, k_lo, k_hi = int(qp[0]), int(qp[-1]), int(kp[0]), int(kp[-1])
        if (left is not None and k_hi < q_lo - left) or (right is not None and k_lo > q_hi + right):
            continue  # no pair of the rectangle is in the window
        if (left is None or k_lo >= q_hi - left) and (right is None or k_hi <= q_lo + right):
            out.append(m)  # every pair is: the rectangle's own mask decides
            continue
        m_len = kp.numel()
        lo = torch.zeros_like(qp) if left is None else torch.searchsorted(kp, qp - left)
        hi = torch.full_like(qp, m_len) if right is None else torch.searchsorted(kp, qp + right, right=True)
        if causal:
            hi = torch.minimum(hi, torch.searchsorted(kp, qp, right=True))
        q_doc, kv_doc = (m.q_doc, m.kv_doc) if m.kind == "positions" else (None, None)
        if q_doc is not None:
            lo = torch.maximum(lo, torch.searchsorted(kv_doc, q_doc))
            hi = torch.minimum(hi, torch.searchsorted(kv_doc, q_doc, right=True))
        sees = (lo < hi).tolist()
        lo, hi = lo.tolist(), hi.tolist()
        band = (left, right)
        a = 0
        while a < len(sees):
            if not sees[a]:
                a += 1
                continue
            b = a
            while b < len(sees) and sees[b]:
                b += 1
            ka, kb = lo[a], hi[b - 1]
            cut = lambda t, x, y: None if t is None else t[x:y]  # noqa: E731
            out.append(BlockMask("positions", m.q_start + a, m.q_start + b, m.kv_start + ka, m.kv_start + kb, 1,
                                 qp[a:b], kp[ka:kb], cut(q_doc, a, b), cut(kv_doc, ka, kb), band=band))
            a = b
    return out


@functools.lru_cache(maxsize=4096)
def _windowed_blocks(bounds: Optional[tuple[int, ...]], layout: str, q_rank: int, kv_rank: int, world_size: int,
                     local_len: int, causal: bool, stripe: int, partition: Optional[Partition],
                     window: Window) -> tuple[BlockMask, ...]:
    """The rectangles of a block pair under documents ``bounds`` (None: the layout's one mask) and
    ``window`` (cached: the same pairs come back every step and layer)."""
    if bounds is None:
        masks = [block_mask(layout, q_rank, kv_rank, world_size, local_len, causal, stripe)]
    else:
        masks = list(layout_document_blocks(bounds, layout, q_rank, kv_rank, world_size, local_len, causal, stripe,
                                            partition, MERGE_ROWS))
    q_pos = rank_positions(layout, q_rank, world_size, local_len, stripe, partition)
    kv_pos = rank_positions(layout, kv_rank, world_size, local_len, stripe, partition)
    return tuple(window_blocks(masks, q_pos, kv_pos, window, causal))


def visible_blocks(documents: Optional[Documents], layout: str, q_rank: int, kv_rank: int, world_size: int,
                   local_len: int, causal: bool, stripe: int = 1, q_rows: Optional[int] = None,
                   window: Window = None) -> list[tuple[slice, BlockMask]]:
    """Every (batch slice, visible rectangle) of a block pair; [] means skip the pair.

    Without documents: the layout's one causal/full :func:`~megatron_burst.layout.block_mask` for
    all samples (the unchanged fast path). ``q_rows`` keeps only local query rows [0, q_rows)
    (sequence-level selective checkpointing's recompute). ``window`` (left, right) intersects
    everything with a sliding window (:func:`window_blocks`).
    """
    if documents is None and window is None:
        mask = block_mask(layout, q_rank, kv_rank, world_size, local_len, causal, stripe)
        if q_rows is not None:
            mask = mask.clip_rows(q_rows)
        return [] if mask.kind == "empty" else [(slice(None), mask)]
    groups = documents.groups if documents is not None else ((0, None, None),)
    partition = documents.partition if documents is not None else None
    out = []
    for first, end, bounds in groups:
        batch = slice(first, end)
        if window is None:
            masks = layout_document_blocks(bounds, layout, q_rank, kv_rank, world_size, local_len, causal, stripe,
                                           partition, MERGE_ROWS)
        else:
            masks = _windowed_blocks(bounds, layout, q_rank, kv_rank, world_size, local_len, causal, stripe,
                                     partition, window)
        for mask in masks:
            if q_rows is not None:
                mask = mask.clip_rows(q_rows)
            if mask.kind != "empty":
                out.append((batch, mask))
    return out


def document_ids(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Document index of each global position: LongTensor like ``positions`` (any device)."""
    return torch.searchsorted(cu_seqlens.to(positions.device, torch.long), positions, right=True) - 1


def dense_document_mask(bounds: Sequence[int], seq_len: int, causal: bool = True) -> torch.Tensor:
    """Boolean [seq_len, seq_len] visibility of the whole sequence (the definition tests check against)."""
    pos = torch.arange(seq_len)
    doc = document_ids(torch.tensor(list(bounds)), pos)
    vis = doc[:, None] == doc[None, :]
    return vis & (pos[None, :] <= pos[:, None]) if causal else vis


# --------------------------------------------------------------------------------------------- #
# Load balance of packed documents under a layout (issue L): work, imbalance degrees, traffic


IMBALANCE_LAYOUTS = ("contiguous", "zigzag", "striped", THD, "balanced")


def thd_padded(bounds: Sequence[int], world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """TransformerEngine's THD padding: every sequence padded to a multiple of 2W. Returns
    (cu_seqlens_padded, document bounds with each padding tail as a document of its own)."""
    mult = 2 * world_size if world_size > 1 else 1
    padded, docs = [0], [0]
    for a, b in zip(bounds, bounds[1:]):
        length = b - a
        slot = -(-length // mult) * mult
        docs.append(padded[-1] + length)
        if slot != length:
            docs.append(padded[-1] + slot)
        padded.append(padded[-1] + slot)
    return tuple(padded), tuple(docs)


def _layout_owner(seq_len: int, world_size: int, layout: str, stripe: int):
    """int64 numpy [S]: the rank holding each token in a fixed layout (layout.layout_indices, vectorized)."""
    import numpy as np

    W, S = world_size, seq_len
    t = np.arange(S, dtype=np.int64)
    if W == 1:
        return np.zeros(S, dtype=np.int64)
    if layout == "contiguous":
        return t // (S // W)
    if layout == "zigzag":
        c = t // (S // (2 * W))
        return np.where(c < W, c, 2 * W - 1 - c)
    return (t // stripe) % W


def _thd_owner(padded: Sequence[int], world_size: int):
    """int64 numpy [S padded]: the rank holding each token under THD (layout.thd_indices, vectorized)."""
    import numpy as np

    W = world_size
    p = np.asarray(padded, dtype=np.int64)
    lens = np.diff(p)
    if W == 1:
        return np.zeros(int(p[-1]), dtype=np.int64)
    start = np.repeat(p[:-1], lens)
    chunk = np.repeat(lens // (2 * W), lens)
    c = (np.arange(int(p[-1]), dtype=np.int64) - start) // chunk
    return np.where(c < W, c, 2 * W - 1 - c)


def rank_pair_work(owner, bounds: Sequence[int], world_size: int, causal: bool = True) -> tuple:
    """Visible pairs between ranks under documents ``bounds``, given ``owner`` (int array [S]: the rank
    holding each global token). Returns (pairs, seen) as float64 numpy [W, W] arrays:
    pairs[r][o] = query-key pairs with the query on rank r and the key on rank o; seen[r][o] = how
    many of rank o's keys at least one query of rank r sees (the K,V tokens o must send r when
    traffic follows documents). O(S x W), no [S, S] mask."""
    import numpy as np

    owner = np.asarray(owner, dtype=np.int64)
    S, W = owner.size, world_size
    b = np.asarray(bounds, dtype=np.int64)
    lens = np.diff(b)
    end = np.repeat(b[1:], lens)
    first = np.repeat(b[:-1], lens)
    pairs = np.zeros((W, W))
    seen = np.zeros((W, W))
    cnt = np.zeros(S + 1, dtype=np.int64)
    for r in range(W):
        np.cumsum(owner == r, out=cnt[1:])
        # rank r's queries that see key k: at positions >= k (causal) or anywhere in k's document
        sees = cnt[end] - (cnt[:-1] if causal else cnt[first])
        pairs[r] = np.bincount(owner, weights=sees, minlength=W)
        seen[r] = np.bincount(owner, weights=sees > 0, minlength=W)
    return pairs, seen


def imbalance(cu_seqlens: Union[torch.Tensor, Sequence[int]], world_size: int, layout, *, stripe: int = 1,
              causal: bool = True) -> dict:
    """Load balance of the packed documents ``cu_seqlens`` ([0, ..., S]) on ``world_size`` CP ranks.

    ``layout``: ``"contiguous"``, ``"zigzag"``, ``"striped"`` (``stripe`` tokens per stripe),
    ``"thd"`` (TransformerEngine's per-sequence zigzag: every document padded to a multiple of 2W,
    each padding tail a document of its own, as the engine computes it), ``"balanced"``
    (:func:`megatron_burst.dispatch.plan_dispatch`), a :class:`~megatron_burst.dispatch.DispatchPlan`,
    or a list of W increasing index tensors (any layout).

    Work is visible query-key pairs, causal within each document (``causal=False``: full within it),
    computed from token ownership (O(S W); exact). At ring step t rank r computes its queries against
    the keys of rank (r - t) mod W. The names follow :func:`megatron_burst.sparse.imbalance`:

    * ``worker_total``: max over ranks of the pass's work / the mean (the issue's "worker-level").
    * ``worker``: per ring step: sum over steps of the max over ranks / sum over steps of the mean (a
      synchronous ring waits for its slowest rank at every step).
    * ``step``: the mean over ranks of max / mean over that rank's steps.
    * ``work``: [rank][step] pairs (ints).
    * ``kv_sent``: per rank, K,V blocks it sends (one block = one rank's local K,V): W - 1 for the ring
      layouts (every block travels W - 1 hops, documents or not); for ``balanced`` (and explicit
      layouts) traffic follows documents: one block to each rank whose queries see one of its keys.
    * ``kv_needed``: that documents-following count for any layout (what an engine that skips
      unneeded blocks would send); ``kv_tokens_needed``: per rank, the K,V tokens other ranks' queries
      actually see, in local blocks (the finest traffic).
    * ``padding``: tokens THD adds (0 otherwise); ``seq_len``: the (padded) length measured.
    """
    import numpy as np

    if isinstance(cu_seqlens, torch.Tensor):
        bounds = [int(x) for x in cu_seqlens.tolist()]
    else:
        bounds = [int(x) for x in cu_seqlens]
    bounds = list(_as_bounds(tuple(bounds), bounds[-1] if bounds else 0, "cu_seqlens"))
    W, S = world_size, bounds[-1]
    if W < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    padding, ring = 0, True
    if isinstance(layout, str):
        if layout not in IMBALANCE_LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(IMBALANCE_LAYOUTS)}, a "
                             "DispatchPlan or a list of per-rank index tensors")
        if layout == THD:
            padded, bounds = thd_padded(bounds, W)
            owner = _thd_owner(padded, W)
            padding = padded[-1] - S
        elif layout == "balanced":
            from megatron_burst.dispatch import plan_dispatch

            owner, ring = plan_dispatch(bounds, W, causal=causal).owner(), False
        else:
            from megatron_burst.layout import check_seq_len

            check_seq_len(S, W, layout, stripe)
            owner = _layout_owner(S, W, layout, stripe)
    else:
        ring = False
        if hasattr(layout, "owner"):
            owner = layout.owner()
        else:
            if len(layout) != W:
                raise ValueError(f"an explicit layout needs {W} index lists (one per rank), got {len(layout)}")
            owner = np.full(S, -1, dtype=np.int64)
            for r, idx in enumerate(layout):
                idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64)
                if idx.size != S // W or (owner[idx] >= 0).any():
                    raise ValueError("an explicit layout must give every rank S / W distinct tokens")
                owner[idx] = r
            if (owner < 0).any():
                raise ValueError("an explicit layout must cover every token of [0, S)")
    pairs, seen = rank_pair_work(owner, bounds, W, causal)
    r = np.arange(W)
    steps = (r[:, None] - r[None, :]) % W  # steps[r][t] = the kv rank of rank r at step t
    work = pairs[r[:, None], steps]
    total = work.sum()
    mean = total / W
    per_rank = work.sum(1)
    needed = [int(((seen[:, o] > 0).sum() - (seen[o, o] > 0))) for o in range(W)]
    local = owner.size // W
    tokens = [float((seen[:, o].sum() - seen[o, o]) / local) for o in range(W)]
    return {
        "worker": float(work.max(0).sum() / mean) if total else 1.0,
        "worker_total": float(per_rank.max() / mean) if total else 1.0,
        "step": float(np.mean([row.max() / (row.sum() / W) if row.sum() else 1.0 for row in work])),
        "work": work.astype(np.int64).tolist(),
        "kv_sent": [W - 1] * W if ring else needed,
        "kv_needed": needed,
        "kv_tokens_needed": tokens,
        "padding": padding,
        "seq_len": int(owner.size),
    }
