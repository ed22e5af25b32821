"""Tiled attention in plain torch: bounded memory, any device, fp32 math, causal tile skipping.

Same interface as :mod:`megatron_burst.kernels.reference`. The forward runs an online softmax over
kv tiles; the backward recomputes probabilities per (q tile, kv tile) from the given lse and D.
"""
from __future__ import annotations

import torch

from megatron_burst.kernels.reference import expand_kv, finite_lse, reduce_kv
from megatron_burst.masks.block import HeadBands, positions_visibility

TILE_Q = 512
TILE_K = 512


def _tile_mask(kind, block, q0, q1, k0, k1, device, positions=None):
    """Visible-mask of tile rows [q0, q1) x cols [k0, k1); None if fully visible; False if empty."""
    if kind == "full":
        return None
    if kind == "positions":  # all increasing: compare the tile's corners before building anything
        q_pos, kv_pos, q_doc, kv_doc, band = positions
        per_head = isinstance(band, HeadBands)  # corners against the envelope; the mask always built
        left, right = band.envelope if per_head else band
        if q_pos is not None and right is not None and int(kv_pos[k0]) > int(q_pos[q1 - 1]) + right:
            return False
        if q_pos is not None and left is not None and int(kv_pos[k1 - 1]) < int(q_pos[q0]) - left:
            return False
        if q_doc is not None and (int(kv_doc[k0]) > int(q_doc[q1 - 1]) or int(kv_doc[k1 - 1]) < int(q_doc[q0])):
            return False
        one_doc = q_doc is None or int(q_doc[q0]) == int(q_doc[q1 - 1]) == int(kv_doc[k0]) == int(kv_doc[k1 - 1])
        in_band = q_pos is None or ((right is None or int(kv_pos[k1 - 1]) <= int(q_pos[q0]) + right)
                                    and (left is None or int(kv_pos[k0]) >= int(q_pos[q1 - 1]) - left))
        if one_doc and in_band and not per_head:
            return None
        sl = lambda t, a, b: None if t is None else t[a:b]  # noqa: E731
        return positions_visibility(sl(q_pos, q0, q1), sl(kv_pos, k0, k1), sl(q_doc, q0, q1), sl(kv_doc, k0, k1),
                                    band.columns(k0, k1) if per_head else band, q1 - q0, k1 - k0, device)
    if kind == "causal":
        lo_q, hi_k = q0, k1 - 1
        if hi_k <= lo_q:
            return None
        if k0 > q1 - 1:
            return False
        rows = torch.arange(q0, q1, device=device)[:, None]
        return rows >= torch.arange(k0, k1, device=device)[None, :]
    rows = torch.arange(q0, q1, device=device)[:, None] // block
    cols = torch.arange(k0, k1, device=device)[None, :] // block
    if (k1 - 1) // block <= q0 // block:
        return None
    if k0 // block > (q1 - 1) // block:
        return False
    return rows >= cols


def forward(q, k, v, kind="full", block=1, scale=1.0, positions=None):
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    ke, ve = expand_kv(k, hq), expand_kv(v, hq)
    out = torch.empty(b, hq, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    for q0 in range(0, sq, TILE_Q):
        q1 = min(q0 + TILE_Q, sq)
        qt = q[:, :, q0:q1].float() * scale
        m = torch.full((b, hq, q1 - q0), float("-inf"), device=q.device)
        l = torch.zeros(b, hq, q1 - q0, device=q.device)
        acc = torch.zeros(b, hq, q1 - q0, v.shape[-1], device=q.device)
        for k0 in range(0, sk, TILE_K):
            k1 = min(k0 + TILE_K, sk)
            vis = _tile_mask(kind, block, q0, q1, k0, k1, q.device, positions)
            if vis is False:
                continue
            s = qt @ ke[:, :, k0:k1].float().transpose(-1, -2)
            if vis is not None:
                s = s.masked_fill(~vis, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            # rows that have seen nothing yet keep m=-inf; guard exp(-inf - -inf)
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + p @ ve[:, :, k0:k1].float()
            m = m_new
        # a row that saw nothing (a positions block of a sparse pattern): out 0, lse -inf
        out[:, :, q0:q1] = acc / torch.where(l > 0, l, 1.0)[..., None]
        lse[:, :, q0:q1] = m + torch.log(l)
    return out, lse


def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, positions=None):
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    hkv = k.shape[1]
    ke, ve = expand_kv(k, hq), expand_kv(v, hq)
    dq = torch.zeros(b, hq, sq, d, device=q.device)
    dk = torch.zeros(b, hq, sk, d, device=q.device)
    dv = torch.zeros(b, hq, sk, v.shape[-1], device=q.device)
    for q0 in range(0, sq, TILE_Q):
        q1 = min(q0 + TILE_Q, sq)
        qt = q[:, :, q0:q1].float()
        dot = dout[:, :, q0:q1].float()
        lse_t = finite_lse(lse[:, :, q0:q1, None].float())
        D_t = D[:, :, q0:q1, None].float()
        for k0 in range(0, sk, TILE_K):
            k1 = min(k0 + TILE_K, sk)
            vis = _tile_mask(kind, block, q0, q1, k0, k1, q.device, positions)
            if vis is False:
                continue
            kt, vt = ke[:, :, k0:k1].float(), ve[:, :, k0:k1].float()
            p = torch.exp((qt @ kt.transpose(-1, -2)) * scale - lse_t)
            if vis is not None:
                p = p.masked_fill(~vis, 0.0)
            dv[:, :, k0:k1] += p.transpose(-1, -2) @ dot
            ds = p * (dot @ vt.transpose(-1, -2) - D_t)
            dq[:, :, q0:q1] += (ds @ kt) * scale
            dk[:, :, k0:k1] += (ds.transpose(-1, -2) @ qt) * scale
    return dq, reduce_kv(dk, hkv), reduce_kv(dv, hkv)
