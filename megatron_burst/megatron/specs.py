"""GPT layer specs whose core attention is megatron-burst's context-parallel attention
(:class:`~megatron_burst.megatron.attention.CPCoreAttention`), and hybrid (LASP-2H) decoder blocks
mixing it with linear attention. Public import path: ``megatron_burst.specs`` (the same module).

    from megatron_burst.specs import get_gpt_layer_spec, swap_core_attention, get_gpt_decoder_block_spec
    spec = get_gpt_layer_spec(cp_algo="burst")             # Megatron's local/TE layer spec, our attention
    spec = swap_core_attention(any_megatron_spec)          # any spec Megatron built: dense, MoE block, MTP...
    block = get_gpt_decoder_block_spec(config, linear_attention="gla", linear_attention_freq=4)

:func:`swap_core_attention` is what the Megatron-LM patch uses: Megatron builds its own spec from
its own flags (qk-layernorm, MoE, MTP, heterogeneous layers, TE or local ...) and only the softmax
core attention inside it is replaced, so the parameters are exactly the unpatched model's.

Options reach the attention as data in the spec's params: per-field (``cp_algo``, ``cp_layout``,
...) and/or ``cp_options``, the :class:`~megatron_burst.megatron.options.CPOptions` the flag
boundary built from the flags (the patch's builder, megatron_burst.train). Options left None
resolve at construction: from ``cp_options`` when given, else from the model
(:class:`~megatron_burst.megatron.model.BurstGPTModel`'s layout) and Megatron's config
(``cp_comm_type``, ``hierarchical_context_parallel_sizes``), else the defaults; an option set here
that disagrees with ``cp_options`` or the model is an error at construction.

Megatron-LM: ``--spec megatron_burst.specs gpt_layer_spec`` imports the module-level
:data:`gpt_layer_spec` (a dense local/TE layer), whose options are left unset: with the patch, its
builder fills them from ``--cp-algo/--cp-layout`` ...; without it, ``--cp-comm-type`` chooses.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, List, Optional, Sequence, Union

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_burst.megatron.attention import CPCoreAttention
from megatron_burst.megatron.options import (CPOptions, linear_attention_pattern, make_cp_options,
                                             make_linear_cp_options)
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron_burst.megatron.gated_delta_net import GATED_DELTA_NET, CPGatedDeltaNet
from megatron_burst.megatron.linear_attention import LinearSelfAttention, LinearSelfAttentionSubmodules
from megatron_burst.megatron.linear_variants import get_variant

__all__ = ["get_gpt_layer_spec", "gpt_layer_spec", "swap_core_attention", "transformer_engine_available",
           "get_gpt_decoder_block_spec", "linear_attention_spec", "hybrid_block_spec"]

# swap_core_attention's options (the softmax layers'); get_gpt_decoder_block_spec passes the rest to Megatron
_SOFTMAX_OPTIONS = ("cp_ring", "cp_ranks_per_node", "seq_selective_ckpt_ratio", "cp_ulysses_size",
                    "cp_layer_comm_types", "cp_sparse", "cp_options")

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
                       seq_selective_ckpt_ratio: Optional[float] = None, cp_ulysses_size: Optional[int] = None,
                       cp_layer_comm_types: Optional[tuple] = None, cp_sparse: Optional[tuple] = None,
                       cp_options: Optional[CPOptions] = None, **more_options: Any) -> ModuleSpec:
    """Megatron's GPT layer spec with :class:`CPCoreAttention` as core attention.

    Args:
        cp_algo: ring, burst, auto, allgather, ulysses or usp; None resolves at construction from
            ``cp_options``, else Megatron's ``cp_comm_type`` (default burst).
        cp_layout: contiguous, zigzag or striped; None resolves from ``cp_options`` (``--cp-layout``),
            else the model's layout (BurstGPTModel's ``cp_layout``), else zigzag. Batches
            (:func:`megatron_burst.get_batch_on_this_cp_rank`) and RoPE must use the same layout;
            a disagreement is an error at construction.
        cp_stripe: stripe width for ``striped`` (None: as the layout).
        cp_ring: "flat" or "double"; None: double when the CP group spans nodes.
        cp_ranks_per_node: CP ranks per node; None: from the launcher (LOCAL_WORLD_SIZE / TP).
        seq_selective_ckpt_ratio: with activation recompute, store (out, lse) of this later
            fraction of each sequence and recompute attention only for the rest.
        cp_ulysses_size: usp's all-to-all group size (None: ``cp_options``, else the config's
            ``hierarchical_context_parallel_sizes`` first entry).
        cp_layer_comm_types: Megatron's per-layer ``--cp-comm-type`` list; layer L (1-based) runs
            entry L-1 (unless cp_algo is given).
        cp_sparse: (p_v, p_s, last_q) of the dynamic vertical-slash pattern.
        cp_options: the :class:`CPOptions` the flag boundary resolved (``cp_options_from_args``):
            fills every option left None here, and the options set here must agree with it.
        use_te: build on ``get_gpt_layer_with_transformer_engine_spec`` (True) or
            ``get_gpt_layer_local_spec`` (False); None: TE when it is installed.
        more_options: passed to Megatron's spec function (normalization, qk_layernorm, ...).
    """
    # Validate now, not at model construction (None stays None: resolved there).
    _check_options(dict(cp_algo=cp_algo, cp_layout=cp_layout, cp_stripe=cp_stripe, cp_ring=cp_ring,
                        cp_ranks_per_node=cp_ranks_per_node, seq_selective_ckpt_ratio=seq_selective_ckpt_ratio,
                        cp_ulysses_size=cp_ulysses_size, cp_sparse=cp_sparse, cp_options=cp_options))
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
                               cp_ranks_per_node=cp_ranks_per_node, seq_selective_ckpt_ratio=seq_selective_ckpt_ratio,
                               **({} if cp_ulysses_size is None else {"cp_ulysses_size": cp_ulysses_size}),
                               **({} if cp_layer_comm_types is None else {"cp_layer_comm_types": cp_layer_comm_types}),
                               **({} if cp_sparse is None else {"cp_sparse": cp_sparse}),
                               **({} if cp_options is None else {"cp_options": cp_options}))


def _module_of(entry: Any) -> Any:
    return entry.module if isinstance(entry, ModuleSpec) else entry


def _module_name(module: Any) -> str:
    if isinstance(module, tuple):  # (import path, name), Megatron's lazy form
        return str(module[-1])
    return getattr(module, "__name__", repr(module))


def swap_core_attention(spec: Any, **options: Any) -> Any:
    """A copy of ``spec`` (a layer spec, a block spec, an MTP block spec, a list of them...) with
    every softmax core attention replaced by :class:`CPCoreAttention` with ``options``
    (cp_algo, cp_layout, cp_stripe, cp_ring, cp_ranks_per_node, seq_selective_ckpt_ratio,
    cp_ulysses_size, cp_layer_comm_types, cp_sparse, and ``cp_options``, the flag boundary's
    :class:`CPOptions`; None = resolve at construction). Nothing else changes: no parameter is
    added, removed or renamed.

    Raises ValueError, naming the Megatron flag, for attention it cannot replace: multi-latent
    attention, experimental attention variants, or any other core attention class. A spec whose
    core attention already is CPCoreAttention keeps it, with unset options filled from
    ``options``. :func:`count_core_attention` tells how many slots the result holds.
    """
    _check_options(options)
    spec = copy.deepcopy(spec)
    _swap_in_place(spec, options)
    return spec


def _check_options(options: dict) -> None:
    """Validate a spec's attention options now, not at model construction (None stays None)."""
    cp_options = options.get("cp_options")
    if cp_options is not None and not isinstance(cp_options, CPOptions):
        raise TypeError(f"cp_options must be a megatron_burst.megatron.options.CPOptions, got "
                        f"{type(cp_options).__name__} (build it with make_cp_options or cp_options_from_args)")
    algo = options.get("cp_algo")
    make_cp_options(algo if algo != "usp" or options.get("cp_ulysses_size") else None, options.get("cp_layout"),
                    options.get("cp_stripe"), None, options.get("cp_ring"), options.get("cp_ranks_per_node"),
                    options.get("seq_selective_ckpt_ratio"), ulysses_size=options.get("cp_ulysses_size"),
                    sparse=options.get("cp_sparse"))


def count_core_attention(spec: Any) -> int:
    """How many CPCoreAttention slots ``spec`` holds."""
    found = []
    _visit(spec, lambda holder, name, entry, parent: found.append(_module_of(entry) is CPCoreAttention))
    return sum(found)


def _swap_in_place(spec: Any, options: dict) -> None:
    def replace(holder: Any, name: str, entry: Any, parent_module: Any) -> None:
        module = _module_of(entry)
        parent_name = _module_name(parent_module) if parent_module is not None else ""
        if "MLA" in parent_name or "MultiLatent" in parent_name:
            raise ValueError("--multi-latent-attention: megatron-burst's CP attention does not implement "
                             "multi-latent attention; run without MLA, or keep Megatron's attention with "
                             "--cp-algo none")
        if module is CPCoreAttention:
            params = dict(entry.params) if isinstance(entry, ModuleSpec) else {}
            for key, value in options.items():
                if params.get(key) is None:
                    params[key] = value
            setattr(holder, name, ModuleSpec(module=CPCoreAttention, params=params))
            return
        if _module_name(module) not in _STOCK_SOFTMAX_ATTENTION:
            raise ValueError(f"the layer spec's core attention {_module_name(module)} (from "
                             "--experimental-attention-variant, kitchen, or a custom --spec) is not softmax "
                             "attention that megatron-burst can replace: keep Megatron's attention with "
                             "--cp-algo none, or use a spec with DotProductAttention/TEDotProductAttention")
        setattr(holder, name, ModuleSpec(module=CPCoreAttention, params=dict(options)))

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


def linear_attention_spec(linear_attention: str, *, use_te: bool = False, cp_layout: Optional[str] = None,
                          cp_stripe: Optional[int] = None, linear_cp_algo: Optional[str] = None) -> ModuleSpec:
    """The ``self_attention`` spec of a linear layer: :class:`LinearSelfAttention` of the variant
    ``linear_attention`` (basic, lightning, retention, gla) with the backend's column/row-parallel
    linears (Transformer Engine's when ``use_te``). Options left None resolve at construction
    (Megatron-LM's flags, else the model's layout, else the defaults)."""
    if linear_attention == GATED_DELTA_NET:
        return gated_delta_net_spec(use_te=use_te, cp_layout=cp_layout, cp_stripe=cp_stripe)
    get_variant(linear_attention)
    make_linear_cp_options(linear_cp_algo, cp_layout, cp_stripe)  # validate now, not at construction
    backend = _backend(use_te)
    return ModuleSpec(
        module=LinearSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "linear_attention": linear_attention, "cp_layout": cp_layout,
                "cp_stripe": cp_stripe, "linear_cp_algo": linear_cp_algo},
        submodules=LinearSelfAttentionSubmodules(linear_qkv=backend.column_parallel_linear(),
                                                 linear_proj=backend.row_parallel_linear(),
                                                 linear_low_rank=backend.column_parallel_linear()))


def gated_delta_net_spec(*, use_te: bool = False, rms_norm: bool = True, cp_layout: Optional[str] = None,
                         cp_stripe: Optional[int] = None, cp_layer_comm_types: Optional[tuple] = None) -> ModuleSpec:
    """The ``self_attention`` spec of a Gated DeltaNet layer: :class:`CPGatedDeltaNet` (Megatron's
    GatedDeltaNet with context parallelism) with Megatron's submodules for the backend. With
    Transformer Engine the layer's input norm is fused into ``in_proj`` (as in Megatron's own GDN
    spec, ``metainfo["fuse_input_layernorm"]``); without it the layer keeps a separate norm.
    ``rms_norm``: the per-head output norm (Qwen3-Next's RMSNorm). ``cp_layer_comm_types``: Megatron's
    per-layer ``--cp-comm-type`` list (each layer checks its own entry)."""
    make_linear_cp_options(None, cp_layout, cp_stripe)
    backend = _backend(use_te)
    fused = use_te and backend.column_parallel_layer_norm_linear() is not None
    params = {"cp_layout": cp_layout, "cp_stripe": cp_stripe}
    if cp_layer_comm_types is not None:
        params["cp_layer_comm_types"] = tuple(cp_layer_comm_types)
    return ModuleSpec(
        module=CPGatedDeltaNet, params=params,
        submodules=GatedDeltaNetSubmodules(
            in_proj=backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear(),
            out_norm=backend.layer_norm(rms_norm=rms_norm, for_qk=False), out_proj=backend.row_parallel_linear()),
        metainfo={"fuse_input_layernorm": fused})


def _backend(use_te: bool):
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider()


def get_gpt_decoder_block_spec(config: Any, *, linear_attention: str = "lightning",
                               linear_attention_freq: Union[int, Sequence[int], None] = None,
                               cp_algo: Optional[str] = "burst", cp_layout: Optional[str] = "zigzag",
                               cp_stripe: Optional[int] = None, linear_cp_algo: Optional[str] = None,
                               use_te: Optional[bool] = None, vp_stage: Optional[int] = None,
                               pp_rank: Optional[int] = None, **spec_options: Any) -> TransformerBlockSubmodules:
    """A hybrid (LASP-2H) GPT decoder block for ``GPTModel(transformer_layer_spec=...)``.

    Megatron's own block spec for ``config`` (``get_gpt_decoder_block_spec``: dense or MoE layers
    by ``config.moe_layer_freq``, this pipeline stage's layers) with, per layer, either
    megatron-burst's softmax CP attention and RoPE (:func:`swap_core_attention` with ``cp_algo``,
    ``cp_layout``, ``cp_stripe`` and the ``cp_ring``/``cp_ranks_per_node``/
    ``seq_selective_ckpt_ratio``/``cp_options`` ... options) or linear attention of the variant ``linear_attention``
    in the same layout (``linear_cp_algo``: lasp2 or lasp1). ``linear_attention="gated_delta_net"``:
    Megatron-Core's GatedDeltaNet layers with CP (:func:`gated_delta_net_spec`, sized by
    ``config.linear_*``), a Qwen3-Next-style hybrid.

    ``linear_attention_freq`` has Megatron-Core's meaning: int N -> every N-th layer softmax, the
    rest linear; a list -> 1 = linear, 0 = softmax per layer; None -> ``config.linear_attention_freq``
    when set, else every layer linear. Other ``spec_options`` (normalization, qk_l2_norm) go to
    Megatron's spec function; ``use_te`` None: Transformer Engine when installed.
    """
    softmax = {key: spec_options.pop(key) for key in _SOFTMAX_OPTIONS if key in spec_options}
    freq = _resolve_freq(linear_attention_freq, getattr(config, "linear_attention_freq", None))
    pattern = linear_attention_pattern(config.num_layers, freq)
    if use_te is None:
        use_te = transformer_engine_available()
    if pp_rank is None and config.pipeline_model_parallel_size == 1:
        pp_rank = 0  # Megatron's stage helpers would otherwise ask an initialized parallel_state
    from megatron.core.models.gpt import gpt_layer_specs

    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage,
                                                       pp_rank=pp_rank, **spec_options)
    return hybrid_block_spec(block, config, pattern, linear_attention=linear_attention, use_te=use_te,
                             linear_cp_algo=linear_cp_algo, vp_stage=vp_stage, pp_rank=pp_rank,
                             cp_algo=cp_algo, cp_layout=cp_layout, cp_stripe=cp_stripe, **softmax)


def _resolve_freq(given, from_config):
    if given is not None and from_config is not None and given != from_config:
        raise ValueError(f"linear_attention_freq={given!r} but config.linear_attention_freq={from_config!r}: "
                         "set one of them (--linear-attention-freq)")
    return given if given is not None else from_config


def hybrid_block_spec(spec: Any, config: Any, pattern: Sequence[int], *, linear_attention: str, use_te: bool = False,
                      linear_cp_algo: Optional[str] = None, vp_stage: Optional[int] = None,
                      pp_rank: Optional[int] = None, **options: Any) -> TransformerBlockSubmodules:
    """``spec`` (a layer spec or a block spec Megatron built for this pipeline stage) as a block
    whose layer with global index i has linear attention where ``pattern[i]`` is 1 and
    megatron-burst's softmax attention (:func:`swap_core_attention` with ``options``) where it is 0.

    A linear layer keeps everything of Megatron's layer but the attention: its ``self_attention``
    becomes :func:`linear_attention_spec`, and an input norm fused into Transformer Engine's qkv
    projection becomes a separate norm (the linear layer's gates read the normed input too).
    Raises ValueError for a layer whose attention is not Megatron's SelfAttention (MLA,
    heterogeneous no-op or linear-replaced attention).
    """
    from megatron.core.transformer.transformer_block import _get_block_submodules

    if len(pattern) != config.num_layers:
        raise ValueError(f"the linear-attention pattern has {len(pattern)} entries for {config.num_layers} layers "
                         "(--linear-attention-freq)")
    if pp_rank is None and config.pipeline_model_parallel_size == 1:
        pp_rank = 0  # Megatron's stage helpers would otherwise ask an initialized parallel_state
    block = _get_block_submodules(config, spec, vp_stage, pp_rank)
    layer_ids = _global_layer_ids(config, len(block.layer_specs), vp_stage, pp_rank)
    # the linear layers slice the sequence as the softmax layers do: the per-field options, else the
    # flag boundary's cp_options
    flags = options.get("cp_options")
    layout, stripe, comm_types = options.get("cp_layout"), options.get("cp_stripe"), options.get("cp_layer_comm_types")
    if flags is not None:
        layout = flags.layout if layout is None else layout
        stripe = flags.stripe if stripe is None else stripe
        comm_types = flags.layer_comm_types if comm_types is None else comm_types
    make_linear_cp_options(linear_cp_algo, layout, stripe)
    if linear_attention == GATED_DELTA_NET:
        linear = gated_delta_net_spec(use_te=use_te, rms_norm=config.normalization == "RMSNorm",
                                      cp_layout=layout, cp_stripe=stripe, cp_layer_comm_types=comm_types)
    else:
        linear = linear_attention_spec(linear_attention, use_te=use_te, cp_layout=layout, cp_stripe=stripe,
                                       linear_cp_algo=linear_cp_algo)
    layers = [_as_linear_layer(layer, linear, config, use_te, i) if pattern[i]
              else swap_core_attention(layer, **options) for layer, i in zip(block.layer_specs, layer_ids)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=block.layer_norm)


def _global_layer_ids(config: Any, count: int, vp_stage: Optional[int], pp_rank: Optional[int]) -> List[int]:
    """Global decoder-layer indices of this pipeline stage's ``count`` layers."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    if config.pipeline_model_parallel_size == 1:
        return list(range(count))
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + count))


def _as_linear_layer(layer: Any, linear: ModuleSpec, config: Any, use_te: bool, index: int) -> ModuleSpec:
    attention = layer.submodules.self_attention if isinstance(layer, ModuleSpec) else None
    if _module_name(_module_of(attention)) != "SelfAttention":
        name = _module_name(_module_of(attention)) if attention is not None else type(layer).__name__
        raise ValueError(f"layer {index + 1}'s attention is {name} (from --multi-latent-attention, "
                         "--heterogeneous-layers-config-path or a custom --spec), which --linear-attention-type "
                         "cannot replace with linear attention: use Megatron's SelfAttention layers")
    sub = layer.submodules
    norm = sub.input_layernorm
    if linear.metainfo.get("fuse_input_layernorm"):  # the linear layer's own projection normalizes
        norm = IdentityOp
    elif norm is IdentityOp or _module_of(norm) is IdentityOp:  # fused into TE's LayerNorm+qkv linear
        norm = _backend(use_te).layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    # The input norm is the layer's own here, under that name, in every backend.
    keys_map = {k: v for k, v in (sub.sharded_state_dict_keys_map or {}).items() if not k.startswith("input_layernorm")}
    sub = dataclasses.replace(sub, input_layernorm=norm, self_attention=copy.deepcopy(linear),
                              sharded_state_dict_keys_map=keys_map)
    return dataclasses.replace(layer, submodules=sub)


# For Megatron-LM's `--spec megatron_burst.specs gpt_layer_spec` (it must be a spec, not a
# factory). Options unset: the patch's builder fills them from --cp-algo/--cp-layout/--cp-stripe
# (cp_options); without the patch --cp-comm-type (Megatron's config) chooses.
gpt_layer_spec: ModuleSpec = get_gpt_layer_spec(cp_algo=None, cp_layout=None, cp_stripe=None)
