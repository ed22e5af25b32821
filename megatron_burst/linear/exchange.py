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
boundaries, :mod:`megatron_burst.linear.docs`) is False for a segment in which a document starts;
its transition is then zero, S_in(i+1) = M_i: the prefix stops there. The backward is the same
scan with keep_i * a_i in place of a_i, and da_i gains the factor keep_i. Nothing more is sent.

* :class:`Lasp1Chain` (LASP-1): the state walks the segments in global order, passed from the owner
  of segment i to the owner of segment i + 1 (W - 1 sequential hops for the contiguous layout),
  each owner computing its inter-segment output and update before sending on, and its gradient
  walks back the same way. Bidirectional: the running sum goes once around the ring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst import comm


@dataclass(frozen=True)
class SegmentMap:
    """Which global segment each of this rank's local segments is, for every rank.

    ``order[r][j]`` is the global index of rank r's j-th local segment; all ranks hold the same
    number of equally long segments.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    order: tuple[tuple[int, ...], ...]
    causal: bool

    @property
    def per_rank(self) -> int:
        return len(self.order[0])

    @property
    def total(self) -> int:
        return self.world_size * self.per_rank

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


def keep_factors(keep: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """keep [T, b] (bool) -> [T, b, 1, 1, 1] in ``like``'s dtype (states are [T, b, h, dk, dv])."""
    if keep is None:
        return None
    return keep.to(like.dtype).reshape(tuple(keep.shape) + (1,) * (like.dim() - 2))


def _prefix_states(M: torch.Tensor, a: Optional[torch.Tensor], matrix: bool = False,
                   keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """S_in for segments in global order. M [T, ...state], a [T, ..., dkg] (or [T, ..., dk, dk] with
    ``matrix``) or None, keep [T, b] (bool) or None -> [T, ...state]."""
    k = keep_factors(keep, M)
    S = [torch.zeros_like(M[0])]
    for i in range(1, M.shape[0]):
        S.append(_transition(a[i - 1] if a is not None else None, S[-1], matrix,
                             None if k is None else k[i - 1]) + M[i - 1])
    return torch.stack(S)


def local_entering_states(M: torch.Tensor, a: Optional[torch.Tensor], matrix: bool = False,
                          keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """S_in of segments that are all local and in global order (one process): the same scan,
    differentiable by autograd."""
    return _prefix_states(M, a, matrix, keep)


def _reverse_scan(delta: torch.Tensor, S_in: torch.Tensor, a: Optional[torch.Tensor], matrix: bool = False,
                  keep: Optional[torch.Tensor] = None):
    """(dM, da) in global order from delta = dL/dS_in (direct) -- see module docstring. With
    ``matrix``: G_i = delta_i + a_i^T G_{i+1} and da_i = G_{i+1} S_in(i)^T. ``keep`` [T, b]: the
    transitions (and so da) of segments where a document starts are zero."""
    k = keep_factors(keep, delta)
    T = delta.shape[0]
    G = [None] * T
    G[T - 1] = delta[T - 1]
    for i in range(T - 2, -1, -1):
        back = None if a is None else (a[i].transpose(-1, -2) if matrix else a[i])
        G[i] = delta[i] + _transition(back, G[i + 1], matrix, None if k is None else k[i])
    zero = torch.zeros_like(delta[0])
    dM = torch.stack([G[i + 1] if i + 1 < T else zero for i in range(T)])
    if a is None:
        return dM, None
    through = dM if k is None else k * dM  # the part of G_{i+1} that reaches a_i
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


def _to_global(per_rank: torch.Tensor, smap: SegmentMap) -> torch.Tensor:
    """[W, nseg, ...] rank-major -> [T, ...] in global segment order."""
    T = smap.total
    index = [0] * T
    for r, mine in enumerate(smap.order):
        for j, gi in enumerate(mine):
            index[gi] = r * smap.per_rank + j
    flat = per_rank.reshape((T,) + tuple(per_rank.shape[2:]))
    return flat[torch.tensor(index, device=flat.device)]


def _mine(global_tensor: torch.Tensor, smap: SegmentMap) -> torch.Tensor:
    return global_tensor[list(smap.order[smap.rank])]


def _all_gather(local: torch.Tensor, smap: SegmentMap, phase: str, label: str) -> torch.Tensor:
    out = local.new_empty(smap.world_size * local.numel())
    comm.all_gather(out, local.reshape(-1), smap.group, phase, label=label).wait()
    return out


def post_state_gather(M: torch.Tensor, a: Optional[torch.Tensor], smap: SegmentMap,
                      label: str = "lasp2 state all-gather"):
    """Post the forward all-gather of this rank's (M, a) (async; LASP-2 overlaps it with the
    intra-segment work). Returns (buffer, pending); the buffer is valid after ``pending.wait()``."""
    local = _pack(M.detach(), None if a is None else a.detach())
    out = local.new_empty(smap.world_size * local.numel())
    return out, comm.all_gather(out, local, smap.group, "forward", label=label)


class Lasp2Exchange(torch.autograd.Function):
    """(M, a) of the local segments -> S_in of the local segments, by one all-gather each way.

    ``gathered`` is the finished forward all-gather of every rank's (M, a) (see
    :func:`post_state_gather`); M and a are inputs for autograd, so dM, da flow back to them.
    ``matrix``: a is a [dk, dk] map per segment (the gated delta rule), S_out = a @ S_in + M.
    ``keep`` [T, b] (bool, global order; documents): False makes a segment's transition zero.
    """

    @staticmethod
    def forward(ctx, M: torch.Tensor, a: Optional[torch.Tensor], gathered: torch.Tensor, smap: SegmentMap,
                matrix: bool = False, keep: Optional[torch.Tensor] = None):
        shapes = [M.shape] + ([a.shape] if a is not None else [])
        parts = _unpack(gathered, smap.world_size, shapes)
        M_all = _to_global(parts[0], smap)
        a_all = _to_global(parts[1], smap) if a is not None else None
        ctx.smap, ctx.has_decay, ctx.matrix, ctx.keep = smap, a is not None, matrix, keep
        if not smap.causal:
            return M_all.sum(0).unsqueeze(0).expand_as(M).contiguous()
        S_all = _prefix_states(M_all, a_all, matrix, keep)
        ctx.save_for_backward(S_all, *([a_all] if a_all is not None else []))
        return _mine(S_all, smap)

    @staticmethod
    def backward(ctx, dS: torch.Tensor):
        smap: SegmentMap = ctx.smap
        label = "gdn dS all-gather" if ctx.matrix else "lasp2 dS all-gather"
        gathered = _all_gather(dS.contiguous(), smap, "backward", label)
        delta_all = _to_global(gathered.view((smap.world_size,) + tuple(dS.shape)), smap)
        if not smap.causal:
            return delta_all.sum(0).unsqueeze(0).expand_as(dS).contiguous(), None, None, None, None, None
        saved = ctx.saved_tensors
        dM_all, da_all = _reverse_scan(delta_all, saved[0], saved[1] if ctx.has_decay else None, ctx.matrix,
                                       ctx.keep)
        return _mine(dM_all, smap), (_mine(da_all, smap) if da_all is not None else None), None, None, None, None


class Lasp1Chain(torch.autograd.Function):
    """LASP-1 (the LASP-2 paper's Algorithm 6): the state walks the segments in global order. The
    owner of a segment receives the state entering it, computes the segment's inter-segment output
    scale * q_in @ S_in, updates the state and sends it on -- so those steps run one rank after
    another. The backward walks back the same way: receive the gradient of the state leaving the
    segment, form this segment's dq_in, dM, da, send the gradient of the state entering it.

    Takes q_in [nseg, b, h, L, dk] (q * exp(G)), M, a of the local segments; returns the
    inter-segment output [nseg, b, h, L, dv]. Bidirectional: the state sum goes once around the ring.
    ``keep`` [T, b] (bool, global order; documents): False makes a segment's transition zero.
    """

    @staticmethod
    def forward(ctx, q_in: torch.Tensor, M: torch.Tensor, a: Optional[torch.Tensor], scale: float,
                smap: SegmentMap, keep: Optional[torch.Tensor] = None):
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
    """The last ``width`` tokens of the global segment before each local segment (zeros before
    the first), from whichever rank holds it: what a short causal convolution needs at a segment
    start. x [nseg, L, ...] (local segments) -> [nseg, width, ...]. One all-gather of every
    rank's segment tails forward, one of the halo gradients backward: (W - 1) x nseg x width
    tokens each way, whatever the sequence length."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, smap: SegmentMap):
        ctx.smap, ctx.width, ctx.shape = smap, width, x.shape
        tails = x[:, x.shape[1] - width:].contiguous()
        gathered = _all_gather(tails, smap, "forward", "previous tokens all-gather")
        every = _to_global(gathered.view((smap.world_size,) + tuple(tails.shape)), smap)
        return _mine(torch.cat([torch.zeros_like(every[:1]), every[:-1]]), smap)

    @staticmethod
    def backward(ctx, d_halo: torch.Tensor):
        smap: SegmentMap = ctx.smap
        gathered = _all_gather(d_halo.contiguous(), smap, "backward", "previous tokens gradient all-gather")
        every = _to_global(gathered.view((smap.world_size,) + tuple(d_halo.shape)), smap)
        d_tails = _mine(torch.cat([every[1:], torch.zeros_like(every[:1])]), smap)  # tail i fed segment i + 1
        dx = d_halo.new_zeros(ctx.shape)
        dx[:, ctx.shape[1] - ctx.width:] = d_tails
        return dx, None, None


def previous_tokens(x: torch.Tensor, width: int, smap: SegmentMap) -> torch.Tensor:
    """See :class:`PreviousTokens`; on one rank the segments are all local (autograd indexing)."""
    if smap.world_size == 1:
        tails = x[:, x.shape[1] - width:]
        order = torch.tensor(smap.order[0], device=x.device)
        every = tails[torch.argsort(order)]  # global order
        halo = torch.cat([torch.zeros_like(every[:1]), every[:-1]])
        return halo[order]
    return PreviousTokens.apply(x, width, smap)
