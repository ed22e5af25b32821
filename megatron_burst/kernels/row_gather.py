"""Row-gathered sparse attention in plain torch (any device): each query row sees its own keys.

The companion of :mod:`megatron_burst.kernels.block_sparse` for the scattered part of a
vertical-slash plan. An isolated slash line puts one visible pair in each row of a 64-row tile but
64 different key columns in the tile, so a tile matmul would compute 64 scores per visible one;
here every row gathers just its own keys (``index_select`` of K/V rows, then row-wise dot
products), so the cost follows the visible pairs. Dense columns (vertical lines, a local band of
slashes) stay with the tile kernel, whose matmuls are cheaper per score (the split:
:func:`megatron_burst.masks.vertical_slash.plan_pair`). Plans have this part on CPU only
(:func:`megatron_burst.masks.vertical_slash.dense_column_for`): on CUDA every visible column goes to the Triton
tile kernel.

Same (out, lse) interface as the other kernels, for ``kind="gather"`` blocks: the keyword
``plan`` is a tuple of :class:`megatron_burst.masks.vertical_slash.SparseRows` groups (rows [R]; idx, valid
[hq, R, n]; on the plan's device, copied once to q's when elsewhere), rows grouped by how many
keys they gather. Rows with no valid key get out 0 and lse -inf (zero gradients). fp32 math, rows
processed in chunks so the gathered K/V copies stay small.
"""
from __future__ import annotations

import torch

from megatron_burst.kernels.block_sparse import add_rows, take_rows

# elements (b * hq * rows * n * d) of one chunk's gathered K (fp32): 512K = 2 MiB (fastest on CPU)
CHUNK_ELEMS = 1 << 19


def _chunks(plan, q: torch.Tensor, k: torch.Tensor):
    """(rows [r], kv-head key indices [hq, r, n], valid [hq, r, n], kv head of each query head [hq]) chunks."""
    b, hq, _, d = q.shape
    for group in plan:
        if group.rows.device == q.device:
            rows, idx, valid = group.rows, group.idx, group.valid
        else:  # copies made once per device
            on_device = group.__dict__.setdefault("_on_device", {})
            if q.device not in on_device:
                on_device[q.device] = tuple(t.to(q.device) for t in (group.rows, group.idx, group.valid))
            rows, idx, valid = on_device[q.device]
        step = max(1, CHUNK_ELEMS // max(1, b * hq * idx.shape[2] * d))
        for r0 in range(0, rows.numel(), step):
            sl = slice(r0, r0 + step)
            yield rows[sl], idx[:, sl], valid[:, sl]


def _take_kv(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """K/V rows [b, hkv, sk, d] at per-query-head indices idx [hq, r, n] -> [b, hq, r, n, d] fp32."""
    hq, hkv = idx.shape[0], x.shape[1]
    grouped = idx.view(hkv, hq // hkv, *idx.shape[1:])  # query heads of one kv head share its rows
    return take_rows(x, grouped.flatten(1, 2)).view(x.shape[0], hq, *idx.shape[1:], x.shape[-1]).float()


def _add_kv(acc: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """acc [b, hkv, sk, d] += src [b, hq, r, n, d] at idx [hq, r, n] (query heads summed into kv heads)."""
    hq, hkv = idx.shape[0], acc.shape[1]
    add_rows(acc, idx.reshape(hkv, -1), src.reshape(src.shape[0], hkv, -1, src.shape[-1]))


def _rows_of(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [b, h, n, (d)] at rows [r] -> [b, h, r, (d)] fp32."""
    return x.index_select(2, rows).float()


def forward(q, k, v, kind="gather", block=1, scale=1.0, plan=()):
    b, hq, sq, _ = q.shape
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    for rows, idx, valid in _chunks(plan, q, k):
        qc = _rows_of(q, rows)
        s = torch.linalg.vecdot(_take_kv(k, idx), qc[:, :, :, None, :]) * scale  # [b, hq, r, n]
        s = s.masked_fill(~valid, float("-inf"))
        m = s.amax(-1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        denom = p.sum(-1)
        o = (p[..., None] * _take_kv(v, idx)).sum(-2)
        out.index_copy_(2, rows, o / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
        lse.index_copy_(2, rows, m_safe + torch.log(denom))  # log 0 = -inf for rows seeing nothing
    return out, lse


def backward(dout, q, k, v, D, lse, kind="gather", block=1, scale=1.0, plan=()):
    b, hq, sq, d = q.shape
    dq = torch.zeros(b, hq, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for rows, idx, valid in _chunks(plan, q, k):
        qc, doc = _rows_of(q, rows), _rows_of(dout, rows)
        kg, vg = _take_kv(k, idx), _take_kv(v, idx)
        s = torch.linalg.vecdot(kg, qc[..., None, :]) * scale
        p = torch.where(valid, torch.exp(s - _rows_of(lse, rows)[..., None]), torch.zeros_like(s))
        ds = p * (torch.linalg.vecdot(vg, doc[..., None, :]) - _rows_of(D, rows)[..., None])
        dq.index_copy_(2, rows, (ds[..., None] * kg).sum(-2) * scale)
        _add_kv(dk, idx, ds[..., None] * qc[..., None, :] * scale)
        _add_kv(dv, idx, p[..., None] * doc[..., None, :])
    return dq, dk, dv
