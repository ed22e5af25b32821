"""GPT layer specs whose core attention is megatron-burst's context-parallel attention.

    from megatron_burst.specs import get_gpt_layer_spec, swap_core_attention
    spec = get_gpt_layer_spec(cp_algo="burst")             # Megatron's local/TE layer spec, our attention
    spec = swap_core_attention(any_megatron_spec)          # any spec Megatron built: dense, MoE block, MTP...

:func:`swap_core_attention` is what the Megatron-LM patch uses: Megatron builds its own spec from
its own flags (qk-layernorm, MoE, MTP, heterogeneous layers, TE or local ...) and only the softmax
core attention inside it is replaced, so the parameters are exactly the unpatched model's.

Megatron-LM without the patch: ``--spec megatron_burst.specs gpt_layer_spec`` imports the
module-level :data:`gpt_layer_spec` (a dense local/TE layer), whose options are left unset so they
resolve at model construction from ``--cp-algo/--cp-layout`` (when :func:`megatron_burst.add_args`
is the ``extra_args_provider``) or ``--cp-comm-type``.

Options left None resolve at construction: from Megatron-LM's flags when present, else from the
model (:class:`~megatron_burst.megatron.model.BurstGPTModel`'s layout), else the defaults; an
option set here that disagrees with the flags or the model is an error at construction.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_burst.megatron.args import make_cp_options
from megatron_burst.megatron.attention import BurstCoreAttention

__all__ = ["get_gpt_layer_spec", "gpt_layer_spec", "swap_core_attention", "transformer_engine_available"]

# Megatron's softmax core attentions, by class name (importing TE's class would need TE): these are
# what swap_core_attention replaces. Anything else in a core_attention slot is refused.
_STOCK_SOFTMAX_ATTENTION = ("DotProductAttention", "TEDotProductAttention")


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (then the TE layer spec is the default base)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


def get_gpt_layer_spec(cp_algo: Optional[str] = None, cp_layout: Optional[str] = None,
                       cp_stripe: Optional[int] = None, use_te: Optional[bool] = None,
                       cp_ring: Optional[str] = None, cp_ranks_per_node: Optional[int] = None,
                       seq_selective_ckpt_ratio: Optional[float] = None,
                       **more_options: Any) -> ModuleSpec:
    """Megatron's GPT layer spec with :class:`BurstCoreAttention` as core attention.

    Args:
        cp_algo: ring, burst or auto; None resolves at construction from Megatron-LM flags or
            ``--cp-comm-type`` (default burst).
        cp_layout: contiguous, zigzag or striped; None resolves from ``--cp-layout``, else the
            model's layout (BurstGPTModel's ``cp_layout``), else zigzag. Batches
            (:func:`megatron_burst.get_batch_on_this_cp_rank`) and RoPE must use the same layout;
            a disagreement is an error at construction.
        cp_stripe: stripe width for ``striped`` (None: as the layout).
        cp_ring: "flat" or "double"; None: double when the CP group spans nodes.
        cp_ranks_per_node: CP ranks per node; None: from the launcher (LOCAL_WORLD_SIZE / TP).
        seq_selective_ckpt_ratio: with activation recompute, store (out, lse) of this later
            fraction of each sequence and recompute attention only for the rest.
        use_te: build on ``get_gpt_layer_with_transformer_engine_spec`` (True) or
            ``get_gpt_layer_local_spec`` (False); None: TE when it is installed.
        more_options: passed to Megatron's spec function (normalization, qk_layernorm, ...).
    """
    # Validate now, not at model construction (None stays None: resolved there).
    make_cp_options(cp_algo, cp_layout, cp_stripe, None, cp_ring, cp_ranks_per_node, seq_selective_ckpt_ratio)
    if more_options.get("multi_latent_attention"):
        raise ValueError("multi_latent_attention=True is not supported by megatron-burst attention")
    if use_te is None:
        use_te = transformer_engine_available()
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        base = get_gpt_layer_with_transformer_engine_spec(**more_options)
    else:
        base = get_gpt_layer_local_spec(**more_options)
    return swap_core_attention(base, cp_algo=cp_algo, cp_layout=cp_layout, cp_stripe=cp_stripe, cp_ring=cp_ring,
                               cp_ranks_per_node=cp_ranks_per_node, seq_selective_ckpt_ratio=seq_selective_ckpt_ratio)


def _module_of(entry: Any) -> Any:
    return entry.module if isinstance(entry, ModuleSpec) else entry


def _module_name(module: Any) -> str:
    if isinstance(module, tuple):  # (import path, name), Megatron's lazy form
        return str(module[-1])
    return getattr(module, "__name__", repr(module))


def swap_core_attention(spec: Any, **options: Any) -> Any:
    """A copy of ``spec`` (a layer spec, a block spec, an MTP block spec, a list of them...) with
    every softmax core attention replaced by :class:`BurstCoreAttention` with ``options``
    (cp_algo, cp_layout, cp_stripe, cp_ring, cp_ranks_per_node, seq_selective_ckpt_ratio; None
    = resolve at construction). Nothing else changes: no parameter is added, removed or renamed.

    Raises ValueError, naming the Megatron flag, for attention it cannot replace: multi-latent
    attention, experimental attention variants, or any other core attention class. A spec whose
    core attention already is BurstCoreAttention keeps it, with unset options filled from
    ``options``. :func:`count_core_attention` tells how many slots the result holds.
    """
    make_cp_options(options.get("cp_algo"), options.get("cp_layout"), options.get("cp_stripe"), None,
                    options.get("cp_ring"), options.get("cp_ranks_per_node"), options.get("seq_selective_ckpt_ratio"))
    spec = copy.deepcopy(spec)
    _swap_in_place(spec, options)
    return spec


def count_core_attention(spec: Any) -> int:
    """How many BurstCoreAttention slots ``spec`` holds."""
    found = []
    _visit(spec, lambda holder, name, entry, parent: found.append(_module_of(entry) is BurstCoreAttention))
    return sum(found)


def _swap_in_place(spec: Any, options: dict) -> None:
    def replace(holder: Any, name: str, entry: Any, parent_module: Any) -> None:
        module = _module_of(entry)
        parent_name = _module_name(parent_module) if parent_module is not None else ""
        if "MLA" in parent_name or "MultiLatent" in parent_name:
            raise ValueError("--multi-latent-attention: megatron-burst's CP attention does not implement "
                             "multi-latent attention; run without MLA, or keep Megatron's attention with "
                             "--cp-algo none")
        if module is BurstCoreAttention:
            params = dict(entry.params) if isinstance(entry, ModuleSpec) else {}
            for key, value in options.items():
                if params.get(key) is None:
                    params[key] = value
            setattr(holder, name, ModuleSpec(module=BurstCoreAttention, params=params))
            return
        if _module_name(module) not in _STOCK_SOFTMAX_ATTENTION:
            raise ValueError(f"the layer spec's core attention {_module_name(module)} (from "
                             "--experimental-attention-variant, kitchen, or a custom --spec) is not softmax "
                             "attention that megatron-burst can replace: keep Megatron's attention with "
                             "--cp-algo none, or use a spec with DotProductAttention/TEDotProductAttention")
        setattr(holder, name, ModuleSpec(module=BurstCoreAttention, params=dict(options)))

    _visit(spec, replace)


def _visit(node: Any, fn, parent_module: Any = None) -> None:
    """Call ``fn(holder, field, entry, parent module)`` for every ``core_attention`` field in the tree."""
    if isinstance(node, ModuleSpec):
        _visit(node.submodules, fn, node.module)
    elif isinstance(node, (list, tuple)):
        for item in node:
            _visit(item, fn, parent_module)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "core_attention" and value is not None:
                fn(node, f.name, value, parent_module)
            else:
                _visit(value, fn, parent_module)


# For Megatron-LM's `--spec megatron_burst.specs gpt_layer_spec` (it must be a spec, not a
# factory). Options unset: they follow --cp-algo/--cp-layout/--cp-stripe or --cp-comm-type.
gpt_layer_spec: ModuleSpec = get_gpt_layer_spec(cp_algo=None, cp_layout=None, cp_stripe=None)
