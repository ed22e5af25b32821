"""Triton source of the fused loss's one elementwise kernel (imports triton).

A plain function: :mod:`megatron_burst.loss.triton_kernels` applies ``triton.jit`` on first use
(see there for why). The layout and the algorithm are in :mod:`megatron_burst.loss.fast`.
"""
from __future__ import annotations

import triton.language as tl

# exp(x) = exp2(x * log2(e)): exp2 is the GPU's native instruction. A constexpr: compiled Triton
# kernels read only constexpr globals (the CPU interpreter reads any, so CI could not see this)
LOG2E = tl.constexpr(1.4426950408889634)


def ce_rows_kernel(Z, G, TGT, WTS, MAX, SUMEXP, ZTGT, TOP, TOPIDX, V, COL0, stride_z, stride_g,
                   BLOCK_V: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr, G_IN_Z: tl.constexpr,
                   UNNORM: tl.constexpr = False, REF_SPAN: tl.constexpr = 40.0):
    """One program per token row of the chunk's logits ``Z`` [T, V] (fp32, row stride stride_z).
    ``TGT - COL0``: each row's target column among these V.

    STATS: walk the row once in BLOCK_V tiles, keeping the running max m and sum exp(z - m) in
    fp32 (one exp per logit: the sum is rescaled once per tile), and read the target's logit;
    store m, s and z_target (0 where TGT is outside [0, V): no target here) to MAX, SUMEXP, ZTGT.
    Without STATS, m and s (the global ones, combined over TP by the caller) are read from MAX
    and SUMEXP instead.
    GRAD: walk the row again and store the gradient of the per-token loss with respect to the
    logits, weighted by WTS: ``G[t, v] = w_t * (exp(z - m) / s - [v == target])`` in G's dtype
    (bf16 for bf16 inputs, the GEMM operand; G may be Z itself when both are fp32).
    G_IN_Z: G's row t is the first half of Z's row t (16-bit G written over the fp32 logits, the
    vocabulary pass's scratch). Block i's stores then land on the fp32 elements below (v0 + BLOCK_V) / 2,
    all read by the time every warp has loaded block i: a barrier between the load and the store
    of each block keeps a warp from overwriting elements another warp has not read yet.

    UNNORM (instead of STATS / GRAD; G a buffer of its own): one read of the row. The reference r
    is the first tile's max; every logit's ``exp(z - r)`` is summed in fp32 and stored to G
    unweighted (the caller scales G W per row afterwards: a per-token factor commutes with the
    d hidden GEMM). Two columns store 0 instead, their terms added by the caller in fp32: the
    target's (w (p - 1) W_target: p rounded and then 1 subtracted would lose p - 1 for a confident
    token) and the row's max's (p_max W_max: its exp(m - r) would be rounded where the old G's
    p ~ 1 was nearly exact). Stored: r, sum exp(z - r), z_target, and the row's max and its column
    to TOP / TOPIDX (as fp32). Any reference gives the same log-sum-exp, r + log s. Where a later
    tile's logits exceed r by more than REF_SPAN (exp would near fp32's range in G, its sum or the
    GEMM), the row is walked again with its true max as the reference (rare: logits more than
    REF_SPAN above all of the first BLOCK_V).
    """
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    # the target's column in these V columns (TGT's column minus COL0, the columns' first); outside
    # [0, V): none here (or ignored)
    tgt = tl.load(TGT + row) - COL0
    cols = tl.arange(0, BLOCK_V)
    if UNNORM:
        has_tgt = (tgt >= 0) & (tgt < V)
        z_tgt = tl.where(has_tgt, tl.load(z_row + tl.where(has_tgt, tgt, 0)), 0.0)
        g_row = G + row * stride_g
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=float("-inf"))
        r, top = tl.max(z, axis=0, return_indices=True)
        m = r
        e = tl.exp2((z - r) * LOG2E)
        s = tl.sum(e, axis=0)
        tl.store(g_row + cols, tl.where(cols == tgt, 0.0, e).to(G.dtype.element_ty), mask=ok)
        for v0 in range(BLOCK_V, V, BLOCK_V):
            offs = v0 + cols
            ok = offs < V
            z = tl.load(z_row + offs, mask=ok, other=float("-inf"))
            m_tile, i_tile = tl.max(z, axis=0, return_indices=True)
            top = tl.where(m_tile > m, v0 + i_tile, top)
            m = tl.maximum(m, m_tile)
            e = tl.exp2((z - r) * LOG2E)
            s += tl.sum(e, axis=0)
            tl.store(g_row + offs, tl.where(offs == tgt, 0.0, e).to(G.dtype.element_ty), mask=ok)
        redo = m - r > REF_SPAN
        s = tl.where(redo, 0.0, s)  # (s may be inf there)
        if redo:
            r = m
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + cols
                ok = offs < V
                z = tl.load(z_row + offs, mask=ok, other=float("-inf"))
                e = tl.exp2((z - r) * LOG2E)
                s += tl.sum(e, axis=0)
                tl.store(g_row + offs, tl.where(offs == tgt, 0.0, e).to(G.dtype.element_ty), mask=ok)
        # every thread's stores above land before the max's column is cleared (no other order
        # between threads of a program writing the same element)
        tl.debug_barrier()
        tl.store(g_row + top, tl.zeros([], dtype=G.dtype.element_ty))
        tl.store(MAX + row, r)
        tl.store(SUMEXP + row, s)
        tl.store(ZTGT + row, z_tgt)
        tl.store(TOP + row, m)
        tl.store(TOPIDX + row, top.to(tl.float32))
    if STATS:
        # The target's logit is read first: with G aliasing Z (fp32), another warp may already be
        # writing gradients into the row once the cross-warp reductions below have passed.
        has_tgt = (tgt >= 0) & (tgt < V)
        z_tgt = tl.load(z_row + tl.where(has_tgt, tgt, 0))
        z_tgt = tl.where(has_tgt, z_tgt, 0.0)
        # First tile peeled off, so that m and s enter the loop as fp32 values (and m is finite).
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
        m = tl.max(z, axis=0)
        s = tl.sum(tl.exp2((z - m) * LOG2E), axis=0)
        for v0 in range(BLOCK_V, V, BLOCK_V):
            offs = v0 + cols
            z = tl.load(z_row + offs, mask=offs < V, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((z - m_new) * LOG2E), axis=0)
            m = m_new
        tl.store(MAX + row, m)
        tl.store(SUMEXP + row, s)
        tl.store(ZTGT + row, z_tgt)
    elif not UNNORM:
        m = tl.load(MAX + row)
        s = tl.load(SUMEXP + row)
    if GRAD:
        w = tl.load(WTS + row)
        coef = w / s
        g_row = G + row * stride_g
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + cols
            ok = offs < V
            z = tl.load(z_row + offs, mask=ok, other=0.0)
            if G_IN_Z:
                tl.debug_barrier()
            g = tl.exp2((z - m) * LOG2E) * coef
            g = tl.where(offs == tgt, g - w, g)
            tl.store(g_row + offs, g.to(G.dtype.element_ty), mask=ok)


def dh_rows_kernel(P, W, OUT, ST, TGT, LABELS, WDH, LOSS, M_ALL, S_ALL, D, IGNORE, stride_p, stride_w, stride_out,
                   stride_st, BLOCK_D: tl.constexpr):
    """The one-read forward's epilogue at TP = 1, one launch per chunk (grid: rows x cdiv(d, BLOCK_D)).

    Per row t, from ``ce_rows(unnormalized=True)``'s statistics ST [5, T] (r, sum exp(z - r), z_target,
    the row's max, its column as fp32) and TGT (the target's column, -1 where none or ignored):
    scale = 1 / s, p_tgt = exp(z_target - r) scale where there is a target (else 0), p_top =
    exp(max - r) scale unless the max's column is the target's (else 0); then

        OUT[t] = round(w (scale P[t]) + [target] w (p_tgt - 1) W[tgt] + w p_top W[top])

    with w = WDH[t], P the fp32 product E W, in that order and in fp32 (the torch composition's
    operations, one rounding). The programs of the first column block also store the per-token
    loss (log s - (z_target - r) where LABELS != IGNORE, else 0) and the statistics m = r, s.
    """
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    r = tl.load(ST + row)
    s = tl.load(ST + stride_st + row)
    zt = tl.load(ST + 2 * stride_st + row)
    top = tl.load(ST + 3 * stride_st + row)
    top_col = tl.load(ST + 4 * stride_st + row).to(tl.int64)
    tgt = tl.load(TGT + row).to(tl.int64)
    w = tl.load(WDH + row)
    hit = tgt >= 0
    scale = 1.0 / s
    p_tgt = tl.where(hit, tl.exp2((zt - r) * LOG2E) * scale, 0.0)
    p_top = tl.where(hit & (top_col == tgt), 0.0, tl.exp2((top - r) * LOG2E) * scale)
    c_p = w * scale
    c_tgt = tl.where(hit, w * (p_tgt - 1.0), 0.0)
    c_top = w * p_top
    cols = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.load(P + row * stride_p + cols, mask=ok, other=0.0) * c_p
    acc += tl.load(W + tl.where(hit, tgt, 0) * stride_w + cols, mask=ok, other=0.0).to(tl.float32) * c_tgt
    acc += tl.load(W + top_col * stride_w + cols, mask=ok, other=0.0).to(tl.float32) * c_top
    tl.store(OUT + row * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=ok)
    if blk == 0:
        valid = tl.load(LABELS + row) != IGNORE
        tl.store(LOSS + row, tl.where(valid, tl.log(s) - tl.where(hit, zt - r, 0.0), 0.0))
        tl.store(M_ALL + row, r)
        tl.store(S_ALL + row, s)


def grad_cols_kernel(ZT, GT, TGT, WTS, MAX, SUMEXP, TN, COL0, stride_z, stride_g, BLOCK_T: tl.constexpr,
                     G_IN_Z: tl.constexpr):
    """The vocabulary pass's softmax gradient on a transposed tile (one program per vocabulary row v of
    ``ZT`` [vt, TN], fp32 logits of that row against TN tokens, row stride stride_z):

        GT[v, t] = w_t (exp(ZT[v, t] - m_t) / s_t - [v == TGT[t] - COL0])   in GT's dtype

    with the per-token statistics m (MAX), s (SUMEXP) and weights w (WTS). G_IN_Z: GT's row v is the
    first half of ZT's row v (16-bit G over the fp32 logits); block i's stores land on elements
    below (t0 + BLOCK_T) / 2 of the row, all read by then: a barrier between each block's load
    and store keeps a warp from overwriting what another has not read (as ce_rows_kernel's G_IN_Z).
    """
    v = tl.program_id(0)
    z_row = ZT + v.to(tl.int64) * stride_z
    g_row = GT + v.to(tl.int64) * stride_g
    cols = tl.arange(0, BLOCK_T)
    for t0 in range(0, TN, BLOCK_T):
        offs = t0 + cols
        ok = offs < TN
        z = tl.load(z_row + offs, mask=ok, other=0.0)
        m = tl.load(MAX + offs, mask=ok, other=0.0)
        s = tl.load(SUMEXP + offs, mask=ok, other=1.0)
        w = tl.load(WTS + offs, mask=ok, other=0.0)
        tgt = tl.load(TGT + offs, mask=ok, other=-1) - COL0
        if G_IN_Z:
            tl.debug_barrier()
        g = tl.exp2((z - m) * LOG2E) * (w / s)
        g = tl.where(tgt == v, g - w, g)
        tl.store(g_row + offs, g.to(GT.dtype.element_ty), mask=ok)


def tile_grad_kernel(H, W, G, TGT, WTS, MAX, SUMEXP, TN, VT, D, COL0, stride_h, stride_w, stride_g,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, WIDEN: tl.constexpr = False):
    """The vocabulary pass's tile in one GEMM: ``G[t, v] = w_t (exp(z - m_t) / s_t - [v == TGT[t] - COL0])``
    with z = (H W^T)[t, v] accumulated in fp32 in registers and never stored (H [TN, D] the tokens, W
    [VT, D] the tile's weight rows, both 16-bit, unit column stride; G [TN, VT] 16-bit). One program
    per [BLOCK_M, BLOCK_N] block of G, in groups of GROUP_M row blocks (the programs of a group share
    W's blocks in L2). EVEN_K: D is a multiple of BLOCK_K (no mask on the K loads). WIDEN (Triton's CPU
    interpreter, whose dot mishandles 16-bit operands): the blocks go to fp32 first, exact products
    summed in fp32 as the tensor cores do."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(TN, BLOCK_M)
    num_n = tl.cdiv(VT, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ok_m = rm < TN
    ok_n = rn < VT
    h_ptr = H + rm[:, None].to(tl.int64) * stride_h + rk[None, :]
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(h_ptr, mask=ok_m[:, None], other=0.0)
            b = tl.load(w_ptr, mask=ok_n[:, None], other=0.0)
        else:
            ok_k = (k0 + rk) < D
            a = tl.load(h_ptr, mask=ok_m[:, None] & ok_k[None, :], other=0.0)
            b = tl.load(w_ptr, mask=ok_n[:, None] & ok_k[None, :], other=0.0)
        if WIDEN:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        h_ptr += BLOCK_K
        w_ptr += BLOCK_K
    m = tl.load(MAX + rm, mask=ok_m, other=0.0)
    s = tl.load(SUMEXP + rm, mask=ok_m, other=1.0)
    w = tl.load(WTS + rm, mask=ok_m, other=0.0)
    tgt = tl.load(TGT + rm, mask=ok_m, other=-1) - COL0
    g = tl.exp2((acc - m[:, None]) * LOG2E) * (w / s)[:, None]
    g = tl.where(rn[None, :] == tgt[:, None], g - w[:, None], g)
    g_ptr = G + rm[:, None].to(tl.int64) * stride_g + rn[None, :]
    tl.store(g_ptr, g.to(G.dtype.element_ty), mask=ok_m[:, None] & ok_n[None, :])
