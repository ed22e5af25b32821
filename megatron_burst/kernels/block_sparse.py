"""Block-sparse attention in plain torch (any device): computes only the visible tiles of a plan.

Same (out, lse) interface as :mod:`megatron_burst.kernels.reference`, for ``kind="sparse"``
blocks: the keyword ``plan`` is a :class:`megatron_burst.masks.vertical_slash.PackedTiles` (what the planner
builds: query tiles of up to 64 rows, the key columns each gathers, a per-head bitmask) or
hand-written tiles (a tuple of :class:`megatron_burst.masks.vertical_slash.SparseTile`, converted by
:func:`megatron_burst.masks.vertical_slash.as_packed`). Tiles absent from the plan are skipped. Rows that see
nothing get out 0 and lse -inf (their gradients are 0). fp32 math; the backward recomputes
probabilities from the given lse and D.

The kernel batches the tiles: it expands the packed plan once on its device (no read-back;
cached on the PackedTiles, so it dies with the plan) into row indices [T, R] and column indices
[T, C] padded to the largest tile and the visibility bits as a bool mask [h, T, R, C] (False on
padding). Padded rows and columns point at one extra scratch row of each buffer, so a whole group
of tiles is one batched matmul (a Python loop per 64-row tile costs more than its arithmetic at
these sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_burst.masks.vertical_slash import PackedTiles, as_packed, unpack_bits

# elements (b * hq * tiles * rows * cols) of one group's fp32 scores: 4M = 16 MiB
GROUP_ELEMS = 1 << 22
# elements (h * tiles * rows * cols) of the bit expansion of one chunk of tiles: 16M
UNPACK_ELEMS = 1 << 24


@dataclass
class _Batched:
    rows: torch.Tensor  # [T, R] query row of each tile row; padding -> sq (a scratch row)
    cols: torch.Tensor  # [T, C] key column of each tile column; padding -> sk (a scratch row)
    vis: torch.Tensor  # [h, T, R, C] bool, False on padding


def _batched(plan, hq: int, sq: int, sk: int, device: torch.device) -> _Batched:
    """The batched form of ``plan`` for hq query heads, a q block of sq rows and a kv block of sk
    rows on ``device``, cached on the plan's PackedTiles there."""
    tiles = as_packed(plan, hq, device)
    cache = tiles.__dict__.setdefault("_batched", {})
    if (sq, sk) not in cache:
        cache[(sq, sk)] = _batch_now(tiles, sq, sk)
    return cache[(sq, sk)]


def _batch_now(p: PackedTiles, sq: int, sk: int) -> _Batched:
    """The batched form of ``p`` on its device, built with whole-tensor ops (no read-back)."""
    device = p.device
    T, R, C, h = p.tiles, p.max_rows, p.max_cols, p.heads
    r = torch.arange(R, device=device)
    rows = p.q0.long()[:, None] + r
    rows_in = (p.q1 - p.q0).long()[:, None]
    rows = torch.where(r < rows_in, rows, sq)
    slot = p.col_start[:T, None] + torch.arange(C, device=device)
    col_ok = slot < p.col_end[:, None]
    if p.cols.numel():
        cols = torch.where(col_ok, p.cols[slot.clamp(0, p.cols.numel() - 1)].long(), sk)
    else:
        cols = torch.full((T, C), sk, dtype=torch.long, device=device)
    words = -(-C // 32)
    vis = torch.zeros(h, T, R, C, dtype=torch.bool, device=device)
    if not (T and C and p.vis.numel()):
        return _Batched(rows, cols, vis)
    w = torch.arange(words, device=device)
    head = torch.arange(h, device=device)[:, None, None, None]
    step = max(1, UNPACK_ELEMS // max(1, h * R * words * 32))
    for a in range(0, T, step):  # chunks of tiles: the expanded bits stay bounded
        b = min(a + step, T)
        at = (p.vis_start[a:b, None, None] + r[:, None] * p.vis_words[a:b, None, None]
              + w)[None] + head * p.vis_head[a:b, None, None]  # [h, t, R, words] word addresses
        ok = (w < p.vis_words[a:b, None, None]) & (r[:, None] < rows_in[a:b, :, None])
        got = torch.where(ok, p.vis[at.clamp(0, p.vis.numel() - 1)], 0)
        vis[:, a:b] = unpack_bits(got, C) & col_ok[None, a:b, None, :]
    return _Batched(rows, cols, vis)


def _groups(b: int, h: int, p: _Batched):
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
    p = _batched(plan, hq, sq, sk, q.device)
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
    p = _batched(plan, hq, sq, sk, q.device)
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
