"""Documents for the linear-attention family: where the recurrent state starts again from zero.

Packed documents ``cu_seqlens`` [0, ..., S] (global positions over the full sequence, the same on
every CP rank; :func:`megatron_burst.masks.documents.check_cu_seqlens`) make every document its own
sequence: the first token of a document sees a zero state, as if the document stood alone. In the
recurrences that is one more factor on the transition,

    S_t = r_t * F_t(S_{t-1}) + (token t's own term),   r_t = 0 at a document start, else 1,

so every decay form takes it as a log-decay of -inf at the document's first token. The kernels do
not add -inf to a cumulative sum (it would poison the differences); they keep the cumulative decay
G finite and mask with document indices instead:

* inside a segment, token j reaches token t >= j iff both are in the same document; the state
  entering the segment reaches token t iff t is still in the document of the token before the
  segment (``enter``); the state a segment leaves from a zero start keeps only its last
  document's tokens;
* across segments, a segment in which a document starts (at its first token or later) is a *reset*
  map: its transition a (LASP-2's decay, the delta rule's A) is multiplied by zero, so the prefix
  state stops there. The global boundaries are the same on every rank, so each rank knows every
  segment's reset flag (``keep``) without sending it: the all-gather is unchanged.

:func:`segment_documents` turns validated documents into those per-token indices and per-segment
flags for one rank's segments (cached: the same call returns every layer and step).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_burst.masks.documents import THD, CuSeqlens, Documents, balanced_documents, check_cu_seqlens, check_thd
from megatron_burst.masks.layout import BALANCED
from megatron_burst.linear.exchange import Resets, resets

__all__ = ["SegmentDocuments", "check_documents", "segment_documents", "document_index", "unplaced"]


@dataclass(frozen=True)
class SegmentDocuments:
    """One rank's segments under documents (``T`` global segments of ``L`` tokens each).

    ``doc`` [nseg, b, 1, L] (long): the document index of every local token, by segment.
    ``enter`` [nseg, b, 1] (long): the document of the token just before each local segment: the
    document the entering state belongs to (0 before the first segment, whose state is zero).
    ``resets``: per global segment (global order) ``keep`` [T, b] (bool), True when no document starts
    inside it, so the state entering it carries on through it; False makes it a reset map.
    """

    doc: torch.Tensor
    enter: torch.Tensor
    resets: Resets

    @property
    def from_entering(self) -> torch.Tensor:
        """[nseg, b, 1, L] bool: token still in the document of the state entering its segment."""
        return self.doc == self.enter.unsqueeze(-1)


def check_documents(cu_seqlens: "CuSeqlens | Documents", seq_len: int, batch: int, layout: Optional[str] = None,
                    world_size: int = 1) -> Documents:
    """Validated documents of a linear-attention call (local checks only: safe before any collective).

    ``cu_seqlens``: as cp_attention takes it -- one int tensor (or list of ints) [0, ..., S] shared
    by the batch, a list of ``batch`` of them (one per sample), or a
    :class:`~megatron_burst.masks.documents.Documents` validated once per batch. ``seq_len`` is the
    global length S = local length x CP size. ``layout`` "thd" or "balanced" (the data-derived
    layouts, :mod:`megatron_burst.linear.runs`): Documents must carry that layout's placement for
    ``world_size`` ranks. Raw THD boundaries are placed here (every sequence's length divisible by
    2 x ``world_size``). Raw balanced boundaries are taken on one rank only: the plan depends on the
    CP topology's ranks per node, which a process group does not tell, so at W > 1 the Documents the
    batch was sliced with (``balanced_documents(..., ranks_per_node=...)``) are required.
    """
    derived = layout in (THD, BALANCED)
    if not isinstance(cu_seqlens, Documents):
        if layout == THD:
            return check_thd(cu_seqlens, None, seq_len // world_size, world_size, batch)
        if layout == BALANCED:
            if world_size > 1:
                raise ValueError("layout='balanced' with raw boundaries: the placement depends on the CP "
                                 "topology's ranks per node, so pass the Documents the batch was sliced with "
                                 "(megatron_burst.balanced_documents(cu_seqlens, S, b, W, ranks_per_node=...)), "
                                 "as the softmax layers get them")
            return balanced_documents(cu_seqlens, seq_len, batch, world_size)
        return check_cu_seqlens(cu_seqlens, seq_len, batch)
    docs = cu_seqlens
    if docs.layout != (layout if derived else None):
        placed = f"placed for layout {docs.layout!r}" if docs.layout else "without a placement"
        fix = (f"build them with megatron_burst.documents.{'check_thd' if layout == THD else 'balanced_documents'}"
               if derived else f"pass layout={docs.layout!r} (the layout the batch was sliced in)")
        raise ValueError(f"documents {placed} do not fit layout={layout!r}: {fix}")
    if docs.plan is not None and docs.plan.world_size != world_size:
        raise ValueError(f"the balanced plan places tokens on {docs.plan.world_size} ranks, the CP group has "
                         f"{world_size}: plan with the group's size")
    if docs.layout == THD and world_size > 1:
        odd = [(a, c) for a, c in zip(docs.partition, docs.partition[1:]) if (c - a) % (2 * world_size)]
        if odd:
            raise ValueError(f"packed sequence {odd[0]} of these THD documents is not divisible by 2 x CP size = "
                             f"{2 * world_size}: they were built for another CP size; build them with "
                             "check_thd for this group")
    if docs.seq_len != seq_len:
        raise ValueError(f"documents for {docs.seq_len} tokens do not fit this call: the global sequence has "
                         f"{seq_len} tokens (local length x CP size)")
    covered = 0
    for first, end, _ in docs.groups:
        if first != covered:
            break
        covered = end
    if covered != batch:
        raise ValueError(f"documents describe samples {[(g[0], g[1]) for g in docs.groups]}, the batch has {batch}: "
                         "give boundaries for every sample")
    return docs


def unplaced(documents: Documents) -> Documents:
    """The same boundaries without a data-derived placement (one rank holds the sequence in order)."""
    return Documents(documents.seq_len, documents.groups)


# Small caches: a step's layers share one batch's entries (a new batch makes new ones), and the
# device tensors they hold are b x S longs.
@functools.lru_cache(maxsize=8)
def _index(documents: Documents, batch: int, device: str) -> torch.Tensor:
    seq_len = documents.seq_len
    pos = torch.arange(seq_len)
    out = torch.empty(batch, seq_len, dtype=torch.long)
    for first, end, bounds in documents.groups:
        cuts = torch.tensor(bounds[1:-1], dtype=torch.long)
        out[first:end] = torch.searchsorted(cuts, pos, right=True)
    return out.to(device)


def document_index(documents: Documents, batch: int, device: torch.device) -> torch.Tensor:
    """[b, S] long: the document index of every global position of every sample (cached)."""
    return _index(documents, batch, str(device))


@functools.lru_cache(maxsize=16)
def _segments(documents: Documents, batch: int, order: tuple, total: int, device: str) -> SegmentDocuments:
    L = documents.seq_len // total

    def split(every: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # -> by segment [T, b, L], enter [T, b]
        enter = torch.cat([torch.zeros_like(every[:, :1]), every[:, L - 1:-1:L]], dim=1).transpose(0, 1)
        return every.view(batch, total, L).transpose(0, 1), enter

    by_segment, enter = split(_index(documents, batch, device))
    host, host_enter = split(_index(documents, batch, "cpu"))  # the flags on the host: the scan plans from them
    mine = torch.tensor(order, device=by_segment.device)
    return SegmentDocuments(doc=by_segment[mine].unsqueeze(2), enter=enter[mine].unsqueeze(2),
                            resets=resets(host[..., -1] == host_enter, torch.device(device)))


def segment_documents(documents: Optional[Documents], batch: int, order: tuple, total: int,
                      device: torch.device) -> Optional[SegmentDocuments]:
    """The :class:`SegmentDocuments` of this rank's segments ``order`` (their global indices, in
    local order) out of ``total`` equal global segments; None without documents."""
    if documents is None:
        return None
    return _segments(documents, batch, tuple(order), total, str(device))
