"""Dense masked flash attention in Triton (GPU; CPU through Triton's interpreter): one forward and one
backward for every dense mask kind the engine produces, with the interface of
:mod:`megatron_burst.kernels.reference`::

    forward(q, k, v, kind, block, scale, positions) -> (out [b, hq, sq, dv] fp32, lse [b, hq, sq] fp32)
    backward(dout, q, k, v, D, lse, kind, block, scale, positions) -> (dq, dk, dv), fp32

Mask as data. Every kind compares a per-row key with a per-column key, plus an optional
document-equality test; row i sees column j iff

    qkey[i] - left <= kkey[j] <= qkey[i] + right      (a None bound is dropped)
    and qdoc[i] == kdoc[j]                             (when document ids are given)

* ``full``: no condition;
* ``causal``: keys are the indices, right = 0 (i >= j, top-left aligned, any sq x sk);
* ``block_causal``: keys are index // block, right = 0;
* ``positions``: keys are the given global positions and (left, right) the band; documents when given;
  with :class:`~megatron_burst.masks.block.HeadBands` a band per query head, optionally per-head
  column flags (``keys``) and holes (offset intervals qkey - kkey in [lo, hi] cut out of the band;
  a tile skips each hole its range of offsets misses; every tile then evaluates the mask).

The kernels get the kind as constexpr flags (where the keys come from: none, ``index // div``
computed in the kernel, or loaded from a vector; which bounds exist; documents or not) and the
bounds as scalars, so one compiled kernel per flag set serves all shapes.

Tile ranges. Keys and documents are nondecreasing along rows and along columns, so the columns
any row of a tile can see lie in one interval (bounded through the tile's first and last rows),
and the columns *every* row of the tile sees form a sub-interval. :func:`_tile_ranges` computes
both for all tiles at once on the device (``torch.searchsorted`` on the key vectors, no host
sync; CPU vectors are copied to the device once per call, int32 where they fit) as [tiles, 4] int32
``(lo, full_lo, full_hi, hi)`` in tiles of the other side. Kernels walk [lo, full_lo) and
[full_hi, hi) with the mask and [full_lo, full_hi) without computing it; tiles outside [lo, hi)
are never touched. The ranges of the index-keyed kinds (full, causal, block_causal) depend only on
the shapes and are cached.

Grids (FlashAttention-2 structure):

* forward: one program per (q tile, b * hq); online softmax in base 2 (``exp2`` with the scale
  folded into log2(e)), fp32 running max/sum/accumulator; out = acc / l, lse = ln 2 * (m + log2 l).
* dk/dv: one program per (kv tile, b * hkv): it loops over the hq / hkv query heads of its GQA
  group and, per head, over the q tiles that can see its columns, accumulating dk and dv of the
  tile in registers (no atomics; k/v are never expanded in memory).
* dq: a separate kernel, one program per (q tile, b * hq), walking the kv tiles like the forward.
  A separate pass instead of fp32 atomics: it recomputes q.k^T and dO.v^T (two more matmuls per
  visible tile) but keeps the gradients deterministic (Megatron's deterministic mode) and avoids
  atomic traffic on dq from every kv tile of every head.

Probabilities in the backward are recomputed from the given lse (and D = rowsum(dO * O) is given):
both belong to the merged attention over all blocks, so nothing is renormalized here.

Invariants: rows that see nothing get out 0 and lse -inf, and zero gradients whatever lse the
backward is given for them; a given lse of -inf (a row that sees nothing anywhere) yields P = 0. Padded rows / columns of the edge tiles are
masked on load and never written. The last, partial kv tile is never treated as fully visible in
the forward and dq kernels (softmax / dS.K must not see the padding); in the dk/dv kernel the
padded q rows get lse = +inf on load, so P = 0 there and the edge q tile may run unmasked.

Precision: fp32 inputs run every product in IEEE fp32 (``input_precision="ieee"``). 16-bit inputs
multiply q.k^T and dO.v^T in their dtype (fp32 accumulation) and round P and dS to the input dtype
for P.V, P^T.dO, dS.K and dS^T.Q (fp32 accumulation), as FlashAttention does. Mixed input dtypes
are widened to fp32 on load and run as fp32. Under the interpreter (whose ``tl.dot`` mishandles
16-bit operands) 16-bit tiles are widened to fp32 and P / dS are rounded to the input dtype in
fp32 (round to nearest even), so the CPU tests see the GPU's roundings, not its summation order.
Head dims up to 256, padded to a power of two with masks. Any strides of q, k, v and dout (a
tensor is copied only if its last dim is not unit-stride).

Triton is imported on first use: the kernel sources below are plain functions, wrapped with
``triton.jit`` by :func:`_kernels` (which also binds the ``tl`` module and the jitted helpers in
this module's globals, where the kernels look them up), so TRITON_INTERPRET=1 works when set
before the process first imports triton; see :mod:`megatron_burst.loss.triton_kernels`.
"""
from __future__ import annotations

from typing import Any, Optional

from collections import OrderedDict

import torch

from megatron_burst.kernels import torch_ops
from megatron_burst.kernels.rows import unit_last
from megatron_burst.kernels.triton_env import AVAILABLE, interpreting, unavailable  # noqa: F401  (module face)
from megatron_burst.masks.block import HeadBands

KINDS = ("full", "causal", "block_causal", "positions")
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# GPU launch configs per (kernel, head-dim bucket, input bits): (BLOCK_M, BLOCK_N, warps, stages);
# BLOCK_M tiles the q rows and BLOCK_N the kv rows in every kernel (the dk/dv kernel's own tile is
# BLOCK_N kv rows, it walks q tiles of BLOCK_M). NOT timed on a GPU yet: each is the largest
# FlashAttention-2-like shape among a few candidates that compiles for sm_90 (Triton 3.9, with all
# mask flags on and with the causal flags) without register spills; fp32 inputs run IEEE fp32 dots
# on FMAs, which need far more registers, hence the small fp32 tiles. To re-check:
# tests/triton_masked_cases.py compile_for_gpu (registers and spill bytes from cuobjdump).
GPU_CONFIG = {
    ("forward", 64, 16): (128, 64, 8, 3), ("forward", 128, 16): (128, 64, 8, 3),
    ("forward", 256, 16): (64, 64, 8, 2),
    ("forward", 64, 32): (64, 32, 8, 2), ("forward", 128, 32): (32, 16, 4, 2),
    ("forward", 256, 32): (32, 32, 8, 1),
    ("dkdv", 64, 16): (32, 128, 8, 2), ("dkdv", 128, 16): (16, 128, 8, 2),
    ("dkdv", 256, 16): (32, 32, 8, 2),
    ("dkdv", 64, 32): (32, 32, 8, 2), ("dkdv", 128, 32): (16, 64, 8, 1),
    ("dkdv", 256, 32): (16, 32, 8, 1),
    ("dq", 64, 16): (128, 64, 8, 3), ("dq", 128, 16): (128, 64, 8, 2),
    ("dq", 256, 16): (64, 32, 8, 2),
    ("dq", 64, 32): (64, 32, 8, 2), ("dq", 128, 32): (32, 16, 8, 1),
    ("dq", 256, 32): (32, 32, 8, 1),
}
# The dk/dv kernel runs one program per (kv tile, batch x kv head); a block of few keys and many
# queries (a sparse pattern's gathered vertical keys: ~1000 keys x 64K queries) would give far fewer
# programs than the GPU has SMs, each walking every q tile. Such launches split the q tiles among
# programs (grid dimension 2) until about DKDV_PROGRAMS run, each split at least DKDV_SPLIT_TILES
# q tiles; the splits write fp32 partial dk / dv that the host sums in a fixed order (deterministic).
DKDV_PROGRAMS = 512
DKDV_SPLIT_TILES = 16
# The interpreter is slow per program; small tiles keep its numpy temporaries small.
INTERPRET_BLOCK = 16
RANGE_CACHE = 256
# Position / document vectors on the CPU with values in [0, KEY_LIMIT) reach the kernels as int32
# (band bounds clamped so key +- bound fits); others (or vectors already on the GPU, which the
# host cannot inspect without a sync) as int64.
KEY_LIMIT = 1 << 30

LOG2E = 1.4426950408889634
# Mask vectors (positions, documents, per-head data) copied to the device, kept per CPU vector: the
# package's mask vectors are made once per plan and never changed in place, and the same block
# comes back every step and layer. At most VECTOR_CACHE_BYTES of device memory (oldest dropped).
VECTOR_CACHE_BYTES = 16 << 20
_DEVICE_VECTORS: "OrderedDict[tuple, tuple]" = OrderedDict()


def _on_device(t: torch.Tensor, dtype: torch.dtype, device: torch.device, prepare=None, tag: str = "") -> torch.Tensor:
    """``prepare(t)`` (default: t) flattened, as ``dtype`` on ``device``, contiguous; from a CPU vector
    ``t`` copied once per (t, dtype, device, tag) (see VECTOR_CACHE_BYTES). Pass the mask's own
    tensor as ``t`` and any derivation as ``prepare``: a temporary ``t`` would never hit."""
    def make() -> torch.Tensor:
        src = t if prepare is None else prepare(t)
        return src.reshape(-1).to(dtype).to(device, non_blocking=True).contiguous()

    if t.device.type != "cpu" or torch.device(device).type == "cpu" or torch_ops.fake_mode_active():
        return make()
    key = (id(t), dtype, str(device), tag)
    hit = _DEVICE_VECTORS.get(key)
    if hit is not None and hit[0] is t:
        _DEVICE_VECTORS.move_to_end(key)
        return hit[1]
    out = make()
    _DEVICE_VECTORS[key] = (t, out)  # holding t keeps its id from being reused while the entry lives
    total = sum(v.numel() * v.element_size() for _, v in _DEVICE_VECTORS.values())
    while total > VECTOR_CACHE_BYTES and len(_DEVICE_VECTORS) > 1:
        _, (_, old) = _DEVICE_VECTORS.popitem(last=False)
        total -= old.numel() * old.element_size()
    return out


def supports(dtype: torch.dtype, head_dim: int, kind: str) -> Optional[str]:
    """Why (dtype, head dim, kind) is out of this kernel's reach (None: supported)."""
    if dtype not in DTYPES:
        return f"fp16/bf16/fp32 only, not {dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"head dim up to {MAX_HEAD_DIM}, not {head_dim}"
    if kind not in KINDS:
        return f"mask kind {kind!r} ({', '.join(KINDS)} only)"
    return None


def supports_block(q: torch.Tensor, k: torch.Tensor, kind: str) -> bool:
    """Whether this kernel takes a block of q [b, hq, sq, d] and k [b, hkv, sk, d] with mask ``kind``."""
    return (AVAILABLE and (q.is_cuda or interpreting()) and q.dtype in DTYPES and k.dtype in DTYPES
            and kind in KINDS and q.shape[-1] <= MAX_HEAD_DIM and k.shape[-1] == q.shape[-1]
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0)


# ----------------------------------------------------------------------------------------------
# Kernel sources (plain functions; see _kernels). ``tl`` is bound by _kernels before jitting.
# ----------------------------------------------------------------------------------------------
tl: Any = None


def _ld(ptrs, rows_ok, cols_ok, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or columns only where asked (out of range: 0)."""
    if ROWS and COLS:
        x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif ROWS:
        x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif COLS:
        x = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


def _keys(KEY, idx, ok, div, POS: tl.constexpr):
    """Mask keys of rows/columns ``idx``: loaded from KEY (POS == 2) or ``idx // div`` (POS == 1)."""
    if POS == 2:
        key = tl.load(KEY + idx, mask=ok, other=0)
    else:
        key = idx // div
    return key


def _visible(qk, kk, qd, kd, left, right, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr, HAS_DOC: tl.constexpr, ok):
    """qk - left <= kk <= qk + right and qd == kd, for broadcastable row/column keys; and ``ok``."""
    vis = ok
    if POS != 0:
        if HAS_RIGHT:
            vis = vis & (kk <= qk + right)
        if HAS_LEFT:
            vis = vis & (kk >= qk - left)
    if HAS_DOC:
        vis = vis & (qd == kd)
    return vis


def _cut_holes(vis, rkey, ckey, HOLES_H, N_HOLES: tl.constexpr):
    """``vis`` without the offsets rkey - ckey (row key - column key, broadcast to the tile) inside
    this head's holes (HOLES_H: N_HOLES (lo, hi) pairs, padded with empty ones). The tile's range of
    offsets comes from the key vectors' extremes, and a hole that misses it is skipped without
    touching the tile (the common case: no [M, N] offsets held across the loop). N_HOLES is a
    constexpr and the loop unrolled: a runtime loop here would make the tile loops around it
    "outer" loops, which Triton's software pipeliner leaves unpipelined."""
    vis = vis & ((rkey - ckey) == (rkey - ckey))  # the tile's full shape (vis may be a broadcast row)
    r_min = tl.min(tl.min(rkey, axis=1), axis=0)
    r_max = tl.max(tl.max(rkey, axis=1), axis=0)
    c_min = tl.min(tl.min(ckey, axis=1), axis=0)
    c_max = tl.max(tl.max(ckey, axis=1), axis=0)
    for j in tl.static_range(N_HOLES):
        lo = tl.load(HOLES_H + 2 * j)
        hi = tl.load(HOLES_H + 2 * j + 1)
        if (lo <= r_max - c_min) & (hi >= r_min - c_max):
            vis = vis & (((rkey - ckey) < lo) | ((rkey - ckey) > hi))
    return vis


def _operand(x, dt, MODE: tl.constexpr):
    """A computed fp32 tile (P or dS) as a tl.dot operand: MODE 0 fp32, 1 cast to the 16-bit input
    dtype ``dt``, 2 / 3 rounded to bf16 / fp16 but kept in fp32 (the interpreter's emulation of 1)."""
    if MODE == 1:
        y = x.to(dt)
    elif MODE == 2:  # fp32 -> bf16, round to nearest even, on the bits (finite inputs)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16 << 16
        y = bits.to(tl.float32, bitcast=True)
    elif MODE == 3:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, KEEP, HOLES_H, div, left,
               right, SK, scale2, t_lo, t_hi,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, HAS_DOC: tl.constexpr, WIDEN: tl.constexpr, MODE: tl.constexpr,
               PRECISION: tl.constexpr, HAS_KEYS: tl.constexpr, HAS_HOLES: tl.constexpr,
               N_HOLES: tl.constexpr):
    """Online-softmax steps over kv tiles [t_lo, t_hi); MASKED evaluates the mask (and the column
    bound), else every column of every tile is visible to every row."""
    arange_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for t in range(t_lo, t_hi):
        n0 = t * BLOCK_N
        offs_n = n0 + arange_n
        n_ok = offs_n < SK
        k = _ld(k_base + n0.to(tl.int64) * sks + arange_n[:, None] * sks + offs_d[None, :], n_ok, offs_d < D,
                MASKED, BLOCK_D != D)
        v = _ld(v_base + n0.to(tl.int64) * svs + arange_n[:, None] * svs + offs_dv[None, :], n_ok, offs_dv < DV,
                MASKED, BLOCK_DV != DV)
        if WIDEN:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        if MASKED:
            ck = _keys(KKEY, offs_n, n_ok, div, POS)
            cd = rd
            if HAS_DOC:
                cd = tl.load(KDOC + offs_n, mask=n_ok, other=-1)[None, :]
            vis = _visible(rk, ck[None, :], rd, cd, left, right, POS, HAS_LEFT, HAS_RIGHT, HAS_DOC, n_ok[None, :])
            if HAS_KEYS:  # this head's own columns of the block
                vis = vis & (tl.load(KEEP + offs_n, mask=n_ok, other=0) != 0)[None, :]
            if HAS_HOLES:
                vis = _cut_holes(vis, rk, ck[None, :], HOLES_H, N_HOLES)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row with nothing seen yet keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(_operand(p, v.dtype, MODE), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


def _head_ranges(HBAND, RANGES, pid, h, HQ, left, right, PER_HEAD: tl.constexpr, HAS_KEYS: tl.constexpr,
                 HAS_HOLES: tl.constexpr):
    """(left, right, t_lo, f_lo, f_hi, t_hi) of head ``h`` in the program of tile ``pid``: the band
    and tile ranges per head (HBAND [HQ, 2] bounds, RANGES [tiles, HQ, 4]) or the block's (scalars,
    RANGES [tiles, 4]). With per-head column flags (HAS_KEYS) or holes (HAS_HOLES) no tile is known
    to be visible entire: the unmasked middle range is empty, every tile masked."""
    if PER_HEAD:
        left = tl.load(HBAND + h * 2)
        right = tl.load(HBAND + h * 2 + 1)
        at = RANGES + (pid * HQ + h) * 4
    else:
        at = RANGES + pid * 4
    t_lo = tl.load(at)
    f_lo = tl.load(at + 1)
    f_hi = tl.load(at + 2)
    t_hi = tl.load(at + 3)
    if HAS_KEYS:
        f_lo = t_hi
        f_hi = t_hi
    if HAS_HOLES:
        f_lo = t_hi
        f_hi = t_hi
    return left, right, t_lo, f_lo, f_hi, t_hi


def masked_fwd_kernel(Q, K, V, OUT, LSE, RANGES, QKEY, KKEY, QDOC, KDOC, HBAND, HKEYS, HHOLES,
                      scale2, left, right, div, HQ, GROUP, SQ, SK,
                      sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, slb, slh,
                      D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, POS: tl.constexpr,
                      HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DOC: tl.constexpr,
                      WIDEN: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, PER_HEAD: tl.constexpr,
                      HAS_KEYS: tl.constexpr, HAS_HOLES: tl.constexpr, N_HOLES: tl.constexpr):
    """One (q tile, b * hq) program: OUT rows (fp32, 0 where nothing is seen) and LSE (natural log, -inf)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < SQ
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _ld(Q + b * sqb + h * sqh + offs_m.to(tl.int64)[:, None] * sqs + offs_d[None, :], m_ok, offs_d < D,
            True, BLOCK_D != D)
    if WIDEN:
        q = q.to(tl.float32)
    rk = _keys(QKEY, offs_m, m_ok, div, POS)[:, None]
    rd = rk
    if HAS_DOC:
        rd = tl.load(QDOC + offs_m, mask=m_ok, other=-1)[:, None]
    left, right, t_lo, f_lo, f_hi, t_hi = _head_ranges(HBAND, RANGES, pid_m, h, HQ, left, right, PER_HEAD, HAS_KEYS,
                                                       HAS_HOLES)
    keep = HKEYS + h * SK  # this head's column flags (HAS_KEYS)
    holes = HHOLES + h * N_HOLES * 2  # this head's holes (HAS_HOLES)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, keep, holes,
                               div, left, right, SK, scale2, t_lo, f_lo, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, POS,
                               HAS_LEFT, HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS, HAS_HOLES, N_HOLES)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, keep, holes,
                               div, left, right, SK, scale2, f_lo, f_hi, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, POS,
                               HAS_LEFT, HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS, HAS_HOLES, N_HOLES)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, keep, holes,
                               div, left, right, SK, scale2, f_hi, t_hi, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, POS,
                               HAS_LEFT, HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS, HAS_HOLES, N_HOLES)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(OUT + b * sob + h * soh + offs_m.to(tl.int64)[:, None] * sos + offs_dv[None, :], out,
             mask=m_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(LSE + b * slb + h * slh + offs_m, lse, mask=m_ok)


def _row_stats(LSE_ROW, DELTA_ROW, offs, ok):
    """(lse in base 2, D) of rows ``offs``; rows out of range or with lse = -inf get +inf, so P = 0."""
    lse = tl.load(LSE_ROW + offs, mask=ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA_ROW + offs, mask=ok, other=0.0)
    return lse, delta


def _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, KEEP, HOLES_H, div,
              left, right, SK, scale2, t_lo, t_hi,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, HAS_DOC: tl.constexpr, WIDEN: tl.constexpr, MODE: tl.constexpr,
              PRECISION: tl.constexpr, HAS_KEYS: tl.constexpr, HAS_HOLES: tl.constexpr,
               N_HOLES: tl.constexpr):
    """dq += dS.K over kv tiles [t_lo, t_hi) (unscaled), P recomputed from the given lse."""
    arange_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for t in range(t_lo, t_hi):
        n0 = t * BLOCK_N
        offs_n = n0 + arange_n
        n_ok = offs_n < SK
        k = _ld(k_base + n0.to(tl.int64) * sks + arange_n[:, None] * sks + offs_d[None, :], n_ok, offs_d < D,
                MASKED, BLOCK_D != D)
        v = _ld(v_base + n0.to(tl.int64) * svs + arange_n[:, None] * svs + offs_dv[None, :], n_ok, offs_dv < DV,
                MASKED, BLOCK_DV != DV)
        if WIDEN:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            ck = _keys(KKEY, offs_n, n_ok, div, POS)
            cd = rd
            if HAS_DOC:
                cd = tl.load(KDOC + offs_n, mask=n_ok, other=-1)[None, :]
            vis = _visible(rk, ck[None, :], rd, cd, left, right, POS, HAS_LEFT, HAS_RIGHT, HAS_DOC, n_ok[None, :])
            if HAS_KEYS:
                vis = vis & (tl.load(KEEP + offs_n, mask=n_ok, other=0) != 0)[None, :]
            if HAS_HOLES:
                vis = _cut_holes(vis, rk, ck[None, :], HOLES_H, N_HOLES)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(_operand(ds, k.dtype, MODE), k, dq, input_precision=PRECISION)
    return dq


def masked_bwd_dq_kernel(Q, K, V, DO, DELTA, LSE, DQ, RANGES, QKEY, KKEY, QDOC, KDOC, HBAND, HKEYS, HHOLES,
                         scale, scale2, left, right, div, HQ, GROUP, SQ, SK,
                         sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos,
                         sDb, sDh, slb, slh, sdqb, sdqh, sdqs,
                         D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, POS: tl.constexpr,
                         HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DOC: tl.constexpr,
                         WIDEN: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, PER_HEAD: tl.constexpr,
                         HAS_KEYS: tl.constexpr, HAS_HOLES: tl.constexpr, N_HOLES: tl.constexpr):
    """One (q tile, b * hq) program: DQ rows (fp32) = scale * sum over visible kv tiles of dS.K."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < SQ
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m.to(tl.int64)[:, None]
    q = _ld(Q + b * sqb + h * sqh + rows * sqs + offs_d[None, :], m_ok, offs_d < D, True, BLOCK_D != D)
    do = _ld(DO + b * sdob + h * sdoh + rows * sdos + offs_dv[None, :], m_ok, offs_dv < DV, True, BLOCK_DV != DV)
    if WIDEN:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2, delta = _row_stats(LSE + b * slb + h * slh, DELTA + b * sDb + h * sDh, offs_m, m_ok)
    rk = _keys(QKEY, offs_m, m_ok, div, POS)[:, None]
    rd = rk
    if HAS_DOC:
        rd = tl.load(QDOC + offs_m, mask=m_ok, other=-1)[:, None]
    left, right, t_lo, f_lo, f_hi, t_hi = _head_ranges(HBAND, RANGES, pid_m, h, HQ, left, right, PER_HEAD, HAS_KEYS,
                                                       HAS_HOLES)
    keep = HKEYS + h * SK  # this head's column flags (HAS_KEYS)
    holes = HHOLES + h * N_HOLES * 2  # this head's holes (HAS_HOLES)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, keep, holes, div,
                   left, right, SK, scale2, t_lo, f_lo, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, POS, HAS_LEFT,
                   HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS, HAS_HOLES, N_HOLES)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, keep, holes, div,
                   left, right, SK, scale2, f_lo, f_hi, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, POS, HAS_LEFT,
                   HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS, HAS_HOLES, N_HOLES)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, sks, svs, rk, rd, KKEY, KDOC, keep, holes, div,
                   left, right, SK, scale2, f_hi, t_hi, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, POS, HAS_LEFT,
                   HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS, HAS_HOLES, N_HOLES)
    tl.store(DQ + b * sdqb + h * sdqh + rows * sdqs + offs_d[None, :], dq * scale,
             mask=m_ok[:, None] & (offs_d < D)[None, :])


def _dkdv_tiles(dk, dv, k, v, ck, cd, q_base, do_base, LSE_ROW, DELTA_ROW, sqs, sdos, QKEY, QDOC, keep_col,
                HOLES_H, div, left, right, SQ, scale2, t_lo, t_hi,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, HAS_DOC: tl.constexpr, WIDEN: tl.constexpr, MODE: tl.constexpr,
                PRECISION: tl.constexpr, HAS_KEYS: tl.constexpr, HAS_HOLES: tl.constexpr,
               N_HOLES: tl.constexpr):
    """dv += P^T.dO and dk += dS^T.Q (unscaled) over q tiles [t_lo, t_hi) of one query head, in the
    transposed orientation ([kv rows, q rows]) so both products take the kv tile as rows."""
    arange_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for t in range(t_lo, t_hi):
        m0 = t * BLOCK_M
        offs_m = m0 + arange_m
        m_ok = offs_m < SQ  # the edge q tile may be partial even when unmasked: its rows get P = 0
        q = _ld(q_base + m0.to(tl.int64) * sqs + arange_m[:, None] * sqs + offs_d[None, :], m_ok, offs_d < D,
                True, BLOCK_D != D)
        do = _ld(do_base + m0.to(tl.int64) * sdos + arange_m[:, None] * sdos + offs_dv[None, :], m_ok,
                 offs_dv < DV, True, BLOCK_DV != DV)
        if WIDEN:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2, delta = _row_stats(LSE_ROW, DELTA_ROW, offs_m, m_ok)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale2
        p_t = tl.exp2(s_t - lse2[None, :])
        if MASKED:
            rk = _keys(QKEY, offs_m, m_ok, div, POS)
            rd = cd
            if HAS_DOC:
                rd = tl.load(QDOC + offs_m, mask=m_ok, other=-1)[None, :]
            vis = _visible(rk[None, :], ck, rd, cd, left, right, POS, HAS_LEFT, HAS_RIGHT, HAS_DOC, m_ok[None, :])
            if HAS_KEYS:
                vis = vis & keep_col
            if HAS_HOLES:
                vis = _cut_holes(vis, rk[None, :], ck, HOLES_H, N_HOLES)
            p_t = tl.where(vis, p_t, 0.0)
        dv = tl.dot(_operand(p_t, do.dtype, MODE), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(_operand(ds_t, q.dtype, MODE), q, dk, input_precision=PRECISION)
    return dk, dv


def masked_bwd_dkdv_kernel(Q, K, V, DO, DELTA, LSE, DK, DV_, RANGES, QKEY, KKEY, QDOC, KDOC, HBAND, HKEYS, HHOLES,
                           scale, scale2, left, right, div, HKV, GROUP, SQ, SK, SPLIT_TILES, sdk_split, sdv_split,
                           sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos,
                           sDb, sDh, slb, slh, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                           D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, POS: tl.constexpr,
                           HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DOC: tl.constexpr,
                           WIDEN: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, PER_HEAD: tl.constexpr,
                           HAS_KEYS: tl.constexpr, HAS_HOLES: tl.constexpr, N_HOLES: tl.constexpr):
    """One (kv tile, b * hkv, q split) program: DK (fp32, scaled) and DV rows of the tile, summed over
    the GROUP query heads of its kv head and the q tiles of its split (q tiles [s * SPLIT_TILES,
    (s + 1) * SPLIT_TILES)) that can see it, in registers; split s writes its own slice of DK / DV_
    (strides sdk_split, sdv_split), which the host sums."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    split = tl.program_id(2)
    s_lo = split * SPLIT_TILES
    s_hi = s_lo + SPLIT_TILES
    b = (bhk // HKV).to(tl.int64)
    hk = (bhk % HKV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < SK
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = offs_n.to(tl.int64)[:, None]
    k = _ld(K + b * skb + hk * skh + cols * sks + offs_d[None, :], n_ok, offs_d < D, True, BLOCK_D != D)
    v = _ld(V + b * svb + hk * svh + cols * svs + offs_dv[None, :], n_ok, offs_dv < DV, True, BLOCK_DV != DV)
    if WIDEN:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    ck = _keys(KKEY, offs_n, n_ok, div, POS)[:, None]
    cd = ck
    if HAS_DOC:
        cd = tl.load(KDOC + offs_n, mask=n_ok, other=-1)[:, None]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        left_h, right_h, t_lo, f_lo, f_hi, t_hi = _head_ranges(HBAND, RANGES, pid_n, h, HKV * GROUP, left, right,
                                                               PER_HEAD, HAS_KEYS, HAS_HOLES)
        holes = HHOLES + h * N_HOLES * 2  # this head's holes (HAS_HOLES)
        # this split's part of the three ranges (masked, full, masked): each clamped to [s_lo, s_hi)
        t_lo = tl.minimum(tl.maximum(t_lo, s_lo), s_hi)
        f_lo = tl.minimum(tl.maximum(f_lo, s_lo), s_hi)
        f_hi = tl.minimum(tl.maximum(f_hi, s_lo), s_hi)
        t_hi = tl.minimum(tl.maximum(t_hi, s_lo), s_hi)
        keep_col = n_ok[:, None]
        if HAS_KEYS:  # this head's own columns of the tile
            keep_col = (tl.load(HKEYS + h * SK + offs_n, mask=n_ok, other=0) != 0)[:, None]
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        lse_row = LSE + b * slb + h * slh
        delta_row = DELTA + b * sDb + h * sDh
        dk, dv = _dkdv_tiles(dk, dv, k, v, ck, cd, q_base, do_base, lse_row, delta_row, sqs, sdos, QKEY, QDOC, keep_col,
                             holes, div, left_h, right_h, SQ, scale2, t_lo, f_lo, D, DV, BLOCK_M, BLOCK_D,
                             BLOCK_DV, True, POS, HAS_LEFT, HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS,
                             HAS_HOLES, N_HOLES)
        dk, dv = _dkdv_tiles(dk, dv, k, v, ck, cd, q_base, do_base, lse_row, delta_row, sqs, sdos, QKEY, QDOC, keep_col,
                             holes, div, left_h, right_h, SQ, scale2, f_lo, f_hi, D, DV, BLOCK_M, BLOCK_D,
                             BLOCK_DV, False, POS, HAS_LEFT, HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS,
                             HAS_HOLES, N_HOLES)
        dk, dv = _dkdv_tiles(dk, dv, k, v, ck, cd, q_base, do_base, lse_row, delta_row, sqs, sdos, QKEY, QDOC, keep_col,
                             holes, div, left_h, right_h, SQ, scale2, f_hi, t_hi, D, DV, BLOCK_M, BLOCK_D,
                             BLOCK_DV, True, POS, HAS_LEFT, HAS_RIGHT, HAS_DOC, WIDEN, MODE, PRECISION, HAS_KEYS,
                             HAS_HOLES, N_HOLES)
    tl.store(DK + split.to(tl.int64) * sdk_split + b * sdkb + hk * sdkh + cols * sdks + offs_d[None, :], dk * scale,
             mask=n_ok[:, None] & (offs_d < D)[None, :])
    tl.store(DV_ + split.to(tl.int64) * sdv_split + b * sdvb + hk * sdvh + cols * sdvs + offs_dv[None, :], dv,
             mask=n_ok[:, None] & (offs_dv < DV)[None, :])


_HELPERS = ("_ld", "_keys", "_visible", "_cut_holes", "_operand", "_row_stats", "_head_ranges", "_fwd_tiles", "_dq_tiles",
            "_dkdv_tiles")
_KERNELS = ("masked_fwd_kernel", "masked_bwd_dq_kernel", "masked_bwd_dkdv_kernel")
_SOURCES = {name: globals()[name] for name in _HELPERS + _KERNELS}
_jitted: dict[bool, dict[str, Any]] = {}


def _kernels() -> dict[str, Any]:
    """The jitted kernels for the current mode (compiled or interpreted), by name.

    Binds ``tl`` and the jitted helpers of that mode in this module's globals: the kernels call the
    helpers by their global names, which Triton resolves when it compiles (or interprets) them.
    """
    if not AVAILABLE:
        raise RuntimeError("the triton masked attention kernel needs the triton package: pip install triton")
    import triton
    import triton.language

    mode = interpreting()
    if mode not in _jitted:
        _jitted[mode] = {name: triton.jit(fn) for name, fn in _SOURCES.items()}
    g = globals()
    g["tl"] = triton.language
    g.update({name: _jitted[mode][name] for name in _HELPERS})
    return _jitted[mode]


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _bucket(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def launch_options(kernel: str, dtypes: set, d: int, dv: int, interpret: bool) -> dict:
    """Compile-time options of a launch: ``kernel`` "forward", "dq" or "dkdv", ``dtypes`` the input
    tensors' dtypes, head dims ``d`` (q, k) and ``dv`` (v). Includes num_warps and num_stages."""
    mixed = len(dtypes) > 1
    bits = 32 if mixed or dtypes == {torch.float32} else 16
    block_m, block_n, warps, stages = GPU_CONFIG[(kernel, _bucket(max(d, dv)), bits)]
    if interpret:
        block_m = block_n = INTERPRET_BLOCK
    if bits == 32:
        mode, widen = 0, mixed
    elif interpret:  # the interpreter's tl.dot mishandles 16-bit operands: fp32 tiles, emulated roundings
        mode, widen = (2 if dtypes == {torch.bfloat16} else 3), True
    else:
        mode, widen = 1, False
    return dict(D=d, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), WIDEN=widen,
                MODE=mode, PRECISION="ieee" if bits == 32 or interpret else "tf32", num_warps=warps,
                num_stages=stages)


class _Mask:
    """A mask kind as kernel data: ``pos`` 0 (no key condition), 1 (keys = index // div) or 2 (keys
    loaded), the key and document vectors on the device (``key_dtype``: int32 where they fit, see
    KEY_LIMIT; or None), and the band bounds (or None)."""

    def __init__(self, kind: str, block: int, positions: Optional[tuple], sq: int, sk: int, device: torch.device):
        self.div, self.qkey, self.kkey, self.qdoc, self.kdoc = 1, None, None, None, None
        self.head_bounds: Optional[torch.Tensor] = None  # [hq * 2] (left, right) per head (HeadBands)
        self.head_keys: Optional[torch.Tensor] = None  # [hq * sk] int8: each head's own columns (HeadBands.keys)
        self.head_holes: Optional[torch.Tensor] = None  # [hq * n * 2] each head's excluded offsets (HeadBands.holes)
        self.n_holes = 0  # holes per head, padded to a power of two (a constexpr: few compiled variants)
        self.left: Optional[int] = None
        self.right: Optional[int] = None
        self.pos = 0
        self.key_dtype = torch.int32
        if kind == "full":
            return
        if kind in ("causal", "block_causal"):
            self.pos, self.right = 1, 0
            self.div = 1 if kind == "causal" else int(block)
            if self.div < 1:
                raise ValueError(f"block_causal needs block >= 1, got {block}")
            return
        if kind != "positions":
            raise ValueError(f"the triton masked kernel takes kinds {', '.join(KINDS)}; got {kind!r}")
        if positions is None:
            raise ValueError("kind 'positions' needs positions=(q_pos, kv_pos, q_doc, kv_doc, band)")
        q_pos, kv_pos, q_doc, kv_doc, band = positions
        per_head = isinstance(band, HeadBands)
        if per_head and q_pos is None:
            raise ValueError("positions: per-head bands (HeadBands) need q_pos and kv_pos")
        if (q_pos is None) != (kv_pos is None) or (q_doc is None) != (kv_doc is None):
            raise ValueError("positions: q_pos/kv_pos and q_doc/kv_doc must be given in pairs (or both None)")
        given = [(t, n, what) for t, n, what in ((q_pos, sq, "q_pos"), (kv_pos, sk, "kv_pos"), (q_doc, sq, "q_doc"),
                                                 (kv_doc, sk, "kv_doc")) if t is not None]
        for t, n, what in given:
            if t.dim() != 1 or t.numel() != n:
                raise ValueError(f"positions: {what} has shape {tuple(t.shape)}; expected [{n}]")
        # int32 keys in the kernels when the host can see that they fit (fewer registers than int64)
        small = all(t.device.type == "cpu" and (t.numel() == 0 or (int(t.min()) >= 0 and int(t.max()) < KEY_LIMIT))
                    for t, _, _ in given)
        self.key_dtype = torch.int32 if small else torch.int64
        on = lambda t: _on_device(t, self.key_dtype, device)  # noqa: E731
        if per_head:  # both bounds per head; the envelope passes as the scalars (unused by the kernels)
            self.pos = 2
            self.qkey, self.kkey = on(q_pos), on(kv_pos)
            self.left, self.right = (self._bound(int(x), small) for x in band.envelope)
            limit = KEY_LIMIT if small else 1 << 62
            self.head_bounds = _on_device(band.bounds, self.key_dtype, device, lambda b: b.clamp(-limit, limit - 1),
                                          f"clamp{limit}")
            if band.keys is not None:
                if tuple(band.keys.shape) != (band.heads, sk):
                    raise ValueError(f"positions: HeadBands.keys has shape {tuple(band.keys.shape)}; expected "
                                     f"[{band.heads}, {sk}] (heads, the block's columns)")
                self.head_keys = _on_device(band.keys, torch.int8, device)
            if band.holes is not None:
                if band.holes.dim() != 3 or band.holes.shape[0] != band.heads or band.holes.shape[2] != 2:
                    raise ValueError(f"positions: HeadBands.holes has shape {tuple(band.holes.shape)}; expected "
                                     f"[{band.heads}, n, 2] (heads, holes, (lo, hi))")
                if band.holes.shape[1]:
                    n = int(band.holes.shape[1])
                    self.n_holes = width = 1 << (n - 1).bit_length()

                    def padded(holes: torch.Tensor) -> torch.Tensor:  # empty holes (lo > hi) up to width
                        pad = torch.tensor([1, 0], dtype=holes.dtype).expand(band.heads, width - n, 2)
                        return torch.cat([holes.clamp(-limit, limit - 1), pad], 1)

                    self.head_holes = _on_device(band.holes, self.key_dtype, device, padded, f"holes{limit}")
        elif q_pos is not None and (band[0] is not None or band[1] is not None):
            self.pos = 2
            self.qkey, self.kkey = on(q_pos), on(kv_pos)
            self.left, self.right = (None if x is None else self._bound(int(x), small) for x in band)
        if q_doc is not None:
            self.qdoc, self.kdoc = on(q_doc), on(kv_doc)

    def check_heads(self, hq: int) -> None:
        """Per-head mask data must cover exactly the call's ``hq`` query heads (the kernels index it by head)."""
        if self.head_bounds is not None and self.head_bounds.numel() != 2 * hq:
            raise ValueError(f"positions: HeadBands has {self.head_bounds.numel() // 2} heads but q has {hq} "
                             "query heads (one band per query head)")

    @staticmethod
    def _bound(x: int, small: bool) -> Optional[int]:
        """A band bound for keys in [0, KEY_LIMIT) (``small``): any bound >= KEY_LIMIT is no bound, and
        one <= -KEY_LIMIT excludes as much as -KEY_LIMIT does, so key + bound stays within int32."""
        if not small:
            return x
        return None if x >= KEY_LIMIT else max(x, -KEY_LIMIT)

    @property
    def has_doc(self) -> bool:
        return self.qdoc is not None

    def flags(self) -> dict:
        return dict(POS=self.pos, HAS_LEFT=self.left is not None, HAS_RIGHT=self.right is not None,
                    HAS_DOC=self.has_doc, PER_HEAD=self.head_bounds is not None, HAS_KEYS=self.head_keys is not None,
                    HAS_HOLES=self.head_holes is not None, N_HOLES=max(self.n_holes, 1))

    def ranges(self, outer: str, n_outer: int, n_inner: int, tile_outer: int, tile_inner: int,
               partial_ok: bool, device: torch.device) -> torch.Tensor:
        """[cdiv(n_outer, tile_outer), 4] int32 tile ranges (see :func:`_tile_ranges`); ``outer`` "q"
        (tiles of q rows over kv tiles) or "kv" (tiles of kv rows over q tiles)."""
        q_side = outer == "q"
        lo_off, hi_off = (self.left, self.right) if q_side else (self.right, self.left)
        if self.head_bounds is not None:  # [tiles, hq, 4]: each head's own ranges
            left, right = self.head_bounds.view(-1, 2).long().unbind(1)
            lo_off, hi_off = (left, right) if q_side else (right, left)
        if self.pos != 2 and not self.has_doc:  # depends on the shapes only: cached
            key = (outer, self.pos, self.div, lo_off, hi_off, n_outer, n_inner, tile_outer, tile_inner, partial_ok,
                   device)
            hit = _range_cache.get(key)
            if hit is None:
                if len(_range_cache) >= RANGE_CACHE:
                    _range_cache.clear()
                a = b = None
                if self.pos == 1:
                    a = torch.arange(n_outer, device=device) // self.div
                    b = torch.arange(n_inner, device=device) // self.div
                hit = _range_cache[key] = _tile_ranges(a, b, None, None, lo_off, hi_off, n_outer, n_inner,
                                                       tile_outer, tile_inner, partial_ok, device)
            return hit
        a, b = (self.qkey, self.kkey) if q_side else (self.kkey, self.qkey)
        ad, bd = (self.qdoc, self.kdoc) if q_side else (self.kdoc, self.qdoc)
        return _tile_ranges(a, b, ad, bd, lo_off, hi_off, n_outer, n_inner, tile_outer, tile_inner, partial_ok)

    def vectors(self, dummy: torch.Tensor) -> tuple:
        """(QKEY, KKEY, QDOC, KDOC, HBAND, HKEYS, HHOLES) kernel arguments; ``dummy`` stands in for absent ones."""
        return tuple(dummy if t is None else t for t in (self.qkey, self.kkey, self.qdoc, self.kdoc,
                                                         self.head_bounds, self.head_keys, self.head_holes))

    def scalars(self) -> tuple:
        """(left, right, div) kernel arguments."""
        return (0 if self.left is None else self.left, 0 if self.right is None else self.right, self.div)


_range_cache: dict[tuple, torch.Tensor] = {}


def _tile_ranges(a: Optional[torch.Tensor], b: Optional[torch.Tensor], ad: Optional[torch.Tensor],
                 bd: Optional[torch.Tensor], lo_off: Optional[int], hi_off: Optional[int], n_outer: int,
                 n_inner: int, tile_outer: int, tile_inner: int, partial_ok: bool,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """Per tile of ``tile_outer`` outer rows, the inner tiles (of ``tile_inner``) to visit, on the device.

    Outer row i sees inner row j iff a[i] - lo_off <= b[j] <= a[i] + hi_off (keys a, b nondecreasing,
    or None: no key condition; a None offset: unbounded; tensors [h] of offsets: per head, the result
    [tiles, h, 4]) and ad[i] == bd[j] (documents, nondecreasing,
    or None). Returns int32 [tiles, 4]: (lo, full_lo, full_hi, hi) with lo <= full_lo <= full_hi <= hi;
    inner tiles [lo, hi) hold every visible pair of the outer tile, and each of [full_lo, full_hi) is
    visible to every outer row of the tile entirely (a partial last inner tile only if ``partial_ok``).
    On the vectors' device, else on ``device``.
    """
    dev = a.device if a is not None else ad.device if ad is not None else device
    o0 = torch.arange(0, n_outer, tile_outer, device=dev)
    o1 = torch.clamp(o0 + tile_outer, max=n_outer) - 1  # the tile's last real row
    lo = torch.zeros_like(o0)
    hi = torch.full_like(o0, n_inner)
    full_lo = torch.zeros_like(o0)  # inner rows [full_lo, full_hi) are visible to all rows of the tile
    full_hi = torch.full_like(o0, n_inner)
    ss = torch.searchsorted
    per_head = isinstance(hi_off, torch.Tensor)
    if per_head:  # [h, tiles] below: each head's offsets against the same tiles
        hi_off, lo_off = hi_off.to(dev)[:, None], lo_off.to(dev)[:, None]
    if a is not None:
        if hi_off is not None:
            hi = torch.minimum(hi, ss(b, (a[o1] + hi_off).contiguous(), right=True))
            full_hi = torch.minimum(full_hi, ss(b, (a[o0] + hi_off).contiguous(), right=True))
        if lo_off is not None:
            lo = torch.maximum(lo, ss(b, (a[o0] - lo_off).contiguous()))
            full_lo = torch.maximum(full_lo, ss(b, (a[o1] - lo_off).contiguous()))
    if ad is not None:
        first, last = ad[o0], ad[o1]
        lo = torch.maximum(lo, ss(bd, first))
        hi = torch.minimum(hi, ss(bd, last, right=True))
        one_doc = first == last
        full_lo = torch.maximum(full_lo, torch.where(one_doc, ss(bd, first), n_inner))
        full_hi = torch.minimum(full_hi, torch.where(one_doc, ss(bd, first, right=True), 0))
    n_tiles = -(-n_inner // tile_inner)
    empty = hi <= lo
    t_lo = torch.where(empty, 0, lo // tile_inner)
    t_hi = torch.where(empty, 0, -(-hi // tile_inner))
    f_lo = torch.maximum(-(-full_lo // tile_inner), t_lo)
    f_hi = full_hi // tile_inner
    if partial_ok:
        f_hi = torch.where(full_hi >= n_inner, n_tiles, f_hi)
    f_hi = torch.minimum(f_hi, t_hi)
    none_full = f_hi <= f_lo
    f_lo = torch.where(none_full, t_lo, f_lo)
    f_hi = torch.where(none_full, t_lo, f_hi)
    t_lo, f_lo, f_hi, t_hi = torch.broadcast_tensors(t_lo, f_lo, f_hi, t_hi)
    out = torch.stack([t_lo, f_lo, f_hi, t_hi], dim=-1)  # [tiles, 4], or [h, tiles, 4] per head
    return (out.transpose(0, 1) if per_head else out).to(torch.int32).contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not q.is_cuda and not interpreting():
        raise ValueError(f"the triton masked kernel needs CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 "
                         "to run it in Triton's CPU interpreter")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"the triton masked kernel takes head dims up to {MAX_HEAD_DIM}, got q {q.shape[-1]} "
                         f"v {v.shape[-1]}")
    if k.shape[-1] != q.shape[-1] or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    for t in (q, k, v):
        if t.dtype not in DTYPES:
            raise ValueError(f"the triton masked kernel takes {', '.join(map(str, DTYPES))}; got {t.dtype}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dkdv_splits(kv_programs: int, q_tiles: int) -> tuple[int, int]:
    """(splits, q tiles per split) of a dk/dv launch of ``kv_programs`` (kv tiles x batch x kv heads)
    over ``q_tiles`` q tiles: one split unless the launch has fewer than DKDV_PROGRAMS programs; then
    as many as bring it to about DKDV_PROGRAMS, each of at least DKDV_SPLIT_TILES q tiles."""
    want = min(_cdiv(DKDV_PROGRAMS, max(1, kv_programs)), _cdiv(q_tiles, DKDV_SPLIT_TILES))
    if want <= 1:
        return 1, max(1, q_tiles)
    per = _cdiv(q_tiles, want)
    return _cdiv(q_tiles, per), per


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "full", block: int = 1,
            scale: float = 1.0, positions: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, hq, sq, d], k [b, hkv, sk, d], v [b, hkv, sk, dv] (any strides) -> (out fp32 [b, hq, sq, dv],
    lse fp32 [b, hq, sq], natural log). ``positions`` = (q_pos [sq], kv_pos [sk], q_doc [sq], kv_doc [sk],
    band) for kind "positions" (vectors on any device). Rows that see nothing: out 0, lse -inf."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.zeros(b, hq, sq, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    _check(q, k, v)
    mask = _Mask(kind, block, positions, sq, sk, q.device)
    mask.check_heads(hq)
    if b * hq == 0 or sq == 0 or sk == 0:
        return out, lse
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    kern = _kernels()["masked_fwd_kernel"]
    opts = launch_options("forward", {q.dtype, k.dtype, v.dtype}, d, dv, interpreting())
    ranges = mask.ranges("q", sq, sk, opts["BLOCK_M"], opts["BLOCK_N"], False, q.device)
    kern[(_cdiv(sq, opts["BLOCK_M"]), b * hq)](
        q, k, v, out, lse, ranges, *mask.vectors(ranges), float(scale) * LOG2E, *mask.scalars(),
        hq, hq // hkv, sq, sk, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *lse.stride()[:2], **opts, **mask.flags())
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: torch.Tensor,
             lse: torch.Tensor, kind: str = "full", block: int = 1, scale: float = 1.0,
             positions: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [b, hq, sq, d], dk [b, hkv, sk, d], dv [b, hkv, sk, dv]), fp32.

    dout [b, hq, sq, dv]; D = rowsum(dout * out) [b, hq, sq] and lse [b, hq, sq] (fp32) are the given
    values of the merged attention (used as they are; lse -inf: the row's gradients are 0).
    """
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    dq = torch.zeros(b, hq, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=torch.float32, device=q.device)
    dvv = torch.zeros(b, hkv, sk, dv, dtype=torch.float32, device=q.device)
    _check(q, k, v)
    if dout.dtype not in DTYPES or tuple(dout.shape) != (b, hq, sq, dv):
        raise ValueError(f"dout {tuple(dout.shape)} {dout.dtype} does not fit q {tuple(q.shape)} v {tuple(v.shape)}")
    mask = _Mask(kind, block, positions, sq, sk, q.device)
    mask.check_heads(hq)
    if b * hq == 0 or sq == 0 or sk == 0:
        return dq, dk, dvv
    q, k, v, dout = unit_last(q), unit_last(k), unit_last(v), unit_last(dout)
    D, lse = D.float(), lse.float()
    kerns = _kernels()
    dtypes = {q.dtype, k.dtype, v.dtype, dout.dtype}
    scale2 = float(scale) * LOG2E
    common = (*mask.scalars(),)

    opts = launch_options("dkdv", dtypes, d, dv, interpreting())
    ranges = mask.ranges("kv", sk, sq, opts["BLOCK_N"], opts["BLOCK_M"], True, q.device)
    kv_programs = _cdiv(sk, opts["BLOCK_N"]) * b * hkv
    splits, split_tiles = dkdv_splits(kv_programs, _cdiv(sq, opts["BLOCK_M"]))
    dk_out, dv_out = dk, dvv
    if splits > 1:  # fp32 partials, one per split, summed below
        dk_out = torch.empty((splits,) + tuple(dk.shape), dtype=torch.float32, device=q.device)
        dv_out = torch.empty((splits,) + tuple(dvv.shape), dtype=torch.float32, device=q.device)
    kerns["masked_bwd_dkdv_kernel"][(_cdiv(sk, opts["BLOCK_N"]), b * hkv, splits)](
        q, k, v, dout, D, lse, dk_out, dv_out, ranges, *mask.vectors(ranges), float(scale), scale2, *common,
        hkv, hq // hkv, sq, sk, split_tiles, dk_out.stride(0) if splits > 1 else 0,
        dv_out.stride(0) if splits > 1 else 0, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *dout.stride()[:3], *D.stride()[:2], *lse.stride()[:2], *dk_out.stride()[-4:-1], *dv_out.stride()[-4:-1],
        **opts, **mask.flags())
    if splits > 1:
        torch.sum(dk_out, 0, out=dk)
        torch.sum(dv_out, 0, out=dvv)

    opts = launch_options("dq", dtypes, d, dv, interpreting())
    ranges = mask.ranges("q", sq, sk, opts["BLOCK_M"], opts["BLOCK_N"], False, q.device)
    kerns["masked_bwd_dq_kernel"][(_cdiv(sq, opts["BLOCK_M"]), b * hq)](
        q, k, v, dout, D, lse, dq, ranges, *mask.vectors(ranges), float(scale), scale2, *common,
        hq, hq // hkv, sq, sk, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
        *D.stride()[:2], *lse.stride()[:2], *dq.stride()[:3], **opts, **mask.flags())
    return dq, dk, dvv
