"""The weight gradient by vocabulary tiles, in the backward (``weight_grad="backward"``).

The default (``weight_grad="forward"``) forms the weight gradient in the forward, walking token
chunks and accumulating ``A += G_c^T h_c`` into an fp32 [V_local, d] buffer kept until the backward:
three GEMMs, but 4 B per weight element of extra memory (2 GiB at V = 128K, d = 4096) -- the
largest buffer of the whole op, larger than the bf16 weight gradient itself.

Here the loop order is vocabulary-outer instead: for each tile of ``vt`` vocabulary rows the
logits of *all* tokens against that tile are recomputed (``z = h W_tile^T``, fp32), turned into the
weighted softmax gradient with the forward's per-token reference (max, or near it) and sum of
exp(z - reference) (global over TP, so no collective is needed), and ``dW_tile = c G^T h`` is
accumulated over the tokens in fp32 (in the GEMM, c in its epilogue, or in an fp32 tile buffer
[vt, d] when the tokens are split) and written **once** in the weight dtype -- or added in fp32
into Megatron's ``main_grad``. (The scaled backward's G carries the loss weights, and c the
objective's factor: G is rounded at the weights' scale, as the default mode's G is.) Nothing of size [V_local, d] exists but
the gradient itself, and each weight-gradient element is rounded to bf16 exactly once (the
unfused path's rounding), whatever the number of tokens. The price: a fourth vocabulary GEMM
(the logits recompute), 2 N V_local d FLOPs.

Because the incoming per-token gradient g is known here, the weight gradient is exact for any g
(no proportionality to the loss mask needed for it).

The recomputed logits stay fp32, as the forward's: 16-bit logits would halve the scratch (larger
tiles near the end, fewer launches) but round them before the softmax, and with the forward's fp32
statistics the normalization no longer matches -- in an emulation at (2K, 16K, 1K) with logits of
std 5, d weight's error was 1.6e-2 that way against 1.8e-3 here (unfused, all bf16: 9.2e-3).

Scratch: per tile, fp32 logits z and the G tile [tn, vt] (4 B per logit: G overwrites z in fp32,
and a 16-bit G is written over the first half of each fp32 row of z by the Triton kernel --
``G_IN_LOGITS``; the torch path keeps a G of its own, 6 B per logit), the fp32 tile accumulator [vt, d] when the tokens are split into sub-chunks
(tn < N) and the result is not itself fp32 (plus an fp32 product [vt, d] where torch cannot
accumulate a bf16 GEMM into fp32 in place), and [3, tn] fp32 statistics.

Where that scratch lives (:func:`plan_vocab_tiles`):

* **inside the result** (the default when the pass allocates d weight, i.e. without ``main_grad``):
  the rows of d weight not yet written are free memory until their tile comes, so each tile's
  scratch is laid out in the result's storage past the tile's own rows. The tiles keep
  ``VOCAB_TILE`` rows while the space after them is large; near the end they shrink (and split the
  tokens when that fits more rows) so that the scratch still fits behind them; the last few rows
  (tens, where even ``MIN_TILE_ROWS`` rows do not fit) use a buffer of their own of at most
  ``TAIL_BYTES``. The pass's peak above the gradient is then that buffer: at N = 16K, V = 128K,
  d = 4096, bf16, ~1.4 MiB -- the op's backward peaks at the two bf16 gradients (1152 MiB) plus that.
  The price is more, smaller tiles near the end (each re-reads h): 106 tiles and 201 (tile, token
  sub-chunk) pieces instead of 64 there (heights multiples of ROW_ALIGN but the last). Shapes are
  chosen by a cost per row that prices memory traffic and each piece's launches
  (PIECE_COST_BYTES): without the latter the plan had 82 tiles but 358 pieces, 128 of them in the
  tail, and the pass was host-bound on an H100.
* **in a buffer of its own** (with ``main_grad``: no result to borrow from; or ``in_result=False``):
  fixed tiles, ``vt`` = min(vocab_chunk, VOCAB_TILE) rows, ``tn`` tokens from TILE_BYTES; at the
  shape above vt = 2048, tn = 4096: 48 MiB of logits / G and a 32 MiB accumulator.

``FUSED_TILE_GRAD`` (the default for 16-bit inputs on the Triton path) forms a tile's G in one Triton
GEMM with the softmax gradient in its epilogue (``triton_kernels.tile_grad``): no fp32 logits at all,
2 B of scratch per logit, so at (16K, 128K, 4096) the shrinking end is 8192 rows (16384 with 4 B) and
the pass 88 pieces (126).

Every tile overwrites its scratch before reading it and writes its rows of the result only after its
last read of the scratch, so the borrowed rows' content never matters (tests: a result poisoned
with NaN, every kind of tile).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_burst.loss import triton_kernels
from megatron_burst.loss.config import LossConfig, local_targets
from megatron_burst.loss.fast import stats_rows

__all__ = ["weight_grad_by_vocab_tiles", "weight_grad_target", "plan_vocab_tiles", "VocabTile",
           "TileScratch", "tile_scratch", "VOCAB_TILE", "TILE_BYTES", "MIN_TILE_ROWS", "TAIL_BYTES"]

# Vocabulary rows per tile: the GEMMs are [tn, d] x [d, vt] and [vt, tn] x [tn, d]; 2048 keeps both
# compute-bound on Hopper at tn >= 1024 while the tile accumulator stays 32 MiB at d = 4096.
VOCAB_TILE = 2048
# Logits-tile bytes (fp32 z + 16-bit G) per (token sub-chunk, vocabulary tile) of the own-buffer plan.
TILE_BYTES = 48 << 20
# Scratch inside the result: tiles shrink to this many rows at least, then the last rows use an own
# buffer of at most TAIL_BYTES (when some tile shape fits in it).
MIN_TILE_ROWS = 64
TAIL_BYTES = 1 << 20
# Token sub-chunk sizes tried when splitting the tokens lets a tile keep more rows.
SPLIT_TOKENS = (4096, 2048, 1024, 512)
ALIGN = 256  # bytes: every scratch piece starts on a 256-byte boundary (cuBLAS / vector loads)
# Tile heights are multiples of this many rows (but the last tile): a tile's height is the leading
# dimension of its [tn, vt] logits and G scratch, and odd ones keep cuBLAS off its tensor-core kernels.
ROW_ALIGN = 16
# A piece (one tile's token sub-chunk) is four launches -- two GEMMs, a shift of the target columns,
# the softmax-gradient kernel -- about 100 us of host time in eager PyTorch; priced as the memory
# traffic of that time at Hopper's ~3 TB/s, so that the plan does not trade a little traffic for
# many tiny pieces (the tail at (16K, 128K, 4096) had 128 pieces of 48 rows x 512 tokens, and the
# pass was host-bound on an H100).
PIECE_COST_BYTES = 256 << 20
# GEMMs on few vocabulary rows run far below the tensor cores' rate (too few output tiles for the SMs:
# the profile of run 6, H100, had the 16384 rows of the plan's shrinking end -- 12.5 % of the FLOPs --
# take ~15 of the pass's ~65 ms). GEMM_ROWS_FLOOR prices a tile of vt < GEMM_ROWS_FLOOR rows as if its
# two GEMMs had GEMM_ROWS_FLOOR rows, their FLOPs converted to bytes at GEMM_FLOPS_PER_BYTE (Hopper:
# ~800 TFLOP/s of bf16 GEMM over ~3.2 TB/s), so that the plan may split the tokens of a late tile
# (an fp32 accumulator) to keep it taller. 0: off (the plan by traffic and launches alone). On an H100
# (2026-11-28) 1024 gave 115.0 against 116.5 ms with the row kernel but nothing with the fused tile
# (113.8 against 113.5), the default since.
GEMM_ROWS_FLOOR = 0
GEMM_FLOPS_PER_BYTE = 250
# Whether the Triton path forms each tile transposed: logits z^T = W_tile h^T [vt, tn] (a small left
# operand against all tokens, the shape of the forward's logits GEMM, which ran at ~840 TFLOP/s on an
# H100 where the tile's h W_tile^T ran at ~610), its softmax gradient G^T by ``grad_cols`` (the same
# values), and d weight = G^T h with G^T as a plain row-major operand. The same scratch and plan.
# Off: timed on an H100 (2026-11-28) at 117.5 ms against the row-major tiles' 116.5 -- no gain (the
# fused tile below is the default and supersedes it; kept as a knob, ``fused_bwdw:TRANSPOSED_TILES=1``).
TRANSPOSED_TILES = False
# Whether the Triton path forms each tile's G in one Triton GEMM (``triton_kernels.tile_grad``: h W_tile^T
# accumulated in fp32 in registers, the softmax gradient in its epilogue, G stored in 16 bits) instead
# of cuBLAS's fp32 logits and the row kernel: no fp32 logits written and read back (8 B per logit),
# and 2 B of scratch per logit instead of 4, so the plan's shrinking end keeps taller tiles. Its GEMM
# is Triton's, not cuBLAS's (wgmma on Hopper). Timed on an H100 (2026-11-28, (16K, 128K, 4096) bf16, two
# calls): 113.5 / 115.6 ms against 116.5 ms without it and 117.4 / 117.2 ms unfused, the same errors and
# peak -- on by default (module switch; the bench's ``fused_bwdw:FUSED_TILE_GRAD=0`` is the A/B).
FUSED_TILE_GRAD = True
# Whether d weight's own unwritten rows hold the scratch (module switch for tests and benchmarks).
SCRATCH_IN_RESULT = True
# Whether the Triton path writes a 16-bit G over the first half of each fp32 logits row instead of a
# G tile of its own (module switch): 4 B of scratch per logit instead of 6, so the tiles near the
# end of the pass stay larger -- 126 (tile, token) pieces instead of 201 at (16K, 128K, 4096).
G_IN_LOGITS = True


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class TileScratch:
    """Byte offsets of one tile's scratch pieces (None: not needed) and its total size.

    z: fp32 logits [tn, vt] (``fused``: the 16-bit G itself); g: 16-bit G [tn, vt] (None for fp32: G
    overwrites z); acc: fp32 accumulator [vt, d] (tokens split, 16-bit destination); tmp: fp32 product
    [vt, d] (a 16-bit GEMM accumulated into fp32 where torch cannot do it in the GEMM)."""

    z: int
    g: Optional[int]  # None: G overwrites z (fp32), or lies in the first half of z's rows (g_in_z)
    acc: Optional[int]
    tmp: Optional[int]
    nbytes: int


def tile_scratch(vt: int, tn: int, n_tokens: int, d: int, dtype: torch.dtype, dest_fp32: bool,
                 acc_temp: bool, g_in_z: bool = False, fused: bool = False) -> TileScratch:
    """The scratch layout of a tile of ``vt`` vocabulary rows walked in sub-chunks of ``tn`` of the
    ``n_tokens`` tokens. ``dest_fp32``: the destination accumulates in fp32 itself (fp32 result or
    Megatron's main_grad); ``acc_temp``: this torch has no in-GEMM fp32 accumulation of 16-bit
    operands (:func:`megatron_burst.loss.fast._addmm_fp32_works`); ``g_in_z``: a 16-bit G lies in
    the first half of each fp32 row of z (the Triton kernel writes it there), no G piece; ``fused``
    (16-bit): the logits never leave the GEMM (``triton_kernels.tile_grad``), the z piece holds the
    16-bit G alone (2 B per logit)."""
    wide = dtype == torch.float32
    fused = fused and not wide
    off = _align((2 if fused else 4) * tn * vt)
    g = None
    if not wide and not g_in_z and not fused:
        g, off = off, _align(off + 2 * tn * vt)
    acc = tmp = None
    if not wide and tn < n_tokens and not dest_fp32:
        acc, off = off, _align(off + 4 * vt * d)
    if not wide and acc_temp and (acc is not None or dest_fp32):
        tmp, off = off, _align(off + 4 * vt * d)
    return TileScratch(0, g, acc, tmp, off)


@dataclass(frozen=True)
class VocabTile:
    """Rows [start, stop) of the vocabulary shard, walked in sub-chunks of ``tokens`` tokens; the
    scratch at byte ``offset`` of the result's storage, or in the pass's own buffer (None)."""

    start: int
    stop: int
    tokens: int
    offset: Optional[int]


def _own_tile(cap: int, n_tokens: int, dtype: torch.dtype, g_in_z: bool = False, fused: bool = False
              ) -> tuple[int, int]:
    """(vt, tn) of the own-buffer plan: vt = cap rows, tn tokens from TILE_BYTES."""
    per_elem = 4 if dtype == torch.float32 or g_in_z else 6
    if fused and dtype != torch.float32:
        per_elem = 2
    tn = max(1, min(n_tokens, TILE_BYTES // (per_elem * cap)))
    if 256 <= tn < n_tokens:
        tn -= tn % 128  # whole GEMM tiles
    return cap, tn


def _bytes_per_row(vt: int, tn: int, n_tokens: int, d: int, elt: int) -> float:
    """What a tile shape costs per vocabulary row beyond its FLOPs, in bytes of memory traffic: h read
    by both GEMMs (each tile re-reads all of it), for split tokens the accumulator's
    read-modify-write, PIECE_COST_BYTES per (tile, token sub-chunk) piece for its launches, and
    below GEMM_ROWS_FLOOR rows the FLOPs its GEMMs waste."""
    subchunks = -(-n_tokens // tn)
    short = max(0, GEMM_ROWS_FLOOR - vt) * 4 * n_tokens * d / GEMM_FLOPS_PER_BYTE
    return (2 * n_tokens * d * elt + (subchunks - 1) * 8 * vt * d + subchunks * PIECE_COST_BYTES + short) / vt


def _token_options(n_tokens: int, vt: int, dtype: torch.dtype, g_in_z: bool, fused: bool = False) -> list[int]:
    own = _own_tile(vt, n_tokens, dtype, g_in_z, fused)[1]
    return sorted({n_tokens, own} | {t for t in SPLIT_TOKENS if t < n_tokens}, reverse=True)


def plan_vocab_tiles(n_tokens: int, v_local: int, d: int, dtype: torch.dtype, vocab_chunk: int, *,
                     in_result: bool, dest_fp32: bool, acc_temp: bool, g_in_z: bool = False,
                     fused: bool = False) -> tuple[VocabTile, ...]:
    """The tiles of one pass over ``v_local`` vocabulary rows (see the module docstring).

    ``in_result``: the scratch may live in the result's storage ([v_local, d] in ``dtype``, not yet
    written) past each tile's rows; else every tile uses the own buffer. ``dest_fp32`` /
    ``acc_temp`` / ``g_in_z`` / ``fused``: as :func:`tile_scratch`. Host arithmetic only, cached per shape (and
    per value of the module's tiling constants).
    """
    constants = (VOCAB_TILE, TILE_BYTES, MIN_TILE_ROWS, TAIL_BYTES, SPLIT_TOKENS, ALIGN, ROW_ALIGN, PIECE_COST_BYTES,
                 GEMM_ROWS_FLOOR, GEMM_FLOPS_PER_BYTE)
    return _plan(n_tokens, v_local, d, dtype, vocab_chunk, in_result, dest_fp32, acc_temp, g_in_z, fused, constants)


@functools.lru_cache(maxsize=256)
def _plan(n_tokens: int, v_local: int, d: int, dtype: torch.dtype, vocab_chunk: int, in_result: bool,
          dest_fp32: bool, acc_temp: bool, g_in_z: bool, fused: bool, constants: tuple) -> tuple[VocabTile, ...]:
    cap = max(1, min(vocab_chunk, VOCAB_TILE, v_local))

    def scratch(vt: int, tn: int) -> int:
        return tile_scratch(vt, tn, n_tokens, d, dtype, dest_fp32, acc_temp, g_in_z, fused).nbytes

    vt, tn = _own_tile(cap, n_tokens, dtype, g_in_z, fused)
    if not in_result or scratch(vt, tn) <= TAIL_BYTES:  # small shapes: nothing worth borrowing
        return tuple(VocabTile(a, min(a + vt, v_local), tn, None) for a in range(0, v_local, vt))
    elt = torch.finfo(dtype).bits // 8
    row_bytes, total = d * elt, v_local * d * elt

    tiles: list[VocabTile] = []
    a = 0
    while a < v_local:
        rem = v_local - a
        best = None  # ((bytes per row, -vt), vt, tn, offset): the cheapest shape that fits behind its rows
        top = min(cap, rem - 1)  # at least one row behind the tile to hold scratch
        sizes = sorted({_aligned_rows(top), *range(MIN_TILE_ROWS, top + 1, MIN_TILE_ROWS)}, reverse=True)
        for vt in (x for x in sizes if x >= min(MIN_TILE_ROWS, cap)):
            offset = _align((a + vt) * row_bytes)
            for tn in _token_options(n_tokens, vt, dtype, g_in_z, fused):
                if scratch(vt, tn) <= total - offset:
                    key = (_bytes_per_row(vt, tn, n_tokens, d, elt), -vt)
                    if best is None or key < best[0]:
                        best = (key, vt, tn, offset)
                    break  # the largest tn that fits is the cheapest for this vt
        if best is None:
            break
        _, vt, tn, offset = best
        tiles.append(VocabTile(a, a + vt, tn, offset))
        a += vt
    if a < v_local:  # the last rows: an own buffer of at most TAIL_BYTES where some shape fits
        rem = v_local - a
        heights = {min(cap, rem), *range(ROW_ALIGN, min(cap, rem) + 1, ROW_ALIGN)}  # the whole rest in one, or aligned
        options = [(vt, tn) for vt in sorted(heights, reverse=True)
                   for tn in _token_options(n_tokens, vt, dtype, g_in_z, fused)]
        fits = [(_bytes_per_row(vt, tn, n_tokens, d, elt), vt, tn) for vt, tn in options if scratch(vt, tn) <= TAIL_BYTES]
        if fits:
            _, vt, tn = min(fits)
        else:
            vt, tn = min(options, key=lambda o: scratch(*o))
        tiles += [VocabTile(b, min(b + vt, v_local), tn, None) for b in range(a, v_local, vt)]
    return tuple(tiles)


def _aligned_rows(rows: int) -> int:
    """``rows`` rounded down to a multiple of ROW_ALIGN (as it is below ROW_ALIGN)."""
    return rows // ROW_ALIGN * ROW_ALIGN or rows


def _logits(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, G: torch.Tensor, impl: str) -> None:
    """out [tn, vt] fp32 <- h w^T, rounded as the forward rounded them (the statistics m, s were
    formed from these very values: any other rounding would break softmax's normalization).
    G: the tile's 16-bit G scratch (free until the softmax gradient is written into it)."""
    if impl == "torch" and h.dtype != torch.float32:
        torch.mm(h, w.t(), out=G)  # the torch path's logits are in the input dtype (as Megatron's)
        out.copy_(G)
    else:
        _fp32_product(h, w, out)


def _fp32_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out [rows of a, rows of b] fp32 <- a b^T with fp32 accumulation and no rounding to 16 bits
    (a tile's logits as h W_tile^T, or transposed as W_tile h^T)."""
    if a.dtype == torch.float32:
        torch.mm(a, b.t(), out=out)
    elif a.is_cuda:
        torch.mm(a, b.t(), out_dtype=torch.float32, out=out)
    else:  # CPU (interpreter tests): bf16 values and their products are exact in fp32
        torch.mm(a.float(), b.float().t(), out=out)


def _softmax_grad(z: torch.Tensor, G: torch.Tensor, tgt: torch.Tensor, col0: int, stats: torch.Tensor,
                  g: torch.Tensor, impl: str) -> None:
    """G [tn, vt] <- g_t (exp(z - m_t) / s_t - [v == tgt_t - col0]) in G's dtype. tgt [tn]: the
    target's column in the shard, col0 the tile's first, any tgt - col0 outside [0, vt) meaning none
    here (int32); stats [2, tn]: rows m, s, each with unit stride; g [tn] contiguous."""
    if impl == "triton":  # the kernel subtracts col0 (no launch per piece for the shift)
        triton_kernels.ce_rows(z, tgt, stats, grad=G, wts=g, compute_stats=False, col0=col0)
        return
    tgt = tgt.long() - col0  # (scatter takes int64 indices)
    m, s = stats[0], stats[1]
    z.sub_(m[:, None]).exp_().mul_((g / s)[:, None])
    hit = (tgt >= 0) & (tgt < z.shape[1])
    z.scatter_add_(1, torch.where(hit, tgt, 0)[:, None], torch.where(hit, -g, 0.0)[:, None])
    if G.data_ptr() != z.data_ptr():
        G.copy_(z)


def _accumulate(acc: torch.Tensor, Gt: torch.Tensor, h: torch.Tensor, first: bool,
                tmp: Optional[torch.Tensor], scale: float) -> None:
    """acc [vt, d] fp32 (+)= scale Gt h (Gt [vt, tn]: G^T) with fp32 products and sums (``first``:
    overwrite; scale applied in the GEMM, to the fp32 sum). tmp: an fp32 [vt, d] scratch for the
    product where torch cannot accumulate 16-bit operands in the GEMM."""
    beta = 0.0 if first else 1.0  # beta 0: acc's content is ignored (NaN included), per torch.addmm
    if Gt.dtype == torch.float32:
        torch.addmm(acc, Gt, h, beta=beta, alpha=scale, out=acc)
    elif Gt.is_cuda:
        from megatron_burst.loss.fast import _addmm_fp32_works
        if _addmm_fp32_works(Gt.device):
            torch.addmm(acc, Gt, h, out_dtype=torch.float32, beta=beta, alpha=scale, out=acc)
        elif first:  # older torch: the fp32 product, then the scale
            torch.mm(Gt, h, out_dtype=torch.float32, out=acc).mul_(scale)
        else:  # older torch: the fp32 product into the tile's scratch, then one add
            acc.add_(torch.mm(Gt, h, out_dtype=torch.float32, out=tmp), alpha=scale)
    else:  # CPU: bf16 values and their products are exact in fp32
        torch.addmm(acc, Gt.float(), h.float(), beta=beta, alpha=scale, out=acc)


def _piece(space: torch.Tensor, offset: Optional[int], numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A flat [numel] view in ``dtype`` of the byte tensor ``space`` from byte ``offset`` (None: None)."""
    if offset is None:
        return None
    nbytes = numel * (torch.finfo(dtype).bits // 8)
    return space[offset:offset + nbytes].view(dtype)


def weight_grad_target(weight: torch.Tensor, main_grad: Optional[torch.Tensor], n_tokens: int, v_local: int
                       ) -> tuple[Optional[torch.Tensor], bool]:
    """(out, done) of a d weight pass: ``out`` the [v_local, d] gradient to fill in weight's dtype, or
    None when the pass adds into ``main_grad``; ``done`` when there are no tokens, ``out`` then being
    the pass's result already (zeros, or None: nothing to add)."""
    if main_grad is not None:
        return None, n_tokens == 0
    out = torch.empty(v_local, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return (out.zero_(), True) if n_tokens == 0 else (out, False)


def weight_grad_by_vocab_tiles(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, m_all: torch.Tensor,
                               s_all: torch.Tensor, g: torch.Tensor, cfg: LossConfig,
                               main_grad: Optional[torch.Tensor], scale: float = 1.0) -> Optional[torch.Tensor]:
    """d weight = scale sum_t g_t (p_t - y_t)^T h_t, one vocabulary tile at a time, each rounded once.

    h: [N, d] (the full sequence: gathered under sequence parallelism), weight: [V_local, d],
    labels: [N] global ids, m_all / s_all: [N] fp32 global (over TP) per-token reference (max) and
    sum exp(z - reference) of the logits from the forward, g: [N] fp32 per-token gradient factor,
    0 at ignored labels. ``scale``: a host scalar applied to the GEMM's fp32 sum (the scaled
    backward passes the loss weights as g and the objective's factor here: the 16-bit G is then
    rounded at the weights' own scale -- a 0/1 mask's G is softmax minus one-hot, whose target
    entries (~ -1 at a diffuse softmax) round with half the relative error of c times them --
    as the default mode's G is). ``main_grad``: [V_local, d] fp32 buffer to add the gradient into
    (returns None), else returns the gradient [V_local, d] in weight's dtype.
    """
    N, d = h.shape
    V = cfg.v_local
    # Per token, once for all tiles (the kernel subtracts a tile's start: one launch per piece, not six):
    # the target's column in this shard as int32, -1 - V where none (ignored, or another shard's) so
    # that no tile's shifted column lands in [0, vt); the statistics as [2, N] rows (m, s). Formed
    # before d weight exists (their temporaries stay below the pass's peak), and kept small: they are
    # alive beside the gradients at that peak (4 B per token; no copy of m, s where they are rows of
    # one buffer).
    tgt_all = local_targets(labels, cfg, none=-1 - V)[0].to(torch.int32)
    stats_all = stats_rows(m_all, s_all)
    g = g.contiguous()
    out, done = weight_grad_target(weight, main_grad, N, V)
    if done:
        return out
    dest_fp32 = main_grad is not None or weight.dtype == torch.float32
    acc_temp = False
    if h.is_cuda and h.dtype != torch.float32:
        from megatron_burst.loss.fast import _addmm_fp32_works
        acc_temp = not _addmm_fp32_works(h.device)
    # the Triton kernel writes a 16-bit G over the first half of each fp32 logits row (the torch path's
    # in-place ops cannot: it keeps a G of its own)
    g_in_z = G_IN_LOGITS and cfg.impl == "triton" and h.dtype != torch.float32
    # the logits GEMM and the softmax gradient in one Triton kernel (16-bit; G the only scratch)
    fused = FUSED_TILE_GRAD and cfg.impl == "triton" and h.dtype != torch.float32
    transposed = TRANSPOSED_TILES and cfg.impl == "triton" and not fused
    tiles = plan_vocab_tiles(N, V, d, h.dtype, cfg.vocab_chunk, in_result=out is not None and SCRATCH_IN_RESULT,
                             dest_fp32=dest_fp32, acc_temp=acc_temp, g_in_z=g_in_z, fused=fused)

    def layout(t: VocabTile) -> TileScratch:
        return tile_scratch(t.stop - t.start, t.tokens, N, d, h.dtype, dest_fp32, acc_temp, g_in_z, fused)

    own_bytes = max((layout(t).nbytes for t in tiles if t.offset is None), default=0)
    own = torch.empty(own_bytes, dtype=torch.uint8, device=h.device) if own_bytes else None
    result_bytes = out.view(-1).view(torch.uint8) if out is not None else None
    weight = weight.contiguous()
    for t in tiles:
        a, b, tn, vt = t.start, t.stop, t.tokens, t.stop - t.start
        lay = layout(t)
        space = own if t.offset is None else result_bytes[t.offset:t.offset + lay.nbytes]
        z_flat = _piece(space, lay.z, tn * vt, h.dtype if fused else torch.float32)
        g_flat = _piece(space, lay.g, tn * vt, h.dtype)
        acc = _piece(space, lay.acc, vt * d, torch.float32)
        tmp = _piece(space, lay.tmp, vt * d, torch.float32)
        acc, tmp = (None if x is None else x.view(vt, d) for x in (acc, tmp))
        w_tile = weight[a:b]
        if main_grad is not None:
            dest, first_overwrites = main_grad[a:b], False  # add into Megatron's buffer
        elif acc is not None:
            dest, first_overwrites = acc, True
        else:
            dest, first_overwrites = out[a:b], True  # one GEMM over all tokens (or fp32 out): no buffer
        for t0 in range(0, N, tn):
            t1 = min(t0 + tn, N)
            rows, cols = (vt, t1 - t0) if transposed else (t1 - t0, vt)  # the scratch's [rows, cols] layout
            n = rows * cols
            z = z_flat[:n].view(rows, cols)
            if g_flat is not None:
                G = g_flat[:n].view(rows, cols)
            elif g_in_z and not fused:  # row i of G: the first half of z's row i (the kernel orders its writes
                # after its reads)
                G = z_flat[:n].view(h.dtype).view(rows, 2 * cols)[:, :cols]
            else:
                G = z
            if fused:  # G is the z piece: the logits stay in the kernel's registers
                triton_kernels.tile_grad(h[t0:t1], w_tile, G, tgt_all[t0:t1], stats_all[:, t0:t1], g[t0:t1], a)
                Gt = G.t()
            elif transposed:  # z = W_tile h^T [vt, tn]: G^T directly, the d weight GEMM's left operand
                _fp32_product(w_tile, h[t0:t1], z)
                triton_kernels.grad_cols(z, G, tgt_all[t0:t1], stats_all[:, t0:t1], g[t0:t1], a)
                Gt = G
            else:
                _logits(h[t0:t1], w_tile, z, G, cfg.impl)
                _softmax_grad(z, G, tgt_all[t0:t1], a, stats_all[:, t0:t1], g[t0:t1], cfg.impl)
                Gt = G.t()
            if dest.dtype != torch.float32:
                # Tokens not split: one GEMM over all of them straight into the 16-bit result (fp32
                # sums scaled in the GEMM's epilogue, one rounding; beta 0: the rows' old content, maybe
                # another tile's scratch, is ignored). CPU: in fp32, then one rounding, to be sure of it.
                if Gt.is_cuda:
                    torch.addmm(dest, Gt, h[t0:t1], beta=0.0, alpha=scale, out=dest)
                else:
                    dest.copy_(torch.mm(Gt.float(), h[t0:t1].float()).mul_(scale))
            else:
                _accumulate(dest, Gt, h[t0:t1], first_overwrites and t0 == 0, tmp, scale)
        if acc is not None:
            out[a:b].copy_(acc)  # the one rounding of this tile's gradient (acc lies past row b)
    return out if main_grad is None else None
