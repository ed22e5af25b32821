"""Triton source of the kernels wrapped by :mod:`megatron_burst.kernels.triton_block_sparse` (imports triton).

Plain functions: triton_block_sparse applies ``triton.jit`` on first use, to the kernels and to the
helpers they call by global name (``_chunk_kv``, ``_chunk_seen``: bound here per interpreter mode). See that module for the
packed plan, the grid and the precision policy.

The kernels share one column walk: the tile's key columns ``COLS[COL_START[t]:COL_END[t]]`` in
chunks of BLOCK_N, the visibility bits of the chunk read from the tile's bitmask (head h's rows
from word VIS_START[t] + h * VIS_HEAD[t], VIS_WORDS[t] int32 words per row, bit c % 32 of word
c // 32 for the tile's c-th column), the chunk's K/V rows gathered by column index. A tile's
columns are the union over heads: the forward and dq programs walk only their head's chunks, from
a list per (tile, head) (CHUNKS [T, HQ, max_chunks], N_CHUNKS [T, HQ]: triton_block_sparse.
chunk_lists), so their loops hold no test and stay software-pipelined; the dk/dv program (all
heads of a kv head) walks the chunks some head of its group sees (a list per (tile, kv head)) and
tests each head's bits per chunk, skipping a head that sees none of it (that test, and the head
loop inside, keep its loop unpipelined).

* ``sparse_fwd_kernel`` and ``sparse_bwd_dq_kernel``: one program per (batch * query head, tile);
* ``sparse_bwd_dkdv_kernel``: one program per (batch * kv head, tile); per chunk it sums the
  dK/dV of the GROUP query heads sharing the kv head in registers and adds them with one
  ``tl.atomic_add`` (GROUP times fewer atomics than a per-query-head program).

``LOWP`` (16-bit inputs on the GPU): the products with a computed operand (P.V, P^T.dO, dS.K,
dS^T.Q) take P and dS rounded to the input dtype, FlashAttention's choice (fp32 accumulation);
otherwise every product runs on the fp32 operands at ``PRECISION``.
"""
from __future__ import annotations

import triton.language as tl


def _chunk_kv(CHUNK_LIST, i, c_start, c_end, COLS, k_base, v_base, sks, skd, svs, svd, offs_d, d_ok, offs_dv, dv_ok,
              BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    """The i-th listed column chunk of a tile: (its columns [BLOCK_N] as offsets into COLS, which of
    them exist, their key indices, K rows [BLOCK_N, BLOCK_D], V rows [BLOCK_N, BLOCK_DV]) gathered
    by key index from k_base / v_base (this batch and kv head)."""
    offs_c = c_start + tl.load(CHUNK_LIST + i).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = offs_c < c_end
    cols = tl.load(COLS + offs_c, mask=c_ok, other=0).to(tl.int64)
    k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :] * skd, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_base + cols[:, None] * svs + offs_dv[None, :] * svd, mask=c_ok[:, None] & dv_ok[None, :], other=0.0)
    if WIDEN:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return offs_c, c_ok, cols, k, v


def _chunk_seen(vis_row, offs_c, c_start, c_ok, row_ok):
    """[BLOCK_M, BLOCK_N] bool: the head's rows (bitmask words from vis_row, one per row) see the
    chunk's columns: bit c % 32 of word c // 32 for the tile's c-th column."""
    local = offs_c - c_start
    words = tl.load(vis_row[:, None] + (local // 32)[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0)
    return ((words >> (local % 32)[None, :]) & 1) != 0


def sparse_fwd_kernel(Q, K, V, OUT, LSE,
                      TILE_Q0, TILE_Q1, COL_START, COL_END, COLS, VIS_START, VIS_HEAD, VIS_WORDS, VIS,
                      CHUNKS, N_CHUNKS, max_chunks, scale, HQ, GROUP, D, DV,
                      sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                      sob, soh, sos, slb, slh,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr,
                      LOWP: tl.constexpr):
    """Online softmax over the tile's visible columns: OUT rows (fp32, 0 if nothing seen), LSE (-inf)."""
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP
    q0 = tl.load(TILE_Q0 + tile)
    tq = tl.load(TILE_Q1 + tile) - q0
    c_start = tl.load(COL_START + tile)
    c_end = tl.load(COL_END + tile)
    n_words = tl.load(VIS_WORDS + tile)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < tq
    rows = (q0 + offs_m).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    # first word of each row's bitmask (int64: the packed masks of a long plan pass 2**31 words)
    vis_row = VIS + tl.load(VIS_START + tile) + h * tl.load(VIS_HEAD + tile) + offs_m.to(tl.int64) * n_words
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # this head's chunks of the tile (chunk_lists): others' columns are never walked, and no test
    # inside the loop keeps it software-pipelined
    at = (tile * HQ + h).to(tl.int64)
    for i in range(0, tl.load(N_CHUNKS + at)):
        offs_c, c_ok, cols, k, v = _chunk_kv(CHUNKS + at * max_chunks, i, c_start, c_end, COLS, K + b * skb + hk * skh,
                                             V + b * svb + hk * svh, sks, skd, svs, svd, offs_d, d_ok, offs_dv, dv_ok,
                                             BLOCK_N, WIDEN)
        seen = _chunk_seen(vis_row, offs_c, c_start, c_ok, row_ok)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with nothing seen yet keep m = -inf; shift them by 0 so that exp gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if LOWP:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        else:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    seen_any = l_i > 0.0
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    lse = tl.where(seen_any, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(tl.where(seen_any, l_i, 1.0)),
                   float("-inf"))
    tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + offs_dv[None, :], out,
             mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + b * slb + h * slh + rows, lse, mask=row_ok)


def sparse_bwd_dq_kernel(Q, K, V, DO, DELTA, LSE, DQ,
                         TILE_Q0, TILE_Q1, COL_START, COL_END, COLS, VIS_START, VIS_HEAD, VIS_WORDS, VIS,
                         CHUNKS, N_CHUNKS, max_chunks, scale, HQ, GROUP, D, DV,
                         sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                         sdob, sdoh, sdos, sdod, slb, slh, sdqb, sdqh, sdqs,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr,
                         LOWP: tl.constexpr):
    """DQ rows of a (batch * query head, tile): P = vis * exp(s - lse) recomputed per column chunk,
    dS = P * (dO.V^T - delta), DQ = scale * dS.K, stored once (tiles' rows are disjoint: no atomics).
    DELTA and LSE share strides (both [b, hq, sq] fp32)."""
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP
    q0 = tl.load(TILE_Q0 + tile)
    tq = tl.load(TILE_Q1 + tile) - q0
    c_start = tl.load(COL_START + tile)
    c_end = tl.load(COL_END + tile)
    n_words = tl.load(VIS_WORDS + tile)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < tq
    rows = (q0 + offs_m).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + offs_dv[None, :] * sdod,
                 mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + b * slb + h * slh + rows, mask=row_ok, other=float("-inf"))
    delta = tl.load(DELTA + b * slb + h * slh + rows, mask=row_ok, other=0.0)
    # a row with lse = -inf saw nothing: P = 0 there (its exp would be +inf)
    row_live = lse > float("-inf")
    lse = tl.where(row_live, lse, 0.0)
    vis_row = VIS + tl.load(VIS_START + tile) + h * tl.load(VIS_HEAD + tile) + offs_m.to(tl.int64) * n_words
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    at = (tile * HQ + h).to(tl.int64)  # this head's chunks of the tile, as in the forward
    for i in range(0, tl.load(N_CHUNKS + at)):
        offs_c, c_ok, cols, k, v = _chunk_kv(CHUNKS + at * max_chunks, i, c_start, c_end, COLS, K + b * skb + hk * skh,
                                             V + b * svb + hk * svh, sks, skd, svs, svd, offs_d, d_ok, offs_dv, dv_ok,
                                             BLOCK_N, WIDEN)
        seen = _chunk_seen(vis_row, offs_c, c_start, c_ok, row_ok) & row_live[:, None]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if LOWP:
            dq = tl.dot(ds.to(k.dtype), k, dq)
        else:
            dq = tl.dot(ds, k.to(tl.float32), dq, input_precision=PRECISION)
    tl.store(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + offs_d[None, :], dq * scale,
             mask=row_ok[:, None] & d_ok[None, :])


def sparse_bwd_dkdv_kernel(Q, K, V, DO, DELTA, LSE, DK, DV_,
                           TILE_Q0, TILE_Q1, COL_START, COL_END, COLS, VIS_START, VIS_HEAD, VIS_WORDS, VIS,
                           CHUNKS, N_CHUNKS, max_chunks, scale, HKV, GROUP, D, DV,
                           sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                           sdob, sdoh, sdos, sdod, slb, slh, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr,
                           LOWP: tl.constexpr):
    """DK/DV of a (batch * kv head, tile): per column chunk, the GROUP query heads of the kv head
    recompute P and dS over the tile's rows and their dK = scale * dS^T.Q, dV = P^T.dO are summed
    in registers, then added to the fp32 [b, hkv, sk, *] buffers with one atomic add (columns
    repeat across tiles). The query heads' rows are re-read per chunk (cache hits: one tile)."""
    pid_bk = tl.program_id(0)
    tile = tl.program_id(1)
    b = (pid_bk // HKV).to(tl.int64)
    hk = pid_bk % HKV
    q0 = tl.load(TILE_Q0 + tile)
    tq = tl.load(TILE_Q1 + tile) - q0
    c_start = tl.load(COL_START + tile)
    c_end = tl.load(COL_END + tile)
    n_words = tl.load(VIS_WORDS + tile)
    vis_tile = VIS + tl.load(VIS_START + tile)
    vis_head = tl.load(VIS_HEAD + tile)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < tq
    rows = (q0 + offs_m).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    # the chunks some query head of this kv head sees (chunk_lists per kv head). The head loop stays a
    # runtime loop: unrolled (GROUP a constexpr) it spills registers and still leaves the chunk loop
    # unpipelined, as each head's products sit under its own test
    at = (tile * HKV + hk).to(tl.int64)
    for i in range(0, tl.load(N_CHUNKS + at)):
        offs_c, c_ok, cols, k, v = _chunk_kv(CHUNKS + at * max_chunks, i, c_start, c_end, COLS, K + b * skb + hk * skh,
                                             V + b * svb + hk * svh, sks, skd, svs, svd, offs_d, d_ok, offs_dv, dv_ok,
                                             BLOCK_N, WIDEN)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        for g in range(0, GROUP):
            h = hk * GROUP + g
            vis_row = vis_tile + h * vis_head + offs_m.to(tl.int64) * n_words
            lse = tl.load(LSE + b * slb + h * slh + rows, mask=row_ok, other=float("-inf"))
            row_live = lse > float("-inf")
            seen = _chunk_seen(vis_row, offs_c, c_start, c_ok, row_ok) & row_live[:, None]
            if tl.max(tl.max(seen.to(tl.int32), axis=1), axis=0) > 0:  # else this head sees none of the chunk
                q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :] * sqd,
                            mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + offs_dv[None, :] * sdod,
                             mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
                if WIDEN:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                delta = tl.load(DELTA + b * slb + h * slh + rows, mask=row_ok, other=0.0)
                lse = tl.where(row_live, lse, 0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                if LOWP:
                    dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)
                    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
                else:
                    dv = tl.dot(tl.trans(p), do.to(tl.float32), dv, input_precision=PRECISION)
                    dk = tl.dot(tl.trans(ds), q.to(tl.float32), dk, input_precision=PRECISION)
        # some head of the group sees the chunk (it is on the list)
        tl.atomic_add(DK + b * sdkb + hk * sdkh + cols[:, None] * sdks + offs_d[None, :], dk * scale,
                      mask=c_ok[:, None] & d_ok[None, :])
        tl.atomic_add(DV_ + b * sdvb + hk * sdvh + cols[:, None] * sdvs + offs_dv[None, :], dv,
                      mask=c_ok[:, None] & dv_ok[None, :])
