"""Train a GPT with megatron-burst context parallelism, built from megatron-core parts only.

    torchrun --nproc-per-node 4 -m megatron_burst.train --context-parallel-size 4 \\
        --cp-algo burst --cp-layout striped --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 \\
        --lr 1e-3 --train-iters 20

Megatron-LM's flag names (``--num-layers``, ``--tensor-model-parallel-size``, ``--data-path`` ...)
plus ours (:func:`megatron_burst.add_args`). The model is megatron.core's GPTModel
(:class:`~megatron_burst.megatron.model.BurstGPTModel`) with :mod:`megatron_burst.specs`, data is
megatron.core's GPTDataset over an indexed dataset (default: the built-in stdlib byte corpus,
:mod:`megatron_burst.data`), the optimizer torch's AdamW under megatron.core's
OptimizerParamScheduler. gloo on CPU, nccl on GPU.

The loss is the per-token mean over the whole global batch (every microbatch, DP and CP rank),
so a run at any CP size follows the CP = 1 trajectory up to float rounding. Checkpoints hold
full (CP-independent) parameters per TP rank: they resume at any CP and DP size.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import megatron_burst
from megatron_burst.megatron.args import CPOptions, add_args, cp_options_from_args

CKPT_TRACKER = "latest_checkpointed_iteration.txt"
# Flags that fix parameter shapes and semantics: a checkpoint only loads when they match.
_MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "kv_channels", "padded_vocab_size", "position_embedding_type",
                "normalization", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights",
                "tensor_model_parallel_size")


# ----------------------------------------------------------------------------------- flags

def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM-named flags used by this trainer, plus megatron-burst's."""
    p = argparse.ArgumentParser(prog="python -m megatron_burst.train", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="KV heads for grouped-query attention (default: = attention heads)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="accepted for Megatron-LM compatibility; --num-query-groups decides")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim (default hidden / heads)")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", default="rope",
                   choices=["rope", "learned_absolute", "none"],
                   help="default rope (Megatron-LM's default is learned_absolute)")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="default 0.0 (Megatron-LM: 0.1); dropout breaks CP = 1 equivalence")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="default 0.0 (Megatron-LM: 0.1); must be 0 with CP > 1")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", type=str, default=None,
                   help="Megatron's name for the CP algorithm; ring/burst/auto select ours "
                        "(see --cp-algo)")
    g.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"],
                   help="default nccl when CUDA is available, else gloo")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro batch size * data-parallel size")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recompute (Megatron's): 'selective' recomputes core attention")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefix(es), Megatron-LM style ('w1 p1 w2 p2' blends). "
                        "Default: the built-in stdlib byte corpus")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--split", default="100,0,0")
    g.add_argument("--data-cache-path", default="data_cache",
                   help="where the built-in corpus and GPTDataset index caches go")
    g.add_argument("--corpus-max-bytes", type=int, default=None,
                   help="size cap of the built-in corpus (default 4 MiB)")
    g.add_argument("--tokenizer-type", default="ByteTokenizer",
                   choices=["ByteTokenizer", "NullTokenizer"])
    g.add_argument("--vocab-size", type=int, default=None, help="for --tokenizer-type NullTokenizer")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--metrics-file", default=None,
                   help="write per-iteration metrics as JSON here (rank 0)")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (and at the end) when --save is given")
    g.add_argument("--load", default=None)
    add_args(p)
    return p


@dataclass
class Topology:
    """Derived parallel sizes (validated before any process group exists)."""

    world_size: int
    tp: int
    cp: int
    dp: int
    num_microbatches: int


def validate_args(args: argparse.Namespace, world_size: int) -> tuple[CPOptions, Topology]:
    """Fill defaults and check every flag combination; raise ValueError naming flag and fix."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "tensor_model_parallel_size", "context_parallel_size", "log_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if world_size % (tp * cp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                         f"{tp} x --context-parallel-size {cp}: launch a multiple of {tp * cp} ranks")
    dp = world_size // (tp * cp)
    heads = args.num_attention_heads
    args.num_query_groups = args.num_query_groups or heads
    if heads % args.num_query_groups:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by --num-query-groups "
                         f"{args.num_query_groups}")
    if heads % tp:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if args.num_query_groups % tp and tp % args.num_query_groups:
        raise ValueError(f"--num-query-groups {args.num_query_groups} and --tensor-model-parallel-size "
                         f"{tp}: one must divide the other")
    if args.kv_channels is None:
        if args.hidden_size % heads:
            raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by "
                             f"--num-attention-heads {heads}: set --kv-channels")
        args.kv_channels = args.hidden_size // heads
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} < --seq-length "
                         f"{args.seq_length}")
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    if cp > 1 and args.attention_dropout > 0:
        raise ValueError(f"--attention-dropout {args.attention_dropout} is not supported with "
                         f"--context-parallel-size {cp}: pass --attention-dropout 0.0")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.data_path and args.mock_data:
        raise ValueError("--data-path and --mock-data are exclusive")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be < --lr-decay-iters "
                         f"{args.lr_decay_iters}")
    if args.save_interval is not None and args.save_interval < 1:
        raise ValueError(f"--save-interval {args.save_interval} must be >= 1")
    opts = cp_options_from_args(args)  # checks --seq-length against the layout and CP size
    return opts, Topology(world_size, tp, cp, dp, args.global_batch_size // (args.micro_batch_size * dp))


# ----------------------------------------------------------------------------------- setup

@dataclass
class Groups:
    """The process groups the trainer uses, taken once from megatron.core.parallel_state."""

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup  # gradients and the loss are reduced over data x context parallel
    pg_collection: object


def init_parallel(topo: Topology) -> Groups:
    """initialize_model_parallel(tp, pp=1, cp) on an initialized torch.distributed world."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(topo.tp, 1, context_parallel_size=topo.cp,
                                 create_gloo_process_groups=False)
    return Groups(tp=ps.get_tensor_model_parallel_group(), cp=ps.get_context_parallel_group(),
                  dp=ps.get_data_parallel_group(),
                  dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
                  pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def seed_everything(seed: int, device: torch.device) -> None:
    """Same seed on every rank: CPU-initialized weights are then identical at any TP/CP size.

    megatron.core's model_parallel_cuda_manual_seed needs CUDA; it also seeds the TP RNG
    tracker used by dropout inside TP regions, which only matters on GPU.
    """
    torch.manual_seed(seed)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: a multiple of divisible_by * TP, so every TP shard is equal."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def model_config(args: argparse.Namespace, topo: Topology, device: torch.device):
    """The TransformerConfig for these flags (fp32, CPU initialization, no fusions)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import torch.nn.functional as F

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, tensor_model_parallel_size=topo.tp,
        context_parallel_size=topo.cp, cp_comm_type=args.cp_comm_type,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, normalization=args.normalization,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        # CPU initialization builds each full weight from the same seed and then takes the TP
        # shard, so initial weights do not depend on TP or CP size (and it works without CUDA).
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=(args.recompute_method or "uniform") if args.recompute_granularity == "full" else None,
        recompute_num_layers=(args.recompute_num_layers or 1) if args.recompute_granularity == "full" else None,
    )


def gpt_model_kwargs(args: argparse.Namespace, opts: CPOptions, topo: Topology, groups: Groups,
                     device: torch.device, pre_process: bool = True, post_process: bool = True) -> dict:
    """GPTModel's constructor arguments for these flags, with megatron-burst's layer spec."""
    from megatron_burst.specs import get_gpt_layer_spec

    spec = get_gpt_layer_spec(cp_algo=args.cp_algo, cp_layout=opts.layout, cp_stripe=opts.stripe,
                              cp_ring=opts.ring, cp_ranks_per_node=opts.ranks_per_node,
                              seq_selective_ckpt_ratio=opts.selective_ckpt_ratio,
                              use_te=False, normalization=args.normalization)
    return dict(
        config=model_config(args, topo, device), transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, pg_collection=groups.pg_collection,
    )


def build_model(args: argparse.Namespace, opts: CPOptions, topo: Topology, groups: Groups,
                device: torch.device):
    """BurstGPTModel with megatron-burst's layer spec, on ``device``."""
    from megatron_burst.megatron.model import BurstGPTModel

    if device.type == "cpu" and args.recompute_granularity is not None:
        from megatron_burst.megatron.cpu_compat import allow_checkpointing_without_cuda

        allow_checkpointing_without_cuda()
    from megatron_burst.megatron.groups import setup_cp_topology

    # the double ring's node groups: a collective, here where the process groups are made
    setup_cp_topology(opts, groups.cp, topo.cp, topo.tp)
    model = BurstGPTModel(**gpt_model_kwargs(args, opts, topo, groups, device),
                          cp_layout=opts.layout, cp_stripe=opts.stripe, fused_lm_loss=args.fused_lm_loss)
    return model.to(device)


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module):
    """AdamW (no weight decay on biases and norms, as Megatron) + OptimizerParamScheduler."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
        lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        weight_decay=args.weight_decay)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant")
    return optimizer, scheduler


def build_tokenizer(args: argparse.Namespace):
    from megatron_burst.data import ByteTokenizer, NullTokenizer

    return NullTokenizer(args.vocab_size) if args.tokenizer_type == "NullTokenizer" else ByteTokenizer()


def build_dataset(args: argparse.Namespace, tokenizer):
    """GPTDataset over --data-path, the built-in corpus, or MockGPTDataset."""
    from megatron_burst import data

    data_path = args.data_path
    if not data_path and not args.mock_data:
        if args.tokenizer_type != "ByteTokenizer":
            raise ValueError("the built-in corpus is byte-tokenized: use --tokenizer-type "
                             "ByteTokenizer or pass --data-path")
        kwargs = {} if args.corpus_max_bytes is None else {"max_bytes": args.corpus_max_bytes}
        data_path = [data.default_corpus(args.data_cache_path, **kwargs)]
    return data.build_train_dataset(
        data_path=data_path, mock=args.mock_data, seq_length=args.seq_length,
        num_samples=args.train_iters * args.global_batch_size, seed=args.seed, tokenizer=tokenizer,
        split=args.split, cache_path=os.path.join(args.data_cache_path, "index"))


# ----------------------------------------------------------------------------------- step

def microbatches(dataset, iteration: int, args: argparse.Namespace, topo: Topology, dp_rank: int
                 ) -> List[Dict[str, torch.Tensor]]:
    """This DP rank's microbatches of ``iteration``, as Megatron's pretraining sampler deals them:
    the global batch is consecutive samples; microbatch m of DP rank r holds samples
    base + m * mbs * dp + r * mbs + [0, mbs)."""
    from megatron_burst.data import collate

    mbs = args.micro_batch_size
    base = iteration * args.global_batch_size
    out = []
    for m in range(topo.num_microbatches):
        start = base + m * mbs * topo.dp + dp_rank * mbs
        out.append(collate([dataset[i] for i in range(start, start + mbs)]))
    return out


def loss_and_grads(model: torch.nn.Module, batches: Sequence[Dict[str, torch.Tensor]],
                   opts: CPOptions, groups: Groups, device: torch.device) -> torch.Tensor:
    """Forward and backward of this rank's microbatches (full sequence [b, s] tensors).

    Slices each batch for this CP rank, and scales the summed masked per-token loss by the loss
    tokens of the whole global batch (all microbatches, DP and CP ranks), so gradients summed
    over data x context parallel ranks are exactly those of the global per-token mean, and the
    returned value, all-reduced over dp_cp, is that mean (Megatron's lm loss).
    """
    local = [megatron_burst.get_batch_on_this_cp_rank(
        {k: v.to(device) for k, v in b.items()}, layout=opts.layout, cp_group=groups.cp,
        stripe=opts.stripe) for b in batches]
    num_tokens = sum(b["loss_mask"].sum() for b in local).to(torch.float64)
    dist.all_reduce(num_tokens, group=groups.dp_cp)
    if num_tokens.item() == 0:
        raise ValueError("the global batch has no loss tokens (loss_mask is all zero)")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for b in local:
        losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                       loss_mask=b["loss_mask"])  # [b, s_local]
        loss = (losses.float() * b["loss_mask"].float()).sum() / num_tokens.float()
        loss.backward()
        total += loss.detach().to(torch.float64)
    dist.all_reduce(total, group=groups.dp_cp)
    return total


def allreduce_grads(model: torch.nn.Module, groups: Groups) -> None:
    """Sum gradients over data x context parallel ranks, in one flat buffer."""
    if dist.get_world_size(groups.dp_cp) == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=groups.dp_cp)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


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


# ----------------------------------------------------------------------------------- checkpoints

def _ckpt_file(root: str, iteration: int, tp_rank: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt")


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args, groups: Groups) -> None:
    """Megatron-LM's legacy layout: iter_XXXXXXX/mp_rank_TT/model_optim_rng.pt, one file per TP
    rank, written by the first data x context parallel rank (parameters do not depend on CP)."""
    if dist.get_rank(groups.dp_cp) == 0:
        path = _ckpt_file(root, iteration, dist.get_rank(groups.tp))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {
            "iteration": iteration, "consumed_samples": iteration * args.global_batch_size,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
            "args": {k: getattr(args, k) for k in _MODEL_FLAGS},
            "cp": {"context_parallel_size": args.context_parallel_size, "layout": args.cp_layout},
            "megatron_burst_version": megatron_burst.__version__,
        }
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # never leave a half-written checkpoint under the real name
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, CKPT_TRACKER + ".tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, CKPT_TRACKER + ".tmp"), os.path.join(root, CKPT_TRACKER))
    dist.barrier()


def load_checkpoint(root: str, model, optimizer, scheduler, args, groups: Groups) -> int:
    """Load the latest checkpoint under ``root``; returns its iteration (0 when there is none).
    Any CP and DP size; TP and the model flags must match the saved run's."""
    tracker = os.path.join(root, CKPT_TRACKER)
    if not os.path.exists(tracker):
        _print0(f"no checkpoint at {root} ({CKPT_TRACKER} missing): training from scratch")
        return 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    iter_dir = os.path.dirname(os.path.dirname(_ckpt_file(root, iteration, 0)))
    saved_tp = len([d for d in os.listdir(iter_dir) if d.startswith("mp_rank_")]) if os.path.isdir(iter_dir) else 0
    if saved_tp != args.tensor_model_parallel_size:
        raise ValueError(f"checkpoint {iter_dir} holds {saved_tp} TP shard(s) but this run has "
                         f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: resume "
                         "with a different --tensor-model-parallel-size is not supported (TP must "
                         "match; CP and DP may differ)")
    path = _ckpt_file(root, iteration, dist.get_rank(groups.tp))
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state["args"]
    diff = [f"--{k.replace('_', '-')} saved {saved.get(k)!r} now {getattr(args, k)!r}"
            for k in _MODEL_FLAGS if saved.get(k) != getattr(args, k)]
    if diff:
        raise ValueError(f"checkpoint {path} does not match this run: " + "; ".join(diff))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _print0(f"loaded checkpoint {path} (iteration {iteration}, saved at CP="
            f"{state['cp']['context_parallel_size']} layout {state['cp']['layout']})")
    return iteration


# ----------------------------------------------------------------------------------- loop

def _print0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def run(argv: Optional[Sequence[str]] = None) -> List[Dict[str, float]]:
    """Train on the already-initialized torch.distributed world; returns per-iteration metrics
    (on every rank). Initializes and afterwards destroys megatron.core.parallel_state."""
    args = build_parser().parse_args(argv)
    world_size = dist.get_world_size()
    opts, topo = validate_args(args, world_size)  # before any collective
    from megatron.core import parallel_state as ps

    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    groups = init_parallel(topo)
    try:
        return _train(args, opts, topo, groups, device)
    finally:
        ps.destroy_model_parallel()


def _train(args, opts: CPOptions, topo: Topology, groups: Groups, device: torch.device):
    tokenizer = build_tokenizer(args)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                               topo.tp)
    seed_everything(args.seed, device)
    model = build_model(args, opts, topo, groups, device)
    optimizer, scheduler = build_optimizer(args, model)
    start = load_checkpoint(args.load, model, optimizer, scheduler, args, groups) if args.load else 0
    dataset = build_dataset(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    _print0(f"megatron-burst train: world {topo.world_size} = TP {topo.tp} x CP {topo.cp} x DP "
            f"{topo.dp}; cp-algo {model.decoder.layers[0].self_attention.core_attention.options.algo} "
            f"cp-layout {opts.layout}{f' stripe {opts.stripe}' if opts.layout == 'striped' else ''}; "
            f"{args.num_layers} layers, hidden {args.hidden_size}, heads {args.num_attention_heads}"
            f"/{args.num_query_groups} kv, seq {args.seq_length}, {n_params} parameters per TP rank; "
            f"global batch {args.global_batch_size} = {topo.num_microbatches} microbatches x "
            f"{args.micro_batch_size} x DP {topo.dp}; device {device.type}")
    dp_rank = dist.get_rank(groups.dp)
    tokens_per_iter = args.global_batch_size * args.seq_length
    metrics: List[Dict[str, float]] = []
    model.train()
    for iteration in range(start, args.train_iters):
        t0 = time.perf_counter()
        batches = microbatches(dataset, iteration, args, topo, dp_rank)
        for p in model.parameters():
            p.grad = None
        with megatron_burst.comm_counter() as counter:
            loss = loss_and_grads(model, batches, opts, groups, device)
        allreduce_grads(model, groups)
        grad_norm = clip_grads(model, args.clip_grad, groups)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step(1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        sent = torch.tensor([float(counter.bytes("sent"))], dtype=torch.float64, device=device)
        dist.all_reduce(sent)  # mean over ranks below: every rank's share of the CP traffic
        row = {"iteration": iteration + 1, "lm_loss": loss.item(), "grad_norm": grad_norm, "lr": lr,
               "elapsed_s": elapsed, "tokens_per_s": tokens_per_iter / elapsed,
               "cp_comm_bytes_per_rank": sent.item() / dist.get_world_size()}
        metrics.append(row)
        if (iteration + 1) % args.log_interval == 0 or iteration + 1 == args.train_iters:
            _print0(f" iteration {iteration + 1:8d}/{args.train_iters:8d} | consumed samples: "
                    f"{(iteration + 1) * args.global_batch_size:10d} | elapsed time per iteration "
                    f"(ms): {elapsed * 1e3:.1f} | learning rate: {lr:.6E} | global batch size: "
                    f"{args.global_batch_size:5d} | lm loss: {row['lm_loss']:.6E} | grad norm: "
                    f"{grad_norm:.3f} | tokens per second: {row['tokens_per_s']:.1f} | "
                    f"cp comm bytes per rank: {int(row['cp_comm_bytes_per_rank'])} |")
        if args.save and args.save_interval and (iteration + 1) % args.save_interval == 0:
            save_checkpoint(args.save, iteration + 1, model, optimizer, scheduler, args, groups)
    if args.save and metrics and (not args.save_interval or args.train_iters % args.save_interval):
        save_checkpoint(args.save, args.train_iters, model, optimizer, scheduler, args, groups)
    if args.metrics_file and dist.get_rank() == 0:
        with open(args.metrics_file, "w") as f:
            json.dump({"cp": topo.cp, "tp": topo.tp, "dp": topo.dp, "layout": opts.layout,
                       "algo": model.decoder.layers[0].self_attention.core_attention.options.algo,
                       "metrics": metrics}, f, indent=1)
    return metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: joins torchrun's world (or a single-process one) and trains."""
    if "RANK" not in os.environ:  # plain `python -m megatron_burst.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    parser = build_parser()
    args = parser.parse_args(argv)
    # Validate flags before creating the world, so a bad combination fails fast on every rank.
    try:
        validate_args(argparse.Namespace(**vars(args)), int(os.environ["WORLD_SIZE"]))
    except ValueError as exc:
        parser.error(str(exc))
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if int(os.environ["RANK"]) != 0:
        warnings.filterwarnings("ignore")  # as Megatron-LM: one copy of library warnings
    dist.init_process_group(backend)
    try:
        run(argv)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
