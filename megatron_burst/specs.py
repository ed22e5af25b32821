"""GPT layer specs whose core attention is megatron-burst's context-parallel attention.

    from megatron_burst.specs import get_gpt_layer_spec
    spec = get_gpt_layer_spec(cp_algo="burst", cp_layout="striped")

Megatron-LM: ``--spec megatron_burst.specs gpt_layer_spec`` imports the module-level
:data:`gpt_layer_spec`, whose algorithm and layout are left unset so they resolve at model
construction from ``--cp-algo/--cp-layout`` (when :func:`megatron_burst.add_args` is the
``extra_args_provider``) or ``--cp-comm-type`` (see :func:`megatron_burst.megatron.args.resolve_cp_algo`).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_burst.megatron.args import make_cp_options
from megatron_burst.megatron.attention import BurstCoreAttention

__all__ = ["get_gpt_layer_spec", "gpt_layer_spec", "transformer_engine_available"]


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (then the TE layer spec is the default base)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


def get_gpt_layer_spec(cp_algo: Optional[str] = "burst", cp_layout: Optional[str] = "zigzag",
                       cp_stripe: Optional[int] = 1, use_te: Optional[bool] = None,
                       cp_ring: Optional[str] = None, cp_ranks_per_node: Optional[int] = None,
                       seq_selective_ckpt_ratio: Optional[float] = None,
                       **more_options: Any) -> ModuleSpec:
    """Megatron's GPT layer spec with :class:`BurstCoreAttention` as core attention.

    Args:
        cp_algo: ring, burst or auto; None resolves at construction from Megatron-LM flags or
            ``--cp-comm-type`` (default burst).
        cp_layout: contiguous, zigzag or striped; None resolves from ``--cp-layout`` (default
            zigzag). Batches (:func:`megatron_burst.get_batch_on_this_cp_rank`) and RoPE
            (:class:`megatron_burst.megatron.model.BurstGPTModel`) must use the same layout.
        cp_stripe: stripe width for ``striped``.
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
    if more_options.get("num_experts"):
        # MoE specs are block specs with per-layer submodules; only dense layers are wired here.
        raise ValueError("num_experts: MoE layer specs are not wired to megatron-burst yet; build "
                         "a dense spec (num_experts=None)")
    if use_te is None:
        use_te = transformer_engine_available()
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        base = get_gpt_layer_with_transformer_engine_spec(**more_options)
    else:
        base = get_gpt_layer_local_spec(**more_options)
    spec = copy.deepcopy(base)
    attn = spec.submodules.self_attention
    attn.submodules.core_attention = ModuleSpec(
        module=BurstCoreAttention,
        params={"cp_algo": cp_algo, "cp_layout": cp_layout, "cp_stripe": cp_stripe, "cp_ring": cp_ring,
                "cp_ranks_per_node": cp_ranks_per_node, "seq_selective_ckpt_ratio": seq_selective_ckpt_ratio},
    )
    return spec


# For Megatron-LM's `--spec megatron_burst.specs gpt_layer_spec` (it must be a spec, not a
# factory). Options unset: they follow --cp-algo/--cp-layout/--cp-stripe or --cp-comm-type.
gpt_layer_spec: ModuleSpec = get_gpt_layer_spec(cp_algo=None, cp_layout=None, cp_stripe=None)
