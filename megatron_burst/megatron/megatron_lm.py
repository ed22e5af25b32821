"""Glue for Megatron-LM's ``pretrain_gpt.py`` (see ``patches/pretrain_gpt.patch``).

Megatron-LM is not a dependency: these helpers take its objects (parsed args, its
``gpt_builder``) as arguments and only touch attributes its 0.15/0.16 releases define.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Optional

from megatron_burst.megatron.args import add_args, cp_options_from_args
from megatron_burst.megatron.batch import get_batch_on_this_cp_rank
from megatron_burst.megatron.rope import use_layout_rope

BURST_SPEC = ["megatron_burst.specs", "gpt_layer_spec"]


def extra_args_provider(parser: argparse.ArgumentParser,
                        chained: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None
                        ) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider`` adding our flags after ``chained`` (e.g. ModelOpt's)."""
    if chained is not None:
        parser = chained(parser)
    return add_args(parser)


def wrap_gpt_builder(gpt_builder: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Megatron-LM's ``gpt_builder(args, pre_process, post_process, ...)``.

    Before building: validates our flags against ``--seq-length/--context-parallel-size`` and,
    when no ``--spec`` was given, selects ``megatron_burst.specs gpt_layer_spec`` (which reads
    ``--cp-algo/--cp-layout``). After: RoPE follows ``--cp-layout``, and with ``--fused-lm-loss``
    the GPTModel becomes a :class:`~megatron_burst.megatron.model.BurstGPTModel` (in place, same
    parameters) whose training forward returns the fused op's per-token loss -- what
    pretrain_gpt's ``loss_func`` expects, given the ``loss_mask`` pretrain_gpt already passes.
    """
    def builder(args: argparse.Namespace, pre_process: bool, post_process: bool, *rest: Any, **kwargs: Any):
        opts = cp_options_from_args(args)
        from megatron.core import parallel_state

        from megatron_burst.megatron.groups import setup_cp_topology

        # Every rank (every pipeline stage) builds models, so the topology's collective is safe here.
        cp = getattr(args, "context_parallel_size", None) or 1
        tp = getattr(args, "tensor_model_parallel_size", None) or 1
        cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
        setup_cp_topology(opts, cp_group, cp, tp)
        if getattr(args, "spec", None) is None:
            args.spec = list(BURST_SPEC)
        model = gpt_builder(args, pre_process, post_process, *rest, **kwargs)
        if getattr(args, "fused_lm_loss", False) and post_process:  # the loss lives on the last stage
            from megatron_burst.megatron.model import as_burst_gpt_model

            return as_burst_gpt_model(model, cp_layout=opts.layout, cp_stripe=opts.stripe, fused_lm_loss=True)
        cp_group = model.pg_collection.cp if hasattr(model, "pg_collection") else None
        return use_layout_rope(model, opts.layout, cp_group, opts.stripe)

    builder.__name__ = getattr(gpt_builder, "__name__", "gpt_builder")
    return builder


def slice_batch(batch: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """``get_batch_on_this_cp_rank`` with the layout from Megatron-LM's parsed args."""
    opts = cp_options_from_args(args)
    return get_batch_on_this_cp_rank(batch, layout=opts.layout, stripe=opts.stripe)
