"""Block-sparse attention in plain torch (any device): computes only the visible tiles of a plan.

Same (out, lse) interface as :mod:`megatron_burst.kernels.reference`, for ``kind="sparse"``
blocks: the keyword ``plan`` is a tuple of :class:`megatron_burst.sparse.SparseTile` (up to 64
query rows, the key columns the tile gathers, a per-head mask). Tiles absent from the plan are
skipped. Rows that see nothing get out 0 and lse -inf (their gradients are 0). fp32 math; the
backward recomputes probabilities from the given lse and D.

The tiles of a plan are packed once (cached on the plan object): row indices [T, rows] and column
indices [T, cols] padded to the largest tile, the mask padded with False. Padded rows and columns
point at one extra scratch row of each buffer, so a whole group of tiles is one batched matmul
(a Python loop per 64-row tile costs more than its arithmetic at these sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# elements (b * hq * tiles * rows * cols) of one group's fp32 scores: 4M = 16 MiB
GROUP_ELEMS = 1 << 22


@dataclass
class _Packed:
    rows: torch.Tensor  # [T, R] query row of each tile row; padding -> sq (a scratch row)
    cols: torch.Tensor  # [T, C] key column of each tile column; padding -> sk (a scratch row)
    vis: torch.Tensor  # [h, T, R, C] bool, False on padding


def _pack(plan: tuple, sq: int, sk: int, device: torch.device) -> _Packed:
    """The packed form of ``plan`` for a q block of sq rows and a kv block of sk rows on ``device``,
    cached on the plan when it can carry attributes (megatron_burst.sparse.TilePlan), so it lives
    and dies with the plan (a dynamic pattern's plans go with the step)."""
    cache = plan.__dict__.setdefault("_packed", {}) if hasattr(plan, "__dict__") else {}
    key = (str(device), sq, sk)
    if key not in cache:
        cache[key] = _pack_now(plan, sq, sk, device)
    return cache[key]


def _pack_now(plan: tuple, sq: int, sk: int, device: torch.device) -> _Packed:
    T = len(plan)
    R = max(t.q1 - t.q0 for t in plan)
    C = max(t.cols.numel() for t in plan)
    h = plan[0].vis.shape[0]
    rows = torch.full((T, R), sq, dtype=torch.long)
    cols = torch.full((T, C), sk, dtype=torch.long)
    vis = torch.zeros(h, T, R, C, dtype=torch.bool)
    for i, t in enumerate(plan):
        n, c = t.q1 - t.q0, t.cols.numel()
        rows[i, :n] = torch.arange(t.q0, t.q1)
        cols[i, :c] = t.cols
        vis[:, i, :n, :c] = t.vis
    return _Packed(rows.to(device), cols.to(device), vis.to(device))


def _groups(b: int, h: int, p: _Packed):
    T, R = p.rows.shape
    per = max(1, GROUP_ELEMS // max(1, b * h * R * p.cols.shape[1]))
    for t0 in range(0, T, per):
        yield slice(t0, min(t0 + per, T))


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of every head: x [b, h, n, d], idx [h, *shape] (row indices per head) -> [b, h, *shape, d].

    One ``embedding`` lookup on x as an [h * n, b * d] table: on CPU several times faster than
    ``index_select`` into a new tensor, and it takes any index shape.
    """
    b, h, n, d = x.shape
    table = x.permute(1, 2, 0, 3).reshape(h * n, b * d)
    base = (torch.arange(h, device=idx.device) * n).view(h, *([1] * (idx.dim() - 1)))
    got = torch.nn.functional.embedding(idx + base, table)  # [h, *shape, b * d]
    return got.view(*idx.shape, b, d).movedim(-2, 0)


def add_rows(acc: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """acc[:, h, idx[h, ...]] += src[:, h, ...] (repeated indices add up). acc [b, h, n, d] contiguous,
    idx [h, *shape], src [b, h, *shape, d]; a 2-D ``index_add_`` (its fast path) when b = 1."""
    b, h, n, d = acc.shape
    flat = (idx + (torch.arange(h, device=idx.device) * n).view(h, *([1] * (idx.dim() - 1)))).reshape(-1)
    if b == 1:
        acc.view(h * n, d).index_add_(0, flat, src.reshape(-1, d))
    else:
        acc.view(b, h * n, d).index_add_(1, flat, src.reshape(b, -1, d))


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, d] with one zero scratch row appended (fp32)."""
    return torch.cat([x.float(), x.new_zeros(x.shape[0], x.shape[1], 1, x.shape[3], dtype=torch.float32)], 2)


def forward(q, k, v, kind="sparse", block=1, scale=1.0, plan=()):
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    out = torch.zeros(b, hq, sq + 1, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, sq + 1), float("-inf"), dtype=torch.float32, device=q.device)
    if not plan:
        return out[:, :, :sq], lse[:, :, :sq]
    p = _pack(plan, sq, sk, q.device)
    qp, kp, vp = _padded(q), _padded(k), _padded(v)
    for grp in _groups(b, hq, p):
        rows, cols = p.rows[grp], p.cols[grp]
        qt = take_rows(qp, rows.expand(hq, *rows.shape)).view(b, hkv, g, *rows.shape, -1)  # [b, hkv, g, t, R, d]
        kt = take_rows(kp, cols.expand(hkv, *cols.shape)).unsqueeze(2)  # [b, hkv, 1, t, C, d]
        vt = take_rows(vp, cols.expand(hkv, *cols.shape)).unsqueeze(2)
        vis = p.vis[:, grp].view(hkv, g, *p.vis[:, grp].shape[1:])
        s = (qt @ kt.transpose(-1, -2)).mul_(scale).masked_fill_(~vis, float("-inf"))  # [b, hkv, g, t, R, C]
        m = s.amax(-1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        e = torch.exp(s.sub_(m_safe[..., None]))
        denom = e.sum(-1)
        o = (e @ vt) / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        flat = rows.reshape(-1)
        out.index_copy_(2, flat, o.reshape(b, hq, -1, o.shape[-1]))
        lse.index_copy_(2, flat, (m_safe + torch.log(denom)).reshape(b, hq, -1))  # log 0 = -inf: rows seeing nothing
    return out[:, :, :sq], lse[:, :, :sq]


def backward(dout, q, k, v, D, lse, kind="sparse", block=1, scale=1.0, plan=()):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    dq = torch.zeros(b, hq, sq + 1, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hkv, sk + 1, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, hkv, sk + 1, v.shape[-1], dtype=torch.float32, device=q.device)
    if not plan:
        return dq[:, :, :sq], dk[:, :, :sk], dv[:, :, :sk]
    p = _pack(plan, sq, sk, q.device)
    qp, kp, vp, dop = _padded(q), _padded(k), _padded(v), _padded(dout)
    stats = torch.stack([lse.float(), D.float()])
    stats = torch.cat([stats, stats.new_zeros(2, b, hq, 1)], 3)  # scratch row: lse 0, D 0 (masked anyway)
    for grp in _groups(b, hq, p):
        rows, cols = p.rows[grp], p.cols[grp]
        flat_r = rows.reshape(-1)
        qt = take_rows(qp, rows.expand(hq, *rows.shape)).view(b, hkv, g, *rows.shape, d)
        dot = take_rows(dop, rows.expand(hq, *rows.shape)).view(b, hkv, g, *rows.shape, -1)
        kt = take_rows(kp, cols.expand(hkv, *cols.shape)).unsqueeze(2)
        vt = take_rows(vp, cols.expand(hkv, *cols.shape)).unsqueeze(2)
        lse_t, D_t = stats.index_select(3, flat_r).view(2, b, hkv, g, *rows.shape)
        vis = p.vis[:, grp].view(hkv, g, *p.vis[:, grp].shape[1:])
        s = (qt @ kt.transpose(-1, -2)).mul_(scale)
        pr = torch.where(vis, torch.exp(s - lse_t[..., None]), torch.zeros_like(s))
        add_rows(dv, cols.expand(hkv, *cols.shape), (pr.transpose(-1, -2) @ dot).sum(2))
        ds = pr.mul_((dot @ vt.transpose(-1, -2)).sub_(D_t[..., None]))
        dq.index_copy_(2, flat_r, (ds @ kt).mul_(scale).reshape(b, hq, -1, d))
        add_rows(dk, cols.expand(hkv, *cols.shape), (ds.transpose(-1, -2) @ qt).sum(2).mul_(scale))
    return dq[:, :, :sq], dk[:, :, :sk], dv[:, :, :sk]
