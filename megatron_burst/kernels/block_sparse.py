"""Block-sparse attention in plain torch (any device): computes only the visible tiles of a plan.

Same (out, lse) interface as :mod:`megatron_burst.kernels.reference`, for ``kind="sparse"``
blocks: the keyword ``plan`` is a tuple of :class:`megatron_burst.sparse.SparseTile` (64 query
rows, the visible 64-column key tiles gathered into one matmul, a per-head mask). Tiles absent
from the plan are skipped. Rows that see nothing get out 0 and lse -inf (their gradients are 0).
fp32 math; the backward recomputes probabilities per tile from the given lse and D.
"""
from __future__ import annotations

import torch

from megatron_burst.kernels.reference import expand_kv, reduce_kv


def _tile_scores(q, k, tile, scale):
    """Scores [b, hq, tq, nc] of the tile's rows against its gathered columns (fp32), and the K rows."""
    qt = q[:, :, tile.q0:tile.q1].float()
    cols = tile.cols.to(q.device)
    kt = expand_kv(k.index_select(2, cols), q.shape[1]).float()
    return qt, kt, cols, (qt @ kt.transpose(-1, -2)) * scale


def forward(q, k, v, kind="sparse", block=1, scale=1.0, plan=()):
    b, hq, sq, _ = q.shape
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    for tile in plan:
        _, _, cols, s = _tile_scores(q, k, tile, scale)
        vis = tile.vis.to(q.device)
        s = s.masked_fill(~vis, float("-inf"))
        m = s.amax(-1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        denom = p.sum(-1)
        vt = expand_kv(v.index_select(2, cols), hq).float()
        o = (p @ vt) / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        out[:, :, tile.q0:tile.q1] = o
        lse[:, :, tile.q0:tile.q1] = m_safe + torch.log(denom)  # log 0 = -inf for rows seeing nothing
    return out, lse


def backward(dout, q, k, v, D, lse, kind="sparse", block=1, scale=1.0, plan=()):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dq = torch.zeros(b, hq, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hq, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, hq, sk, v.shape[-1], dtype=torch.float32, device=q.device)
    for tile in plan:
        rows = slice(tile.q0, tile.q1)
        qt, kt, cols, s = _tile_scores(q, k, tile, scale)
        vis = tile.vis.to(q.device)
        p = torch.where(vis, torch.exp(s - lse[:, :, rows, None].float()), torch.zeros_like(s))
        do = dout[:, :, rows].float()
        vt = expand_kv(v.index_select(2, cols), hq).float()
        dv.index_add_(2, cols, p.transpose(-1, -2) @ do)
        ds = p * (do @ vt.transpose(-1, -2) - D[:, :, rows, None].float())
        dq[:, :, rows] += (ds @ kt) * scale
        dk.index_add_(2, cols, (ds.transpose(-1, -2) @ qt) * scale)
    return dq, reduce_kv(dk, hkv), reduce_kv(dv, hkv)
