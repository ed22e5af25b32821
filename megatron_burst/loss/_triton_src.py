"""Triton source of the kernels wrapped by :mod:`megatron_burst.loss.triton_kernels` (imports triton).

Plain functions: triton_kernels applies ``triton.jit`` on first use. See that module for the layout.
"""
from __future__ import annotations

import triton.language as tl


def logits_stats_kernel(H, W, BUF, TGT, MAX, SUMEXP, ZT, T, V, D,
                        stride_h, stride_w, stride_buf,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One program per BLOCK_T tokens: logits tiles into BUF, online max / sum-exp, target logit."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    tgt = tl.load(TGT + offs_t, mask=t_ok, other=-1)  # local target row, -1: not on this rank
    run_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_T], tl.float32)
    z_tgt = tl.zeros([BLOCK_T], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_ok = offs_v < V
        acc = tl.zeros([BLOCK_V, BLOCK_T], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            w = tl.load(W + offs_v[:, None] * stride_w + offs_d[None, :],
                        mask=v_ok[:, None] & d_ok[None, :], other=0.0)
            h = tl.load(H + offs_t[:, None] * stride_h + offs_d[None, :],
                        mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:  # interpreter only, see logits_stats
                w = w.to(tl.float32)
                h = h.to(tl.float32)
            acc = tl.dot(w, tl.trans(h), acc, input_precision=PRECISION)
        tl.store(BUF + offs_v[:, None] * stride_buf + offs_t[None, :], acc,
                 mask=v_ok[:, None] & t_ok[None, :])
        # Padding rows of the last tile must not win the max or add to the sum.
        acc = tl.where(v_ok[:, None], acc, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(acc, axis=0))
        # exp(-inf - finite) = 0 makes the first tile's rescale harmless.
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(acc - new_max[None, :]), axis=0)
        run_max = new_max
        z_tgt += tl.sum(tl.where(offs_v[:, None] == tgt[None, :], acc, 0.0), axis=0)
    tl.store(MAX + offs_t, run_max, mask=t_ok)
    tl.store(SUMEXP + offs_t, run_sum, mask=t_ok)
    tl.store(ZT + offs_t, z_tgt, mask=t_ok)


def softmax_grad_kernel(BUF, G, TGT, MAX, SUMEXP, WTS, T, V, stride_buf, stride_g,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per (BLOCK_V, BLOCK_T) tile: G = w * (exp(z - m) / s - onehot), cast to G's dtype."""
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    v_ok = offs_v < V
    t_ok = offs_t < T
    ok = v_ok[:, None] & t_ok[None, :]
    z = tl.load(BUF + offs_v[:, None] * stride_buf + offs_t[None, :], mask=ok, other=0.0)
    m = tl.load(MAX + offs_t, mask=t_ok, other=0.0)
    s = tl.load(SUMEXP + offs_t, mask=t_ok, other=1.0)
    w = tl.load(WTS + offs_t, mask=t_ok, other=0.0)
    tgt = tl.load(TGT + offs_t, mask=t_ok, other=-1)
    p = tl.exp(z - m[None, :]) / s[None, :]
    p = tl.where(offs_v[:, None] == tgt[None, :], p - 1.0, p) * w[None, :]
    tl.store(G + offs_v[:, None] * stride_g + offs_t[None, :], p.to(G.dtype.element_ty), mask=ok)
