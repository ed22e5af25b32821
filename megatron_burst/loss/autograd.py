"""The fused op's autograd function: D and A formed (and D reduced over TP) in the forward; the
backward scales them by c in place, or recomputes when the incoming gradient is not c * loss_mask.

See :mod:`megatron_burst.loss.fused` for the algorithm. This module holds the backward's one
host decision (:func:`proportional_factor`), the bookkeeping of which path it took
(:data:`backward_paths`, :class:`FusedLossRecomputeWarning`) and the weight-gradient hand-off,
including Megatron's gradient-accumulation fusion (``weight.main_grad``).
"""
from __future__ import annotations

import collections
import warnings
from typing import Optional

import torch

from megatron_burst.loss import fast
from megatron_burst.loss.chunks import chunked_forward, hidden_grad_prescaled, recompute_grads
from megatron_burst.loss.config import LossConfig, labels_out_of_range, raise_label_error
from megatron_burst.loss.parallel import gather_sequence, reduce_hidden_grad
from megatron_burst.loss.vocab_pass import weight_grad_by_vocab_tiles

__all__ = ["FusedLinearCrossEntropyFunction", "proportional_factor", "backward_paths", "FusedLossRecomputeWarning",
           "PROPORTIONAL_RTOL"]

# g_t may deviate from c * w_t by this relative amount (4u) and still count as proportional: g is
# itself computed in fp32 (e.g. mask * (1/num_tokens)), so its own rounding is of this order.
PROPORTIONAL_RTOL = 4 * 2.0 ** -24

# How many backward passes took each path: "scaled" (no matmul) or "recompute" (g not proportional
# to the loss mask). Process-wide, for tests and for noticing a mismatched loss_mask.
backward_paths: collections.Counter = collections.Counter()


class FusedLossRecomputeWarning(UserWarning):
    """The incoming loss gradient was not proportional to ``loss_mask``: the backward recomputed."""


def proportional_factor(g: torch.Tensor, w: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, ok): ok says g == c * w on the valid tokens (to PROPORTIONAL_RTOL). Device tensors, no host read.

    g, w: [N] fp32, valid: [N] bool (ignored labels have no gradient, so their g does not matter).
    c: 0-dim fp32, g_i / w_i at the token i of largest |w_i| -- exact for 0/1 masks (c = g_i) -- or
    0 when no token carries weight (then ok iff g is 0 everywhere); ok: 0-dim bool.
    """
    g = torch.where(valid, g, 0.0)
    w = torch.where(valid, w, 0.0)
    if w.numel() == 0:
        return g.new_zeros(()), torch.ones((), dtype=torch.bool, device=g.device)
    i = w.abs().argmax().view(1)  # gather, not w[i]: indexing with a 0-dim tensor reads it on the host
    w_i, g_i = w.gather(0, i), g.gather(0, i)
    c = torch.where(w_i != 0, g_i / w_i, 0.0)
    expected = c * w
    ok = ((g - expected).abs() <= PROPORTIONAL_RTOL * expected.abs()).all()
    return c.view(()), ok


def _megatron_dummy_wgrad(weight: torch.Tensor, main_grad: torch.Tensor) -> Optional[torch.Tensor]:
    """What Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication returns as the weight
    gradient once it has accumulated into ``main_grad`` (gradient_accumulation_fusion).

    Under Megatron's DistributedDataParallel (which sets ``grad_added_to_main_grad``) a dummy of the
    weight's shape, so that DDP's gradient hook runs on the main backward thread; DDP skips adding
    it to main_grad since ``grad_added_to_main_grad`` is set -- unless ``zero_out_wgrad`` (an
    embedding tied with the output layer on one pipeline stage), where the dummy is zeros and DDP
    adds ``weight.grad`` = embedding gradient + 0. Without DDP's attribute: None.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(main_grad.shape, dtype=weight.dtype, device=main_grad.device)


def _weight_grad(weight: torch.Tensor, acc: torch.Tensor, c: Optional[torch.Tensor],
                 main_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """d weight = c * acc (c None: 1) from the fp32 accumulator acc [V/tp, d], which it consumes.

    With ``main_grad`` (gradient-accumulation fusion) the product is added into it in fp32 and
    Megatron's placeholder is returned. Otherwise the result reuses acc's storage when weight is
    fp32 (no second [V/tp, d] buffer) and is written straight into the weight dtype otherwise.
    """
    if main_grad is not None:
        weight.main_grad = main_grad  # as Megatron's layer: restore the buffer captured in the forward
        if c is None:
            main_grad.add_(acc)
        else:
            main_grad.addcmul_(acc, c)  # one pass, no temporary; c stays on the device
        return _megatron_dummy_wgrad(weight, main_grad)
    if c is None:
        return acc if weight.dtype == acc.dtype else acc.to(weight.dtype)
    if weight.dtype == acc.dtype:
        return acc.mul_(c)
    return torch.mul(acc, c, out=torch.empty(acc.shape, dtype=weight.dtype, device=acc.device))


def _scale_in_place(t: torch.Tensor, s: torch.Tensor, block_elems: int = 1 << 22) -> torch.Tensor:
    """t [n, d] *= s (0-dim fp32 on the device), each element rounded once, in place; returns t.

    Not ``t.mul_(s)`` for a 16-bit t: type promotion makes a 0-dim tensor take t's dtype, so s itself
    would be rounded to bf16 first -- a systematic relative error of up to 2^-9 on the whole
    gradient (this was the fused loss's excess d hidden error). The product is formed in fp32,
    a bounded block of rows at a time (no fp32 copy of all of t).
    """
    if t.dtype == torch.float32:
        return t.mul_(s)
    rows = max(1, block_elems // max(1, t.shape[1]))  # 16 MiB of fp32 at most
    for a in range(0, t.shape[0], rows):
        t[a:a + rows] = t[a:a + rows].float().mul_(s)
    return t


def _weight_grad_in_backward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             m_all: torch.Tensor, s_all: torch.Tensor, g: torch.Tensor, cfg: LossConfig,
                             main_grad: Optional[torch.Tensor], scale: float = 1.0) -> Optional[torch.Tensor]:
    """weight_grad="backward": d weight from the per-token gradient scale * g [N] (g 0 at ignored
    labels), per vocabulary tile (:mod:`megatron_burst.loss.vocab_pass`) -- exact for any g. hidden:
    [n, d] as saved (the sequence shard under SP: all-gathered here). Returns d weight [V/tp, d] or
    Megatron's placeholder."""
    h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
    if main_grad is not None:
        weight.main_grad = main_grad  # as Megatron's layer: restore the buffer captured in the forward
    dw = weight_grad_by_vocab_tiles(h, weight, labels, m_all, s_all, g, cfg, main_grad, scale)
    return dw if main_grad is None else _megatron_dummy_wgrad(weight, main_grad)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """apply(hidden [n, d], weight [V/tp, d], labels [N], wts [N] fp32, cfg, main_grad or None,
    labels_shape) -> loss [N]. labels_shape: the caller's labels' shape (for error messages).

    n = N, or N/tp under sequence parallelism (hidden is then this rank's shard). ``main_grad``:
    the fp32 buffer to accumulate d weight into (Megatron's gradient-accumulation fusion), or None.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, wts: torch.Tensor,
                cfg: LossConfig, main_grad: Optional[torch.Tensor], labels_shape: tuple) -> torch.Tensor:
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
        dw_here = need_dw and cfg.weight_grad == "forward"
        loss, m_all, s_all, D, A = chunked_forward(h, weight, labels, wts, cfg, need_dh, dw_here)
        # the one-read forward's D carries 1 / sum(wts), which the scaled backward takes out of c
        ctx.d_prescaled = hidden_grad_prescaled(cfg, h.dtype, need_dh, dw_here)
        del h  # under sequence parallelism the gathered [N, d] copy is freed here, not saved
        if D is not None:
            # Reduce D over TP now, so the scaled backward has no collective: summing the ranks'
            # partial factors and then scaling, c * sum_r D_r, is the sum_r c * D_r the backward
            # would otherwise reduce (up to the rounding of the reordered product). Under sequence
            # parallelism only this rank's shard of the sum is kept: [N/tp, d] instead of [N, d].
            D = reduce_hidden_grad(D, cfg)
        ctx.cfg, ctx.need, ctx.labels_shape = cfg, (need_dh, need_dw), labels_shape
        # main_grad lives in ctx, not save_for_backward: other layers (the tied embedding, other
        # micro-batches) add to it in place meanwhile, which the saved-tensor version check forbids.
        ctx.main_grad = main_grad if need_dw else None
        ctx.scaled_in_place = False
        # hidden (the sequence shard under SP) and weight are kept only for the recompute path;
        # both are alive anyway (activation / parameter). labels_bad is read with the backward's
        # decision (see backward).
        ctx.save_for_backward(hidden, weight, labels, wts, labels_out_of_range(labels, cfg), m_all, s_all, D, A)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.scaled_in_place:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward ran twice through one graph (retain_graph=True). Its "
                "first backward scaled the saved gradient factors in place, so a second one cannot be "
                "formed: compute the loss again for each backward")
        hidden, weight, labels, wts, labels_bad, m_all, s_all, D, A = ctx.saved_tensors
        cfg, (need_dh, need_dw) = ctx.cfg, ctx.need
        g = grad_loss.reshape(-1).float()
        valid = labels != cfg.ignore_index
        c, proportional = proportional_factor(g, wts, valid)
        # The one host read of the whole op (forward + backward): which path to take, together
        # with the forward's label check, as one small integer, and c (weight_grad="backward"
        # scales its GEMMs by it; the other paths keep using the device copy). All TP ranks decide
        # alike because g and the labels are replicated over TP (the per-token loss is); the two
        # paths differ in their collectives, so a rank-dependent objective would hang.
        decision, c_host = torch.stack([(proportional.int() + 2 * labels_bad.int()).float(), c.float()]).tolist()
        decision = int(decision)
        if decision & 2:
            raise_label_error(labels.view(ctx.labels_shape), cfg)
        if decision & 1:
            backward_paths["scaled"] += 1
            # D and A belong to this graph alone (one per forward call, e.g. per micro-batch) and
            # are freed after this backward: scaling them in place costs no second buffer.
            ctx.scaled_in_place = True
            if need_dh:  # (D times 1 / sum(wts) and c = 1 / sum(wts): a factor 1, D as it is)
                dh = _scale_in_place(D, c / fast.hidden_grad_prescale(wts) if ctx.d_prescaled else c)
            else:
                dh = None
            if not need_dw:
                dw = None
            elif cfg.weight_grad == "forward":
                dw = _weight_grad(weight, A, c, ctx.main_grad)
            else:
                # the loss weights as G's factor and c in the GEMM (see vocab_pass: G is rounded at
                # the weights' scale, as the forward-mode G; c * wts is g within PROPORTIONAL_RTOL)
                dw = _weight_grad_in_backward(hidden, weight, labels, m_all, s_all, torch.where(valid, wts, 0.0),
                                              cfg, ctx.main_grad, c_host)
            return dh, dw, None, None, None, None, None
        backward_paths["recompute"] += 1
        warnings.warn(
            "fused_linear_cross_entropy: the incoming per-token loss gradient is not proportional to "
            "loss_mask, so the backward recomputed the logits (exact, but ~2x the LM-head time). Pass "
            "loss_mask=<the mask the per-token loss is multiplied by> to avoid it.",
            FusedLossRecomputeWarning, stacklevel=2)
        g = torch.where(valid, g, 0.0)
        dw_here = need_dw and cfg.weight_grad == "forward"
        dh = dw_acc = None
        if need_dh or dw_here:
            h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
            dh, dw_acc = recompute_grads(h, weight, labels, m_all, s_all, g, cfg, need_dh, dw_here)
            del h
        if dh is not None:
            dh = reduce_hidden_grad(dh, cfg)
        if not need_dw:
            dw = None
        elif dw_here:
            dw = _weight_grad(weight, dw_acc, None, ctx.main_grad)
        else:
            dw = _weight_grad_in_backward(hidden, weight, labels, m_all, s_all, g, cfg, ctx.main_grad)
        return dh, dw, None, None, None, None, None
