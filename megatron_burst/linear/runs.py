"""The data-derived layouts (packed THD batches, the balanced layout) for the linear-attention family.

The fixed layouts give each rank equal segments at known places (:mod:`megatron_burst.linear.checks`).
Packed THD batches (TransformerEngine's partitioning: every padded sequence cut into 2W chunks, rank
r holding chunks r and 2W - 1 - r) and the balanced layout (:func:`megatron_burst.dispatch.plan_dispatch`:
most documents whole on one rank, a few split) place a rank's tokens by the batch's documents. Both
are described here the same way, as *runs*: the maximal stretches of consecutive global positions a
rank holds (:func:`megatron_burst.masks.documents.rank_positions`), of any length and a different number
per rank. A run is a segment like any other -- its zero-start output, the state (or affine map) it
leaves, the state entering it -- so the ops compute runs with the same chunked kernels (the runs of
one chunk count stacked into one call, :class:`RunGroup`) and the exchange scans every run's state
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

__all__ = ["RUN_LAYOUTS", "Runs", "rank_runs", "run_map", "RunDocuments", "run_documents", "split_runs", "RunGroup",
           "chunk_groups", "in_run_order"]

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
    them for equal segments, one entry per local run i of length L_i:

    ``doc[i]`` [1, b, 1, L_i] (long): the document index of each token; ``enter[i]`` [1, b, 1] (long):
    the document of the token just before the run (0 before the sequence's first); ``resets``: keep
    [T, b] (bool, global run order), True when no document starts in the run.
    """

    doc: tuple[torch.Tensor, ...]
    enter: tuple[torch.Tensor, ...]
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
    enter = enter_all[:, mine].T.reshape(-1, 1, batch, 1).to(device).unbind(0)  # per run [1, b, 1]
    doc = tuple(every[:, a:a + n].reshape(1, batch, 1, n) for a, n in runs.per_rank[rank])
    return RunDocuments(doc, tuple(enter), keep)


def run_documents(documents: Documents, batch: int, runs: Runs, rank: int, device: torch.device) -> RunDocuments:
    """The :class:`RunDocuments` of ``rank``'s runs (cached: every layer of a step gets the same tensors)."""
    return _run_documents(documents, batch, runs, rank, str(device))


def split_runs(t: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """[b, h, s, ...] (this rank's tokens in local order) -> per run [1, b, h, L_i, ...] (views): the
    segment layout the chunked kernels take, one run at a time."""
    return [x.unsqueeze(0) for x in t.split(lengths, dim=2)]


@dataclass(frozen=True)
class RunGroup:
    """Local runs ``index`` (in local order) whose lengths round up to the same ``length`` (whole chunks):
    stacked, they make one batched call of the chunked kernels. A run's padding tokens are identity
    steps (zero k, v, log-decay and beta; its last document), so its state or map is unchanged, and
    their outputs are dropped."""

    index: tuple[int, ...]
    length: int

    def stack(self, parts: list, dim: int, replicate: bool = False) -> torch.Tensor:
        """Per-run tensors [1, ..., L_i, ...] (tokens on ``dim``) -> [n, ..., length, ...], padded with
        zeros (``replicate``: with the run's last entry, for document indices)."""
        out = []
        for i in self.index:
            t = parts[i]
            missing = self.length - t.shape[dim]
            if missing:
                if replicate:
                    pad = t.narrow(dim, t.shape[dim] - 1, 1).repeat_interleave(missing, dim)
                else:
                    shape = list(t.shape)
                    shape[dim] = missing
                    pad = t.new_zeros(shape)
                t = torch.cat([t, pad], dim=dim)
            out.append(t)
        return torch.cat(out)

    def unstack(self, t: torch.Tensor, lengths: list[int], dim: int) -> dict[int, torch.Tensor]:
        """[n, ..., length, ...] -> {run index: [1, ..., L_i, ...]} (the padding dropped)."""
        return {i: t[j:j + 1].narrow(dim, 0, lengths[i]) for j, i in enumerate(self.index)}


def chunk_groups(lengths: list[int], chunk: int) -> list[RunGroup]:
    """The local runs grouped by their length rounded up to whole chunks of ``chunk`` tokens (no padding
    beyond what the chunked kernels add anyway): THD's two chunks of a sequence always share a group."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(-(-n // chunk) * chunk, []).append(i)
    return [RunGroup(tuple(index), length) for length, index in sorted(groups.items())]


def in_run_order(parts: list) -> torch.Tensor:
    """[(RunGroup, its runs' tensor [n, ...]), ...] -> [nseg, ...] in the runs' local order."""
    rows = {i: t[j:j + 1] for grp, t in parts for j, i in enumerate(grp.index)}
    return torch.cat([rows[i] for i in range(len(rows))])
