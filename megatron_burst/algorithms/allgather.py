"""All-gather context parallelism (Llama 3's CP; the softmax half of LASP-2H, LASP-2 Algorithm 7).

Forward: every rank all-gathers K,V (kv heads only: GQA heads are expanded inside the kernels,
never before sending) and attends with its own queries, at their global positions, to the
gathered keys. Backward: K,V are gathered again (so only this rank's n tokens are kept between
forward and backward, as in the ring), each rank computes dK,dV for the whole sequence from its
queries, and a reduce-scatter (fp32) sums them back to the owners. dQ stays home.

Overlap: K,V are gathered in pieces (a piece = the same rows of every rank's block; with zigzag the
two chunks). All pieces are posted at once; the own block is attended while they are in flight,
then each piece as it arrives. In the backward, a piece's dK,dV reduce-scatter is posted as soon as
that piece is done, so it runs under the next piece's compute. Every visible region comes from
:meth:`CPConfig.blocks` (layout.BlockMask; document masks too), cut to the piece with
:meth:`BlockMask.restrict_kv` (with documents, K,V are gathered as one piece).

Bytes per rank (n local tokens, batch b, hkv kv heads, head dim d, e = input element size), as
ring all-gather / reduce-scatter count them:
  forward  (W-1) * 2*b*hkv*n*d*e                 (the same bytes as the ring forward)
  backward (W-1) * (2*b*hkv*n*d*e + 2*b*hkv*n*d*4) (K,V again + dK,dV in fp32: ring's bytes)
Fewer, larger messages than the ring (one collective per piece instead of W-1 hops), and the
gathered K,V of one piece (W x the local piece) is resident while it is used.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst import comm
from megatron_burst.algorithms.schedule import CPConfig
from megatron_burst.kernels import block_backward, block_forward, empty_accumulator, merge_into


def kv_pieces(cfg: CPConfig, n: int) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) of a local K,V block gathered as separate collectives.

    Two pieces where a layout allows a cut that keeps every mask a rectangle: zigzag's two chunks,
    a stripe boundary near the middle (striped), the middle (contiguous); one otherwise.
    """
    if cfg.documents is not None or cfg.window is not None:  # 'positions' rectangles are not cut into pieces
        return [(0, n)]
    if cfg.layout == "zigzag":
        cut = n // 2
    elif cfg.layout == "striped":
        cut = (n // cfg.stripe // 2) * cfg.stripe
    else:
        cut = n // 2
    return [(0, n)] if cut <= 0 or cut >= n else [(0, cut), (cut, n)]


def _link(cfg: CPConfig) -> str:
    """Link class of a ring collective's bytes on this rank: a ring all-gather / reduce-scatter
    sends everything to the next rank of the group."""
    return cfg.topology.link_of((cfg.rank + 1) % cfg.world_size)


def _post_gathers(cfg: CPConfig, k: torch.Tensor, v: torch.Tensor, pieces, phase: str) -> list:
    """Post one all-gather of [K, V] rows [lo, hi) per piece; returns (buffer, pending) per piece."""
    W = cfg.world_size
    posted = []
    for lo, hi in pieces:
        mine = torch.stack([k[:, :, lo:hi], v[:, :, lo:hi]])  # [2, b, hkv, m, d]
        # rank-major along dim 0, as all_gather_into_tensor wants it; viewed [W, 2, b, hkv, m, d]
        flat = torch.empty((W * 2,) + tuple(mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        buf = flat.view((W,) + tuple(mine.shape))
        pending = comm.all_gather(flat, mine, cfg.topology.group, phase, _link(cfg),
                                  label=f"{phase} all-gather kv[{lo}:{hi}]")
        posted.append((buf, pending))
    return posted


def _piece_masks(cfg: CPConfig, src: int, n: int, lo: int, hi: int, q_rows: Optional[int] = None):
    """(batch slice, region) of this rank's queries x rank ``src``'s key rows [lo, hi), in
    piece-local kv rows. Block-causal rectangles are cut to the piece first, then split
    (:meth:`CPConfig.split`): their split parts are not cut."""
    cut = []
    for bs, mask in cfg.blocks(cfg.rank, src, n, q_rows, split=False):
        m = mask if (lo, hi) == (0, n) else mask.restrict_kv(lo, hi)
        if m.kind != "empty":
            cut.append((bs, m.shifted(0, -lo)))
    yield from cfg.split(cut)


def allgather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: CPConfig,
                      q_rows: Optional[int] = None, out: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, hq, n, d], k/v [b, hkv, n, d] -> (out [b, hq, n, d], lse [b, hq, n]) fp32.

    Same contract as :func:`megatron_burst.algorithms.ring.kv_ring_forward` (``out`` an optional
    fp32 accumulator, ``q_rows`` limits the computed rows).
    """
    n = q.shape[2]
    out, lse = empty_accumulator(q, v.shape[-1], out)
    if q_rows == 0:
        return out, lse

    def attend(src, kk, vv, lo, hi):
        for bs, m in _piece_masks(cfg, src, n, lo, hi, q_rows):
            o, l = block_forward(q[bs], kk[bs], vv[bs], m, cfg.scale, cfg.kernel)
            merge_into(out[bs, :, m.q_slice], lse[bs, :, m.q_slice], o, l)

    pieces = kv_pieces(cfg, n)
    posted = _post_gathers(cfg, k, v, pieces, "forward") if cfg.world_size > 1 else []
    attend(cfg.rank, k, v, 0, n)  # the own block needs no transfer: it hides the first gather
    for (lo, hi), (buf, pending) in zip(pieces, posted):
        pending.wait()
        for src in range(cfg.world_size):
            if src != cfg.rank:
                attend(src, buf[src, 0], buf[src, 1], lo, hi)
    return out, lse


def allgather_backward(dout, q, k, v, D, lse, cfg: CPConfig, out=None):
    """K,V gathered again; dK,dV of every rank's keys reduce-scattered home in fp32.

    Shapes as in the forward; D, lse [b, hq, n] fp32; ``out`` the final output (optional, for
    kernels that read it). Returns fp32 (dq, dk, dv).
    """
    b, hq, n, _ = q.shape
    W, r = cfg.world_size, cfg.rank
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    pieces = kv_pieces(cfg, n)
    # per piece: dK,dV of that piece of every rank's block, rank-major (the reduce-scatter input)
    grads = [torch.zeros((W, 2) + tuple(k.shape[:2]) + (hi - lo, k.shape[-1]), dtype=torch.float32,
                         device=k.device) for lo, hi in pieces]

    def attend(src, kk, vv, lo, hi, g):
        for bs, m in _piece_masks(cfg, src, n, lo, hi):
            dqb, dkb, dvb = block_backward(dout[bs], q[bs], kk[bs], vv[bs], D[bs], lse[bs], m, cfg.scale, cfg.kernel,
                                           None if out is None else out[bs])
            dq[bs, :, m.q_slice] += dqb
            m.add_kv_grad(g[src, 0][bs], dkb)
            m.add_kv_grad(g[src, 1][bs], dvb)

    posted = _post_gathers(cfg, k, v, pieces, "backward") if W > 1 else []
    for (lo, hi), g in zip(pieces, grads):  # own block first: no transfer needed
        attend(r, k[:, :, lo:hi], v[:, :, lo:hi], lo, hi, g)
    if W == 1:
        dkv = torch.cat([g[0] for g in grads], dim=3)
        return dq, dkv[0], dkv[1]
    homes, scatters = [], []
    for (lo, hi), (buf, pending), g in zip(pieces, posted, grads):
        pending.wait()
        for src in range(W):
            if src != r:
                attend(src, buf[src, 0], buf[src, 1], lo, hi, g)
        home = torch.empty(g.shape[1:], dtype=g.dtype, device=g.device)
        scatters.append(comm.reduce_scatter(home, g.view((-1,) + tuple(g.shape[2:])), cfg.topology.group, "backward", _link(cfg),
                                            label=f"backward reduce-scatter dkv[{lo}:{hi}]"))
        homes.append(home)
    for s in scatters:
        s.wait()
    dkv = torch.cat(homes, dim=3)
    return dq, dkv[0], dkv[1]


def forward_bytes(b: int, hkv: int, n: int, d: int, elem: int, world_size: int) -> int:
    """Bytes one rank sends in the all-gather forward."""
    return (world_size - 1) * 2 * b * hkv * n * d * elem


def backward_bytes(b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int) -> int:
    """Bytes one rank sends in the all-gather backward (K,V again, then dK,dV fp32)."""
    return (world_size - 1) * (2 * b * hkv * n * d * elem + 2 * b * hkv * n * d * 4)
