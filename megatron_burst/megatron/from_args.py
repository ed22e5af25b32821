"""The flag boundary: parsed args (megatron-burst's flags, and Megatron-LM's where they exist) in,
validated options out (:mod:`megatron_burst.megatron.options`).

Both entry points build their options here, once, and pass them down as data:
:mod:`megatron_burst.megatron.megatron_lm` (the patched ``pretrain_gpt.py``, which gets Megatron-LM's
parsed args) and :mod:`megatron_burst.train` (its own parser). ``args`` is any namespace: Megatron-LM
flags it lacks are read as unset. Nothing here reads Megatron-LM's global args -- the caller hands
them in. Each refusal names the flag to change.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron_burst.masks.layout import BALANCED, check_seq_len
from megatron_burst.megatron.comm_types import PER_LAYER, STOCK_ATTENTION, check_gated_delta_net_comm_type
from megatron_burst.megatron.linear_variants import GATED_DELTA_NET, LINEAR_ATTENTION_TYPES, get_variant
from megatron_burst.megatron.options import (DEFAULT_LINEAR_CP_ALGO, LINEAR_MIN_STRIPE, BurstOptions, CPOptions,
                                             LinearAttentionOptions, linear_attention_pattern, make_cp_options)
from megatron_burst.megatron.validate import check_cp_heads, check_hierarchical_cp_sizes, check_selective_recompute

__all__ = ["options_from_args", "cp_options_from_args", "linear_options_from_args", "sparse_from_args",
           "cp_ranks_per_node_from_args", "check_sparse_flags", "check_balanced_linear_layers"]


def options_from_args(args: argparse.Namespace, num_query_groups: Optional[int] = None) -> BurstOptions:
    """Every option megatron-burst's flags decide for one model (:class:`BurstOptions`), validated
    against the other flags present in ``args``. ``num_query_groups``: the model's key/value head
    count (None: one per attention head)."""
    cp = cp_options_from_args(args)
    return BurstOptions(cp=cp, linear=linear_options_from_args(args, cp, num_query_groups),
                        fused_lm_loss=bool(getattr(args, "fused_lm_loss", False)),
                        te_free_fusions=bool(getattr(args, "te_free_fusions", False)))


def sparse_from_args(args: argparse.Namespace) -> Optional[tuple]:
    """(p_v, p_s, last_q, slash_lines) of --sparse-attention vertical_slash, validated; None without it."""
    if getattr(args, "sparse_attention", "none") in (None, "none"):
        return None
    from megatron_burst.masks.dynamic import Dynamic

    p_v, p_s = getattr(args, "sparse_budget", (0.9, 0.9))
    budgets = Dynamic(float(p_v), float(p_s), int(getattr(args, "sparse_last_q", 64)),
                      slash_lines=getattr(args, "sparse_slash_lines", "offsets"))
    seq = getattr(args, "seq_length", None)
    try:
        budgets.check(seq if seq is not None else budgets.last_q)
    except ValueError as exc:
        raise ValueError(f"--sparse-budget {p_v} {p_s} --sparse-last-q {budgets.last_q}: {exc}") from None
    return (budgets.p_v, budgets.p_s, budgets.last_q, budgets.slash_lines)


def cp_ranks_per_node_from_args(args: argparse.Namespace) -> Optional[int]:
    """``--cp-ranks-per-node``, else Megatron's ``--hierarchical-context-parallel-sizes`` (inner size)."""
    explicit = getattr(args, "cp_ranks_per_node", None)
    if explicit is not None:
        return explicit
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    return int(sizes[0]) if sizes else None


def cp_options_from_args(args: argparse.Namespace) -> CPOptions:
    """Resolve parsed flags (ours, plus Megatron's ``cp_comm_type`` when present) and validate
    them against ``--seq-length`` and ``--context-parallel-size`` when those are present."""
    opts = make_cp_options(getattr(args, "cp_algo", None), getattr(args, "cp_layout", None),
                           getattr(args, "cp_stripe", None), getattr(args, "cp_comm_type", None),
                           getattr(args, "cp_ring", None), cp_ranks_per_node_from_args(args),
                           getattr(args, "seq_selective_ckpt_ratio", None),
                           getattr(args, "hierarchical_context_parallel_sizes", None))
    check_selective_recompute(opts.selective_ckpt_ratio, opts.algo, getattr(args, "recompute_granularity", "unset"),
                              getattr(args, "recompute_modules", None))
    seq_length = getattr(args, "seq_length", None)
    cp = getattr(args, "context_parallel_size", None) or 1
    check_hierarchical_cp_sizes(getattr(args, "hierarchical_context_parallel_sizes", None), cp)
    check_sparse_flags(args, opts)
    if opts.algo == STOCK_ATTENTION and opts.layout != "zigzag":
        raise ValueError(f"--cp-algo none keeps Megatron's attention, which slices in zigzag only: drop "
                         f"--cp-layout {opts.layout}")
    check_cp_heads(opts, getattr(args, "cp_comm_type", None), cp, getattr(args, "num_attention_heads", None),
                   getattr(args, "num_query_groups", None), getattr(args, "tensor_model_parallel_size", None) or 1)
    if seq_length is not None and cp > 1:  # one rank holds any sequence length
        try:
            check_seq_len(seq_length, cp, opts.layout, opts.stripe)
        except ValueError as exc:
            raise ValueError(f"--seq-length {seq_length} with --context-parallel-size {cp} and "
                             f"--cp-layout {opts.layout}: {exc}") from None
    if opts.layout == BALANCED and getattr(args, "sparse_attention", "none") not in (None, "none"):
        # the vertical-slash plans are built from a fixed layout's positions (megatron_burst.sparse_plan)
        raise ValueError(f"--cp-layout balanced with --sparse-attention {args.sparse_attention}: the sparse "
                         "attention runs on the fixed layouts only; pass --cp-layout striped --cp-stripe 64 (its "
                         "balanced sparse ring), or drop --sparse-attention")
    sparse = None if opts.algo == STOCK_ATTENTION else sparse_from_args(args)
    return opts if sparse is None else dataclasses.replace(opts, sparse=sparse)


def check_sparse_flags(args: argparse.Namespace, opts: CPOptions) -> None:
    """--sparse-attention vertical_slash runs on the ring/burst schedules of the softmax layers,
    without sequence-selective checkpointing or attention dropout: refuse those at the flags, each
    naming what to drop. Sliding windows (--window-size) and --reset-attention-mask documents
    compose with the pattern (the engine intersects them); packed THD batches are data, not a flag,
    and are refused by the layer when one arrives."""
    if getattr(args, "sparse_attention", "none") in (None, "none") or opts.algo == STOCK_ATTENTION:
        return
    clash = []
    if opts.algo not in ("ring", "burst"):
        clash.append(f"--cp-algo {opts.algo} (use ring or burst)" if opts.algo != PER_LAYER
                     else "a per-layer --cp-comm-type list (use --cp-algo ring or burst)")
    if opts.selective_ckpt_ratio is not None:
        clash.append(f"--seq-selective-ckpt-ratio {opts.selective_ckpt_ratio}")
    dropout = getattr(args, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        clash.append(f"--attention-dropout {dropout} (pass 0)")
    if clash:
        raise ValueError(f"--sparse-attention vertical_slash runs on the ring/burst schedules alone: drop "
                         f"{'; '.join(clash)}")


def linear_options_from_args(args: argparse.Namespace, cp_opts: CPOptions,
                             num_query_groups: Optional[int]) -> Optional[LinearAttentionOptions]:
    """The linear-attention options these flags ask for (None: no linear layers), refusing what the
    linear layers cannot honour, each error naming its flag. ``num_query_groups`` is the model's
    key/value head count (None: one per attention head)."""
    kind = getattr(args, "linear_attention_type", None)
    freq = getattr(args, "linear_attention_freq", None)
    megatron_variant = getattr(args, "experimental_attention_variant", None)
    cp = getattr(args, "context_parallel_size", None) or 1
    if megatron_variant is not None and kind is None and cp > 1 and cp_opts.algo != STOCK_ATTENTION:
        # Megatron's own variant layers have no context parallelism (its config asserts as much for GDN)
        hint = ("megatron-burst runs Megatron-Core's GatedDeltaNet layers under context parallelism itself: pass "
                "--linear-attention-type gated_delta_net instead (same parameters; --linear-attention-freq places "
                "them)" if megatron_variant == GATED_DELTA_NET else
                "megatron-burst's context-parallel attention does not implement it; train it at "
                "--context-parallel-size 1")
        raise ValueError(f"--experimental-attention-variant {megatron_variant} with --context-parallel-size {cp}: "
                         f"{hint}")
    # --reset-attention-mask: the linear layers take the batch's documents as the softmax layers do
    # (the state restarts at every document start, in every layout and --linear-cp-algo)
    if kind is None:
        if freq is not None and megatron_variant is None:
            raise ValueError(f"--linear-attention-freq {freq} has no linear layers to place: add "
                             f"--linear-attention-type ({', '.join(LINEAR_ATTENTION_TYPES)}), or drop it")
        return None
    if megatron_variant is not None:
        raise ValueError(f"--linear-attention-type {kind} and --experimental-attention-variant {megatron_variant} "
                         "both replace attention layers: pass one of them")
    if cp_opts.algo == STOCK_ATTENTION:
        raise ValueError(f"--linear-attention-type {kind} builds megatron-burst's hybrid model, but --cp-algo none "
                         "keeps Megatron's model untouched: drop one of them")
    pattern = tuple(linear_attention_pattern(args.num_layers, freq))
    check_balanced_linear_layers(kind, pattern, cp_opts, getattr(args, "linear_cp_algo", None))
    if kind == GATED_DELTA_NET:
        return _gated_delta_net_options(args, cp_opts, pattern)
    variant = get_variant(kind)
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    cp = getattr(args, "context_parallel_size", None) or 1
    head_dim = getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
    if variant.shared_kv_heads and num_query_groups is not None and num_query_groups % tp:
        raise ValueError(f"--linear-attention-type {kind} shares key/value heads over --num-query-groups "
                         f"{num_query_groups}, which --tensor-model-parallel-size {tp} does not divide: use a "
                         "multiple of the TP size")
    low_rank = variant.low_rank_dim(head_dim)
    if low_rank is not None and low_rank % tp:
        raise ValueError(f"--linear-attention-type {kind}'s low-rank projection has {low_rank} outputs (the head "
                         f"dim --kv-channels for lightning, 16 for gla), which --tensor-model-parallel-size {tp} "
                         "does not divide")
    if variant.rotary and getattr(args, "position_embedding_type", "rope") != "rope":
        raise ValueError(f"--linear-attention-type {kind} rotates queries and keys (RetNet's Theta), but "
                         f"--position-embedding-type is {args.position_embedding_type}: pass "
                         "--position-embedding-type rope")
    if cp > 1 and 1 in pattern and cp_opts.layout == "striped" and cp_opts.stripe < LINEAR_MIN_STRIPE:
        raise ValueError(f"--cp-layout striped with --cp-stripe {cp_opts.stripe}: linear attention runs in chunks "
                         f"of at least {LINEAR_MIN_STRIPE} tokens per stripe under context parallelism; pass "
                         f"--cp-stripe {LINEAR_MIN_STRIPE} or more, or --cp-layout zigzag/contiguous")
    return LinearAttentionOptions(type=kind, pattern=pattern, cp_algo=getattr(args, "linear_cp_algo", None)
                                  or DEFAULT_LINEAR_CP_ALGO)


def _gated_delta_net_options(args: argparse.Namespace, cp_opts: CPOptions, pattern: tuple) -> LinearAttentionOptions:
    """--linear-attention-type gated_delta_net: its CP is one all-gather of per-segment maps (no
    --linear-cp-algo choice); heads split over TP; stripes of at least a chunk."""
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    cp = getattr(args, "context_parallel_size", None) or 1
    algo = getattr(args, "linear_cp_algo", None)
    if algo not in (None, DEFAULT_LINEAR_CP_ALGO):
        raise ValueError(f"--linear-cp-algo {algo}: gated_delta_net always exchanges its per-segment maps in one "
                         f"all-gather (LASP-2 style); drop --linear-cp-algo or pass {DEFAULT_LINEAR_CP_ALGO}")
    # Megatron-LM sizes the layers by its own --linear-* flags (megatron_burst.train by the attention's)
    sizes = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
             "linear_num_value_heads")
    unset = [f"--{name.replace('_', '-')}" for name in sizes if hasattr(args, name) and getattr(args, name) is None]
    if 1 in pattern and unset:
        raise ValueError(f"--linear-attention-type gated_delta_net sizes its layers by {', '.join(unset)}: set "
                         "them (Qwen3-Next: 4, 128, 128, 16, 32)")
    key_heads = getattr(args, "linear_num_key_heads", None) or getattr(args, "num_query_groups", None) \
        or args.num_attention_heads
    if key_heads % tp:
        raise ValueError(f"--linear-attention-type gated_delta_net: {key_heads} key heads cannot be split over "
                         f"--tensor-model-parallel-size {tp}")
    comm = getattr(args, "cp_comm_type", None)
    if cp > 1 and comm is not None:  # what Megatron's TransformerLayer hands each layer under CP
        per_layer = list(comm) if isinstance(comm, (list, tuple)) else [comm]
        if len(per_layer) == 1:
            per_layer = per_layer * len(pattern)
        for number, (entry, linear) in enumerate(zip(per_layer, pattern), start=1):
            if linear:
                check_gated_delta_net_comm_type(entry, number)
    if cp > 1 and 1 in pattern and cp_opts.layout == "striped" and cp_opts.stripe < LINEAR_MIN_STRIPE:
        raise ValueError(f"--cp-layout striped with --cp-stripe {cp_opts.stripe}: gated_delta_net runs in chunks of "
                         f"at least {LINEAR_MIN_STRIPE} tokens per stripe under context parallelism; pass "
                         f"--cp-stripe {LINEAR_MIN_STRIPE} or more, or --cp-layout zigzag/contiguous")
    return LinearAttentionOptions(type=GATED_DELTA_NET, pattern=pattern, cp_algo=DEFAULT_LINEAR_CP_ALGO)


def check_balanced_linear_layers(kind: str, pattern: tuple, cp_opts: CPOptions, linear_cp_algo: Optional[str] = None
                                 ) -> None:
    """Refuse ``--linear-cp-algo lasp1`` under ``--cp-layout balanced``, at the flags rather than at the
    first forward: LASP-1 passes the state rank to rank through equal segments, while the balanced
    placement gives each rank runs of any length (:mod:`megatron_burst.linear.runs`). LASP-2 and
    Gated DeltaNet's exchange take them."""
    if cp_opts.layout != BALANCED or 1 not in pattern or linear_cp_algo != "lasp1":
        return
    layers = [number for number, linear in enumerate(pattern, start=1) if linear]
    shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
    raise ValueError(f"--cp-layout balanced with --linear-cp-algo lasp1: the linear-attention ({kind}) layers "
                     f"(layers {shown}) run LASP-1 in the fixed layouts only; pass --linear-cp-algo lasp2 (one "
                     "all-gather of the runs' states), or --cp-layout zigzag (or contiguous / striped)")
