"""Plain, obviously-correct LM head + cross-entropy for tests: every rank builds the whole problem.

Each rank all-gathers the vocabulary shards of the weight (and, under sequence parallelism, the
sequence shards of the hidden states), computes the full ``[N, V]`` logits in fp32 and calls
``torch.nn.functional.cross_entropy`` with autograd. Only this rank's own shard is live in the
autograd graph, so ``weight.grad`` is this rank's rows of the full weight gradient and
``hidden.grad`` is the full hidden gradient (this rank's sequence shard of it under sequence
parallelism) -- the same values Megatron's output layer delivers after its tensor-parallel
all-reduce (or reduce-scatter). Memory is O(N x V): tests only.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _gather_live(local: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Concatenate every rank's ``local`` along dim 0, keeping this rank's piece in the graph."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local.detach().contiguous(), group=group)
    pieces[rank] = local  # the live piece: gradients reach this rank's tensor and no other
    return torch.cat(pieces, dim=0)


def reference_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   tp_group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100,
                                   sequence_parallel: bool = False) -> torch.Tensor:
    """Per-token loss ``logsumexp(h W^T) - (h W^T)[label]`` in fp32, 0 where ``label == ignore_index``.

    hidden: [..., d] (this rank's sequence shard [s/tp, ...] if ``sequence_parallel``);
    weight: this rank's vocabulary shard [V/tp, d]; labels: [..., ] global vocabulary ids with
    hidden's leading shape (the full sequence under sequence parallelism). Returns fp32, labels' shape.
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    h, w = hidden.float(), weight.float()
    if tp > 1:
        w = _gather_live(w, tp_group)
        if sequence_parallel:
            h = _gather_live(h, tp_group)
    logits = h.reshape(-1, h.shape[-1]) @ w.t()
    loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction="none")
    return loss.view(labels.shape)
