"""Fused vocab-parallel LM head + cross-entropy (BurstEngine §3.3, "sequence-level fusion").

Megatron's unfused path materializes the logits ``[N, V/tp]`` (and their fp32 copy, softmax and
gradient, each as large) -- at long sequence and 128K vocabularies the largest tensors of the
whole step. This op walks the tokens in chunks of ``token_chunk`` and, per chunk, computes the
chunk's logits [token_chunk, V/tp] tile by tile over the vocabulary (``vocab_chunk`` rows at a
time, running max in fp32) into one reused fp32 buffer, finishes the loss *and* the gradients of
that chunk, and moves on: nothing of size N x V is ever allocated, and the backward does no
matmul over the vocabulary. Keeping the chunk's logits until its gradients are formed is what
avoids recomputing them (BurstEngine's point against CCE-style schemes): the forward does the
same three GEMMs the unfused path does (logits, d hidden, d weight), no fourth.

Gradient exactness. The per-token loss l_t has d l_t / d z_t = p_t - y_t (softmax minus one-hot),
so for an incoming per-token gradient g_t

    d hidden_t = g_t * (p_t - y_t) W            (a row scaling of a per-token quantity)
    d W        = sum_t g_t * (p_t - y_t)^T h_t  (a sum over tokens, weighted by g)

g is not known in the forward. d hidden is exact for any g if the forward stores the per-token
factor. d W cannot be pre-reduced for an unknown g -- except up to a scalar: in Megatron the loss
is ``sum(loss * loss_mask) / num_tokens``, so g_t = c * loss_mask_t with one scalar c. The forward
therefore reduces with the weights ``w_t = loss_mask_t`` (1 if no mask is given; 0 for ignored
labels) and stores

    D = w * (p - y) W   [N, d] (input dtype),   A = sum_t w_t (p_t - y_t)^T h_t   [V/tp, d] (fp32).

The backward checks that the incoming g is proportional to w on the non-ignored tokens
(|g_t - c w_t| <= 4u |c w_t|, u = 2^-24 the fp32 unit roundoff: the rounding with which g itself
is computed, e.g. mask * (1/num_tokens)) and then returns ``c * D`` and ``c * A``: exact, with no
matmul. ("Exact" throughout: the unfused gradient's value, up to the rounding of reordered sums.)
If g is *not* proportional (a different mask, per-token weights, a loss that mixes in other terms
of the per-token losses, ...), the backward takes the recompute path instead: it recomputes each
chunk's logits from the saved hidden states and the forward's per-token max / sum-exp and forms
the gradients with the actual g -- exact for every g, at the cost of the three matmuls again. That path is counted in
:data:`backward_paths` and announced once by :class:`FusedLossRecomputeWarning`, so a caller
whose mask does not match sees it and can pass the right ``loss_mask``.

Tensor parallelism matches Megatron's ``ColumnParallelLinear`` output layer followed by
``vocab_parallel_cross_entropy``: rank r holds vocabulary rows [r V/tp, (r+1) V/tp); per chunk the
max is all-reduced (MAX), then the sum-exp and the target logit (SUM, one call) -- two small
all-reduces per chunk, so fewer, larger chunks cost less latency; the hidden gradient is
all-reduced in the backward (as the layer's input-gradient all-reduce does). With
``sequence_parallel=True`` the hidden states arrive as sequence shards: they are all-gathered in
the forward and the hidden gradient is reduce-scattered, as Megatron's sequence-parallel output
layer does.
"""
from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.loss import triton_kernels

__all__ = ["fused_linear_cross_entropy", "backward_paths", "FusedLossRecomputeWarning", "DEFAULT_TILE_ELEMS"]

# Default logits tile of one token chunk: token_chunk * V_local <= this many fp32 values (256 MiB).
DEFAULT_TILE_ELEMS = 1 << 26
DEFAULT_VOCAB_CHUNK = 16384
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# g_t may deviate from c * w_t by this relative amount (4u) and still count as proportional: g is
# itself computed in fp32 (e.g. mask * (1/num_tokens)), so its own rounding is of this order.
PROPORTIONAL_RTOL = 4 * 2.0 ** -24

# How many backward passes took each path: "scaled" (no matmul) or "recompute" (g not proportional
# to the loss mask). Process-wide, for tests and for noticing a mismatched loss_mask.
backward_paths: collections.Counter = collections.Counter()


class FusedLossRecomputeWarning(UserWarning):
    """The incoming loss gradient was not proportional to ``loss_mask``: the backward recomputed."""


@dataclass(frozen=True)
class _Plan:
    group: Optional[dist.ProcessGroup]
    tp_size: int
    tp_rank: int
    v_local: int
    token_chunk: int
    vocab_chunk: int
    ignore_index: int
    sequence_parallel: bool
    impl: str  # "torch" or "triton"

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.v_local


# ------------------------------------------------------------------------------------ collectives


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, plan: _Plan) -> None:
    if plan.tp_size > 1:
        dist.all_reduce(t, op=op, group=plan.group)


def _gather_sequence(h: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[n, d] sequence shard -> [tp * n, d], rank-major (Megatron's sequence-parallel all-gather)."""
    if plan.tp_size == 1:
        return h
    out = h.new_empty(plan.tp_size * h.shape[0], h.shape[1])
    dist.all_gather_into_tensor(out, h.contiguous(), group=plan.group)
    return out


def _reduce_hidden_grad(dh: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Sum the per-rank partial hidden gradients (each rank saw only its vocabulary shard)."""
    if plan.tp_size == 1:
        return dh
    if plan.sequence_parallel:
        out = dh.new_empty(dh.shape[0] // plan.tp_size, dh.shape[1])
        dist.reduce_scatter_tensor(out, dh, group=plan.group)
        return out
    dist.all_reduce(dh, group=plan.group)
    return dh


# ------------------------------------------------------------------------------- one token chunk
# A chunk's logits live transposed in ``buf`` ([V_local, T] fp32, contiguous): a tile of vocabulary
# rows is then a contiguous slice, and both gradient matmuls read ``buf`` (or its transpose) as is.


def _local_targets(labels: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of the target in this rank's shard, or 0; whether this rank holds the target), [T] each."""
    local = labels - plan.vocab_start
    hit = (local >= 0) & (local < plan.v_local) & (labels != plan.ignore_index)
    return torch.where(hit, local, 0), hit


def _logits_torch(h: torch.Tensor, weight: torch.Tensor, buf: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """buf <- (h W^T)^T tile by tile over the vocabulary (fp32); returns the local running max [T]."""
    run_max = None
    for a in range(0, plan.v_local, plan.vocab_chunk):
        b = min(a + plan.vocab_chunk, plan.v_local)
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
                   buf: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of one chunk into buf; returns the global (max M, sum exp(z - M), z_target - M), [T] each.

    Afterwards buf holds exp(z - M) for the torch path and the raw logits z for the Triton path;
    :func:`_chunk_grad` and :func:`_chunk_recompute` know which.
    """
    if plan.impl == "triton":
        m_loc, s_loc, z_tgt = triton_kernels.logits_stats(h, weight, torch.where(hit, tgt, -1), buf)
        m = m_loc.clone()
        _all_reduce(m, dist.ReduceOp.MAX, plan)
        s = s_loc * torch.exp(m_loc - m)  # rescale the local sum to the global max
    else:
        m = _logits_torch(h, weight, buf, plan)
        z_tgt = buf.gather(0, tgt[None])[0]
        _all_reduce(m, dist.ReduceOp.MAX, plan)
        buf.sub_(m).exp_()
        s = buf.sum(dim=0)
    # One all-reduce for both sums; only the rank holding a token's target contributes its logit.
    sums = torch.stack([s, torch.where(hit, z_tgt - m, 0.0)])
    _all_reduce(sums, dist.ReduceOp.SUM, plan)
    return m, sums[0], sums[1]


def _chunk_recompute(h: torch.Tensor, weight: torch.Tensor, m: torch.Tensor, buf: torch.Tensor,
                     plan: _Plan) -> None:
    """Recompute a chunk's logits into buf, in the state :func:`_chunk_forward` leaves it in."""
    if plan.impl == "triton":
        no_target = torch.full((h.shape[0],), -1, dtype=torch.long, device=h.device)
        triton_kernels.logits_stats(h, weight, no_target, buf)
    else:
        _logits_torch(h, weight, buf, plan)
        buf.sub_(m).exp_()


def _chunk_grad(buf: torch.Tensor, m: torch.Tensor, s: torch.Tensor, tgt: torch.Tensor, hit: torch.Tensor,
                wts: torch.Tensor, gbuf: Optional[torch.Tensor], plan: _Plan) -> torch.Tensor:
    """G = wts * (softmax - onehot), [V_local, T], in the matmul dtype (gbuf, or buf itself for fp32)."""
    if plan.impl == "triton":
        out = buf if gbuf is None else gbuf
        return triton_kernels.softmax_grad(buf, torch.where(hit, tgt, -1), m, s, wts, out)
    # w * (e / s - onehot) as e * (w / s) - w * onehot: one pass over the tile instead of two
    # (Megatron divides, subtracts, then multiplies; the results differ by one rounding at most).
    buf.mul_(wts / s)
    buf.scatter_add_(0, tgt[None], -(wts * hit)[None])  # -w at the target, -0 elsewhere
    if gbuf is None:
        return buf
    gbuf.copy_(buf)
    return gbuf


def _chunk_matmuls(G: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, dh_out: Optional[torch.Tensor],
                   dw_acc: Optional[torch.Tensor], plan: _Plan) -> None:
    """dh_out <- G^T W ([T, d], input dtype); dw_acc += G h ([V_local, d], fp32 accumulator)."""
    if dh_out is not None:
        torch.mm(G.t(), weight, out=dh_out)
    if dw_acc is not None:
        if G.dtype == torch.float32:
            dw_acc.addmm_(G, h)
        else:
            # bf16 matmul (as Megatron's weight-gradient GEMM), accumulated over chunks in fp32;
            # tiled over the vocabulary so the bf16 partial product stays tile-sized.
            for a in range(0, plan.v_local, plan.vocab_chunk):
                b = min(a + plan.vocab_chunk, plan.v_local)
                dw_acc[a:b].add_(torch.mm(G[a:b], h))


class _Buffers:
    """The chunk's logits buffer (fp32) and, for bf16, its matmul-dtype copy; reused by every chunk."""

    def __init__(self, plan: _Plan, rows: int, dtype: torch.dtype, device: torch.device):
        n = plan.v_local * min(plan.token_chunk, rows)
        self.flat = torch.empty(n, dtype=torch.float32, device=device)
        self.gflat = None if dtype == torch.float32 else torch.empty(n, dtype=dtype, device=device)

    def views(self, plan: _Plan, t: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        n = plan.v_local * t  # a leading slice of flat storage is contiguous for any t
        buf = self.flat[:n].view(plan.v_local, t)
        return buf, None if self.gflat is None else self.gflat[:n].view(plan.v_local, t)


def _chunks(h: torch.Tensor, labels: torch.Tensor, plan: _Plan):
    """Walk the tokens in chunks: yields (rows slice, buf, gbuf, local target, hit) per chunk, the
    buffers shared by every chunk (see :class:`_Buffers`) and the targets from :func:`_local_targets`."""
    N = h.shape[0]
    bufs = _Buffers(plan, N, h.dtype, h.device)
    for a in range(0, N, plan.token_chunk):
        rows = slice(a, min(a + plan.token_chunk, N))
        buf, gbuf = bufs.views(plan, rows.stop - a)
        yield (rows, buf, gbuf) + _local_targets(labels[rows], plan)


# ------------------------------------------------------------------------------ whole sequences


def _forward(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, wts: torch.Tensor, plan: _Plan,
             need_dh: bool, need_dw: bool):
    """Loss and per-token stats of all N tokens; with need_dh/need_dw also D and A (module docstring).

    h: [N, d] (full sequence), weight: [V_local, d], labels, wts: [N]. Returns loss, m, s ([N]
    fp32), D ([N, d], h's dtype, or None) and A ([V_local, d] fp32, or None).
    """
    N, d = h.shape
    loss = torch.empty(N, dtype=torch.float32, device=h.device)
    m_all, s_all = torch.empty_like(loss), torch.empty_like(loss)
    D = torch.empty_like(h) if need_dh else None
    A = torch.zeros(plan.v_local, d, dtype=torch.float32, device=h.device) if need_dw else None
    for r, buf, gbuf, tgt, hit in _chunks(h, labels, plan):
        m, s, z_tgt = _chunk_forward(h[r], weight, tgt, hit, buf, plan)
        loss[r] = torch.where(labels[r] != plan.ignore_index, torch.log(s) - z_tgt, 0.0)
        m_all[r], s_all[r] = m, s
        if need_dh or need_dw:
            G = _chunk_grad(buf, m, s, tgt, hit, wts[r], gbuf, plan)
            _chunk_matmuls(G, h[r], weight, D[r] if need_dh else None, A, plan)
    return loss, m_all, s_all, D, A


def recompute_grads(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, m_all: torch.Tensor,
                    s_all: torch.Tensor, g: torch.Tensor, plan: _Plan, need_dh: bool, need_dw: bool):
    """Exact gradients for any per-token g by recomputing each chunk's logits (3 matmuls per chunk).

    g: [N] fp32, already 0 at ignored labels. Returns (d hidden [N, d] partial over this rank's
    vocabulary -- not yet reduced over TP -- or None, d weight [V_local, d] in weight's dtype or None).
    """
    N, d = h.shape
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.zeros(plan.v_local, d, dtype=torch.float32, device=h.device) if need_dw else None
    for r, buf, gbuf, tgt, hit in _chunks(h, labels, plan):
        _chunk_recompute(h[r], weight, m_all[r], buf, plan)
        G = _chunk_grad(buf, m_all[r], s_all[r], tgt, hit, g[r], gbuf, plan)
        _chunk_matmuls(G, h[r], weight, dh[r] if need_dh else None, dw, plan)
    return dh, None if dw is None else dw.to(weight.dtype)


def proportional_scale(g: torch.Tensor, w: torch.Tensor, valid: torch.Tensor) -> Optional[float]:
    """c with g == c * w on the valid tokens (to PROPORTIONAL_RTOL), or None if there is none.

    g, w: [N] fp32, valid: [N] bool (ignored labels have no gradient, so their g does not matter).
    """
    g = torch.where(valid, g, 0.0)
    w = torch.where(valid, w, 0.0)
    i = int(w.abs().argmax()) if w.numel() else 0
    if w.numel() == 0 or w[i] == 0:  # no token carries weight: proportional only if g is 0 too
        return 0.0 if bool((g == 0).all()) else None
    c = g[i] / w[i]  # exact for 0/1 masks: g_i = c
    expected = c * w
    if bool(((g - expected).abs() <= PROPORTIONAL_RTOL * expected.abs()).all()):
        return float(c)
    return None


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, wts: torch.Tensor,
                plan: _Plan) -> torch.Tensor:
        h = _gather_sequence(hidden, plan) if plan.sequence_parallel else hidden
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, m_all, s_all, D, A = _forward(h, weight, labels, wts, plan, need_dh, need_dw)
        ctx.plan, ctx.need = plan, (need_dh, need_dw)
        # h and weight are kept only for the recompute path (hidden is alive as an activation anyway).
        ctx.save_for_backward(h, weight, labels, wts, m_all, s_all, D, A)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        h, weight, labels, wts, m_all, s_all, D, A = ctx.saved_tensors
        plan, (need_dh, need_dw) = ctx.plan, ctx.need
        g = grad_loss.reshape(-1).float()
        valid = labels != plan.ignore_index
        c = proportional_scale(g, wts, valid)
        if c is not None:
            backward_paths["scaled"] += 1
            dh = D * c if need_dh else None
            dw = (A * c).to(weight.dtype) if need_dw else None
        else:
            backward_paths["recompute"] += 1
            warnings.warn(
                "fused_linear_cross_entropy: the incoming per-token loss gradient is not proportional to "
                "loss_mask, so the backward recomputed the logits (exact, but ~2x the LM-head time). Pass "
                "loss_mask=<the mask the per-token loss is multiplied by> to avoid it.",
                FusedLossRecomputeWarning, stacklevel=2)
            dh, dw = recompute_grads(h, weight, labels, m_all, s_all, torch.where(valid, g, 0.0), plan,
                                     need_dh, need_dw)
        if dh is not None:
            dh = _reduce_hidden_grad(dh, plan)
        return dh, dw, None, None, None


# ------------------------------------------------------------------------------------ public API


def _make_plan(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_mask, tp_group,
               ignore_index: int, sequence_parallel: bool, token_chunk, vocab_chunk, impl: str,
               name: str = "fused_linear_cross_entropy") -> _Plan:
    """Validate the arguments (errors name the value and the fix) and fix the chunking."""
    for arg, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dtype not in SUPPORTED_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} has dtype {got}; supported are torch.float32 and torch.bfloat16 "
                             f"(cast {arg} to one of them)")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{name}: hidden is {hidden.dtype} but weight is {weight.dtype}; pass both in the "
                         "same dtype (the output layer computes in the parameter dtype)")
    if weight.dim() != 2 or hidden.dim() < 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{name}: hidden {tuple(hidden.shape)} must be [..., d] and weight {tuple(weight.shape)} "
                         "this rank's vocabulary shard [V/tp, d] (V/tp >= 1) with the same d")
    if labels.device != hidden.device or weight.device != hidden.device:
        raise ValueError(f"{name}: hidden ({hidden.device}), weight ({weight.device}) and labels "
                         f"({labels.device}) must be on one device")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"{name}: labels must hold integer vocabulary ids, got dtype {labels.dtype}")
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    lead = tuple(hidden.shape[:-1])
    if sequence_parallel:
        expect = (lead[0] * tp_size,) + lead[1:]
        if tuple(labels.shape) != expect:
            raise ValueError(f"{name}: with sequence_parallel=True hidden {tuple(hidden.shape)} is this rank's "
                             f"sequence shard and labels must cover the whole sequence, shape {expect} "
                             f"(tp={tp_size}); got labels {tuple(labels.shape)}")
    elif tuple(labels.shape) != lead:
        hint = ""
        if tp_size > 1 and labels.dim() and labels.shape[0] == lead[0] * tp_size:
            hint = " (labels cover tp x hidden's sequence: pass sequence_parallel=True if hidden is a sequence shard)"
        raise ValueError(f"{name}: labels {tuple(labels.shape)} must have hidden's leading shape {lead}{hint}")
    if loss_mask is not None and (not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != labels.shape):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"{name}: loss_mask {got} must have the labels' shape {tuple(labels.shape)}")
    v_local = weight.shape[0]
    vocab = v_local * tp_size
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.numel() and bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        value = int(labels[idx])
        fix = (" -- if weight is a tensor-parallel vocabulary shard, pass tp_group" if tp_group is None and value >= 0
               else f"; mark padding with ignore_index={ignore_index}")
        raise ValueError(f"{name}: labels{list(idx)} = {value} is outside the vocabulary [0, {vocab}) "
                         f"(tp={tp_size} x {v_local} rows){fix}")
    n_tokens = max(labels.numel(), 1)
    for arg, v in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}: {arg} must be a positive int (or None for the default), got {v!r}")
    if token_chunk is None:
        # The chunk's logits tile is token_chunk x V_local fp32; bound it, not the token count.
        token_chunk = max(1, DEFAULT_TILE_ELEMS // v_local)
        if token_chunk >= 128:
            token_chunk -= token_chunk % 128  # whole GEMM tiles
    token_chunk = min(token_chunk, n_tokens)
    vocab_chunk = min(vocab_chunk or DEFAULT_VOCAB_CHUNK, v_local)
    if impl == "auto":
        # The Triton kernels are correctness-tested (interpreter) but not yet timed on a GPU; until
        # they are, torch (cuBLAS GEMMs + elementwise passes) is the measured, safe default.
        impl = "torch"
    if impl not in ("torch", "triton"):
        raise ValueError(f"{name}: impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "triton":
        triton_kernels.check_device(hidden)
    return _Plan(tp_group if tp_size > 1 else None, tp_size, tp_rank, v_local, token_chunk, vocab_chunk,
                 ignore_index, bool(sequence_parallel), impl)


def _token_weights(labels: torch.Tensor, loss_mask: Optional[torch.Tensor], ignore_index: int) -> torch.Tensor:
    """w_t = loss_mask_t (1 without a mask), 0 for ignored labels; [N] fp32."""
    valid = (labels.reshape(-1) != ignore_index).float()
    return valid if loss_mask is None else valid * loss_mask.reshape(-1).float()


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               tp_group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100,
                               loss_mask: Optional[torch.Tensor] = None, sequence_parallel: bool = False,
                               token_chunk: Optional[int] = None, vocab_chunk: Optional[int] = None,
                               impl: str = "auto") -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` without materializing the logits.

    Args:
        hidden: [..., d] final hidden states (Megatron: [s, b, d]); with ``sequence_parallel`` this
            rank's sequence shard [s/tp, b, d].
        weight: this rank's vocabulary shard [V/tp, d] of the output weight (rank r holds rows
            [r V/tp, (r+1) V/tp), as Megatron's ColumnParallelLinear / VocabParallelEmbedding); may
            be the tied embedding weight -- its gradient accumulates into the shared parameter.
        labels: global vocabulary ids with hidden's leading shape (the full sequence under
            sequence parallelism); ``ignore_index`` marks tokens without a loss.
        tp_group: the tensor-parallel group the vocabulary is split over (None: no split).
        loss_mask: the mask (or per-token weights) the caller multiplies the returned loss by. It
            is *not* applied here; it tells the forward how to pre-reduce d(weight) so the backward
            needs no matmul. A gradient not proportional to it is still exact (recompute path).
        sequence_parallel: hidden is sequence-sharded over ``tp_group`` (all-gathered here, its
            gradient reduce-scattered), as with Megatron's ``--sequence-parallel``.
        token_chunk: tokens per chunk (default: DEFAULT_TILE_ELEMS / (V/tp), so a chunk's fp32
            logits tile holds at most 64 Mi values); must be equal on all TP ranks.
        vocab_chunk: vocabulary rows per logits tile (default 16384).
        impl: "torch" (any device), "triton" (CUDA, or CPU with TRITON_INTERPRET=1: fused logits
            tile loop with online log-sum-exp, then torch GEMMs for the gradients) or "auto"
            (currently torch everywhere: the Triton kernels have not been timed on a GPU yet).

    Returns:
        fp32 per-token loss ``logsumexp_v(z_tv) - z_t,label`` with the labels' shape; 0 at ignored
        labels (whose hidden/weight gradients are 0 whatever the incoming gradient).

    Memory: per chunk, the fp32 logits tile token_chunk x V/tp (plus its bf16 copy for bf16
    inputs, and a bf16 vocab_chunk x token_chunk logits tile); kept from forward to backward: D
    [N, d] (input dtype), the fp32 weight-gradient accumulator [V/tp, d], the per-token max and
    sum-exp [N] fp32, and the (gathered, under sequence parallelism) hidden states for the
    recompute path.
    """
    plan = _make_plan(hidden, weight, labels, loss_mask, tp_group, ignore_index, sequence_parallel,
                      token_chunk, vocab_chunk, impl)
    d = hidden.shape[-1]
    h2 = hidden.reshape(-1, d)
    y = labels.reshape(-1)
    wts = _token_weights(labels, loss_mask, ignore_index)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _FusedLinearCrossEntropy.apply(h2, weight, y, wts, plan)
    else:  # inference: the loss alone, no gradient work
        h_full = _gather_sequence(h2, plan) if plan.sequence_parallel else h2
        loss = _forward(h_full, weight, y, wts, plan, False, False)[0]
    return loss.view(labels.shape)
