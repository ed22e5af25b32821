"""Sequence layouts (placements as data): which global tokens each context-parallel rank holds,
and the causal/full mask of each block pair of a fixed layout.

A layout maps a global sequence of ``seq_len`` tokens onto ``world_size`` ranks:

* ``contiguous``: rank r holds tokens [r*n, (r+1)*n), n = seq_len / W.
* ``zigzag``: Megatron's load balancing: the sequence is cut into 2W chunks and rank r holds chunks
  r and 2W-1-r (in that order).
* ``striped``: stripes of ``stripe`` consecutive tokens are dealt round-robin: stripe j goes to rank
  j mod W. ``stripe=1`` puts token t on rank t mod W; wider stripes are "block-striped".
* ``balanced``: derived from the batch's packed documents (``cu_seqlens``): the placement of
  :func:`megatron_burst.masks.dispatch.plan_dispatch`, which balances attention work (and keeps short
  documents whole on one rank). Every rank holds S / W tokens, in increasing global order; S must
  be divisible by W. Functions here take the documents as ``cu_seqlens`` or the plan as ``plan``.

On one rank (``world_size=1``) every layout is the identity, so any sequence length works there.

Packed THD batches are placed per sequence (:func:`thd_indices`, TransformerEngine's zigzag per
sequence); their masks are documents (:mod:`megatron_burst.masks.documents`).

In every layout a rank's local tokens are in increasing global order. That makes the diagonal block
(q rank == kv rank) plain causal in local indices, and lets :func:`block_mask` describe every other
(q rank, kv rank) block of a fixed layout as a :class:`~megatron_burst.masks.block.BlockMask`
rectangle with a simple mask inside. Index tensors returned from caches are shared: read-only.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

from megatron_burst.masks.block import BlockMask
from megatron_burst.masks.bounds import checked_bounds
from megatron_burst.masks.dispatch import DispatchPlan, check_divisible, checked_ranks_per_node, plan_dispatch

__all__ = ["LAYOUTS", "BALANCED", "ENGINE_LAYOUTS", "BalancedCuSeqlens", "check_layout", "seq_divisor",
           "check_seq_len", "check_local_len", "balanced_plan", "layout_indices", "thd_indices", "plan_rows",
           "layout_indices_on", "shard", "unshard", "block_mask", "global_causal_mask"]

# The fixed layouts: a token's rank follows from its position alone (what Megatron's --cp-layout takes).
LAYOUTS = ("contiguous", "zigzag", "striped")
BALANCED = "balanced"  # placed by the documents (plan_dispatch); needs cu_seqlens or a plan
ENGINE_LAYOUTS = LAYOUTS + (BALANCED,)  # what cp_attention, shard and layout_indices take

# one int tensor / list [0, ..., S], or one per sample (balanced plans on their union)
BalancedCuSeqlens = Union[torch.Tensor, Sequence[int], Sequence[torch.Tensor], Sequence[Sequence[int]]]


def check_layout(layout: str, stripe: int = 1) -> None:
    """Raise ValueError for an unknown layout name or a bad stripe width (any of ENGINE_LAYOUTS)."""
    if layout not in ENGINE_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(ENGINE_LAYOUTS)}")
    if not isinstance(stripe, int) or stripe < 1:
        raise ValueError(f"stripe={stripe!r} must be a positive int")
    if stripe != 1 and layout != "striped":
        raise ValueError(f"stripe={stripe} is only meaningful with layout='striped', not {layout!r}")


def seq_divisor(layout: str, world_size: int, stripe: int = 1) -> int:
    """The number the global sequence length must be divisible by for ``layout`` (1 on one rank,
    where every layout is the identity)."""
    check_layout(layout, stripe)
    if world_size == 1 or layout in ("contiguous", BALANCED):
        return world_size
    if layout == "zigzag":
        return 2 * world_size
    return world_size * stripe


def check_seq_len(seq_len: int, world_size: int, layout: str, stripe: int = 1) -> None:
    """Raise ValueError unless ``seq_len`` splits evenly over ``world_size`` ranks in ``layout``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    div = seq_divisor(layout, world_size, stripe)
    if seq_len <= 0 or seq_len % div:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {div}, which layout={layout!r} needs "
            f"with world_size={world_size}" + (f" and stripe={stripe}" if layout == "striped" else "")
            + f": pad the sequence to a multiple of {div}"
        )


def check_local_len(local_len: int, world_size: int, layout: str, stripe: int = 1) -> None:
    """Raise ValueError unless a rank-local length fits ``layout`` (a zigzag shard has 2 chunks...)."""
    check_seq_len(local_len * world_size, world_size, layout, stripe)


def _union_bounds(cu_seqlens: BalancedCuSeqlens, seq_len: int) -> tuple[int, ...]:
    """The document boundaries [0, ..., seq_len] of one cu_seqlens, or the union of per-sample ones."""
    per_sample = (isinstance(cu_seqlens, (list, tuple)) and len(cu_seqlens) > 0
                  and isinstance(cu_seqlens[0], (torch.Tensor, list, tuple)))
    union: set[int] = set()
    for i, cu in enumerate(cu_seqlens if per_sample else [cu_seqlens]):
        union.update(checked_bounds(cu, seq_len, f"cu_seqlens[{i}]" if per_sample else "cu_seqlens"))
    return tuple(sorted(union))


@functools.lru_cache(maxsize=16)
def _plan_of(bounds: tuple[int, ...], world_size: int, causal: bool, ranks_per_node: int) -> DispatchPlan:
    # every layer of a step asks for the same batch's plan: plan once per (boundaries, W, causal, R)
    return plan_dispatch(bounds, world_size, causal=causal, ranks_per_node=ranks_per_node)


def balanced_plan(cu_seqlens: BalancedCuSeqlens, seq_len: int, world_size: int, causal: bool = True,
                  ranks_per_node: Optional[int] = None) -> DispatchPlan:
    """The ``balanced`` layout's placement of a batch: :func:`~megatron_burst.masks.dispatch.plan_dispatch`
    of its document boundaries ``cu_seqlens`` ([0, ..., seq_len] int tensor or list, or a list of
    them, one per sample) on ``world_size`` ranks.

    Per-sample boundaries are planned on their union (every boundary of every sample): one
    placement for the whole batch, as tensors [s, b, ...] need. Any placement is exact for every
    sample (its own documents still decide what it sees); the union makes it balance each
    sample's documents nearly as well as its own plan would. Deterministic and the same on every
    rank; cached per (boundaries, W, causal, ranks per node). ``causal`` only steers the balance
    (non-causal work is L^2 per document): the engine plans with the default, so pass the same value
    everywhere. ``ranks_per_node``: the CP topology's ranks per node (None: one node), which places
    the plan node-aware (:func:`~megatron_burst.masks.dispatch.placement_order`); batch slicing and
    the attention layers must use the same value (cp_attention checks).
    """
    check_divisible(seq_len, world_size)
    R = checked_ranks_per_node(world_size, ranks_per_node)  # None and W: one cache entry
    return _plan_of(_union_bounds(cu_seqlens, seq_len), world_size, bool(causal), R)


def _resolve_plan(seq_len: int, world_size: int, cu_seqlens: Optional[BalancedCuSeqlens],
                  plan: Optional[DispatchPlan], ranks_per_node: Optional[int] = None) -> DispatchPlan:
    """The balanced layout's plan from ``plan`` or ``cu_seqlens`` (exactly one), checked against S and W
    (and against ``ranks_per_node`` when both it and ``plan`` are given)."""
    if plan is None and cu_seqlens is None:
        raise ValueError("layout='balanced' places tokens by the batch's documents: pass cu_seqlens=[0, ..., S] "
                         "(or plan=megatron_burst.documents.balanced_documents(...).plan)")
    if plan is not None and cu_seqlens is not None:
        raise ValueError("pass either cu_seqlens or plan for layout='balanced', not both")
    if plan is None:
        return balanced_plan(cu_seqlens, seq_len, world_size, ranks_per_node=ranks_per_node)
    if not isinstance(plan, DispatchPlan):
        raise ValueError(f"plan={plan!r} must be a megatron_burst.dispatch.DispatchPlan")
    if (plan.seq_len, plan.world_size) != (seq_len, world_size):
        raise ValueError(f"the plan places {plan.seq_len} tokens on {plan.world_size} ranks, but this call has "
                         f"{seq_len} tokens on {world_size} ranks: plan this batch for this CP size")
    if ranks_per_node is not None and plan.ranks_per_node != checked_ranks_per_node(world_size, ranks_per_node):
        raise ValueError(f"the plan is placed for {plan.ranks_per_node} ranks per node, this call asks for "
                         f"ranks_per_node={ranks_per_node}: plan the batch with ranks_per_node={ranks_per_node} "
                         "(or pass ranks_per_node=None to take the plan's)")
    return plan


def layout_indices(seq_len: int, rank: int, world_size: int, layout: str, stripe: int = 1, *,
                   cu_seqlens: Optional[BalancedCuSeqlens] = None, plan: Optional[DispatchPlan] = None,
                   ranks_per_node: Optional[int] = None) -> torch.Tensor:
    """Global token positions held by ``rank``, in local (increasing) order. Returns LongTensor [seq_len / W].

    ``layout="balanced"`` needs the batch's documents: ``cu_seqlens`` (see :func:`balanced_plan`) or
    the ``plan`` itself (e.g. ``Documents.plan``, planned once per batch); other layouts take neither.
    ``ranks_per_node`` (balanced only): the CP topology's ranks per node the plan is placed for
    (None: one node with ``cu_seqlens``; the plan's own with ``plan``, else checked against it).
    """
    check_seq_len(seq_len, world_size, layout, stripe)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, {world_size})")
    if layout == BALANCED:
        return plan_rows(_resolve_plan(seq_len, world_size, cu_seqlens, plan, ranks_per_node))[rank].clone()
    if cu_seqlens is not None or plan is not None or ranks_per_node is not None:
        raise ValueError(f"cu_seqlens / plan / ranks_per_node place tokens only in layout 'balanced'; layout "
                         f"{layout!r} places them by position alone (pass none of them)")
    n = seq_len // world_size
    if layout == "contiguous" or world_size == 1:  # one rank holds everything, in order
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        c = n // 2
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)])
    stripes = torch.arange(rank, seq_len // stripe, world_size)
    return (stripes[:, None] * stripe + torch.arange(stripe)[None, :]).reshape(-1)


def thd_indices(cu_seqlens_padded: Sequence[int], rank: int, world_size: int) -> torch.Tensor:
    """Global positions ``rank`` holds of a packed (THD) batch, TransformerEngine's partitioning.

    Each (padded) sequence [cu[i], cu[i+1]) is cut into 2W chunks and rank r holds chunks r and
    2W-1-r of every sequence: zigzag per sequence, in increasing global order. Returns LongTensor
    [cu[-1] / W]. Every padded length must be divisible by 2W when W > 1 (see megatron_burst.masks.documents.check_thd).
    """
    if world_size == 1:  # one rank holds everything, in order: lengths need no divisibility
        return torch.arange(cu_seqlens_padded[-1])
    parts = []
    for a, b in zip(cu_seqlens_padded, cu_seqlens_padded[1:]):
        c = (b - a) // (2 * world_size)
        parts += [torch.arange(a + rank * c, a + (rank + 1) * c),
                  torch.arange(a + (2 * world_size - 1 - rank) * c, a + (2 * world_size - rank) * c)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@functools.lru_cache(maxsize=16)
def plan_rows(plan: DispatchPlan) -> tuple[torch.Tensor, ...]:
    """Every rank's global positions under ``plan``: W LongTensors [S/W], increasing, CPU, built in one
    O(S) pass and cached per plan (the layers of a step ask again; the plan's hash is cached).
    Shared: read-only."""
    return tuple(plan.all_indices())


@functools.lru_cache(maxsize=64)
def layout_indices_on(seq_len: int, rank: int, world_size: int, layout: str, stripe: int,
                      device: torch.device, plan: Optional[DispatchPlan] = None) -> torch.Tensor:
    """:func:`layout_indices` on ``device``, built once per arguments and reused (read-only!).

    Batch slicing and RoPE ask for the same positions every step; building them on the host and
    copying them to the GPU each time would cost a host-to-device copy per call. ``plan``: the
    balanced layout's placement (its cached hash keeps the lookup cheap).
    """
    return layout_indices(seq_len, rank, world_size, layout, stripe, plan=plan).to(device)


def shard(x: torch.Tensor, dim: int, rank: int, world_size: int, layout: str, stripe: int = 1, *,
          cu_seqlens: Optional[BalancedCuSeqlens] = None, plan: Optional[DispatchPlan] = None,
          ranks_per_node: Optional[int] = None) -> torch.Tensor:
    """The part of the full-sequence tensor ``x`` (sequence along ``dim``, S long) that ``rank`` holds:
    ``x`` with dim ``dim`` cut to S / W. ``cu_seqlens`` / ``plan`` / ``ranks_per_node``: layout
    "balanced" only (see :func:`layout_indices`)."""
    idx = layout_indices(x.shape[dim], rank, world_size, layout, stripe, cu_seqlens=cu_seqlens, plan=plan,
                         ranks_per_node=ranks_per_node)
    if layout == "contiguous":
        return x.narrow(dim, int(idx[0]), idx.numel())
    return x.index_select(dim, idx.to(x.device))


def unshard(shards: Sequence[torch.Tensor], dim: int, layout: str, stripe: int = 1, *,
            cu_seqlens: Optional[BalancedCuSeqlens] = None, plan: Optional[DispatchPlan] = None,
            ranks_per_node: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`shard`: reassemble the full sequence (S = W x the shards' length along ``dim``)
    from every rank's shard, in (physical) rank order. ``cu_seqlens`` / ``plan`` / ``ranks_per_node``:
    layout "balanced" only."""
    world_size = len(shards)
    local_len = shards[0].shape[dim]
    seq_len = local_len * world_size
    cat = torch.cat(list(shards), dim=dim)
    if layout == "contiguous":
        check_seq_len(seq_len, world_size, layout, stripe)
        return cat
    order = torch.cat([layout_indices(seq_len, r, world_size, layout, stripe, cu_seqlens=cu_seqlens, plan=plan,
                                      ranks_per_node=ranks_per_node) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return cat.index_select(dim, inverse.to(cat.device))


def block_mask(layout: str, q_rank: int, kv_rank: int, world_size: int, local_len: int,
               causal: bool, stripe: int = 1) -> BlockMask:
    """Visible part of the block (queries of ``q_rank``) x (keys of ``kv_rank``), both ``local_len`` long."""
    if layout not in LAYOUTS:  # balanced and THD blocks come from documents (masks.documents)
        raise ValueError(f"block_mask covers the fixed layouts {', '.join(LAYOUTS)}; layout {layout!r} is placed by "
                         "documents: use megatron_burst.documents.visible_blocks")
    n = local_len
    if not causal:
        return BlockMask("full", 0, n, 0, n)
    if q_rank == kv_rank:
        return BlockMask("causal", 0, n, 0, n)
    if layout == "contiguous":
        return BlockMask("full", 0, n, 0, n) if kv_rank < q_rank else BlockMask("empty")
    if layout == "zigzag":
        c = n // 2
        if kv_rank < q_rank:  # both q chunks see the kv rank's early chunk; its late chunk is in the future
            return BlockMask("full", 0, n, 0, c)
        return BlockMask("full", c, n, 0, n)  # only the q rank's late chunk sees this (later) kv rank
    # striped: q stripe a of rank i vs kv stripe b of rank j: visible iff b <= a (j < i) or b < a (j > i)
    if kv_rank < q_rank:
        return BlockMask("causal" if stripe == 1 else "block_causal", 0, n, 0, n, stripe)
    if n == stripe:  # a single stripe per rank: the later rank's stripe is entirely in the future
        return BlockMask("empty")
    return BlockMask("causal" if stripe == 1 else "block_causal", stripe, n, 0, n - stripe, stripe)


def global_causal_mask(layout: str, q_rank: int, kv_rank: int, world_size: int, local_len: int,
                       stripe: int = 1) -> torch.Tensor:
    """Boolean [n, n] causal visibility computed from global positions (the definition tests check against)."""
    seq_len = local_len * world_size
    qp = layout_indices(seq_len, q_rank, world_size, layout, stripe)
    kp = layout_indices(seq_len, kv_rank, world_size, layout, stripe)
    return kp[None, :] <= qp[:, None]
