"""The fused loss's GPU fast path (``impl="triton"``): cuBLAS GEMMs and one fused Triton pass per chunk.

Per token chunk of T tokens (this rank's V_local = V/tp vocabulary rows, hidden size d):

1. **logits** ``z = h_c W^T`` [T, V_local] -- one cuBLAS GEMM, bf16 operands, fp32 accumulation
   and an **fp32 result** (``torch.mm(..., out_dtype=torch.float32)``): the logits are never
   rounded to bf16, so the loss is as accurate as an fp32 computation and the gradient carries
   one bf16 rounding (of G) instead of two (Megatron rounds the logits too).
2. **one Triton pass** over the rows (:func:`~megatron_burst.loss.triton_kernels.ce_rows`): per
   row the running max and sum-exp (one exp per logit) and the target logit, then the weighted
   logits gradient ``G = w (softmax - onehot)`` written in bf16 -- the operand of the two
   gradient GEMMs. At TP = 1 both walks of a row happen in one launch (one program per row reads
   it twice: the statistics must be complete before its gradient is written); under TP the
   statistics are all-reduced between a statistics launch and a gradient launch (two small
   all-reduces per chunk, as the torch path).
3. **d hidden** ``D_c = G W`` [T, d] -- cuBLAS, written straight into the [N, d] buffer that
   becomes the hidden gradient (input dtype: one rounding of an fp32-accumulated sum over V).
4. **d weight** ``A += G^T h_c`` [V_local, d] -- cuBLAS with an fp32 C operand accumulated *in
   the GEMM* (``torch.addmm(A, G^T, h_c, out_dtype=torch.float32, out=A)``; the first chunk
   writes A with beta = 0, so A needs no zeroing). Where torch lacks that overload, each vocabulary
   tile's fp32 product goes through a tile-sized temporary (measured once per device, logged).

No fourth GEMM: the backward only scales D and A by the incoming scalar c (see
:mod:`megatron_burst.loss.fused`), or, for a gradient not proportional to the loss mask, runs
this same chunk walk with the actual per-token gradient (the documented recompute path).

FLOPs and bytes (N tokens, bf16, TP = 1, per chunk of T tokens):

* GEMMs: 3 x 2 T V d, the unfused path's three and no more (2 N V d each over the sequence:
  17.6 TFLOP each, 52.8 TFLOP in all at N = 16K, V = 128K, d = 4096).
* Logits-sized traffic, per logit: 4 B written by the logits GEMM (1), 4 + 4 B read and 2 B written
  by the Triton pass (2), 2 + 2 B read by the gradient GEMMs (3, 4) -- 18 B, one elementwise kernel. The unfused path
  moves about 46 B per logit in 6-8 elementwise kernels (bf16 logits, their fp32 copy,
  log-softmax, its gradient, the bf16 cast) and holds N x V of them at once.
* Weight-gradient accumulator: 8 V d B (fp32 read + write in the epilogue of GEMM 4) per chunk,
  i.e. (N / T) x 8 V d over the sequence -- the price of chunking over tokens. Its intensity is
  therefore about T / 4 FLOP per byte of A: T >= 1024 keeps it above Hopper's ~300 FLOP/B ridge
  (989 TFLOP/s over 3.35-4.8 TB/s), which is why the default chunk is large (below).

Memory (beyond inputs and the gradients themselves): one chunk's fp32 logits and bf16 G, T x
V_local x 6 B (fp32 inputs: 4 B, G overwrites z in place); the hidden-gradient factor D [N, d] in
the input dtype -- it *becomes* d hidden -- and the fp32 accumulator A [V_local, d] -- 8 B per
weight element with the bf16 weight gradient it turns into. Nothing of size N x V exists.
At N = 16K, V = 128K, d = 4096, bf16: chunk 1024 tokens = 768 MiB, D = 128 MiB, A = 2 GiB,
d weight (bf16, allocated by the backward while A is alive) = 1 GiB -- a peak of ~3.1 GiB above the
inputs (gradients included), against the unfused path's ~24 GiB. Cut Cross-Entropy's 1154 MiB and
Liger-Kernel's 1408 MiB there are the two bf16 gradients themselves (1152 MiB) plus nothing, or a
256 MiB chunk: Liger accumulates d weight over token chunks in bf16 (hence its 1.5e-3 d weight
error, ~9x the unfused path's), CCE recomputes the logits. Reaching their memory without either
would take the fp32 accumulator A away, which no token-chunked order allows: d weight sums over
all tokens, and its per-token factors need each token's full log-sum-exp first. The op's
``weight_grad="backward"`` takes the other order for d weight (vocabulary tiles in the backward, a
fourth GEMM; :mod:`megatron_burst.loss.vocab_pass`) and reaches it: the two gradients + <= 1 MiB. With Megatron's
gradient-accumulation fusion (``accumulate_into_main_grad``) the bf16 d weight is never allocated
(A is added into the fp32 ``main_grad``), so the op's peak there is D + A + one chunk.

**One read of the logits when the forward forms d hidden alone** (``weight_grad="backward"``, or a
frozen weight; 16-bit inputs): step 2 reads each fp32 logit twice (statistics, then G), 10 B per
logit with G's write. But a factor per token commutes with the d hidden GEMM -- row t of G W
scales with row t of G -- so G need not be normalized before it: the kernel stores E = exp(z -
r_t) with a reference r_t known at the row's first tile (that tile's max) and sums it in the same
walk (``ce_rows(unnormalized=True)``; 6 B per logit, one exp instead of two). Then D_t = w_t (E
W)_t exp(r_t - M_t) / S_t, with the global statistics M, S combined over TP as before, in fp32
(the product E W has an fp32 output in the logits' storage, no longer read) and rounded once. Two
columns are left out of E and added exactly in fp32 instead: the target's, w (p - 1) W_target
(p rounded and 1 subtracted would lose p - 1 for a confident token), and the row's max's, p_max
W_max (the old G rounded p ~ 1 nearly exactly; exp(m - r) is rounded at an arbitrary mantissa).
Its d hidden error is then at most the two-read forward's (in an emulation over logits of std
1-5 and rows with one far logit). A row whose later logits exceed r_t by more than
``triton_kernels.REF_SPAN`` (40: exp(40) keeps G, its sum and the fp32 GEMM far from overflow) is
walked again from its true max, in the kernel. The stored per-token statistics are then (r, sum
exp(z - r)) rather than (max, sum exp(z - max)): the same log-sum-exp, and every consumer forms
exp(z - m) / s. Its D is stored times 1 / sum(wts) (:func:`hidden_grad_prescale`, applied in the
same fp32 combine): the backward's factor c / that is 1 for the usual objective sum(loss * mask) /
sum(mask), so d hidden is rounded once, not twice (1.7e-3 against 2.4e-3 in the interpreted
precision test). (Run 4's H100 profile of the lean mode at (16K, 128K, 4096) had 12 ms in the two
softmax-gradient passes; by their bytes ~7 ms of it the forward's, ~4 ms with one read -- not yet
timed.)

Default chunk (:func:`default_token_chunk`): T = FAST_CHUNK_BYTES (1 GiB) / (V_local x bytes per
logit), at least 1024 tokens when memory allows (GEMM 4's intensity above), then capped so that
the chunk plus D and A fit in half of the device's free memory (CUDA; plus the allocator's cached
free blocks), rounded down to a multiple of 512 (256, 128) tokens, and never more than N. At V =
128K: 1024 tokens; V = 32K: 5120; TP = 2 at V = 128K: 2560. Under TP the ranks agree on it (one
MIN all-reduce per shape, cached: see :func:`megatron_burst.loss.config.make_loss_config`), since
the number of chunks fixes the number of collectives.

Why this should beat the unfused path and CCE on Hopper: the GEMMs are the unfused path's
(cuBLAS, same shapes up to the chunking of one dimension; ~75 ms of the unfused path's 100 ms at
the issue's shape on an H200), the logits-sized traffic drops from ~46 B to 18 B per logit in one
kernel instead of several (~25 ms -> ~8 ms), and nothing N x V is allocated (the unfused path's
24 GiB). The torch path of this op (172 ms there) lost its time in its weight-gradient
accumulation -- an fp32 product per vocabulary tile written to a temporary and added to A, 8 V d
B per chunk on top of the GEMM, over 32 chunks of 512 tokens -- and in ~10 elementwise passes per
chunk; here the accumulation happens in the GEMM's epilogue, over half as many chunks. Cut
Cross-Entropy recomputes the logits in its backward -- a fourth 2 N V d GEMM -- and makes up for
it by skipping gradient blocks whose softmax values are negligible (its default gradient
filtering; presumably where its 1e-2 gradient error at that shape comes from); this path skips
nothing and computes the logits once.

CPU (``TRITON_INTERPRET=1``, the tests): the same walk with the GEMMs as fp32 torch matmuls of the
(exactly representable) bf16 values -- the products are exact in fp32, as on the tensor cores, so
only the order of the fp32 sums differs from cuBLAS.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.loss import triton_kernels
from megatron_burst.loss.config import (FAST_CHUNK_BYTES, MIN_EFFICIENT_CHUNK, LossConfig, bytes_per_logit,  # noqa: F401
                                         fast_token_chunk as default_token_chunk, local_targets)
from megatron_burst.loss.parallel import all_reduce_stats

__all__ = ["chunked_forward", "recompute_grads", "reads_once", "hidden_grad_prescale", "per_token_stats",
           "stats_rows", "default_token_chunk",
           "bytes_per_logit", "weight_grad_mode",
           "FAST_CHUNK_BYTES", "MIN_EFFICIENT_CHUNK"]

logger = logging.getLogger("megatron_burst.loss")

# Whether a forward that forms d hidden alone (no d weight) reads each logit once (module switch for
# tests and benchmarks; see the module docstring).
ONE_READ_FORWARD = True
# Whether the one-read forward's per-chunk epilogue at TP = 1 -- the per-token factors, d hidden's
# two fp32 column terms and its rounding, the loss and the statistics -- is one Triton launch
# (``triton_kernels.dh_rows``) instead of ~25 torch ops (six of them [T, d]-sized passes); under TP
# the statistics are all-reduced between, so the torch ops remain (module switch).
FUSED_EPILOGUE = True

# ------------------------------------------------------------------------------------- the GEMMs

_ADDMM_F32: dict[str, bool] = {}  # device -> torch.addmm(fp32 C, bf16, bf16, out_dtype=fp32, out=C) works


def _addmm_fp32_works(device: torch.device) -> bool:
    """Whether this torch accumulates a bf16 GEMM into an fp32 C in place, honouring alpha, and with
    beta = 0 ignores C's content (NaN included) (checked once per device)."""
    key = str(device)
    if key not in _ADDMM_F32:
        ok = False
        try:
            g = torch.Generator().manual_seed(0)
            c = torch.randn(48, 40, generator=g).to(device)
            a = torch.randn(24, 48, generator=g).to(device=device, dtype=torch.bfloat16)
            b = torch.randn(24, 40, generator=g).to(device=device, dtype=torch.bfloat16)
            prod = a.float().t() @ b.float()
            want = c + 0.375 * prod
            out = torch.addmm(c, a.t(), b, out_dtype=torch.float32, alpha=0.375, out=c)
            fresh = torch.full_like(c, float("nan"))
            torch.addmm(fresh, a.t(), b, out_dtype=torch.float32, beta=0.0, alpha=0.375, out=fresh)
            ok = (out.data_ptr() == c.data_ptr() and bool(torch.allclose(c, want, rtol=1e-4, atol=1e-4))
                  and bool(torch.allclose(fresh, 0.375 * prod, rtol=1e-4, atol=1e-4)))
            why = "" if ok else "it did not accumulate in place (with alpha, or beta = 0 over NaN)"
        except (RuntimeError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
        if not ok:  # a slower path (an fp32 product and an add per GEMM): said, never silent
            logger.warning("megatron-burst: torch %s cannot accumulate a bf16 GEMM into an fp32 buffer in place on "
                           "%s (torch.addmm(out_dtype=float32, out=C): %s); the fused loss forms d weight through "
                           "an fp32 tile buffer instead (an extra pass per tile; torch >= 2.8 has it)",
                           torch.__version__, device, why)
        _ADDMM_F32[key] = ok
    return _ADDMM_F32[key]


def weight_grad_mode(device: torch.device) -> str:
    """How GEMM 4 accumulates A for 16-bit inputs on ``device``: "in-GEMM" or "tile buffer" (older torch)."""
    if device.type != "cuda":
        return "fp32 matmul (CPU)"
    return "in-GEMM" if _addmm_fp32_works(device) else "tile buffer"


def _logits(h: torch.Tensor, weight: torch.Tensor, w32: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out [T, V_local] fp32 <- h W^T with fp32 accumulation and no rounding to the input dtype."""
    if h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    elif h.is_cuda:
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    else:  # CPU (interpreter tests): bf16 values and their products are exact in fp32
        torch.mm(h.float(), w32.t(), out=out)


def _weight_grad_accumulate(A: torch.Tensor, G: torch.Tensor, h: torch.Tensor, first: bool, cfg: LossConfig) -> None:
    """A [V_local, d] fp32 (+)= G^T h; ``first``: overwrite (A is uninitialized)."""
    if G.dtype == torch.float32:
        if first:
            torch.mm(G.t(), h, out=A)
        else:
            A.addmm_(G.t(), h)
        return
    if not G.is_cuda:  # CPU: exact products in fp32, tile-sized temporaries
        h32 = h.float()
        for a in range(0, cfg.v_local, cfg.vocab_chunk):
            b = min(a + cfg.vocab_chunk, cfg.v_local)
            if first:
                torch.mm(G[:, a:b].t().float(), h32, out=A[a:b])
            else:
                A[a:b].addmm_(G[:, a:b].t().float(), h32)
        return
    if first:
        torch.mm(G.t(), h, out_dtype=torch.float32, out=A)
    elif _addmm_fp32_works(G.device):
        torch.addmm(A, G.t(), h, out_dtype=torch.float32, out=A)
    else:
        for a in range(0, cfg.v_local, cfg.vocab_chunk):
            b = min(a + cfg.vocab_chunk, cfg.v_local)
            A[a:b].add_(torch.mm(G[:, a:b].t(), h, out_dtype=torch.float32))


# ----------------------------------------------------------------------------------- the walk


class _Chunk:
    """The buffers every chunk reuses: fp32 logits [T, V_local] and, for 16-bit inputs, G in the
    input dtype (fp32 inputs: G overwrites the logits in place). Leading slices serve a short last
    chunk (a leading slice of flat storage is contiguous for any row count). ``dh_fp32``: the
    one-read forward's fp32 product G W [T, d] -- in the logits' storage (no longer read once G
    is written) unless V_local < d."""

    def __init__(self, cfg: LossConfig, rows: int, dtype: torch.dtype, device: torch.device, need_grad: bool,
                 d: int = 0, dh_fp32: bool = False):
        t = min(cfg.token_chunk, rows)
        n = cfg.v_local * t
        self.z = torch.empty(n, dtype=torch.float32, device=device)
        self.g = torch.empty(n, dtype=dtype, device=device) if need_grad and dtype != torch.float32 else None
        self.d = d
        self.p = None if not dh_fp32 else (self.z if d <= cfg.v_local else torch.empty(t * d, device=device))

    def views(self, cfg: LossConfig, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = cfg.v_local * t
        z = self.z[:n].view(t, cfg.v_local)
        return z, (z if self.g is None else self.g[:n].view(t, cfg.v_local))

    def product(self, t: int) -> torch.Tensor:
        """The one-read forward's fp32 [t, d] product buffer (overlaps the logits)."""
        return self.p[:t * self.d].view(t, self.d)


def _stats(z: torch.Tensor, tgt: torch.Tensor, hit: torch.Tensor, cfg: LossConfig,
           G: Optional[torch.Tensor], wts: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (max M, sum exp(z - M), z_target - M) of a chunk, [T] fp32 each; with G (and wts)
    also G = wts (softmax - onehot). TP = 1: one launch; TP > 1: statistics, two all-reduces, gradient."""
    st = torch.empty(3, z.shape[0], dtype=torch.float32, device=z.device)
    if cfg.tp_size == 1:
        triton_kernels.ce_rows(z, tgt, st, grad=G, wts=wts)
        return st[0], st[1], torch.where(hit, st[2] - st[0], 0.0)
    triton_kernels.ce_rows(z, tgt, st)
    m, s, zt_rel = _combine_over_tp(st[0], st[1], st[2], hit, cfg)
    if G is not None:
        st[0], st[1] = m, s
        triton_kernels.ce_rows(z, tgt, st, grad=G, wts=wts, compute_stats=False)
    return m, s, zt_rel


def _combine_over_tp(m_loc: torch.Tensor, s_loc: torch.Tensor, zt: torch.Tensor, hit: torch.Tensor,
                     cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (reference m_loc, sum exp(z - m_loc), target logit) -> the global (M, sum exp(z - M),
    z_target - M), [T] fp32 each: a MAX all-reduce, then one SUM all-reduce for both sums (only the
    rank holding a token's target contributes its logit)."""
    m = m_loc.clone()
    all_reduce_stats(m, dist.ReduceOp.MAX, cfg)
    sums = torch.stack([s_loc * torch.exp(m_loc - m), torch.where(hit, zt - m, 0.0)])
    all_reduce_stats(sums, dist.ReduceOp.SUM, cfg)
    return m, sums[0], sums[1]


def _unnormalized_factors(st: torch.Tensor, tgt: torch.Tensor, hit: torch.Tensor, cfg: LossConfig
                          ) -> tuple[torch.Tensor, ...]:
    """The one-read forward's per-token factors from ``ce_rows(unnormalized=True)``'s statistics st
    [5, T] (this rank's reference r_t, sum exp(z - r_t), target logit, max, max's column), whose E
    holds exp(z - r_t) with 0 at the target's column and at the row's max's.

    Returns the global (reference M, sum exp(z - M), z_target - M) as :func:`_stats` does, the
    per-row factor exp(r_t - M_t) / S_t that turns E W into this rank's part of P W (P the
    softmax), the target's probability where this rank holds the target (else 0), the probability
    of this rank's max where it is not the target (else 0) and that max's column; [T] each (fp32,
    the column int64). TP > 1: :func:`_stats`'s two all-reduces."""
    r, s_loc, zt, top, top_col = st
    if cfg.tp_size == 1:
        m, s, scale, zt_rel = r, s_loc, s_loc.reciprocal(), torch.where(hit, zt - r, 0.0)
    else:
        m, s, zt_rel = _combine_over_tp(r, s_loc, zt, hit, cfg)
        scale = torch.exp(r - m) / s
    top_col = top_col.long()
    p_tgt = torch.where(hit, torch.exp(zt - r) * scale, 0.0)
    p_top = torch.where(hit & (top_col == tgt), 0.0, torch.exp(top - r) * scale)
    return m, s, zt_rel, scale, p_tgt, p_top, top_col


def _product(E: torch.Tensor, weight: torch.Tensor, w32: Optional[torch.Tensor], P: torch.Tensor) -> None:
    """P [T, d] fp32 <- E W (E [T, V_local] 16-bit), fp32 accumulation, no rounding to 16 bits."""
    if E.is_cuda:
        torch.mm(E, weight, out_dtype=torch.float32, out=P)
    else:  # CPU (interpreter tests): bf16 values and their products are exact in fp32
        torch.mm(E.float(), w32, out=P)


def _hidden_grad_unnormalized(P: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, p_tgt: torch.Tensor,
                              p_top: torch.Tensor, top_col: torch.Tensor, wts: torch.Tensor, tgt: torch.Tensor,
                              hit: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, d] <- wts_t (scale_t P_t + p_top_t W_top + [hit_t] (p_tgt_t - 1) W_tgt) with P = E W
    (fp32, :func:`_product`; overwritten): this rank's part of G W for the one-read forward (E is 0
    at both columns, whose terms are formed here in fp32), rounded once, as G W straight from the
    GEMM would be. Under TP; at TP = 1 ``triton_kernels.dh_rows`` forms the same in one launch."""
    P.mul_((wts * scale)[:, None])
    P.addcmul_(weight.index_select(0, tgt.clamp(min=0)), torch.where(hit, wts * (p_tgt - 1.0), 0.0)[:, None])
    P.addcmul_(weight.index_select(0, top_col), (wts * p_top)[:, None])
    out.copy_(P)


def reads_once(dtype: torch.dtype, need_dh: bool, need_dw: bool) -> bool:
    """Whether :func:`chunked_forward` takes the one-read walk: d hidden alone (no d weight in the
    forward), 16-bit inputs (fp32: G overwrites z, which a row walked again would need)."""
    return ONE_READ_FORWARD and need_dh and not need_dw and dtype != torch.float32


def hidden_grad_prescale(wts: torch.Tensor) -> torch.Tensor:
    """The factor the one-read forward's D carries: 1 / sum(wts) (1 without weight), 0-dim fp32.

    D is rounded to 16 bits once in the forward and again when the backward scales it by the
    objective's factor c -- unless that product is exact: the usual objective sum(loss * mask) /
    sum(mask) has c = 1 / sum(mask), so D stored already times it is scaled by c / prescale = 1 (or
    a power of two, e.g. 1 / micro-batches) and its second rounding vanishes. Any other c costs the
    second rounding as before. The weights are the same on every TP rank, so is this factor."""
    total = wts.sum()
    return torch.where(total > 0, 1.0 / total, torch.ones_like(total))


def per_token_stats(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_all, s_all): the two [n] fp32 rows of one [2, n] buffer, so that the weight-gradient pass
    reads them in place as its [2, n] statistics (:func:`stats_rows`)
    instead of stacking a copy beside the gradients at the backward's peak."""
    both = torch.empty(2, n, dtype=torch.float32, device=device)
    return both[0], both[1]


def stats_rows(m_all: torch.Tensor, s_all: torch.Tensor) -> torch.Tensor:
    """[2, N] fp32 rows (m, s): a view where m_all and s_all are the rows of one [2, N] buffer (as the
    forward makes them: :func:`per_token_stats`), else a stacked copy."""
    n = m_all.numel()
    if (m_all.dim() == s_all.dim() == 1 and m_all.stride(0) == s_all.stride(0) == 1 and s_all.numel() == n
            and m_all.dtype == s_all.dtype == torch.float32
            and m_all.untyped_storage().data_ptr() == s_all.untyped_storage().data_ptr()
            and s_all.storage_offset() == m_all.storage_offset() + n):
        return m_all.as_strided((2, n), (n, 1))
    return torch.stack([m_all, s_all])


def _upcast_weight(h: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    return weight.float() if (not h.is_cuda and h.dtype != torch.float32) else None


def chunked_forward(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, wts: Optional[torch.Tensor],
                    cfg: LossConfig, need_dh: bool, need_dw: bool):
    """The contract of :func:`megatron_burst.loss.chunks.chunked_forward` on the fast path; where
    :func:`reads_once`, D is times :func:`hidden_grad_prescale` (wts)."""
    N, d = h.shape
    need_grad = need_dh or need_dw
    loss = torch.empty(N, dtype=torch.float32, device=h.device)
    m_all, s_all = per_token_stats(N, h.device)
    D = torch.empty_like(h) if need_dh else None
    A = torch.empty(cfg.v_local, d, dtype=torch.float32, device=h.device) if need_dw else None
    if N == 0:
        return loss, m_all, s_all, D, None if A is None else A.zero_()
    weight = weight.contiguous()
    w32 = _upcast_weight(h, weight)
    # d hidden alone (weight_grad="backward", or a frozen weight), 16-bit: the one-read kernel (G's
    # normalization moves past the GEMM), and D comes out times hidden_grad_prescale(wts)
    one_read = reads_once(h.dtype, need_dh, need_dw)
    w_dh = wts * hidden_grad_prescale(wts) if one_read else None
    bufs = _Chunk(cfg, N, h.dtype, h.device, need_grad, d, dh_fp32=one_read)
    tgt_all, hit_all = local_targets(labels, cfg)  # once for all chunks: no small launches per chunk
    for a in range(0, N, cfg.token_chunk):
        r = slice(a, min(a + cfg.token_chunk, N))
        hr = h[r]
        z, G = bufs.views(cfg, r.stop - a)
        _logits(hr, weight, w32, z)
        tgt, hit = tgt_all[r], hit_all[r]
        if one_read:
            st = torch.empty(5, r.stop - a, dtype=torch.float32, device=h.device)
            triton_kernels.ce_rows(z, tgt, st, grad=G, unnormalized=True)
            P = bufs.product(r.stop - a)  # in z's storage: z is not read again
            _product(G, weight, w32, P)
            if FUSED_EPILOGUE and cfg.tp_size == 1:
                triton_kernels.dh_rows(P, weight, D[r], st, tgt, labels[r], w_dh[r], loss[r], m_all[r], s_all[r],
                                       cfg.ignore_index)
                continue
            m, s, zt, scale, p_tgt, p_top, top_col = _unnormalized_factors(st, tgt, hit, cfg)
        else:
            m, s, zt = _stats(z, tgt, hit, cfg, G if need_grad else None, wts[r] if need_grad else None)
        loss[r] = torch.where(labels[r] != cfg.ignore_index, torch.log(s) - zt, 0.0)
        m_all[r], s_all[r] = m, s
        if one_read:
            _hidden_grad_unnormalized(P, weight, scale, p_tgt, p_top, top_col, w_dh[r], tgt, hit, D[r])
        elif need_dh:
            torch.mm(G, weight, out=D[r])
        if need_dw:
            _weight_grad_accumulate(A, G, hr, a == 0, cfg)
    return loss, m_all, s_all, D, A


def recompute_grads(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, m_all: torch.Tensor,
                    s_all: torch.Tensor, g: torch.Tensor, cfg: LossConfig, need_dh: bool, need_dw: bool):
    """The contract of :func:`megatron_burst.loss.chunks.recompute_grads` on the fast path."""
    N, d = h.shape
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.empty(cfg.v_local, d, dtype=torch.float32, device=h.device) if need_dw else None
    if N == 0:
        return dh, None if dw is None else dw.zero_()
    weight = weight.contiguous()
    w32 = _upcast_weight(h, weight)
    bufs = _Chunk(cfg, N, h.dtype, h.device, True)
    tgt_all, _ = local_targets(labels, cfg)
    stats_all, g = stats_rows(m_all, s_all), g.contiguous()  # once, not per chunk
    for a in range(0, N, cfg.token_chunk):
        r = slice(a, min(a + cfg.token_chunk, N))
        hr = h[r]
        z, G = bufs.views(cfg, r.stop - a)
        _logits(hr, weight, w32, z)
        triton_kernels.ce_rows(z, tgt_all[r], stats_all[:, r], grad=G, wts=g[r], compute_stats=False)
        if need_dh:
            torch.mm(G, weight, out=dh[r])
        if need_dw:
            _weight_grad_accumulate(dw, G, hr, a == 0, cfg)
    return dh, dw
