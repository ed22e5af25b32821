"""Triton source of the on-chip recompute variant (``impl="triton_recompute"``; imports triton).

Imported only on first use, by :mod:`megatron_burst.loss.onchip` (``TRITON_INTERPRET`` must be set
before triton is first imported for the CPU interpreter: see :mod:`megatron_burst.loss.triton_kernels`).
The algorithm, the launch shapes and the memory are described in :mod:`megatron_burst.loss.onchip`.

Every kernel recomputes logit tiles ``z = h W^T`` [BLOCK_N, BLOCK_V] with ``tl.dot`` over d in
BLOCK_D slices (fp32 accumulation; fp32 inputs with ``input_precision="ieee"``, no TF32); no
logits tile ever leaves the chip. Globals read inside kernels are constexpr (compiled Triton
refuses plain Python globals; the interpreter would not notice).
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2 e)


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a b in fp32. UPCAST (Triton's CPU interpreter only, whose dot multiplies bf16 operands'
    raw bits): fp32 operands -- bf16 values and their products are exact in fp32, as on the tensor
    cores, so only the order of the fp32 sums can differ. On a GPU the operands stay 16-bit."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _logits_tile(H, W, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """z [BLOCK_N, BLOCK_V] fp32 = H[rows] W[cols]^T (masked rows / columns give 0)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_D)
    for k0 in range(0, D, BLOCK_D):
        k = k0 + ks
        k_ok = k < D
        h = tl.load(H + rows[:, None] * stride_h + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(h, tl.trans(w), acc, PREC, UPCAST)
    return acc


@triton.jit
def _grad_tile(z, cols, col_ok, tgt, lse, gw, OUT_DTYPE: tl.constexpr):
    """G = gw * (exp(z - lse) - [col == tgt]) rounded once to the GEMM dtype; 0 outside the vocabulary."""
    p = tl.exp2((z - lse[:, None]) * LOG2E)
    g = gw[:, None] * (p - tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0))
    return tl.where(col_ok[None, :], g, 0.0).to(OUT_DTYPE)


@triton.jit
def lse_stats_kernel(H, W, TGT, MAX, SUMEXP, ZTGT, N, V, D, stride_h, stride_w, tiles_per_split,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Program (token tile i, vocabulary split j): walk the split's vocabulary tiles, keep per row the
    running max m and sum exp(z - m) (fp32, one exp per logit) and the target logit (TGT: local
    column, -1 if not in this shard); store them at [j, row] of MAX / SUMEXP / ZTGT ([splits, N])."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_begin = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < V
        z = _logits_tile(H, W, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_D, PREC, UPCAST)
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: every tile has a column in range
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((z - m_new[:, None]) * LOG2E), axis=1)
        m = m_new
    out = split * N + rows
    tl.store(MAX + out, m, mask=row_ok)
    tl.store(SUMEXP + out, s, mask=row_ok)
    tl.store(ZTGT + out, zt, mask=row_ok)


@triton.jit
def hidden_grad_kernel(H, W, TGT, LSE, GW, DH, N, V, D, stride_h, stride_w, stride_o,
                       BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Program i owns token rows [i BLOCK_N, (i+1) BLOCK_N) of DH [N, D] (fp32): walks all
    vocabulary tiles, recomputes z, forms G (rounded to the input dtype) and adds G W[tile] into
    its rows slice by slice of d (the first tile overwrites: DH needs no zeroing). No other
    program touches those rows: deterministic, no atomics."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    gw = tl.load(GW + rows, mask=row_ok, other=0.0)
    ks = tl.arange(0, BLOCK_D)
    for v0 in range(0, V, BLOCK_V):
        cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < V
        z = _logits_tile(H, W, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_D, PREC, UPCAST)
        g = _grad_tile(z, cols, col_ok, tgt, lse, gw, W.dtype.element_ty)
        for k0 in range(0, D, BLOCK_D):
            k = k0 + ks
            k_ok = k < D
            w = tl.load(W + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            o_ptr = DH + rows[:, None] * stride_o + k[None, :]
            o_ok = row_ok[:, None] & k_ok[None, :]
            prev = tl.load(o_ptr, mask=o_ok & (v0 > 0), other=0.0)
            tl.store(o_ptr, _dot(g, w, prev, PREC, UPCAST), mask=o_ok)


@triton.jit
def weight_grad_kernel(H, W, TGT, LSE, GW, DW, N, D, v_offset, v_count, stride_h, stride_w, stride_o,
                       ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                       BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program j owns vocabulary rows v_offset + [j BLOCK_V, (j+1) BLOCK_V) (at most v_count rows
    from v_offset), stored at rows [j BLOCK_V, ...) of DW (fp32, row stride stride_o): walks all
    token tiles, recomputes z, forms G and adds G^T H[tile] into its rows slice by slice of d.
    ACCUMULATE: DW holds values to add to (Megatron's main_grad); else the first token tile
    overwrites. Deterministic, no atomics."""
    pid = tl.program_id(0)
    local = (pid * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    col_ok = local < v_count
    cols = local + v_offset
    ks = tl.arange(0, BLOCK_D)
    for t0 in range(0, N, BLOCK_N):
        rows = (t0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok = rows < N
        tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
        lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
        gw = tl.load(GW + rows, mask=row_ok, other=0.0)
        z = _logits_tile(H, W, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_D, PREC, UPCAST)
        gt = tl.trans(_grad_tile(z, cols, col_ok, tgt, lse, gw, H.dtype.element_ty))  # [BLOCK_V, BLOCK_N]
        for k0 in range(0, D, BLOCK_D):
            k = k0 + ks
            k_ok = k < D
            h = tl.load(H + rows[:, None] * stride_h + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            o_ptr = DW + local[:, None] * stride_o + k[None, :]
            o_ok = col_ok[:, None] & k_ok[None, :]
            if ACCUMULATE:
                prev = tl.load(o_ptr, mask=o_ok, other=0.0)
            else:
                prev = tl.load(o_ptr, mask=o_ok & (t0 > 0), other=0.0)
            tl.store(o_ptr, _dot(gt, h, prev, PREC, UPCAST), mask=o_ok)
