"""The training loop: :func:`run` trains on an initialized torch.distributed world."""
from __future__ import annotations

import json
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import megatron_burst
from megatron_burst.activation_store import end_iteration
from megatron_burst.kernels import report as attention_kernel_report
from megatron_burst.linear.kernel_choice import report as linear_kernel_report
from megatron_burst.megatron.options import CPOptions
from megatron_burst.train.args import ParallelSizes, build_parser, validate_args
from megatron_burst.train.checkpointing import load_checkpoint, save_checkpoint
from megatron_burst.train.data import build_dataset, build_tokenizer, microbatches
from megatron_burst.train.setup import (Groups, build_model, build_optimizer, init_parallel,
                                        padded_vocab_size, print_rank_0, seed_everything)
from megatron_burst.train import mixed_precision
from megatron_burst.train.step import allreduce_grads, clip_grads, count_zero_grads, loss_and_grads



def kernel_report() -> list[str]:
    """Which local kernels ran: softmax attention's decisions, then the linear family's."""
    return attention_kernel_report() + linear_kernel_report()

def run(argv: Optional[Sequence[str]] = None) -> List[Dict[str, float]]:
    """Train on the already-initialized torch.distributed world; returns per-iteration metrics
    (on every rank). Initializes and afterwards destroys megatron.core.parallel_state."""
    args = build_parser().parse_args(argv)
    world_size = dist.get_world_size()
    opts, sizes = validate_args(args, world_size)  # before any collective
    from megatron.core import parallel_state as ps

    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    groups = init_parallel(sizes)
    try:
        return _train(args, opts, sizes, groups, device)
    finally:
        ps.destroy_model_parallel()


def precision_summary(args) -> str:
    """The banner's precision: "fp32", or what --bf16 keeps in which precision."""
    return ("bf16 (megatron.core Float16Module + DDP with fp32 grad accumulation/all-reduce, "
            "Float16OptimizerWithFloat16Params with fp32 main params)" if args.bf16 else "fp32")


def _softmax_attention(model: torch.nn.Module):
    """The first softmax core attention of the model (None: every layer is linear attention)."""
    from megatron_burst.megatron.attention import CPCoreAttention

    return next((m for m in model.modules() if isinstance(m, CPCoreAttention)), None)


def attention_summary(model: torch.nn.Module, args, sizes: ParallelSizes) -> str:
    """What the attention will run: the algorithm (what ``auto`` resolves to for this model's
    per-rank shape) and the ring shape, e.g. "cp-algo auto -> ring (backward), ring double
    (2 nodes x 4)"; with linear layers, which ones and their CP algorithm, e.g.
    "linear attention lightning (lasp2) in layers 1,2,3 of 4"."""
    from megatron_burst.megatron.gated_delta_net import CPGatedDeltaNet
    from megatron_burst.megatron.linear_attention import LinearSelfAttention

    linear = [m for m in model.modules() if isinstance(m, (LinearSelfAttention, CPGatedDeltaNet))]
    parts = [_softmax_summary(model, args, sizes)]
    if linear:
        first = linear[0]
        what = (f"{first.variant.name} ({first.options.algo})" if isinstance(first, LinearSelfAttention)
                else "gated_delta_net (map all-gather)")
        parts.append(f"linear attention {what} in layers "
                     f"{','.join(str(m.layer_number) for m in linear)} of {args.num_layers}")
    return "; ".join(part for part in parts if part)


def _softmax_summary(model: torch.nn.Module, args, sizes: ParallelSizes) -> str:
    from megatron_burst.algorithms import choose_algo, resolve_algo
    from megatron_burst.topology import CPTopology, registered_usp_topology

    attention = _softmax_attention(model)
    if attention is None:  # every layer linear, or another core attention (a spec given in place of ours)
        other = next((type(m).__name__ for name, m in model.named_modules()
                      if name.endswith("self_attention.core_attention")), None)
        return f"core attention {other}" if other else ""
    algo = attention.options.algo
    target = attention.cp_target
    nodes = target.num_nodes if isinstance(target, CPTopology) else 1
    ring = attention.options.ring or ("double" if nodes > 1 else "flat")
    text = f"cp-algo {algo}"
    if algo == "auto" and sizes.cp > 1:
        elem = next(model.parameters()).element_size()
        shape = (args.micro_batch_size, args.num_attention_heads // sizes.tp, max(1, args.num_query_groups // sizes.tp),
                 args.seq_length // sizes.cp, args.kv_channels, elem, sizes.cp)
        usp_sizes = tuple(u for u in range(2, sizes.cp) if registered_usp_topology(attention.cp_group, u) is not None)
        family, U = choose_algo(*shape, nodes=nodes, ring=ring, usp_sizes=usp_sizes)
        if family in ("ring", "burst"):
            text += f" -> {resolve_algo('auto', *shape, nodes=nodes, ring=ring)} backward"
        else:
            text += f" -> {family}" + (f" {U} x {sizes.cp // U}" if family == "usp" else "")
    if sizes.cp > 1:
        text += f", ring {ring}" + (f" ({nodes} nodes x {sizes.cp // nodes})" if nodes > 1 else "")
    return text


def _train(args, opts: CPOptions, sizes: ParallelSizes, groups: Groups,
           device: torch.device) -> List[Dict[str, float]]:
    """Build everything from the validated flags, resume from --load, train, save, log."""
    tokenizer = build_tokenizer(args)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                               sizes.tp)
    seed_everything(args.seed, device)
    from megatron_burst.megatron import te_free

    if getattr(args, "te_free_fusions", False):  # before the TransformerConfig and the optimizer exist
        for line in te_free.install():
            print_rank_0(f"megatron-burst train: --te-free-fusions: {line}")
    else:  # a CUDA machine without TE / apex: say what runs unfused
        hint = te_free.unfused_here(device)
        if hint:
            print_rank_0(hint)
    model = build_model(args, opts, sizes, groups, device)  # --bf16: DDP(Float16Module(model))
    optimizer, scheduler = build_optimizer(args, model, device)
    start, consumed = load_checkpoint(args.load, model, optimizer, scheduler, args, groups) if args.load else (0, 0)
    dataset = build_dataset(args, tokenizer, consumed + max(0, args.train_iters - start) * args.global_batch_size)
    n_params = sum(p.numel() for p in model.parameters())
    print_rank_0(f"megatron-burst train: world {sizes.world_size} = TP {sizes.tp} x CP {sizes.cp} x DP "
                 f"{sizes.dp}; {attention_summary(model, args, sizes)}; "
                 f"cp-layout {opts.layout}{f' stripe {opts.stripe}' if opts.layout == 'striped' else ''}; "
                 f"{args.num_layers} layers, hidden {args.hidden_size}, heads {args.num_attention_heads}"
                 f"/{args.num_query_groups} kv, seq {args.seq_length}, {n_params} parameters per TP rank; "
                 f"global batch {args.global_batch_size} = {sizes.num_microbatches} microbatches x "
                 f"{args.micro_batch_size} x DP {sizes.dp}; device {device.type}; {precision_summary(args)}")
    dp_rank = dist.get_rank(groups.dp)
    eod_token = tokenizer.eod if args.reset_attention_mask else None
    tokens_per_iter = args.global_batch_size * args.seq_length
    metrics: List[Dict[str, float]] = []
    model.train()
    for iteration in range(start, args.train_iters):
        t0 = time.perf_counter()
        batches = microbatches(dataset, consumed, args, sizes, dp_rank)
        if args.bf16:
            mixed_precision.zero_grads(model, optimizer)
        else:
            for p in model.parameters():
                p.grad = None
        with megatron_burst.comm_counter() as counter:
            loss = loss_and_grads(model, batches, opts, groups, device, eod_token=eod_token)
        end_iteration(model)  # selective-checkpoint stores: verified and emptied before the update
        consumed += args.global_batch_size
        lr = optimizer.param_groups[0]["lr"]
        if args.bf16:  # megatron.core: fp32 grad all-reduce, then clip + AdamW on the fp32 main params
            grad_norm, num_zeros = mixed_precision.reduce_and_step(model, optimizer, args, device)
        else:
            allreduce_grads(model, groups)
            grad_norm = clip_grads(model, args.clip_grad, groups)
            num_zeros = count_zero_grads(model, groups) if args.log_num_zeros_in_grad else None
            optimizer.step()
        scheduler.step(args.global_batch_size)  # in samples, as Megatron-LM
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        sent = torch.tensor([float(counter.bytes("sent"))], dtype=torch.float64, device=device)
        dist.all_reduce(sent)  # mean over ranks below: every rank's share of the CP traffic
        row = {"iteration": iteration + 1, "lm_loss": loss.item(), "grad_norm": grad_norm, "lr": lr,
               "elapsed_s": elapsed, "tokens_per_s": tokens_per_iter / elapsed,
               "cp_comm_bytes_per_rank": sent.item() / dist.get_world_size(), "consumed_samples": consumed}
        if num_zeros is not None:
            row["num_zeros"] = num_zeros
        if device.type == "cuda":  # Megatron-LM's "mem-max-allocated-bytes": the peak since the start
            row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        metrics.append(row)
        if iteration == start:  # the kernels are chosen (and self-checked) in the first step
            for line in kernel_report():
                print_rank_0(f"megatron-burst train: {line}")
        if (iteration + 1) % args.log_interval == 0 or iteration + 1 == args.train_iters:
            print_rank_0(f" iteration {iteration + 1:8d}/{args.train_iters:8d} | consumed samples: "
                         f"{consumed:10d} | elapsed time per iteration "
                         f"(ms): {elapsed * 1e3:.1f} | learning rate: {lr:.6E} | global batch size: "
                         f"{args.global_batch_size:5d} | lm loss: {row['lm_loss']:.6E} | grad norm: "
                         f"{grad_norm:.3f} | "
                         + (f"number of zeros: {num_zeros} | " if num_zeros is not None else "")
                         + f"tokens per second: {row['tokens_per_s']:.1f} | "
                         + (f"mem max allocated (GiB): {row['max_memory_allocated_bytes'] / 2**30:.2f} | "
                            if "max_memory_allocated_bytes" in row else "")
                         + f"cp comm bytes per rank: {int(row['cp_comm_bytes_per_rank'])} |")
        if args.save and args.save_interval and (iteration + 1) % args.save_interval == 0:
            save_checkpoint(args.save, iteration + 1, consumed, model, optimizer, scheduler, args, groups)
    if args.save and metrics and (not args.save_interval or args.train_iters % args.save_interval):
        save_checkpoint(args.save, args.train_iters, consumed, model, optimizer, scheduler, args, groups)
    if args.metrics_file and dist.get_rank() == 0:
        softmax = _softmax_attention(model)
        with open(args.metrics_file, "w") as f:
            json.dump({"cp": sizes.cp, "tp": sizes.tp, "dp": sizes.dp, "layout": opts.layout,
                       "precision": "bf16" if args.bf16 else "fp32",
                       "algo": softmax.options.algo if softmax is not None else None,
                       "attention": attention_summary(model, args, sizes), "kernels": kernel_report(),
                       "metrics": metrics}, f, indent=1)
    return metrics

