"""Process groups, seeding, model configuration, model and optimizer construction."""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_burst.megatron.options import CPOptions
from megatron_burst.train.args import DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES, ParallelSizes


@dataclass
class Groups:
    """The process groups the trainer uses, taken once from megatron.core.parallel_state."""

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup  # gradients and the loss are reduced over data x context parallel
    pg_collection: object


def print_rank_0(msg: str) -> None:
    """Print on global rank 0 only (every process prints when no world exists yet)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def init_parallel(sizes: ParallelSizes, timeout_minutes: Optional[float] = None) -> Groups:
    """initialize_model_parallel(tp, pp=1, cp) on an initialized torch.distributed world, every
    group with ``timeout_minutes`` (None: the world's own timeout, which ``python -m
    megatron_burst.train`` sets from --distributed-timeout-minutes). With
    --hierarchical-context-parallel-sizes (``sizes.hierarchical_cp``) the hierarchical CP groups
    are made as Megatron-LM makes them and put in ``pg_collection.hcp``, where USP takes them."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_burst.world import group_timeout

    if timeout_minutes is None:
        world = group_timeout()
        timeout_minutes = world.total_seconds() / 60 if world is not None else DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES
    ps.initialize_model_parallel(sizes.tp, 1, context_parallel_size=sizes.cp,
                                 create_gloo_process_groups=False, distributed_timeout_minutes=timeout_minutes)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    hierarchical = getattr(sizes, "hierarchical_cp", None)
    if hierarchical and sizes.cp > 1 and getattr(pg_collection, "hcp", None) is None:
        # megatron.core makes them with einops, not a dependency here: the same layout, made here
        from megatron_burst.megatron.groups import make_hierarchical_cp_groups

        pg_collection.hcp = make_hierarchical_cp_groups(ps.get_context_parallel_group(), hierarchical)
    return Groups(tp=ps.get_tensor_model_parallel_group(), cp=ps.get_context_parallel_group(),
                  dp=ps.get_data_parallel_group(),
                  dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
                  pg_collection=pg_collection)


def seed_everything(seed: int, device: torch.device) -> None:
    """Seed python's ``random``, numpy's and torch's global generators, as Megatron-LM does.

    Same seed on every rank: CPU-initialized weights are then identical at any TP/CP size.
    megatron.core's model_parallel_cuda_manual_seed needs CUDA; it also seeds the TP RNG
    tracker used by dropout inside TP regions, which only matters on GPU.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: a multiple of divisible_by * TP, so every TP shard is equal."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def model_config(args: argparse.Namespace, sizes: ParallelSizes, device: torch.device):
    """The TransformerConfig for these flags (fp32, or with --bf16 bf16 parameters and Megatron's
    per-token loss reduction; CPU initialization, no fusions but --te-free-fusions' RoPE)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import torch.nn.functional as F

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, tensor_model_parallel_size=sizes.tp,
        # --linear-attention-type gated_delta_net: Qwen3-Next-style heads from the attention flags
        # (keys: the query groups, values: the attention heads, both kv_channels wide; conv kernel 4)
        linear_key_head_dim=args.kv_channels, linear_value_head_dim=args.kv_channels,
        linear_num_key_heads=args.num_query_groups, linear_num_value_heads=args.num_attention_heads,
        linear_conv_kernel_dim=4,
        # a per-layer list reaches our attention through the spec (cp_layer_comm_types): Megatron-Core
        # 0.16.1's TransformerLayer indexes the list with its 1-based layer number (off by one)
        context_parallel_size=sizes.cp,
        cp_comm_type=args.cp_comm_type if not isinstance(args.cp_comm_type, list) else None,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        window_size=getattr(args, "window_size", None), window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        init_method_std=args.init_method_std, normalization=args.normalization,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        # CPU initialization builds each full weight from the same seed and then takes the TP
        # shard, so initial weights do not depend on TP or CP size (and it works without CUDA).
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=bool(getattr(args, "te_free_fusions", False)),  # megatron_burst.megatron.te_free's RoPE
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=(args.recompute_method or "uniform") if args.recompute_granularity == "full" else None,
        recompute_num_layers=(args.recompute_num_layers or 1) if args.recompute_granularity == "full" else None,
        # --bf16 as Megatron-LM's core_transformer_config_from_args sets it; the loss is already the
        # global per-token mean (step.loss_and_grads), so megatron.core's DDP must sum, not average
        **(dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                calculate_per_token_loss=True) if getattr(args, "bf16", False) else {}),
    )


def gpt_model_kwargs(args: argparse.Namespace, opts: CPOptions, sizes: ParallelSizes, groups: Groups,
                     device: torch.device, pre_process: bool = True, post_process: bool = True) -> dict:
    """GPTModel's constructor arguments for these flags, with megatron-burst's layer spec, or with
    --linear-attention-type its hybrid decoder block (linear layers where --linear-attention-freq
    says, megatron-burst's softmax attention in the others)."""
    from megatron_burst.megatron.from_args import linear_options_from_args
    from megatron_burst.specs import get_gpt_decoder_block_spec, get_gpt_layer_spec

    config = model_config(args, sizes, device)
    # the flags' options (validate_args built them) reach every softmax layer as cp_options;
    # --sparse-attention's pattern and a per-layer --cp-comm-type list travel inside them
    softmax = dict(cp_options=opts, cp_algo=None, cp_layout=None, cp_stripe=None, use_te=False,
                   normalization=args.normalization)
    linear = linear_options_from_args(args, opts, args.num_query_groups)
    if linear is None:
        spec = get_gpt_layer_spec(**softmax)
    else:
        spec = get_gpt_decoder_block_spec(config, linear_attention=linear.type, linear_cp_algo=linear.cp_algo,
                                          linear_attention_freq=list(linear.pattern), **softmax)
    return dict(
        config=config, transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, pg_collection=groups.pg_collection,
    )


def build_model(args: argparse.Namespace, opts: CPOptions, sizes: ParallelSizes, groups: Groups,
                device: torch.device):
    """BurstGPTModel with megatron-burst's layer spec, on ``device``; with --bf16 in bf16, wrapped in
    megatron.core's Float16Module and DistributedDataParallel (fp32 main grads) as Megatron-LM wraps
    it (:mod:`megatron_burst.train.mixed_precision`; ``mixed_precision.unwrap_model`` gives the
    BurstGPTModel back)."""
    from megatron_burst.megatron.model import BurstGPTModel

    if device.type == "cpu" and args.recompute_granularity is not None:
        from megatron_burst.megatron.cpu_compat import allow_checkpointing_without_cuda

        allow_checkpointing_without_cuda()
    from megatron_burst.megatron.groups import setup_cp_topology

    # the double ring's node groups (and USP's where pg_collection.hcp cannot serve): a collective,
    # made here with the other process groups
    setup_cp_topology(opts, groups.cp, sizes.cp, sizes.tp, pg_collection=groups.pg_collection)
    model = BurstGPTModel(**gpt_model_kwargs(args, opts, sizes, groups, device),
                          cp_layout=opts.layout, cp_stripe=opts.stripe, fused_lm_loss=args.fused_lm_loss)
    model = model.to(device)
    if getattr(args, "bf16", False):
        from megatron_burst.train import mixed_precision

        model = mixed_precision.wrap_model(model, device)
    return model


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module, device: Optional[torch.device] = None):
    """AdamW (no weight decay on biases and norms, as Megatron) + OptimizerParamScheduler.

    fp32: torch's AdamW (fused with --te-free-fusions) on the model's parameters (gradients reduced and clipped by
    :mod:`megatron_burst.train.step`). --bf16: megatron.core's ``get_megatron_optimizer``
    (Float16OptimizerWithFloat16Params: fp32 main parameters, the same AdamW and weight-decay groups,
    Megatron's clipping) over the DDP-wrapped model from :func:`build_model`.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if getattr(args, "bf16", False):
        from megatron_burst.train import mixed_precision

        device = device if device is not None else next(model.parameters()).device
        optimizer = mixed_precision.build_optimizer(args, model, device)
    else:
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        hyper = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                     weight_decay=args.weight_decay)
        if getattr(args, "te_free_fusions", False):
            from megatron_burst.fusions.optimizer import FusedTorchAdam

            optimizer = FusedTorchAdam(groups, adam_w_mode=True, **hyper)
        else:
            optimizer = torch.optim.AdamW(groups, **hyper)
    gbs = args.global_batch_size  # Megatron-LM counts the schedule in samples (step(gbs) per iteration),
    # so a resume with another global batch size keeps its place on the schedule
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        # Megatron-LM's resume rule: a schedule flag that differs from the checkpoint's is an error
        # unless one of these says which side wins (megatron.core's default would take the
        # checkpoint's silently)
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    return optimizer, scheduler

