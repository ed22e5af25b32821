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
Both are scaled in place: D and A belong to one forward call (one micro-batch) and are freed with
its graph, so the scaled backward allocates no [N, d] or [V/tp, d] buffer (a bf16 weight's
gradient is written straight into the weight dtype; a second backward through the same graph is
refused). If g is *not* proportional (a different mask, per-token weights, a loss that mixes in
other terms of the per-token losses, ...), the backward takes the recompute path instead: it
recomputes each chunk's logits from the saved hidden states and the forward's per-token max /
sum-exp and forms the gradients with the actual g -- exact for every g, at the cost of the three
matmuls again. That path is counted in :data:`backward_paths` and announced once by
:class:`FusedLossRecomputeWarning`, so a caller whose mask does not match sees it and can pass the
right ``loss_mask``.

Tensor parallelism matches Megatron's ``ColumnParallelLinear`` output layer followed by
``vocab_parallel_cross_entropy``: rank r holds vocabulary rows [r V/tp, (r+1) V/tp); per chunk the
max is all-reduced (MAX), then the sum-exp and the target logit (SUM, one call) -- two small
all-reduces per chunk, so fewer, larger chunks cost less latency. D is partial over each rank's
vocabulary; it is reduced over TP *in the forward* (all-reduce; reduce-scatter under sequence
parallelism), since c * sum_r D_r = sum_r c * D_r: the scaled backward runs no collective at all.
With ``sequence_parallel=True`` the hidden states arrive as sequence shards [N/tp, d]: they are
all-gathered in the forward for the chunk walk, but only the shard is saved (the recompute path
gathers it again), and only this rank's shard of D is kept, [N/tp, d].

Gradient-accumulation fusion (Megatron's ``gradient_accumulation_fusion``, here
``accumulate_into_main_grad=True``): c * A is added in fp32 straight into ``weight.main_grad`` and
the weight gradient returned is Megatron's placeholder -- exactly what Megatron-Core's
``LinearWithGradAccumulationAndAsyncCommunication`` does, so its DistributedDataParallel sees the
output layer as it always does.

Host reads (device -> host syncs on a GPU). A training call reads exactly one small tensor: the
backward's decision (scaled or recompute path) -- which must be a host decision, the two paths
run different kernels and collectives -- packed into one integer together with the forward's
check that every label is in the vocabulary (formed on the device in the forward, read here; an
out-of-range label raises the ValueError from the backward). The scale c stays on the device.
Without a backward (no_grad, frozen inputs) the label check is read in the forward instead, before
any collective. Validation of shapes, dtypes and chunk sizes is host metadata only.

Implementations (``impl``): "triton", the GPU fast path (:mod:`.fast`: cuBLAS GEMMs with fp32
logits and an in-GEMM fp32 weight-gradient accumulator, one fused Triton softmax-gradient pass per
chunk; its FLOPs, bytes and memory are worked out there), and "torch" (:mod:`.chunks`: the same
algorithm in torch ops, any device). "auto" (:mod:`.choice`) runs "triton" on CUDA after a
one-time self-check against the fp32 reference that raises on failure
(``MEGATRON_BURST_ALLOW_SLOW_KERNELS=1``: warn and run "torch"), and "torch" elsewhere; the
decision is logged on ``logging.getLogger("megatron_burst.loss")``.

Code map: :mod:`.config` (validation, chunking: :class:`LossConfig`), :mod:`.choice` (what "auto"
runs, the self-check), :mod:`.parallel` (TP / SP collectives), :mod:`.chunks` (chunk walker, torch
backend), :mod:`.fast` (the fast path's walk), :mod:`.triton_kernels` (its Triton kernel),
:mod:`.autograd` (the autograd function, the backward's decision), this module (the public
function).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.loss import onchip
from megatron_burst.loss.autograd import FusedLinearCrossEntropyFunction, FusedLossRecomputeWarning, backward_paths
from megatron_burst.loss.chunks import loss_without_grad
from megatron_burst.loss.choice import resolve_impl
from megatron_burst.loss.config import DEFAULT_TILE_ELEMS, check_labels, make_loss_config, token_weights

__all__ = ["fused_linear_cross_entropy", "backward_paths", "FusedLossRecomputeWarning", "DEFAULT_TILE_ELEMS"]


def _main_grad_of(weight: torch.Tensor, name: str = "fused_linear_cross_entropy") -> torch.Tensor:
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(f"{name}: accumulate_into_main_grad=True but weight has no main_grad buffer (got "
                         f"{type(main_grad).__name__}); wrap the model in Megatron's DistributedDataParallel, "
                         "which creates it, or pass accumulate_into_main_grad=False (gradient_accumulation_fusion off)")
    if main_grad.shape != weight.shape or main_grad.device != weight.device:
        raise ValueError(f"{name}: weight.main_grad {tuple(main_grad.shape)} on {main_grad.device} must match "
                         f"weight {tuple(weight.shape)} on {weight.device}")
    return main_grad


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               tp_group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100,
                               loss_mask: Optional[torch.Tensor] = None, sequence_parallel: bool = False,
                               accumulate_into_main_grad: bool = False, token_chunk: Optional[int] = None,
                               vocab_chunk: Optional[int] = None, impl: str = "auto",
                               weight_grad: str = "forward") -> torch.Tensor:
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
        accumulate_into_main_grad: Megatron's ``gradient_accumulation_fusion``: add d(weight) in
            fp32 into ``weight.main_grad`` (which must exist: Megatron's DDP creates it) and return
            Megatron's placeholder as the weight gradient (see the module docstring).
        token_chunk: tokens per chunk (default: impl "torch": DEFAULT_TILE_ELEMS / (V/tp), so a
            chunk's fp32 logits tile holds at most 64 Mi values; impl "triton": about 1 GiB of
            chunk buffers, at least 1024 tokens where memory allows -- see
            :func:`megatron_burst.loss.fast.default_token_chunk`); must be equal on all TP ranks
            (the defaults are agreed on CUDA).
        vocab_chunk: vocabulary rows per logits tile of the torch path (default 16384).
        impl: "auto" (the fast path on CUDA after its self-check, else "torch"), "triton" (CUDA,
            or CPU with TRITON_INTERPRET=1: cuBLAS GEMMs + one fused Triton pass per chunk) or
            "torch" (any device). Opt-in, never chosen by "auto", not yet run on a GPU:
            "triton_recompute" (:mod:`megatron_burst.loss.onchip`: the logits are recomputed tile by
            tile in Triton kernels and never stored, d hidden and d weight formed in the backward
            from the actual gradient -- ``loss_mask`` and ``weight_grad`` make no difference there).
        weight_grad: where d(weight) is formed. "forward" (default): accumulated over token chunks
            in the forward into an fp32 [V/tp, d] buffer kept for the backward (three vocabulary
            GEMMs in all). "backward": per vocabulary tile in the backward from the actual incoming
            gradient, each element rounded once, no [V/tp, d] buffer beyond the gradient itself
            (a fourth GEMM: the tile's logits are recomputed); its scratch lies in the gradient's
            rows not yet written, so the backward's peak is the two gradients + <= 1 MiB.
            See :mod:`megatron_burst.loss.vocab_pass`.

    Returns:
        fp32 per-token loss ``logsumexp_v(z_tv) - z_t,label`` with the labels' shape; 0 at ignored
        labels (whose hidden/weight gradients are 0 whatever the incoming gradient).

    Memory: per chunk, the fp32 logits tile token_chunk x V/tp (plus its bf16 copy for bf16
    inputs; the torch path also a bf16 vocab_chunk x token_chunk logits tile), and in the forward the partial D
    [N, d] (and, under sequence parallelism, the gathered hidden states [N, d]). Kept from forward
    to backward: D reduced over TP ([N, d], or [N/tp, d] under sequence parallelism; input
    dtype), the fp32 weight-gradient accumulator [V/tp, d], the per-token max and sum-exp [N]
    fp32, and hidden as passed (the shard under sequence parallelism) for the recompute path. The
    scaled backward allocates nothing of those sizes but a bf16 weight's gradient [V/tp, d].
    """
    impl = resolve_impl(impl, hidden, fused_linear_cross_entropy)
    cfg = make_loss_config(hidden, weight, labels, loss_mask, tp_group, ignore_index, sequence_parallel,
                           token_chunk, vocab_chunk, impl, weight_grad=weight_grad)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if cfg.impl == onchip.IMPL:  # opt-in: logits recomputed on chip, no D / A (see megatron_burst.loss.onchip)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            main_grad = _main_grad_of(weight) if accumulate_into_main_grad and weight.requires_grad else None
            loss = onchip.OnchipLinearCrossEntropyFunction.apply(h2, weight, y, cfg, main_grad)
        else:
            check_labels(labels, cfg)
            loss = onchip.loss_only(h2, weight, y, cfg)
        return loss.view(labels.shape)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        main_grad = _main_grad_of(weight) if accumulate_into_main_grad and weight.requires_grad else None
        wts = token_weights(labels, loss_mask, ignore_index)
        loss = FusedLinearCrossEntropyFunction.apply(h2, weight, y, wts, cfg, main_grad, tuple(labels.shape))
    else:  # inference: the loss alone, no gradient work; labels checked now (one host read)
        check_labels(labels, cfg)
        loss = loss_without_grad(h2, weight, y, cfg)
    return loss.view(labels.shape)
