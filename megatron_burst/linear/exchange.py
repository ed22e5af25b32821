"""How segments get the state that enters them: LASP-2 (one all-gather) or LASP-1 (a chain of sends).

Global segment i (in sequence order) enters with S_in(0) = 0, S_in(i) = a_{i-1} * S_in(i-1) + M_{i-1}
(causal; ``a`` broadcasts over a state's dk rows), or with S = sum_j M_j for every segment
(bidirectional). These autograd Functions take this rank's (M, a) per local segment and return
its S_in per local segment; their backward returns dM, da for the local segments from dS_in.

Backward algebra (causal): with delta_i = dL/dS_in(i) from the local uses and G_i the total
gradient reaching S_in(i): G_last = delta_last, G_i = delta_i + a_i * G_{i+1}; then dM_i = G_{i+1}
and da_i = sum over dv (and over dk for a scalar decay) of G_{i+1} * S_in(i). Bidirectional:
dM_i = sum of every segment's delta.

* :class:`Lasp2Exchange` (LASP-2): one all-gather of every rank's (M, a) in the forward; every rank
  scans all segments itself. One all-gather of delta in the backward; every rank runs the reverse
  scan and keeps its own segments' dM, da. Bytes per rank and direction: (W - 1) x its own
  (M, a) [forward] or delta [backward], whatever the sequence length.
Documents: ``keep`` [T, b] (bool, global order, the same on every rank: derived from the global
boundaries, :mod:`megatron_burst.linear.docs`; :class:`Resets`) is False for a segment in which a
document starts; its transition is then zero, S_in(i+1) = M_i: the prefix stops there. The backward
is the same scan with keep_i * a_i in place of a_i, and da_i gains the factor keep_i. Nothing more is
sent. The scans run as wavefronts (:class:`_Waves`): steps = the longest chain between resets, not T.

* :class:`Lasp1Chain` (LASP-1): the state walks the segments in global order, passed from the owner
  of segment i to the owner of segment i + 1 (W - 1 sequential hops for the contiguous layout),
  each owner computing its inter-segment output and update before sending on, and its gradient
  walks back the same way. Bidirectional: the running sum goes once around the ring.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst import comm


@dataclass(frozen=True)
class SegmentMap:
    """Which global segment each of this rank's local segments is, for every rank.

    ``order[r][j]`` is the global index of rank r's j-th local segment. The fixed layouts give every
    rank the same number of equally long segments; the data-derived ones (THD, balanced:
    :mod:`megatron_burst.linear.runs`) give runs of any length, a different number per rank. The
    exchanges only see per-segment states: a rank's part of an all-gather is padded to
    :attr:`per_rank` segments (the most any rank holds) so every rank sends the same size.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    order: tuple[tuple[int, ...], ...]
    causal: bool

    @property
    def per_rank(self) -> int:
        """The most segments any rank holds (the all-gathers' per-rank slot count)."""
        return max(len(mine) for mine in self.order)

    @property
    def total(self) -> int:
        """T, the number of global segments."""
        return sum(len(mine) for mine in self.order)

    def owner(self, global_index: int) -> tuple[int, int]:
        """(rank, local index) of a global segment."""
        for r, mine in enumerate(self.order):
            if global_index in mine:
                return r, mine.index(global_index)
        raise KeyError(global_index)


def _decay_rows(a: torch.Tensor) -> torch.Tensor:
    """a [..., dkg] -> broadcastable over states [..., dk, dv]."""
    return a.unsqueeze(-1)


def _transition(a: Optional[torch.Tensor], S: torch.Tensor, matrix: bool,
                keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The segment's map applied to the state entering it: a * S (diagonal decay), a @ S (``matrix``:
    a [..., dk, dk], the delta rule) or S (no decay); times ``keep`` (per sample: [b, 1, 1, 1], 0
    where a document starts in the segment) when given."""
    out = S if a is None else (a @ S if matrix else _decay_rows(a) * S)
    return out if keep is None else keep * out


@dataclass(frozen=True, eq=False)
class Resets:
    """Documents as the exchange sees them (:mod:`megatron_burst.linear.docs`, :mod:`.runs`).

    ``keep`` [T, b] (bool, on the states' device, global order): False for a segment in which a
    document starts; its transition is then zero. ``links`` (host, T - 1 flags): whether segment i's
    transition reaches segment i + 1 for any sample -- the scans' dependency chains, known on the host
    (the boundaries are), so planning them never reads ``keep`` back from the device.
    """

    keep: torch.Tensor
    links: tuple[bool, ...]

    def __post_init__(self):
        object.__setattr__(self, "links", tuple(bool(x) for x in self.links))  # hashable: the scan plans are cached


def resets(keep: torch.Tensor, device: torch.device) -> Resets:
    """:class:`Resets` from the host's keep [T, b] (bool)."""
    return Resets(keep.to(device), tuple(keep[:-1].any(1).tolist()))


def keep_factors(keep: Optional[Resets], like: torch.Tensor) -> Optional[torch.Tensor]:
    """keep [T, b] (bool) -> [T, b, 1, 1, 1] in ``like``'s dtype (states are [T, b, h, dk, dv])."""
    if keep is None:
        return None
    flags = keep.keep
    return flags.to(like.dtype).reshape(tuple(flags.shape) + (1,) * (like.dim() - 2))


@dataclass(frozen=True)
class _Waves:
    """A scan over T segments as wavefronts. A segment's value needs its neighbour's (the one before it
    in the prefix scan, after it in the reverse scan) only when the transition between them is linked,
    so each segment belongs to wave d = the length of its linked chain back to an unlinked start, and a
    wave is one batched step. Chains are cut at every document start: a THD batch's T runs (2W - 1 per
    sequence, W = 8: ~1000 at 1M tokens) take 2W - 1 steps instead of T; without documents the chain is
    all T segments (T = W or 2W: few).

    ``members[d]``: wave d's segments, increasing. ``source[d]`` (d >= 1): the position in wave d - 1 of
    each member's neighbour (wave d never has more members than wave d - 1; consecutive positions are a
    view, :func:`_rows`). ``reads[d]``: the rows of M, a and keep wave d's step reads: i - 1 for each
    member i > 0 (prefix scan), the members themselves (reverse scan). ``where[i]``: segment i's row in
    the waves concatenated. Planned once per batch (cached), so a layer's scan builds no lists."""

    members: tuple[tuple[int, ...], ...]
    source: tuple[tuple[int, ...], ...]
    reads: tuple[tuple[int, ...], ...]
    where: tuple[int, ...]


@functools.lru_cache(maxsize=64)
def _waves(links: tuple[bool, ...], reverse: bool) -> _Waves:
    T = len(links) + 1
    depth = [0] * T
    order = range(T - 2, -1, -1) if reverse else range(1, T)
    for i in order:
        n = i + 1 if reverse else i - 1  # the neighbour it reads
        depth[i] = depth[n] + 1 if links[min(i, n)] else 0
    members: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for i in range(T):
        members[depth[i]].append(i)
    position = {i: p for wave in members for p, i in enumerate(wave)}
    source = [()] + [tuple(position[i + 1 if reverse else i - 1] for i in wave) for wave in members[1:]]
    reads = [tuple(wave) if reverse else tuple(i - 1 for i in wave if i > 0) for wave in members]
    flat = [i for wave in members for i in wave]
    where = [0] * T
    for row, i in enumerate(flat):
        where[i] = row
    return _Waves(tuple(tuple(w) for w in members), tuple(source), tuple(reads), tuple(where))


@functools.lru_cache(maxsize=512)
def _index(rows: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _rows(t: Optional[torch.Tensor], rows) -> Optional[torch.Tensor]:
    """t[rows] along dim 0: a view when the rows are consecutive, else one gather (the index tensor
    cached per device, so a step's layers copy it to the device once)."""
    if t is None:
        return None
    rows = tuple(rows)
    if rows and rows == tuple(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]:rows[0] + len(rows)]
    return t[_index(rows, str(t.device))]


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view (of all T states, of the whole all-gather buffer): what a
    Function saves or returns must not keep a larger buffer alive until the backward."""
    return t.clone() if t._base is not None else t


def _scan_links(T: int, keep: Optional[Resets]) -> tuple[bool, ...]:
    if keep is None:
        return (True,) * (T - 1)
    if len(keep.links) != T - 1:
        raise ValueError(f"document resets for {len(keep.links) + 1} segments, the scan has {T}")
    return keep.links


def _prefix_states(M: torch.Tensor, a: Optional[torch.Tensor], matrix: bool = False,
                   keep: Optional[Resets] = None, want=None) -> torch.Tensor:
    """S_in of the segments ``want`` (global indices; default all, in global order). M [T, ...state],
    a [T, ..., dkg] (or [T, ..., dk, dk] with ``matrix``) or None, keep as :class:`Resets` or None ->
    [len(want), ...state]. No in-place writes: autograd can differentiate it (one process)."""
    T = M.shape[0]
    w = _waves(_scan_links(T, keep), False)
    k = keep_factors(keep, M)
    # segment 0 enters with zero; an unlinked i with M_{i-1} (the prefix restarts)
    starts = [torch.zeros_like(M[:1])] if w.members[0][0] == 0 else []
    waves = [torch.cat(starts + ([_rows(M, w.reads[0])] if w.reads[0] else []))]
    for before, src in zip(w.reads[1:], w.source[1:]):
        prev = _rows(waves[-1], src)
        waves.append(_transition(_rows(a, before), prev, matrix, _rows(k, before)) + _rows(M, before))
    every = waves[0] if len(waves) == 1 else torch.cat(waves)
    return _rows(every, [w.where[i] for i in (range(T) if want is None else want)])


def local_entering_states(M: torch.Tensor, a: Optional[torch.Tensor], matrix: bool = False,
                          keep: Optional[Resets] = None) -> torch.Tensor:
    """S_in of segments that are all local and in global order (one process): the same scan,
    differentiable by autograd."""
    return _prefix_states(M, a, matrix, keep)


def _reverse_scan(delta: torch.Tensor, S_in: torch.Tensor, a: Optional[torch.Tensor], matrix: bool = False,
                  keep: Optional[Resets] = None, mine: tuple = ()):
    """(dM, da) of the segments ``mine`` from delta = dL/dS_in [T, ...] (direct, global order) -- see the
    module docstring. ``S_in`` [len(mine), ...]: the entering states of those segments only (a rank
    keeps its own, not all T). With ``matrix``: G_i = delta_i + a_i^T G_{i+1} and da_i = G_{i+1} S_in(i)^T.
    ``keep``: the transitions (and so da) of segments where a document starts are zero. The same
    wavefronts as the prefix scan, walked from the end."""
    T = delta.shape[0]
    w = _waves(_scan_links(T, keep), True)
    k = keep_factors(keep, delta)
    waves = [_rows(delta, w.reads[0])]  # the last segment and every unlinked one: G_i = delta_i
    for wave, src in zip(w.reads[1:], w.source[1:]):
        nxt = _rows(waves[-1], src)
        back = _rows(a, wave)
        if back is not None and matrix:
            back = back.transpose(-1, -2)
        waves.append(_rows(delta, wave) + _transition(back, nxt, matrix, _rows(k, wave)))
    G = torch.cat(waves + [torch.zeros_like(delta[:1])])  # the last row: G_T = 0 (nothing follows)
    dM = _rows(G, [w.where[i + 1] if i + 1 < T else T for i in mine])  # dM_i = G_{i+1}
    if a is None:
        return dM, None
    through = dM if k is None else _rows(k, mine) * dM  # the part of G_{i+1} that reaches a_i
    if matrix:
        return dM, through @ S_in.transpose(-1, -2)
    prod = through * S_in  # keep_i * G_{i+1} * S_in(i)
    da = prod.sum(-1) if a.shape[-1] != 1 else prod.sum((-1, -2)).unsqueeze(-1)
    return dM, da


def _pack(*tensors: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors if t is not None])


def _unpack(flat: torch.Tensor, world_size: int, shapes: list) -> list:
    """[W * n] gathered flat buffers -> per shape a tensor [W, *shape]."""
    per_rank = flat.view(world_size, -1)
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(per_rank[:, offset:offset + n].reshape((world_size,) + tuple(shape)))
        offset += n
    return out


@functools.lru_cache(maxsize=64)
def _global_rows(order: tuple, per_rank: int) -> tuple[int, ...]:
    index = [0] * sum(len(mine) for mine in order)
    for r, mine in enumerate(order):
        for j, gi in enumerate(mine):
            index[gi] = r * per_rank + j
    return tuple(index)


def _to_global(per_rank: torch.Tensor, smap: SegmentMap) -> torch.Tensor:
    """[W, per_rank, ...] rank-major (padded slots included) -> [T, ...] in global segment order."""
    flat = per_rank.reshape((smap.world_size * smap.per_rank,) + tuple(per_rank.shape[2:]))
    return _rows(flat, _global_rows(smap.order, smap.per_rank))


def _padded(local: torch.Tensor, smap: SegmentMap) -> torch.Tensor:
    """This rank's [nseg, ...] padded with zeros to [per_rank, ...] (its all-gather slot; the padding is
    never read)."""
    missing = smap.per_rank - local.shape[0]
    if missing == 0:
        return local
    return torch.cat([local, local.new_zeros((missing,) + tuple(local.shape[1:]))])


def _all_gather(local: torch.Tensor, smap: SegmentMap, phase: str, label: str) -> torch.Tensor:
    out = local.new_empty(smap.world_size * local.numel())
    comm.all_gather(out, local.reshape(-1), smap.group, phase, label=label).wait()
    return out


def post_state_gather(M: torch.Tensor, a: Optional[torch.Tensor], smap: SegmentMap,
                      label: str = "lasp2 state all-gather"):
    """Post the forward all-gather of this rank's (M, a) (async; LASP-2 overlaps it with the
    intra-segment work). Returns (buffer, pending); the buffer is valid after ``pending.wait()``."""
    local = _pack(_padded(M.detach(), smap), None if a is None else _padded(a.detach(), smap))
    out = local.new_empty(smap.world_size * local.numel())
    return out, comm.all_gather(out, local, smap.group, "forward", label=label)


class Lasp2Exchange(torch.autograd.Function):
    """(M, a) of the local segments -> S_in of the local segments, by one all-gather each way.

    ``gathered`` is the finished forward all-gather of every rank's (M, a) (see
    :func:`post_state_gather`); M and a are inputs for autograd, so dM, da flow back to them.
    ``matrix``: a is a [dk, dk] map per segment (the gated delta rule), S_out = a @ S_in + M.
    ``keep`` (documents, :class:`Resets`): a segment where a document starts has a zero transition.
    """

    @staticmethod
    def forward(ctx, M: torch.Tensor, a: Optional[torch.Tensor], gathered: torch.Tensor, smap: SegmentMap,
                matrix: bool = False, keep: Optional[Resets] = None):
        slot = lambda t: (smap.per_rank,) + tuple(t.shape[1:])  # noqa: E731  (a rank's padded part)
        shapes = [slot(M)] + ([slot(a)] if a is not None else [])
        parts = _unpack(gathered, smap.world_size, shapes)
        M_all = _to_global(parts[0], smap)
        a_all = _to_global(parts[1], smap) if a is not None else None
        ctx.smap, ctx.has_decay, ctx.matrix, ctx.keep = smap, a is not None, matrix, keep
        if not smap.causal:
            return M_all.sum(0).unsqueeze(0).expand_as(M).contiguous()
        S_mine = _own(_prefix_states(M_all, a_all, matrix, keep, want=smap.order[smap.rank]))
        # the backward's reverse scan needs every transition but only this rank's entering states (for
        # its own da): keeping those, not all T, is what bounds a layer's memory when T is large (THD)
        ctx.save_for_backward(S_mine, *([_own(a_all)] if a_all is not None else []))
        return S_mine

    @staticmethod
    def backward(ctx, dS: torch.Tensor):
        smap: SegmentMap = ctx.smap
        label = "gdn dS all-gather" if ctx.matrix else "lasp2 dS all-gather"
        gathered = _all_gather(_padded(dS, smap).contiguous(), smap, "backward", label)
        delta_all = _to_global(gathered.view((smap.world_size, smap.per_rank) + tuple(dS.shape[1:])), smap)
        if not smap.causal:
            return delta_all.sum(0).unsqueeze(0).expand_as(dS).contiguous(), None, None, None, None, None
        saved = ctx.saved_tensors
        dM, da = _reverse_scan(delta_all, saved[0], saved[1] if ctx.has_decay else None, ctx.matrix,
                               ctx.keep, smap.order[smap.rank])
        return dM, da, None, None, None, None


class Lasp1Chain(torch.autograd.Function):
    """LASP-1 (the LASP-2 paper's Algorithm 6): the state walks the segments in global order. The
    owner of a segment receives the state entering it, computes the segment's inter-segment output
    scale * q_in @ S_in, updates the state and sends it on -- so those steps run one rank after
    another. The backward walks back the same way: receive the gradient of the state leaving the
    segment, form this segment's dq_in, dM, da, send the gradient of the state entering it.

    Takes q_in [nseg, b, h, L, dk] (q * exp(G)), M, a of the local segments; returns the
    inter-segment output [nseg, b, h, L, dv]. Bidirectional: the state sum goes once around the ring.
    ``keep`` (documents, :class:`Resets`): a segment where a document starts has a zero transition.
    """

    @staticmethod
    def forward(ctx, q_in: torch.Tensor, M: torch.Tensor, a: Optional[torch.Tensor], scale: float,
                smap: SegmentMap, keep: Optional[Resets] = None):
        ring = comm.RingComm(smap.group)
        ctx.smap, ctx.has_decay, ctx.scale = smap, a is not None, scale
        ctx.keep = keep = keep_factors(keep, M)
        if not smap.causal:
            S = _ring_sum(ring, M.sum(0), "forward", "lasp1 state ring")
            ctx.save_for_backward(q_in, S)
            return scale * (q_in @ S)
        S_in = torch.zeros_like(M)
        o_inter = q_in.new_empty(q_in.shape[:-1] + (M.shape[-1],))
        pending, carry = [], None
        for gi in range(smap.total):
            r, j = smap.owner(gi)
            if r != smap.rank:
                continue
            if gi > 0:
                pr, _ = smap.owner(gi - 1)
                S_in[j] = carry if pr == smap.rank else ring.exchange(
                    [], [torch.empty_like(M[j])], "forward", recv_from=pr, label=f"lasp1 state {gi}").wait()[0]
            o_inter[j] = scale * (q_in[j] @ S_in[j])
            carry = _transition(a[j] if a is not None else None, S_in[j], False,
                                None if keep is None else keep[gi]) + M[j]
            if gi + 1 < smap.total:
                nr, _ = smap.owner(gi + 1)
                if nr != smap.rank:
                    pending.append(ring.exchange([carry.contiguous()], [], "forward", send_to=nr,
                                                 label=f"lasp1 state {gi + 1}"))
        for p in pending:
            p.wait()
        ctx.save_for_backward(q_in, S_in, *([a] if a is not None else []))
        return o_inter

    @staticmethod
    def backward(ctx, d_inter: torch.Tensor):
        smap: SegmentMap = ctx.smap
        scale = ctx.scale
        ring = comm.RingComm(smap.group)
        if not smap.causal:
            q_in, S = ctx.saved_tensors
            delta = scale * (q_in.transpose(-1, -2) @ d_inter).sum(0)
            total = _ring_sum(ring, delta, "backward", "lasp1 dS ring")
            return scale * (d_inter @ S.transpose(-1, -2)), total.unsqueeze(0).expand(
                (q_in.shape[0],) + tuple(total.shape)).contiguous(), None, None, None, None
        saved = ctx.saved_tensors
        q_in, S_in, a = saved[0], saved[1], (saved[2] if ctx.has_decay else None)
        keep = ctx.keep
        dq = torch.empty_like(q_in)
        dM = torch.zeros_like(S_in)
        da = torch.zeros_like(a) if a is not None else None
        pending, carry = [], None  # carry: G of the next segment, when this rank owns it
        for gi in range(smap.total - 1, -1, -1):
            r, j = smap.owner(gi)
            if r != smap.rank:
                continue
            G_next = None
            if gi + 1 < smap.total:
                nr, _ = smap.owner(gi + 1)
                G_next = carry if nr == smap.rank else ring.exchange(
                    [], [torch.empty_like(S_in[j])], "backward", recv_from=nr, label=f"lasp1 dS {gi}").wait()[0]
            dq[j] = scale * (d_inter[j] @ S_in[j].transpose(-1, -2))
            G = scale * (q_in[j].transpose(-1, -2) @ d_inter[j])  # this segment's own use of S_in
            if G_next is not None:
                k_j = None if keep is None else keep[gi]
                G = G + _transition(a[j] if a is not None else None, G_next, False, k_j)
                dM[j] = G_next
                if a is not None:
                    prod = (G_next if k_j is None else k_j * G_next) * S_in[j]
                    da[j] = prod.sum(-1) if a.shape[-1] != 1 else prod.sum((-1, -2)).unsqueeze(-1)
            carry = G
            if gi > 0:
                pr, _ = smap.owner(gi - 1)
                if pr != smap.rank:
                    pending.append(ring.exchange([G.contiguous()], [], "backward", send_to=pr,
                                                 label=f"lasp1 dS {gi - 1}"))
        for p in pending:
            p.wait()
        return dq, dM, da, None, None, None


def _ring_sum(ring: comm.RingComm, local: torch.Tensor, phase: str, label: str) -> torch.Tensor:
    """Sum of every rank's ``local`` by passing blocks once around the ring (W - 1 steps)."""
    total, block = local.clone(), local.contiguous()
    for step in range(ring.world_size - 1):
        block = ring.exchange([block], [torch.empty_like(block)], phase, label=f"{label} step {step}").wait()[0]
        total += block
    return total


class PreviousTokens(torch.autograd.Function):
    """The ``width`` tokens before each local segment's first one in the global sequence (zeros before
    the sequence), from whichever rank holds them: what a short causal convolution needs at a segment
    start. Every segment contributes its *tail*, its last ``width`` tokens (front zero-padded when it
    is shorter); a halo token is read from the tail of the global segment holding it (``index``, host
    arithmetic the same on every rank). One all-gather of every rank's tails forward, one of the halo
    gradients backward: (W - 1) x (segments per rank) x width tokens each way, whatever the length.

    tails [nseg, width, ...] (local segments) -> [nseg, width, ...]; ``index`` [T, width] (long, global
    segment order): the slot of every halo token in the global tails flattened [T * width], -1 for a
    position before the sequence."""

    @staticmethod
    def forward(ctx, tails: torch.Tensor, index: torch.Tensor, smap: SegmentMap):
        ctx.smap, ctx.index, ctx.shape = smap, index, tails.shape
        gathered = _all_gather(_padded(tails, smap).contiguous(), smap, "forward", "previous tokens all-gather")
        every = _to_global(gathered.view((smap.world_size, smap.per_rank) + tuple(tails.shape[1:])), smap)
        flat = torch.cat([every.reshape((-1,) + tuple(tails.shape[2:])), every.new_zeros((1,) + tuple(tails.shape[2:]))])
        return flat[_rows(index, smap.order[smap.rank])]  # -1 reads the zero row

    @staticmethod
    def backward(ctx, d_halo: torch.Tensor):
        smap: SegmentMap = ctx.smap
        rest = tuple(d_halo.shape[2:])
        gathered = _all_gather(_padded(d_halo, smap).contiguous(), smap, "backward",
                               "previous tokens gradient all-gather")
        every = _to_global(gathered.view((smap.world_size, smap.per_rank) + tuple(d_halo.shape[1:])), smap)
        slots = ctx.index.reshape(-1) % (ctx.index.numel() + 1)  # -1 -> the extra row, dropped below
        d_flat = d_halo.new_zeros((ctx.index.numel() + 1,) + rest).index_add_(0, slots, every.reshape((-1,) + rest))
        d_tails = d_flat[:-1].view((smap.total, ctx.shape[1]) + rest)
        return _rows(d_tails, smap.order[smap.rank]), None, None


@functools.lru_cache(maxsize=32)  # every layer of a step asks for the same batch's index
def halo_index(segments: tuple[tuple[int, int], ...], width: int) -> torch.Tensor:
    """[T, width] (long, CPU; shared: read-only): for every global segment (start, length), in global
    order, the slot of each of the ``width`` positions before its start in the global tails flattened
    ([T * width], each segment's last ``width`` tokens, front zero-padded), -1 before the sequence start."""
    starts = torch.tensor([a for a, _ in segments])
    ends = starts + torch.tensor([n for _, n in segments])
    pos = starts[:, None] + torch.arange(-width, 0)  # [T, width] global positions
    owner = torch.searchsorted(ends, pos, right=True).clamp(max=len(segments) - 1)  # the segment holding pos
    slot = owner * width + pos - (ends[owner] - width)
    return torch.where(pos >= 0, slot, torch.full_like(slot, -1))


def tails_of(x: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """Each local segment's last ``width`` tokens, front zero-padded: x [s, ...] held as segments of
    ``lengths`` (local order) -> [nseg, width, ...] (differentiable)."""
    out = []
    for seg in x.split(lengths):
        tail = seg[max(0, seg.shape[0] - width):]
        if tail.shape[0] < width:
            tail = torch.cat([tail.new_zeros((width - tail.shape[0],) + tuple(tail.shape[1:])), tail])
        out.append(tail)
    return torch.stack(out)


def previous_tokens(x: torch.Tensor, width: int, smap: SegmentMap,
                    segments: Optional[tuple[tuple[int, int], ...]] = None) -> torch.Tensor:
    """The ``width`` tokens before each local segment (see :class:`PreviousTokens`). x [nseg, L, ...] (the
    fixed layouts' equal segments) -> [nseg, width, ...]; or, with ``segments`` (every global segment's
    (start, length) in global order: runs, :mod:`megatron_burst.linear.runs`), x [s, ...] this rank's
    tokens in local order. On one rank the segments are all local (autograd indexing)."""
    if segments is None:
        L = x.shape[1]
        segments = tuple((gi * L, L) for gi in range(smap.total))
        # equal segments of at least ``width`` tokens: their tails are one slice (striped: no loop over stripes)
        tails = x[:, L - width:] if L >= width else tails_of(x.reshape((-1,) + tuple(x.shape[2:])), [L] * len(x), width)
        x = x.reshape((-1,) + tuple(x.shape[2:]))
    else:
        tails = tails_of(x, [segments[gi][1] for gi in smap.order[smap.rank]], width)
    index = halo_index(segments, width).to(x.device)
    if smap.world_size == 1:
        every = tails[torch.argsort(torch.tensor(smap.order[0], device=x.device))]  # global order
        flat = torch.cat([every.reshape((-1,) + tuple(x.shape[1:])), every.new_zeros((1,) + tuple(x.shape[1:]))])
        return flat[index[list(smap.order[0])]]
    return PreviousTokens.apply(tails, index, smap)
