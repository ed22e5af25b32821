"""Triton source of the fused rotary position embedding (imports triton).

A plain function: :mod:`megatron_burst.fusions.rope` applies ``triton.jit`` on first use (Triton
decides at decoration time whether a kernel is compiled or interpreted, so the decoration must
wait until ``TRITON_INTERPRET`` is settled; see :mod:`megatron_burst.loss.triton_kernels`). The
semantics and the layout are in :mod:`megatron_burst.fusions.rope`.

Compiled kernels read only ``tl.constexpr`` globals (the CPU interpreter reads any, so CI could
not see a plain one): this module has none besides the import.
"""
from __future__ import annotations

import triton.language as tl


def rope_kernel(X, F, Y, B, H, stride_xs, stride_xb, stride_xh, stride_f, R: tl.constexpr,
                D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr):
    """One program per row (s, b) of ``X`` and block of BLOCK_H heads: rotate the first R columns.

    X: [S, B, H, D] input (the forward's t, or the backward's dy), strides (stride_xs, stride_xb,
    stride_xh, 1); F: freqs rows [S_f >= S, R], row stride stride_f, unit column stride, any float
    dtype (converted to fp32); Y: [S, B, H, D] contiguous output in Y's dtype. R (the rotary
    dim: even, R <= D <= BLOCK_D) and D are constexprs, so masks and partner columns vectorize.

    Column j < R has a partner p(j) and a sign s_j: non-interleaved p(j) = j + R/2 (s_j = -1) for
    j < R/2, else j - R/2 (s_j = +1); interleaved p(j) = j ^ 1, s_j = -1 for even j, else +1.
    Forward:  y[j]  = x[j] cos f[j] + s_j x[p(j)] sin f[j]           (Megatron's x cos + rotate_half(x) sin)
    Backward: dx[j] = dy[j] cos f[j] - s_j dy[p(j)] sin f[p(j)]     (its exact adjoint, for any freqs)
    Columns j >= R are copied. fp32 math, one rounding to Y's dtype.
    """
    # int64 row: S * B * H * D passes 2^31 at long sequences (S can be 1M)
    row = tl.program_id(0).to(tl.int64)
    s = row // B
    b = row - s * B
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    rot = cols < R
    if INTERLEAVED:
        negative = (cols % 2) == 0
    else:
        half = R // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        negative = cols < half
    sign = tl.where(negative, -1.0, 1.0)

    f_row = F + s * stride_f
    f = tl.load(f_row + cols, mask=rot, other=0.0).to(tl.float32)

    head_ok = heads[:, None] < H
    x_row = X + s * stride_xs + b * stride_xb + heads[:, None].to(tl.int64) * stride_xh
    x = tl.load(x_row + cols[None, :], mask=head_ok & (cols[None, :] < D), other=0.0).to(tl.float32)
    if INTERLEAVED:
        # partners are the pair neighbours: swap each pair in registers (a gather load of
        # cols ^ 1 would not vectorize)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
        xp = tl.reshape(tl.join(x_odd, x_even), (BLOCK_H, BLOCK_D))
    else:
        # the partner half: a second read of the same row (served by the cache; contiguous runs,
        # vectorized as R is a constexpr)
        xp = tl.load(x_row + partner[None, :], mask=head_ok & rot[None, :], other=0.0).to(tl.float32)
    if BACKWARD:
        if INTERLEAVED:
            f_even, f_odd = tl.split(tl.reshape(f, (BLOCK_D // 2, 2)))
            fp = tl.reshape(tl.join(f_odd, f_even), (BLOCK_D,))
        else:
            fp = tl.load(f_row + partner, mask=rot, other=0.0).to(tl.float32)
        y = x * tl.cos(f)[None, :] - (sign * tl.sin(fp))[None, :] * xp
    else:
        y = x * tl.cos(f)[None, :] + (sign * tl.sin(f))[None, :] * xp
    # pass-through columns exactly (x converted to fp32 and back is the same value)
    y = tl.where(rot[None, :], y, x)

    y_row = Y + (row * H + heads[:, None]) * D
    tl.store(y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=head_ok & (cols[None, :] < D))
