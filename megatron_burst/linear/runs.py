"""The data-derived layouts (packed THD batches, the balanced layout) for the linear-attention family.

The fixed layouts give each rank equal segments at known places (:mod:`megatron_burst.linear.checks`).
Packed THD batches (TransformerEngine's partitioning: every padded sequence cut into 2W chunks, rank
r holding chunks r and 2W - 1 - r) and the balanced layout (:func:`megatron_burst.dispatch.plan_dispatch`:
most documents whole on one rank, a few split) place a rank's tokens by the batch's documents. Both
are described here the same way, as *runs*: the maximal stretches of consecutive global positions a
rank holds (:func:`megatron_burst.masks.documents.rank_positions`), of any length and a different number
per rank. A run is a segment like any other -- its zero-start output, the state (or affine map) it
leaves, the state entering it -- so the ops compute runs with the same chunked kernels (the runs of
one chunk count stacked into one call by index gathers, :class:`RunLayout`) and the exchange scans every run's state
in global order (:class:`~megatron_burst.linear.exchange.SegmentMap`
with per-rank counts: a rank's part of the all-gather is padded to the most runs a rank holds).

These layouts always come with documents (they are derived from them): a run in which a document
starts is a reset (its transition is zero, ``keep`` False), exactly as a fixed layout's segment is;
every rank derives the flags from the global boundaries, so nothing extra is sent. A run that
continues a document split over ranks (THD: every chunk after a sequence's first; balanced: the
pieces of the few split documents) is entered by the state its predecessor left.

Bytes: one state [dk, dv] (with its decay; the delta rule: a map [dk, dk] and [dk, dv]) per run and
all-gather slot. THD: 2 x (sequences) per rank, every sequence's chunks being spread over all
ranks. Balanced: one per run, few (whole documents next to each other on a rank form one run).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.masks.documents import THD, Documents, rank_positions
from megatron_burst.masks.layout import BALANCED
from megatron_burst.linear.docs import document_index
from megatron_burst.linear.exchange import Resets, SegmentMap, resets

__all__ = ["RUN_LAYOUTS", "Runs", "rank_runs", "run_map", "RunDocuments", "run_documents", "RunGroup", "chunk_groups",
           "RunLayout", "run_layout"]

RUN_LAYOUTS = (THD, BALANCED)


@dataclass(frozen=True)
class Runs:
    """Every rank's runs: ``per_rank[r]`` = ((global start, length), ...) in rank r's local (increasing)
    order; ``order[r]`` their global indices (runs numbered by start over all ranks)."""

    per_rank: tuple[tuple[tuple[int, int], ...], ...]
    order: tuple[tuple[int, ...], ...]

    def lengths(self, rank: int) -> list[int]:
        return [n for _, n in self.per_rank[rank]]

    @property
    def starts(self) -> tuple[tuple[int, int], ...]:
        """Every run (start, length) in global order."""
        return tuple(sorted(run for mine in self.per_rank for run in mine))


def _runs_of(positions: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """((start, length), ...) of the maximal runs of consecutive values in increasing ``positions``
    (vectorized: a 1M-token sequence is planned once per batch, not walked token by token)."""
    cut = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    first = torch.cat([torch.zeros(1, dtype=torch.long), cut])
    lengths = torch.diff(first, append=torch.tensor([positions.numel()]))
    return tuple(zip(positions[first].tolist(), lengths.tolist()))


@functools.lru_cache(maxsize=16)  # a step's layers share one batch's documents
def rank_runs(documents: Documents, world_size: int) -> Runs:
    """The :class:`Runs` of a THD or balanced batch on ``world_size`` ranks (``documents`` carries the
    placement: THD's padded boundaries or the balanced plan). Host arithmetic, cached per batch."""
    layout = documents.layout
    if layout not in RUN_LAYOUTS:
        raise ValueError(f"documents without a data-derived placement (layout {layout!r}) have no runs: pass "
                         f"documents of layout {' or '.join(RUN_LAYOUTS)}")
    local_len = documents.seq_len // world_size
    per_rank = tuple(_runs_of(rank_positions(layout, r, world_size, local_len, partition=documents.partition))
                     for r in range(world_size))
    index = {run: i for i, run in enumerate(sorted(run for mine in per_rank for run in mine))}
    return Runs(per_rank, tuple(tuple(index[run] for run in mine) for mine in per_rank))


def run_map(group: Optional[dist.ProcessGroup], rank: int, world_size: int, runs: Runs) -> SegmentMap:
    """The exchange's view of ``runs``: rank r's local segments are its runs (causal)."""
    return SegmentMap(group, rank, world_size, runs.order, True)


@dataclass(frozen=True)
class RunDocuments:
    """One rank's runs under documents, as :class:`megatron_burst.linear.docs.SegmentDocuments` holds
    them for equal segments: ``doc`` [b, s] (long): the document index of each local token (local
    order); ``enter`` [nseg, b, 1] (long): per local run, the document of the token just before it (0
    before the sequence's first); ``resets``: keep [T, b] (bool, global run order), True when no
    document starts in the run.
    """

    doc: torch.Tensor
    enter: torch.Tensor
    resets: Resets


@functools.lru_cache(maxsize=16)
def _run_documents(documents: Documents, batch: int, runs: Runs, rank: int, device: str) -> RunDocuments:
    every = document_index(documents, batch, torch.device(device))  # [b, S]
    host = document_index(documents, batch, torch.device("cpu"))  # the per-run flags: host work, one copy each
    starts = torch.tensor([a for a, _ in runs.starts])
    ends = starts + torch.tensor([n for _, n in runs.starts])
    enter_all = torch.where(starts > 0, host[:, (starts - 1).clamp(min=0)], 0)  # [b, T]
    keep = resets((host[:, ends - 1] == enter_all).T.contiguous(), torch.device(device))  # [T, b]
    mine = torch.tensor(runs.order[rank], dtype=torch.long)
    enter = enter_all[:, mine].T.reshape(-1, batch, 1).to(device)  # [nseg, b, 1]
    doc = torch.cat([every[:, a:a + n] for a, n in runs.per_rank[rank]], dim=1)  # [b, s]
    return RunDocuments(doc, enter, keep)


def run_documents(documents: Documents, batch: int, runs: Runs, rank: int, device: torch.device) -> RunDocuments:
    """The :class:`RunDocuments` of ``rank``'s runs (cached: every layer of a step gets the same tensors)."""
    return _run_documents(documents, batch, runs, rank, str(device))


@dataclass(frozen=True)
class RunGroup:
    """Local runs ``index`` (in local order) whose lengths round up to the same ``length`` (whole chunks):
    stacked, they make one batched call of the chunked kernels. A run's padding tokens are identity
    steps (zero k, v, log-decay and beta; its last document), so its state or map is unchanged, and
    their outputs are dropped."""

    index: tuple[int, ...]
    length: int


def chunk_groups(lengths: list[int], chunk: int) -> list[RunGroup]:
    """The local runs grouped by their length rounded up to whole chunks of ``chunk`` tokens (no padding
    beyond what the chunked kernels add anyway): THD's two chunks of a sequence always share a group."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(-(-n // chunk) * chunk, []).append(i)
    return [RunGroup(tuple(index), length) for length, index in sorted(groups.items())]


@dataclass(frozen=True, eq=False)
class RunLayout:
    """How one rank's s local tokens, held as runs of ``lengths``, move into the batched calls and
    back, as index tensors on the device (built once per batch, :func:`run_layout`): a few gathers per
    tensor and group, never an op per run (a THD batch has ~100 runs per rank; on a GPU every op
    is a kernel launch).

    ``groups``: :func:`chunk_groups`. Per group, ``take`` [n * length] the local token of each stacked
    slot (run-major), ``s`` for a padding slot (a zero row appended to the tokens); ``take_last`` the
    same with a padding slot repeating its run's last token (document indices); ``rows`` [n] its runs'
    local indices. ``scatter`` [s]: each local token's slot among the groups' slots concatenated;
    ``run_order`` [nseg]: each local run's row among the groups' runs concatenated. ``flat`` [b * s]
    (None when b == 1: the identity): fla's varlen rows (run i of sample j, run-major) as indices into
    the local tokens flattened sample-major, ``unflat`` its inverse.
    """

    lengths: tuple[int, ...]
    groups: tuple[RunGroup, ...]
    take: tuple[torch.Tensor, ...]
    take_last: tuple[torch.Tensor, ...]
    rows: tuple[torch.Tensor, ...]
    scatter: torch.Tensor
    run_order: torch.Tensor
    flat: Optional[torch.Tensor]
    unflat: Optional[torch.Tensor]

    def stack(self, x: torch.Tensor, dim: int, replicate: bool = False) -> list[torch.Tensor]:
        """``x`` with the local tokens on ``dim`` -> per group [n, ...x without dim..., length at dim]:
        the group's runs stacked (run first), padded with zeros (``replicate``: the run's last token)."""
        dim = dim % x.dim()
        if not replicate:
            pad = list(x.shape)
            pad[dim] = 1
            x = torch.cat([x, x.new_zeros(pad)], dim)
        out = []
        for grp, idx in zip(self.groups, self.take_last if replicate else self.take):
            y = x.index_select(dim, idx).unflatten(dim, (len(grp.index), grp.length))
            out.append(y.movedim(dim, 0))
        return out

    def unstack(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of :meth:`stack` for outputs: per group [n, ..., length at ``dim`` + 1, ...] -> the local
        tokens on ``dim`` (the padding dropped)."""
        joined = torch.cat([p.movedim(0, dim).flatten(dim, dim + 1) for p in parts], dim)
        return joined.index_select(dim, self.scatter)

    def in_run_order(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per group [n, ...] -> [nseg, ...] in the runs' local order."""
        return torch.cat(parts).index_select(0, self.run_order)

    def to_flat(self, t: torch.Tensor, sbhd: bool) -> torch.Tensor:
        """A rank-local tensor [s, b, h, ...] (``sbhd``) or [b, s, h, ...] -> fla's varlen input
        [1, b * s, h, ...]: the rows (run i of sample j, run-major) one after another."""
        t = t.transpose(0, 1) if sbhd else t  # [b, s, ...]
        t = t.reshape((-1,) + tuple(t.shape[2:]))
        return (t if self.flat is None else t.index_select(0, self.flat)).unsqueeze(0)

    def from_flat(self, o: torch.Tensor, batch: int, sbhd: bool) -> torch.Tensor:
        """Inverse of :meth:`to_flat`: [1, b * s, h, ...] -> [s, b, h, ...] (``sbhd``) or [b, s, h, ...]."""
        o = o[0] if self.unflat is None else o[0].index_select(0, self.unflat)
        o = o.reshape((batch, -1) + tuple(o.shape[1:]))
        return o.transpose(0, 1) if sbhd else o


@functools.lru_cache(maxsize=16)  # a step's layers share one batch's layout
def _run_layout(lengths: tuple[int, ...], chunk: int, batch: int, device: str) -> RunLayout:
    n_all = torch.tensor(lengths, dtype=torch.long)
    s = int(n_all.sum())
    starts = torch.cumsum(n_all, 0) - n_all
    groups = tuple(chunk_groups(list(lengths), chunk))
    take, take_last, rows = [], [], []
    slot_of = torch.empty(s, dtype=torch.long)
    offset = 0
    for grp in groups:  # host index arithmetic, once per batch; vectorized over the group's runs
        idx = torch.tensor(grp.index, dtype=torch.long)
        a, n = starts[idx, None], n_all[idx, None]
        pos = torch.arange(grp.length)
        token, pad = a + pos, pos >= n  # [runs, length]
        take.append(torch.where(pad, s, token).flatten())
        take_last.append(torch.where(pad, a + n - 1, token).flatten())
        slots = offset + torch.arange(token.numel()).view(token.shape)
        slot_of[token[~pad]] = slots[~pad]
        offset += token.numel()
        rows.append(idx)
    run_order = torch.empty(len(lengths), dtype=torch.long)
    run_order[torch.cat(rows)] = torch.arange(len(lengths))
    flat = unflat = None
    if batch > 1:  # fla's rows run-major: run i of sample j, tokens in order
        run_of = torch.repeat_interleave(torch.arange(len(lengths)), n_all)  # [s]
        sample, token = torch.meshgrid(torch.arange(batch), torch.arange(s), indexing="ij")
        flat = (sample * s + token).flatten()[torch.argsort((run_of[token] * batch + sample).flatten(), stable=True)]
        unflat = torch.empty_like(flat)
        unflat[flat] = torch.arange(flat.numel())
    dev = torch.device(device)
    return RunLayout(lengths, groups, tuple(t.to(dev) for t in take), tuple(t.to(dev) for t in take_last),
                     tuple(r.to(dev) for r in rows), slot_of.to(dev), run_order.to(dev),
                     None if flat is None else flat.to(dev), None if unflat is None else unflat.to(dev))


def run_layout(lengths: list[int], chunk: int, batch: int, device: torch.device) -> RunLayout:
    """The :class:`RunLayout` of a rank's runs of ``lengths`` (cached per batch)."""
    return _run_layout(tuple(lengths), chunk, batch, str(device))
