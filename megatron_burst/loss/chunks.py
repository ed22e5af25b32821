"""The chunk walker: one token chunk at a time, logits tile by tile, loss and gradients per chunk.

Per chunk (``LossConfig.token_chunk`` tokens) the logits live transposed in one reused fp32
buffer ``buf`` ([V_local, T], contiguous): a tile of vocabulary rows is then a contiguous slice,
and both gradient matmuls read ``buf`` (or its transpose) as is. This is the "torch" implementation
(GEMMs plus torch elementwise passes, any device); ``LossConfig.impl == "triton"`` hands the whole
walk to :mod:`megatron_burst.loss.fast` (cuBLAS GEMMs with fp32 logits and an in-GEMM fp32
weight-gradient accumulator, one fused Triton pass per chunk).

Whole sequences: :func:`chunked_forward` (loss, per-token stats and, on request, the gradient
factors D and A of the fused op), :func:`recompute_grads` (exact gradients for any incoming
per-token gradient, recomputing each chunk's logits) and :func:`loss_without_grad` (inference).
None reduces anything over TP but the per-token statistics; the callers own the hidden-gradient
reduction (:mod:`.parallel`).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_burst.loss import fast
from megatron_burst.loss.config import LossConfig, local_targets
from megatron_burst.loss.parallel import all_reduce_stats, gather_sequence

__all__ = ["chunked_forward", "hidden_grad_prescaled", "recompute_grads", "loss_without_grad"]

# torch.mm(bf16, bf16, out_dtype=torch.float32) (CUDA only; torch >= 2.8 has the overload).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


# ------------------------------------------------------------------------------- one token chunk


def _logits_torch(h: torch.Tensor, weight: torch.Tensor, buf: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """buf <- (h W^T)^T tile by tile over the vocabulary (fp32); returns the local running max [T]."""
    run_max = None
    for a in range(0, cfg.v_local, cfg.vocab_chunk):
        b = min(a + cfg.vocab_chunk, cfg.v_local)
        if h.dtype == torch.float32:
            torch.mm(weight[a:b], h.t(), out=buf[a:b])
        else:
            # Logits in the input dtype, then fp32 -- the rounding Megatron's path has (its output
            # layer returns bf16 logits, which vocab_parallel_cross_entropy converts to fp32).
            buf[a:b].copy_(torch.mm(weight[a:b], h.t()))
        tile_max = buf[a:b].amax(dim=0)
        run_max = tile_max if run_max is None else torch.maximum(run_max, tile_max, out=run_max)
    return run_max


def _chunk_forward(h: torch.Tensor, weight: torch.Tensor, tgt: torch.Tensor, hit: torch.Tensor,
                   buf: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of one chunk into buf; returns the global (max M, sum exp(z - M), z_target - M), [T]
    each, and leaves exp(z - M) in buf."""
    m = _logits_torch(h, weight, buf, cfg)
    z_tgt = buf.gather(0, tgt[None])[0]
    all_reduce_stats(m, dist.ReduceOp.MAX, cfg)
    buf.sub_(m).exp_()
    s = buf.sum(dim=0)
    # One all-reduce for both sums; only the rank holding a token's target contributes its logit.
    sums = torch.stack([s, torch.where(hit, z_tgt - m, 0.0)])
    all_reduce_stats(sums, dist.ReduceOp.SUM, cfg)
    return m, sums[0], sums[1]


def _chunk_recompute(h: torch.Tensor, weight: torch.Tensor, m: torch.Tensor, buf: torch.Tensor,
                     cfg: LossConfig) -> None:
    """Recompute a chunk's logits into buf, in the state :func:`_chunk_forward` leaves it in."""
    _logits_torch(h, weight, buf, cfg)
    buf.sub_(m).exp_()


def _chunk_grad(buf: torch.Tensor, m: torch.Tensor, s: torch.Tensor, tgt: torch.Tensor, hit: torch.Tensor,
                wts: torch.Tensor, gbuf: Optional[torch.Tensor], cfg: LossConfig) -> torch.Tensor:
    """G = wts * (softmax - onehot), [V_local, T], in the matmul dtype (gbuf, or buf itself for fp32)."""
    # w * (e / s - onehot) as e * (w / s) - w * onehot: one pass over the tile instead of two
    # (Megatron divides, subtracts, then multiplies; the results differ by one rounding at most).
    buf.mul_(wts / s)
    buf.scatter_add_(0, tgt[None], -(wts * hit)[None])  # -w at the target, -0 elsewhere
    if gbuf is None:
        return buf
    gbuf.copy_(buf)
    return gbuf


def _chunk_matmuls(G: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, dh_out: Optional[torch.Tensor],
                   dw_acc: Optional[torch.Tensor], cfg: LossConfig) -> None:
    """dh_out <- G^T W ([T, d], input dtype); dw_acc += G h ([V_local, d], fp32 accumulator)."""
    if dh_out is not None:
        torch.mm(G.t(), weight, out=dh_out)
    if dw_acc is not None:
        if G.dtype == torch.float32:
            dw_acc.addmm_(G, h)
            return
        # bf16 operands (as Megatron's weight-gradient GEMM) with fp32 products and sums, added to
        # the fp32 accumulator unrounded: a bf16 product per chunk would round every chunk's
        # partial sum, where Megatron rounds the total once (and not at all into main_grad).
        # Tiled over the vocabulary so the fp32 partial product stays tile-sized.
        fast = G.is_cuda and _MM_OUT_DTYPE
        h32 = None if fast else h.float()
        for a in range(0, cfg.v_local, cfg.vocab_chunk):
            b = min(a + cfg.vocab_chunk, cfg.v_local)
            if fast:  # cuBLAS bf16 GEMM with an fp32 result
                dw_acc[a:b].add_(torch.mm(G[a:b], h, out_dtype=torch.float32))
            else:  # bf16 values are exact in fp32 and so are their products: the same sums
                dw_acc[a:b].addmm_(G[a:b].float(), h32)


# ----------------------------------------------------------------------------------- the walker


class _Buffers:
    """The chunk's logits buffer (fp32) and, for bf16, its matmul-dtype copy; reused by every chunk."""

    def __init__(self, cfg: LossConfig, rows: int, dtype: torch.dtype, device: torch.device):
        n = cfg.v_local * min(cfg.token_chunk, rows)
        self.flat = torch.empty(n, dtype=torch.float32, device=device)
        self.gflat = None if dtype == torch.float32 else torch.empty(n, dtype=dtype, device=device)

    def views(self, cfg: LossConfig, t: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        n = cfg.v_local * t  # a leading slice of flat storage is contiguous for any t
        buf = self.flat[:n].view(cfg.v_local, t)
        return buf, None if self.gflat is None else self.gflat[:n].view(cfg.v_local, t)


def _chunks(h: torch.Tensor, labels: torch.Tensor, cfg: LossConfig) -> Iterator[tuple]:
    """Walk the tokens in chunks: yields (rows slice, buf, gbuf, local target, hit) per chunk, the
    buffers shared by every chunk (see :class:`_Buffers`) and the targets from
    :func:`~megatron_burst.loss.config.local_targets`."""
    N = h.shape[0]
    bufs = _Buffers(cfg, N, h.dtype, h.device)
    for a in range(0, N, cfg.token_chunk):
        rows = slice(a, min(a + cfg.token_chunk, N))
        buf, gbuf = bufs.views(cfg, rows.stop - a)
        yield (rows, buf, gbuf) + local_targets(labels[rows], cfg, none=0)


def hidden_grad_prescaled(cfg: LossConfig, dtype: torch.dtype, need_dh: bool, need_dw: bool) -> bool:
    """Whether :func:`chunked_forward` returns D times ``fast.hidden_grad_prescale(wts)``: the fast
    path's one-read forward (:func:`megatron_burst.loss.fast.reads_once`)."""
    return cfg.impl == "triton" and fast.reads_once(dtype, need_dh, need_dw)


def chunked_forward(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, wts: Optional[torch.Tensor],
                    cfg: LossConfig, need_dh: bool, need_dw: bool):
    """Loss and per-token stats of all N tokens; with need_dh/need_dw also D and A (see fused.py).

    h: [N, d] (full sequence), weight: [V_local, d], labels: [N], wts: [N] fp32 (the weights D and A
    are reduced with; None without need_dh/need_dw). Returns loss, m, s ([N]
    fp32), D ([N, d], h's dtype, partial over this rank's vocabulary -- not yet reduced over TP --
    or None) and A ([V_local, d] fp32, or None); D times fast.hidden_grad_prescale(wts) where
    :func:`hidden_grad_prescaled`.
    """
    if cfg.impl == "triton":
        return fast.chunked_forward(h, weight, labels, wts, cfg, need_dh, need_dw)
    N, d = h.shape
    loss = torch.empty(N, dtype=torch.float32, device=h.device)
    m_all, s_all = fast.per_token_stats(N, h.device)
    D = torch.empty_like(h) if need_dh else None
    A = torch.zeros(cfg.v_local, d, dtype=torch.float32, device=h.device) if need_dw else None
    for r, buf, gbuf, tgt, hit in _chunks(h, labels, cfg):
        m, s, z_tgt = _chunk_forward(h[r], weight, tgt, hit, buf, cfg)
        loss[r] = torch.where(labels[r] != cfg.ignore_index, torch.log(s) - z_tgt, 0.0)
        m_all[r], s_all[r] = m, s
        if need_dh or need_dw:
            G = _chunk_grad(buf, m, s, tgt, hit, wts[r], gbuf, cfg)
            _chunk_matmuls(G, h[r], weight, D[r] if need_dh else None, A, cfg)
    return loss, m_all, s_all, D, A


def recompute_grads(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, m_all: torch.Tensor,
                    s_all: torch.Tensor, g: torch.Tensor, cfg: LossConfig, need_dh: bool, need_dw: bool):
    """Exact gradients for any per-token g by recomputing each chunk's logits (3 matmuls per chunk).

    h: [N, d] (full sequence); g: [N] fp32, already 0 at ignored labels. Returns (d hidden [N, d]
    in h's dtype, partial over this rank's vocabulary -- not yet reduced over TP -- or None,
    d weight [V_local, d] as an fp32 accumulator, or None).
    """
    if cfg.impl == "triton":
        return fast.recompute_grads(h, weight, labels, m_all, s_all, g, cfg, need_dh, need_dw)
    N, d = h.shape
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.zeros(cfg.v_local, d, dtype=torch.float32, device=h.device) if need_dw else None
    for r, buf, gbuf, tgt, hit in _chunks(h, labels, cfg):
        _chunk_recompute(h[r], weight, m_all[r], buf, cfg)
        G = _chunk_grad(buf, m_all[r], s_all[r], tgt, hit, g[r], gbuf, cfg)
        _chunk_matmuls(G, h[r], weight, dh[r] if need_dh else None, dw, cfg)
    return dh, dw


def loss_without_grad(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      cfg: LossConfig) -> torch.Tensor:
    """The per-token loss alone [N] fp32 (inference / no parameter needs a gradient): no gradient work.

    hidden: [n, d] (this rank's sequence shard under sequence parallelism), labels: [N] (checked
    by the caller: :func:`~megatron_burst.loss.config.check_labels`).
    """
    h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
    return chunked_forward(h, weight, labels, None, cfg, False, False)[0]
