"""The fused loss's tensor- / sequence-parallel collectives, over ``LossConfig.group`` (explicit).

Megatron's layout: rank r of the TP group holds vocabulary rows [r V/tp, (r+1) V/tp) of the output
weight; with sequence parallelism the hidden states [N, d] arrive as rank-major sequence shards
[N/tp, d] (rows [r N/tp, (r+1) N/tp) of the flattened [s, b] token order) and their gradient
must leave in the same shards. All three functions are no-ops at tp_size == 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_burst.loss.config import LossConfig

__all__ = ["all_reduce_stats", "gather_sequence", "reduce_hidden_grad"]


def all_reduce_stats(t: torch.Tensor, op: dist.ReduceOp, cfg: LossConfig) -> None:
    """In place: combine per-token statistics (max, sum-exp, target logit) of the vocabulary shards."""
    if cfg.tp_size > 1:
        dist.all_reduce(t, op=op, group=cfg.group)


def gather_sequence(h: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """[n, d] sequence shard -> [tp * n, d], rank-major (Megatron's sequence-parallel all-gather)."""
    if cfg.tp_size == 1:
        return h
    out = h.new_empty(cfg.tp_size * h.shape[0], h.shape[1])
    dist.all_gather_into_tensor(out, h.contiguous(), group=cfg.group)
    return out


def reduce_hidden_grad(dh: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Sum the per-rank partial hidden gradients [N, d] (each rank saw only its vocabulary shard).

    Returns the full sum [N, d] (all-reduce, in place) or, with sequence parallelism, this rank's
    sequence shard of it [N/tp, d] (reduce-scatter), as Megatron's output layer does for its input
    gradient.
    """
    if cfg.tp_size == 1:
        return dh
    if cfg.sequence_parallel:
        out = dh.new_empty(dh.shape[0] // cfg.tp_size, dh.shape[1])
        dist.reduce_scatter_tensor(out, dh, group=cfg.group)
        return out
    dist.all_reduce(dh, group=cfg.group)
    return dh
