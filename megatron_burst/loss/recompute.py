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

from megatron_burst.loss.chunks import chunked_forward, loss_without_grad, recompute_grads
from megatron_burst.loss.choice import resolve_impl
from megatron_burst.loss.config import LossConfig, check_labels, make_loss_config
from megatron_burst.loss.fused import fused_linear_cross_entropy
from megatron_burst.loss.parallel import gather_sequence, reduce_hidden_grad

__all__ = ["recompute_linear_cross_entropy"]

_NAME = "recompute_linear_cross_entropy"


class _RecomputeLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                cfg: LossConfig) -> torch.Tensor:
        h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
        loss, m_all, s_all, _, _ = chunked_forward(h, weight, labels, None, cfg, False, False)
        ctx.cfg, ctx.need = cfg, (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(hidden, weight, labels, m_all, s_all)  # the shard under SP, as the fused op
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, labels, m_all, s_all = ctx.saved_tensors
        cfg = ctx.cfg
        h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
        g = torch.where(labels != cfg.ignore_index, grad_loss.reshape(-1).float(), 0.0)
        dh, dw = recompute_grads(h, weight, labels, m_all, s_all, g, cfg, *ctx.need)
        if dh is not None:
            dh = reduce_hidden_grad(dh, cfg)
        return dh, None if dw is None else dw.to(weight.dtype), None, None


def recompute_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   tp_group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100,
                                   sequence_parallel: bool = False, token_chunk: Optional[int] = None,
                                   vocab_chunk: Optional[int] = None, impl: str = "auto") -> torch.Tensor:
    """Same contract as :func:`megatron_burst.loss.fused_linear_cross_entropy` (no loss_mask needed).

    hidden: [..., d], weight: [V/tp, d], labels: hidden's leading shape -> fp32 per-token loss.
    """
    impl = resolve_impl(impl, hidden, fused_linear_cross_entropy)
    cfg = make_loss_config(hidden, weight, labels, None, tp_group, ignore_index, sequence_parallel, token_chunk,
                           vocab_chunk, impl, name=_NAME)
    check_labels(labels, cfg, _NAME)  # one host read, before any collective
    h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _RecomputeLinearCrossEntropy.apply(h2, weight, y, cfg)
    else:
        loss = loss_without_grad(h2, weight, y, cfg)
    return loss.view(labels.shape)
