"""One optimizer step's math: forward/backward with the global per-token loss, the gradient
all-reduce over data x context parallel ranks, and global-norm clipping."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

import megatron_burst
from megatron_burst.megatron.groups import layers_ranks_per_node
from megatron_burst.megatron.options import CPOptions
from megatron_burst.train.setup import Groups


def loss_and_grads(model: torch.nn.Module, batches: Sequence[Dict[str, torch.Tensor]],
                   opts: CPOptions, groups: Groups, device: torch.device,
                   eod_token: Optional[int] = None) -> torch.Tensor:
    """Forward and backward of this rank's microbatches (full sequence [b, s] tensors).

    ``eod_token`` (--reset-attention-mask): attention stays within documents ending at each EOD.

    Slices each batch for this CP rank, and scales the summed masked per-token loss by the loss
    tokens of the whole global batch (all microbatches, DP and CP ranks), so gradients summed
    over data x context parallel ranks are exactly those of the global per-token mean, and the
    returned value, all-reduced over dp_cp, is that mean (Megatron's lm loss).
    """
    local = [slice_for_cp({k: v.to(device) for k, v in b.items()}, opts, groups, eod_token) for b in batches]
    num_tokens = sum(b["loss_mask"].sum() for b in local).to(torch.float64)
    dist.all_reduce(num_tokens, group=groups.dp_cp)
    if num_tokens.item() == 0:
        raise ValueError("the global batch has no loss tokens (loss_mask is all zero)")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for b in local:
        losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"],
                       packed_seq_params=b.get("packed_seq_params"))  # [b, s_local]
        loss = (losses.float() * b["loss_mask"].float()).sum() / num_tokens.float()
        loss.backward()
        total += loss.detach().to(torch.float64)
    dist.all_reduce(total, group=groups.dp_cp)
    return total


def slice_for_cp(batch: Dict[str, torch.Tensor], opts: CPOptions, groups: Groups,
                 eod_token: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """This CP rank's part of a microbatch, with ``packed_seq_params`` when it has documents.

    A packed THD batch ([1, t] entries plus ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``,
    as Megatron-LM's SFT data gives them) is cut per sequence as TransformerEngine does (under
    ``--cp-layout balanced``: by the balanced plan of its sequences); a [b, s] batch is cut in
    ``--cp-layout``, with EOD documents when ``eod_token`` is given.
    """
    # balanced batches are planned for the nodes of the layers' topology (None: fixed layouts)
    per_node = (layers_ranks_per_node(opts, dist.get_world_size(groups.cp), dist.get_world_size(groups.tp))
                if opts.layout == "balanced" else None)
    if "cu_seqlens" not in batch:
        return megatron_burst.get_batch_on_this_cp_rank(batch, layout=opts.layout, cp_group=groups.cp,
                                                        stripe=opts.stripe, eod_token=eod_token,
                                                        ranks_per_node=per_node)
    from megatron_burst.megatron.packed import get_thd_batch_on_this_cp_rank

    rest = {k: v for k, v in batch.items() if k not in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")}
    cu = batch["cu_seqlens"].reshape(-1)
    padded = batch.get("cu_seqlens_padded")
    padded = cu if padded is None else padded.reshape(-1)
    max_seqlen = batch.get("max_seqlen")
    if max_seqlen is None:
        max_seqlen = (padded[1:] - padded[:-1]).max().reshape(1)
    local, params = get_thd_batch_on_this_cp_rank(rest, cu, padded, max_seqlen, groups.cp, layout=opts.layout,
                                                  ranks_per_node=per_node)
    local["packed_seq_params"] = params
    return local


def allreduce_grads(model: torch.nn.Module, groups: Groups) -> None:
    """Sum gradients over data x context parallel ranks, in one flat buffer."""
    if dist.get_world_size(groups.dp_cp) == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=groups.dp_cp)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def count_zero_grads(model: torch.nn.Module, groups: Groups) -> int:
    """Gradient elements that are exactly zero, over the whole model (Megatron-LM's num-zeros, logged
    with --log-num-zeros-in-grad): TP shards summed over TP ranks, replicated params counted once."""
    params = [p for p in model.parameters() if p.grad is not None]
    zeros = torch.zeros((), dtype=torch.float64, device=params[0].grad.device)
    tp_rank = dist.get_rank(groups.tp)
    for p in params:  # the same rule as clip_grads' norm
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            zeros += (p.grad.detach() == 0).sum()
    dist.all_reduce(zeros, group=groups.tp)
    return int(zeros.item())


def clip_grads(model: torch.nn.Module, max_norm: float, groups: Groups) -> float:
    """Global L2 grad norm (TP shards summed over TP, replicated params counted once), clipped."""
    params = [p for p in model.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=params[0].grad.device)
    tp_rank = dist.get_rank(groups.tp)
    for p in params:
        # Megatron marks TP-sharded params with `tensor_model_parallel`; the others are identical
        # on every TP rank and are counted on TP rank 0 only.
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=groups.tp)
    norm = float(sq.sqrt())
    if max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                p.grad.mul_(coeff)
    return norm

