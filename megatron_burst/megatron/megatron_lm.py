"""Glue for Megatron-LM's ``pretrain_gpt.py`` (see ``patches/pretrain_gpt.patch``).

Megatron-LM is not a dependency: these helpers take its objects (parsed args, its
``model_provider`` and ``gpt_builder``) as arguments and only touch attributes its 0.15/0.16
releases define.

What the patch changes in the model, and nothing more: Megatron builds its own layer spec from its
own flags (dense, MoE, MTP, heterogeneous, TE or local, qk-layernorm ...); only the softmax core
attention inside it becomes :class:`~megatron_burst.megatron.attention.CPCoreAttention`
(:func:`megatron_burst.specs.swap_core_attention`), so parameter names and counts are the
unpatched model's. RoPE follows ``--cp-layout`` and batches are sliced in it. ``--cp-algo none``
keeps Megatron's attention and slicing. With ``--linear-attention-type`` the model is the hybrid
(LASP-2H) one instead: the layers ``--linear-attention-freq`` selects get linear attention in the
same layout (their other modules stay Megatron's). Anything that cannot be honoured is refused at
startup, naming its flag (:func:`check_args`).

This module is the flag boundary on the Megatron-LM side, the only one that reads Megatron-LM's
global state (``megatron.training.get_args`` in :func:`wrap_model_provider`, ``get_tokenizer`` in
:func:`slice_batch`): it resolves the flags once into a
:class:`~megatron_burst.megatron.options.BurstOptions` and hands the layers its ``cp`` part as the
specs' ``cp_options`` (``tests/test_no_global_args.py`` keeps every other module off those globals).
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from megatron_burst.masks.layout import BALANCED
from megatron_burst.megatron.batch import get_batch_on_this_cp_rank
from megatron_burst.megatron.comm_types import STOCK_ATTENTION
from megatron_burst.megatron.flags import add_args
from megatron_burst.megatron.from_args import cp_options_from_args, linear_options_from_args
from megatron_burst.megatron.options import BurstOptions, CPOptions, LinearAttentionOptions

BURST_SPEC = ["megatron_burst.specs", "gpt_layer_spec"]


def extra_args_provider(parser: argparse.ArgumentParser,
                        chained: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None
                        ) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider`` adding our flags after ``chained`` (e.g. ModelOpt's)."""
    if chained is not None:
        parser = chained(parser)
    return add_args(parser)


def check_args(args: argparse.Namespace) -> CPOptions:
    """Resolve our flags and refuse what megatron-burst cannot honour, each error naming its flag.

    Runs when the model is built (startup, every rank, before any step and before any collective
    of ours). Returns the resolved CP options (:func:`burst_options` returns all of them).
    """
    return burst_options(args).cp


def burst_options(args: argparse.Namespace) -> BurstOptions:
    """Megatron-LM's parsed ``args`` resolved into the options the model is built with, refusing
    what megatron-burst cannot honour (each error naming its flag). Collective-free."""
    opts = cp_options_from_args(args)  # also: layout vs --seq-length, selective ckpt vs recompute, sparse
    # --linear-attention-*: refused with --cp-algo none, among others;
    # --experimental-attention-variant (Megatron's GatedDeltaNet) pointed to --linear-attention-type
    linear = linear_options(args, opts)
    if getattr(args, "use_legacy_models", False):
        raise ValueError("--use-legacy-models: megatron-burst works with megatron.core's GPTModel; drop the flag")
    fused = bool(getattr(args, "fused_lm_loss", False))
    if fused and getattr(args, "fp16", False):
        raise ValueError("--fused-lm-loss supports fp32 and bf16 parameters, not --fp16: use --bf16, or drop "
                         "--fused-lm-loss")
    pp = getattr(args, "pipeline_model_parallel_size", None) or 1
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if opts.layout == BALANCED and (pp > 2 or (pp > 1 and vpp is not None)):
        # pretrain_gpt.get_batch gives middle stages no batch, hence no packed_seq_params: their
        # layers and RoPE would have no plan for the tokens the first stage placed
        raise ValueError(f"--cp-layout balanced with --pipeline-model-parallel-size {pp}"
                         + (f" and --virtual-pipeline-model-parallel-size {vpp}" if vpp is not None else "")
                         + ": Megatron-LM's get_batch hands middle pipeline stages no packed_seq_params, which carry "
                         "each batch's balanced plan; use at most 2 pipeline stages without virtual stages, or "
                         "--cp-layout zigzag")
    options = BurstOptions(cp=opts, linear=linear, fused_lm_loss=fused,
                           te_free_fusions=bool(getattr(args, "te_free_fusions", False)))
    if options.stock_attention:
        return options
    if getattr(args, "reset_attention_mask", False) and (pp > 2 or (pp > 1 and vpp is not None)):
        # the documents reach the layers as packed_seq_params, which get_batch builds only on the
        # first and last stage: middle stages would attend across documents
        raise ValueError(f"--reset-attention-mask with --pipeline-model-parallel-size {pp}"
                         + (f" and --virtual-pipeline-model-parallel-size {vpp}" if vpp is not None else "")
                         + ": Megatron-LM's get_batch hands middle pipeline stages no packed_seq_params, so their "
                         "layers could not keep attention inside documents; use at most 2 pipeline stages without "
                         "virtual stages, or drop --reset-attention-mask")
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    if groups is not None and groups < tp and not torch.cuda.is_available():
        raise ValueError(f"--num-query-groups {groups} below --tensor-model-parallel-size {tp} needs Megatron's "
                         "KV-head all-gather, which runs on CUDA only: use at least as many query groups as TP "
                         "ranks on CPU")
    return options


def linear_options(args: argparse.Namespace, opts: CPOptions) -> Optional[LinearAttentionOptions]:
    """``--linear-attention-type/-freq`` and ``--linear-cp-algo`` resolved against Megatron-LM's
    args (None: no linear layers)."""
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    return linear_options_from_args(args, opts, groups)


def wrap_model_provider(model_provider: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Megatron-LM's ``model_provider(model_builder, pre_process, post_process, ...)`` so the
    builder it is given goes through :func:`wrap_gpt_builder`.

    :func:`check_args` runs first (before model_provider builds anything), then with
    ``--te-free-fusions`` :func:`megatron_burst.megatron.te_free.install`. ModelOpt's builder
    (``--modelopt-enabled`` and friends) replaces the builder inside model_provider, which would
    silently drop megatron-burst; it is refused instead.
    """
    def provider(model_builder: Callable[..., Any], pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None, config: Any = None, pg_collection: Any = None):
        from megatron.training import get_args

        args = get_args()
        # Refusals first, before Megatron's model_provider builds a TransformerConfig (whose own
        # assertions, e.g. Gated DeltaNet's "no context parallel", would otherwise speak first).
        options = burst_options(args)
        opts = options.cp
        # before model_provider builds the TransformerConfig (its RoPE-fusion check) and the optimizer
        _te_free_start_up(options.te_free_fusions)
        if getattr(args, "modelopt_enabled", False) and opts.algo != STOCK_ATTENTION:
            raise ValueError("ModelOpt's model builder (--modelopt-enabled) replaces the GPT builder, so "
                             "megatron-burst's attention would silently not be used: pass --cp-algo none with "
                             "ModelOpt, or train without ModelOpt")
        return model_provider(wrap_gpt_builder(model_builder), pre_process, post_process, vp_stage,
                              config=config, pg_collection=pg_collection)

    provider.__name__ = getattr(model_provider, "__name__", "model_provider")
    return provider


def _te_free_start_up(install: bool) -> None:
    """With --te-free-fusions, :func:`megatron_burst.megatron.te_free.install` (every model chunk's
    provider call; idempotent); without it, on a CUDA machine lacking TE and apex, the line naming
    what megatron.core runs unfused (a slow path is never silent). Printed once, by rank 0, under
    Megatron-LM's other start-up lines."""
    from megatron_burst.megatron import te_free

    if install:
        text = "megatron-burst --te-free-fusions:\n" + "\n".join(f">   {line}" for line in te_free.install())
    else:
        text = te_free.unfused_here()
    if text and not _REPORTED_TE_FREE and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(f"> {text}", flush=True)
    _REPORTED_TE_FREE.append(True)


_REPORTED_TE_FREE: list = []


@contextlib.contextmanager
def _attention_swapped_in(gpt_builder: Callable[..., Any], options: Dict[str, Any],
                          linear: Optional[LinearAttentionOptions] = None, use_te: bool = False) -> Iterator[None]:
    """While ``gpt_builder`` runs, every GPTModel it constructs gets its specs' softmax core
    attention swapped for ours (the specs Megatron built from its flags are otherwise untouched).
    With ``linear``, the decoder's layers where its pattern says 1 get linear attention instead
    (:func:`megatron_burst.specs.hybrid_block_spec`; MoE, norms and MLPs stay Megatron's); MTP
    layers keep softmax attention.

    gpt_builder constructs ``GPTModel(..., transformer_layer_spec=..., mtp_block_spec=...)`` from its
    module's namespace; that name is what is replaced, for the duration of the call only.
    """
    from megatron_burst.specs import hybrid_block_spec, swap_core_attention

    namespace = getattr(gpt_builder, "__globals__", None)
    real = namespace.get("GPTModel") if namespace is not None else None
    if real is None:
        raise TypeError(f"{getattr(gpt_builder, '__name__', gpt_builder)!r} does not construct a GPTModel by that "
                        "name (a Megatron-LM version this glue does not know): build the model with "
                        "megatron_burst.specs.swap_core_attention on its layer spec instead")

    def gpt_model_with_our_attention(*args: Any, **kwargs: Any):
        if linear is not None:
            kwargs["transformer_layer_spec"] = hybrid_block_spec(
                kwargs["transformer_layer_spec"], kwargs["config"], linear.pattern, linear_attention=linear.type,
                use_te=use_te, linear_cp_algo=linear.cp_algo, vp_stage=kwargs.get("vp_stage"), **options)
        for key in ("transformer_layer_spec", "mtp_block_spec"):
            if kwargs.get(key) is not None:
                kwargs[key] = swap_core_attention(kwargs[key], **options)
        return real(*args, **kwargs)

    namespace["GPTModel"] = gpt_model_with_our_attention
    try:
        yield
    finally:
        namespace["GPTModel"] = real


def wrap_gpt_builder(gpt_builder: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Megatron-LM's ``gpt_builder(args, pre_process, post_process, ...)``.

    Before building: :func:`check_args`, and the double ring's node topology (a collective; every
    rank builds models, so every rank gets here). Building: Megatron's own spec with our core
    attention (module docstring). After: the model becomes a
    :class:`~megatron_burst.megatron.model.BurstGPTModel` in place (same parameters): RoPE follows
    ``--cp-layout``, every attention layer's layout is checked against it, and with
    ``--fused-lm-loss`` the last stage's training forward returns the fused per-token loss.
    ``--cp-algo none``: Megatron's model as it is (plus the fused loss if asked for).
    """
    def builder(args: argparse.Namespace, pre_process: bool, post_process: bool, *rest: Any, **kwargs: Any):
        from megatron_burst.megatron.model import as_burst_gpt_model

        options = burst_options(args)  # the flags, resolved once; the layers get them as data
        fused = options.fused_lm_loss and post_process  # the loss lives on the last stage
        if options.stock_attention:
            model = gpt_builder(args, pre_process, post_process, *rest, **kwargs)
            return as_burst_gpt_model(model, cp_layout=None, fused_lm_loss=True) if fused else model
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_burst.megatron.groups import setup_cp_topology

        opts = options.cp
        cp = getattr(args, "context_parallel_size", None) or 1
        tp = getattr(args, "tensor_model_parallel_size", None) or 1
        # the groups the model will get: the builder's pg_collection, else Megatron's (with its
        # hierarchical CP groups when --hierarchical-context-parallel-sizes made them)
        pgs = kwargs.get("pg_collection") or (ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp", "hcp"])
                                              if cp > 1 else None)
        setup_cp_topology(opts, parallel_state.get_context_parallel_group() if cp > 1 else None, cp, tp,
                          pg_collection=pgs)
        use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
        with _attention_swapped_in(gpt_builder, {"cp_options": opts}, options.linear, use_te):
            model = gpt_builder(args, pre_process, post_process, *rest, **kwargs)
        return as_burst_gpt_model(model, cp_layout=opts.layout, cp_stripe=opts.stripe, fused_lm_loss=fused)

    builder.__name__ = getattr(gpt_builder, "__name__", "gpt_builder")
    return builder


def slice_batch(batch: Dict[str, Any], args: argparse.Namespace, eod_token: Optional[int] = None) -> Dict[str, Any]:
    """This CP rank's part of ``batch``: in ``--cp-layout`` (Megatron's own zigzag slicing with
    ``--cp-algo none``). With ``--reset-attention-mask`` the documents come from the EOD tokens
    (``eod_token``, default Megatron-LM's tokenizer's) and the result's last entry is
    ``packed_seq_params`` (the patch pops it and hands it to the model)."""
    opts = cp_options_from_args(args)
    if opts.algo == STOCK_ATTENTION:
        from megatron.core.utils import get_batch_on_this_cp_rank as megatron_slicing

        return megatron_slicing(batch)
    if getattr(args, "reset_attention_mask", False) and eod_token is None:
        from megatron.training import get_tokenizer  # Megatron-LM only

        eod_token = get_tokenizer().eod
    if not getattr(args, "reset_attention_mask", False):
        eod_token = None
    return get_batch_on_this_cp_rank(batch, layout=opts.layout, stripe=opts.stripe, eod_token=eod_token,
                                     ranks_per_node=_layers_ranks_per_node(opts, args))


def _layers_ranks_per_node(opts: CPOptions, args: argparse.Namespace) -> Optional[int]:
    """The attention layers' CP ranks per node (balanced batches are planned for the same nodes);
    None for the fixed layouts, which place tokens by position alone."""
    if opts.layout != BALANCED:
        return None
    from megatron.core import parallel_state

    from megatron_burst.megatron.groups import layers_ranks_per_node

    return layers_ranks_per_node(opts, parallel_state.get_context_parallel_world_size(),
                                 getattr(args, "tensor_model_parallel_size", 1) or 1)


def slice_thd_batch(batch: Dict[str, Any], cu_seqlens: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor],
                    max_seqlen: torch.Tensor, args: argparse.Namespace) -> tuple:
    """A packed THD batch's part on this CP rank and its PackedSeqParams: Megatron-Core's
    ``get_thd_batch_on_this_cp_rank`` (TransformerEngine's per-sequence zigzag) with ``--cp-algo
    none``, else megatron_burst's same partitioning without TransformerEngine (``--cp-layout
    balanced``: the balanced plan of the sequences, params in "sbhd" carrying it)."""
    from megatron.core.utils import get_thd_batch_on_this_cp_rank as megatron_thd

    from megatron_burst.megatron.packed import get_thd_batch_on_this_cp_rank

    padded = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    opts = cp_options_from_args(args)
    if opts.algo == STOCK_ATTENTION:
        return megatron_thd(batch, cu_seqlens, padded, max_seqlen)
    from megatron.core import parallel_state

    return get_thd_batch_on_this_cp_rank(batch, cu_seqlens, padded, max_seqlen,
                                         parallel_state.get_context_parallel_group(), layout=opts.layout,
                                         ranks_per_node=_layers_ranks_per_node(opts, args))
