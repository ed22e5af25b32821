"""Recompute-style chunked LM head + cross-entropy (the CCE family): the fused op's baseline.

The forward walks the same token chunks as :func:`fused_linear_cross_entropy` but keeps only the
per-token max and sum-exp; the backward recomputes every chunk's logits from the saved hidden
states and forms the gradients with the actual incoming gradient. It stores less than the fused op
(no [N, d] hidden-gradient factor, no [V/tp, d] weight-gradient accumulator) and works for any
incoming gradient without a loss-mask hint, but does four vocabulary matmuls instead of three.
It shares every chunk kernel with the fused op (this is exactly the fused op's recompute path), so
a benchmark of the two isolates the algorithmic difference.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.loss.fused import (_forward, _gather_sequence, _make_plan, _Plan, _reduce_hidden_grad,
                                       _token_weights, recompute_grads)

__all__ = ["recompute_linear_cross_entropy"]


class _RecomputeLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, wts: torch.Tensor,
                plan: _Plan) -> torch.Tensor:
        h = _gather_sequence(hidden, plan) if plan.sequence_parallel else hidden
        loss, m_all, s_all, _, _ = _forward(h, weight, labels, wts, plan, False, False)
        ctx.plan, ctx.need = plan, (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(h, weight, labels, m_all, s_all)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        h, weight, labels, m_all, s_all = ctx.saved_tensors
        plan = ctx.plan
        g = torch.where(labels != plan.ignore_index, grad_loss.reshape(-1).float(), 0.0)
        dh, dw = recompute_grads(h, weight, labels, m_all, s_all, g, plan, *ctx.need)
        if dh is not None:
            dh = _reduce_hidden_grad(dh, plan)
        return dh, dw, None, None, None


def recompute_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   tp_group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100,
                                   sequence_parallel: bool = False, token_chunk: Optional[int] = None,
                                   vocab_chunk: Optional[int] = None, impl: str = "auto") -> torch.Tensor:
    """Same contract as :func:`megatron_burst.loss.fused_linear_cross_entropy` (no loss_mask needed).

    hidden: [..., d], weight: [V/tp, d], labels: hidden's leading shape -> fp32 per-token loss.
    """
    plan = _make_plan(hidden, weight, labels, None, tp_group, ignore_index, sequence_parallel, token_chunk,
                      vocab_chunk, impl, name="recompute_linear_cross_entropy")
    h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    wts = _token_weights(labels, None, ignore_index)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _RecomputeLinearCrossEntropy.apply(h2, weight, y, wts, plan)
    else:
        h_full = _gather_sequence(h2, plan) if plan.sequence_parallel else h2
        loss = _forward(h_full, weight, y, wts, plan, False, False)[0]
    return loss.view(labels.shape)
