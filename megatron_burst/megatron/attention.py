"""``CPCoreAttention``: the Megatron-Core ``core_attention`` that runs every megatron-burst CP
algorithm (ring, burst, auto, allgather, ulysses, usp; dense, windowed, documents, sparse).

Megatron's ``SelfAttention`` projects q/k/v, applies RoPE and calls its ``core_attention`` with
``[s_local, b, heads_per_partition, d]`` tensors. This module hands them to
:func:`megatron_burst.cp_attention` over the context-parallel group and returns
``[s_local, b, heads * d]``, like Megatron's ``DotProductAttention`` (which needs CUDA and refuses
CP > 1) and ``TEDotProductAttention``. ``BurstCoreAttention`` is its former name (a deprecated alias).

Its options come from the layer spec's params: per-field values (``cp_algo``, ``cp_layout`` ...)
and/or ``cp_options``, the :class:`~megatron_burst.megatron.options.CPOptions` the flag boundary
built (Megatron-LM's patched ``pretrain_gpt.py``, megatron_burst.train). It never reads
Megatron-LM's global args. Process groups come from ``pg_collection`` (``cp``; ``hcp`` for USP),
else from the groups built once where the process groups are made
(:mod:`megatron_burst.megatron.groups`).

Everything that cannot be honoured is rejected in ``__init__``, before any collective, with the
setting to change. Heads come from the tensors, so TP (heads per partition) and GQA need no
special handling: q has hq heads, k/v hkv, and ``cp_attention`` requires ``hq % hkv == 0``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


from megatron_burst.activation_store import SelectiveAttentionCache, selective_cp_attention
from megatron_burst.algorithms import prepare
from megatron_burst.masks.documents import THD
from megatron_burst.masks.window import check_window
from megatron_burst.masks.layout import BALANCED
from megatron_burst.megatron.comm_types import PER_LAYER, STOCK_ATTENTION
from megatron_burst.megatron.groups import (cp_group_from, needs_node_topology, needs_usp_topology,
                                            resolve_cp_ranks_per_node, usp_topology_from_pg_collection)
from megatron_burst.megatron.options import CPOptions, make_cp_options
from megatron_burst.megatron.packed import documents_of
from megatron_burst.megatron.validate import check_cp_dropout, check_selective_ckpt_algo
from megatron_burst.topology import CPTopology, registered_cp_topology, registered_usp_topology

__all__ = ["CPCoreAttention", "BurstCoreAttention", "FollowsModelLayout", "layer_window"]

_SUPPORTED_MASKS = {AttnMaskType.causal: True, AttnMaskType.no_mask: False}


_cp_group_from = cp_group_from  # the name this module used


def _checkpointing() -> bool:
    """True inside Megatron's activation-checkpoint forward/recompute (tensor_parallel.checkpoint)."""
    from megatron.core.tensor_parallel import random as tp_random

    return tp_random.is_checkpointing()


def _check_against_options(options: CPOptions, cp_algo: Optional[str], cp_layout: Optional[str],
                           cp_stripe: Optional[int]) -> None:
    """A layer spec's explicit options must agree with the options the flag boundary resolved
    (``cp_options``): the flags slice the batches and RoPE. An algorithm the user did not type
    (``requested_algo`` None: the default, or one a --cp-comm-type named, checked again at
    resolution) a spec may choose."""
    if cp_layout is not None and cp_layout != options.layout:
        raise ValueError(f"the layer spec sets cp_layout={cp_layout!r} but --cp-layout is {options.layout!r}, and "
                         "batches and RoPE follow the flag: pass --cp-layout "
                         f"{cp_layout}, or build the spec without cp_layout")
    if cp_stripe is not None and cp_stripe != options.stripe:
        raise ValueError(f"the layer spec sets cp_stripe={cp_stripe} but --cp-stripe is {options.stripe}: pass "
                         f"--cp-stripe {cp_stripe}, or build the spec without cp_stripe")
    if cp_algo is not None and options.requested_algo is not None and cp_algo != options.requested_algo:
        raise ValueError(f"the layer spec sets cp_algo={cp_algo!r} but --cp-algo is {options.requested_algo!r}: pass "
                         "one value (or build the spec without cp_algo)")


def layer_window(config, layer_number: int) -> Optional[tuple]:
    """This layer's sliding window (left, right) from ``config.window_size`` and
    ``window_attn_skip_freq`` (Megatron-Core's is_layer_window_attention; layer_number 1-based),
    validated; None for full attention."""
    window = getattr(config, "window_size", None)
    if not window:
        return None
    freq = getattr(config, "window_attn_skip_freq", None)
    if isinstance(freq, list) and not 1 <= layer_number <= len(freq):
        raise ValueError(f"window_attn_skip_freq={freq} has {len(freq)} entries but this is layer {layer_number}: "
                         "give one 0/1 per layer")
    if freq is not None and not isinstance(freq, (int, list)):
        raise ValueError(f"window_attn_skip_freq={freq!r} must be an int N (every N-th layer full) or a 0/1 list")
    swa = freq is None or (layer_number % freq != 0 if isinstance(freq, int) else bool(freq[layer_number - 1]))
    if not swa:
        return None
    try:
        check_window(tuple(window))
    except (ValueError, TypeError) as e:
        raise ValueError(f"window_size={window} (--window-size): {e}") from None
    return tuple(window)


def _mask_is_causal(mask_type: AttnMaskType) -> bool:
    if mask_type not in _SUPPORTED_MASKS:
        raise ValueError(f"attn_mask_type={mask_type.name} is not supported by megatron-burst "
                         "attention, which honours only 'causal' and 'no_mask' (padding and "
                         "arbitrary masks cannot be applied across CP ranks); use a causal GPT "
                         "layer spec and unpadded batches")
    return _SUPPORTED_MASKS[mask_type]


class FollowsModelLayout:
    """Mixin of the layers that slice the sequence in a CP layout (softmax core attention, linear
    attention): the layout may be left free at construction and bound to the model's later.

    The class sets ``options`` (a frozen dataclass with ``layout`` and ``stripe``),
    ``_layout_fixed`` (the spec or the flags fixed it) and ``layer_number``.
    """

    _layout_noun = "attention"

    def bind_layout(self, layout: str, stripe: int = 1) -> None:
        """Follow the model's sequence layout (what its RoPE and the batch slicing use).

        A layout the spec or the flags fixed must already be the model's: a disagreement is a
        ValueError naming both, never a silent mismatch between attention, RoPE and batches.
        """
        if (self.options.layout, self.options.stripe) == (layout, stripe):
            return
        if self._layout_fixed:
            raise ValueError(f"layer {self.layer_number}: {self._layout_noun} slices the sequence as "
                             f"cp_layout={self.options.layout!r} (stripe {self.options.stripe}) but the model's RoPE "
                             f"and batches use {layout!r} (stripe {stripe}): build the layer spec without cp_layout "
                             "(it then follows the model), or use one --cp-layout everywhere")
        self.options = dataclasses.replace(self.options, layout=layout, stripe=stripe)


class CPCoreAttention(FollowsModelLayout, MegatronModule):
    """Context-parallel core attention, every megatron-burst algorithm, with Megatron's constructor
    and forward signatures.

    Extra keyword arguments (set through the layer spec's params, see
    :func:`megatron_burst.specs.get_gpt_layer_spec`): ``cp_options`` (the
    :class:`~megatron_burst.megatron.options.CPOptions` the flag boundary resolved), and per-field
    values: ``cp_algo`` (ring/burst/auto/allgather/ulysses/usp, or None to resolve from
    ``cp_comm_type``), ``cp_layout`` (None: zigzag, or the model's), ``cp_stripe``, ``cp_ring``
    (flat/double; None: double when the CP group spans nodes), ``cp_ranks_per_node`` (None: from
    the launcher), ``seq_selective_ckpt_ratio`` (sequence-level selective checkpointing under
    activation recompute), ``cp_ulysses_size`` (None: ``config.hierarchical_context_parallel_sizes[0]``),
    ``cp_layer_comm_types`` and ``cp_sparse``. A per-field value given together with ``cp_options``
    must agree with it where the flags decide (layout, stripe, a typed --cp-algo); unset ones are
    taken from it, and its layout is fixed (else the layout follows the model's, see
    :meth:`bind_layout`). Documents arrive as ``packed_seq_params`` in ``forward`` (see
    :mod:`megatron_burst.megatron.packed`).
    """

    _layout_noun = "core attention"

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        *,
        cp_options: Optional[CPOptions] = None,
        cp_algo: Optional[str] = None,
        cp_layout: Optional[str] = None,
        cp_stripe: Optional[int] = None,
        cp_ring: Optional[str] = None,
        cp_ranks_per_node: Optional[int] = None,
        seq_selective_ckpt_ratio: Optional[float] = None,
        cp_ulysses_size: Optional[int] = None,
        cp_layer_comm_types: Optional[tuple] = None,
        cp_sparse: Optional[tuple] = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_group = cp_group_from(pg_collection)
        if cp_options is not None:  # resolved at the flag boundary: the one source of truth
            if not isinstance(cp_options, CPOptions):
                raise TypeError(f"cp_options must be a megatron_burst.megatron.options.CPOptions, got "
                                f"{type(cp_options).__name__} (build it with make_cp_options or cp_options_from_args)")
            _check_against_options(cp_options, cp_algo, cp_layout, cp_stripe)
            if cp_algo is None and cp_options.algo != PER_LAYER:
                cp_algo = cp_options.algo
            cp_layout = cp_options.layout if cp_layout is None else cp_layout
            cp_stripe = cp_options.stripe if cp_stripe is None else cp_stripe
            cp_ring = cp_options.ring if cp_ring is None else cp_ring
            cp_ranks_per_node = cp_ranks_per_node or cp_options.ranks_per_node
            if seq_selective_ckpt_ratio is None:
                seq_selective_ckpt_ratio = cp_options.selective_ckpt_ratio
            cp_ulysses_size = cp_options.ulysses_size if cp_ulysses_size is None else cp_ulysses_size
            cp_layer_comm_types = cp_options.layer_comm_types if cp_layer_comm_types is None else cp_layer_comm_types
            cp_sparse = cp_options.sparse if cp_sparse is None else cp_sparse
        if cp_ulysses_size is None and getattr(config, "hierarchical_context_parallel_sizes", None):
            cp_ulysses_size = int(config.hierarchical_context_parallel_sizes[0])  # Megatron's a2a size
        if cp_layer_comm_types is not None:  # Megatron's per-layer --cp-comm-type: this layer's entry
            if not 1 <= self.layer_number <= len(cp_layer_comm_types):
                raise ValueError(f"layer {self.layer_number}: --cp-comm-type lists {len(cp_layer_comm_types)} "
                                 "values: give one per layer")
            cp_comm_type = cp_layer_comm_types[self.layer_number - 1]
        cp_size = dist.get_world_size(self.cp_group) if dist.is_initialized() else 1

        # The layout is fixed (by the spec or the flag boundary's options) or still free to follow
        # the model's (BurstGPTModel binds it: see bind_layout).
        self._layout_fixed = cp_layout is not None or cp_stripe is not None
        self.options: CPOptions = make_cp_options(cp_algo, cp_layout, cp_stripe, cp_comm_type, cp_ring,
                                                  cp_ranks_per_node, seq_selective_ckpt_ratio,
                                                  ulysses_size=cp_ulysses_size, sparse=cp_sparse)
        if self.options.algo == STOCK_ATTENTION:
            raise ValueError(f"layer {self.layer_number}: CPCoreAttention with --cp-algo none: 'none' keeps "
                             "Megatron's attention, so build the model with Megatron's layer spec (drop --spec)")
        # Whether the recompute of this forward pass will run (training with grad): set by the
        # model's forward pre-hook (see megatron_burst.megatron.model); None: assume it will.
        self.recompute_follows: Optional[bool] = None

        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r}: megatron-burst implements "
                             "self-attention only; keep Megatron's core attention for cross "
                             "attention")
        self.causal = _mask_is_causal(attn_mask_type)
        if config.context_parallel_size != cp_size:
            raise ValueError(f"config.context_parallel_size={config.context_parallel_size} but the "
                             f"CP process group has {cp_size} ranks: build the model after "
                             "initialize_model_parallel(..., context_parallel_size="
                             f"{config.context_parallel_size}) or pass pg_collection with that cp")
        self.dropout_p = float(config.attention_dropout if attention_dropout is None
                               else attention_dropout)
        check_cp_dropout(self.dropout_p, cp_size)
        # Sliding window (--window-size), per layer as Megatron-Core decides it (window_attn_skip_freq:
        # every N-th layer, or a 0/1 list, keeps full attention); validated here, before any collective
        self.window = layer_window(config, self.layer_number)
        if self.window is not None and self.dropout_p > 0:
            raise ValueError(f"window_size={config.window_size} with attention dropout {self.dropout_p}: the dropout "
                             "path (CP=1) has no sliding window; set --attention-dropout 0")
        # MTraining's dynamic vertical-slash pattern (--sparse-attention vertical_slash): (p_v, p_s, last_q).
        # The engine intersects it with this layer's window and the batch's documents (cu_seqlens);
        # what it cannot run with a pattern is refused here, before any collective.
        self.sparse = None
        if cp_sparse is not None:
            from megatron_burst.masks.dynamic import Dynamic

            self.sparse = Dynamic(*cp_sparse[:3], slash_lines=cp_sparse[3] if len(cp_sparse) > 3 else "offsets")
            self.sparse.check(self.sparse.last_q)
            clash = [name for name, bad in (
                (f"--seq-selective-ckpt-ratio {self.options.selective_ckpt_ratio}",
                 self.options.selective_ckpt_ratio is not None),
                (f"--cp-algo {self.options.algo} (use ring or burst)", self.options.algo not in ("ring", "burst")),
                (f"--attention-dropout {self.dropout_p} (pass 0)", self.dropout_p > 0),
                (f"attn_mask_type={attn_mask_type.name} (the pattern is causal: use a causal layer spec)",
                 not self.causal)) if bad]
            if clash:
                raise ValueError(f"--sparse-attention vertical_slash runs on the ring/burst schedules alone: drop "
                                 f"{'; '.join(clash)}")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by "
                             "megatron-burst: use softmax_type='vanilla'")
        if getattr(config, "multi_latent_attention", False):
            raise ValueError("multi_latent_attention is not supported by megatron-burst attention")
        if getattr(config, "qk_clip", False):
            raise ValueError("qk_clip needs per-head max logits, which megatron-burst attention "
                             "does not report: set qk_clip=False")

        # Ring shape: the node topology when the CP group spans nodes. It is built once where the
        # process groups are made (a collective); a constructor only looks it up.
        self.cp_target: Optional[dist.ProcessGroup | CPTopology] = self.cp_group
        if cp_size > 1:
            per_node = resolve_cp_ranks_per_node(self.options, cp_size, config.tensor_model_parallel_size)
            if needs_node_topology(self.options, cp_size, per_node):
                topo = registered_cp_topology(self.cp_group)
                if topo is None or topo.ranks_per_node != per_node:
                    raise ValueError(
                        f"the CP group ({cp_size} ranks, {per_node} per node) needs its node topology, which is "
                        "built once, collectively, where the process groups are made: call "
                        "megatron_burst.megatron.groups.setup_cp_topology(options, cp_group, cp_size, tp_size) "
                        "on every rank after initialize_model_parallel and before building the model "
                        "(megatron_burst.train and the Megatron-LM patch do), or pass --cp-ring flat")
                self.cp_target = topo
            if self.options.algo in ("ulysses", "usp"):
                from megatron_burst.algorithms.ulysses import check_heads

                tp = config.tensor_model_parallel_size
                hq = config.num_attention_heads // tp
                hkv = max(1, (config.num_query_groups or config.num_attention_heads) // tp)
                check_heads(hq, hkv, cp_size if self.options.algo == "ulysses" else self.options.ulysses_size,
                            self.options.algo)
            if self.options.algo == "usp" and needs_usp_topology(self.options, cp_size):
                # Megatron's hierarchical CP groups (pg_collection.hcp) when they serve, else the
                # groups setup_cp_topology built
                U = self.options.ulysses_size
                usp = (usp_topology_from_pg_collection(pg_collection, self.cp_group, U, per_node)
                       or registered_usp_topology(self.cp_group, U))
                if usp is None:
                    raise ValueError(
                        f"layer {self.layer_number}: usp with Ulysses groups of {U} needs its 2-D process groups: "
                        "Megatron's hierarchical CP groups in pg_collection.hcp (initialize_model_parallel(..., "
                        f"hierarchical_context_parallel_sizes=[{U}, {cp_size // U}])), or groups built once, "
                        "collectively: call megatron_burst.megatron.groups.setup_cp_topology(options, cp_group, "
                        "cp_size, tp_size) on every rank before building the model (megatron_burst.train and the "
                        "Megatron-LM patch do)")
                self.cp_target = usp
        self.resolved_algo: Optional[str] = None  # what ``auto`` chose in the last forward

        self.selective_cache: Optional[SelectiveAttentionCache] = None
        if self.options.selective_ckpt_ratio is not None:
            check_selective_ckpt_algo(self.options.selective_ckpt_ratio, self.options.algo)
            if config.recompute_granularity is None:
                raise ValueError(f"seq_selective_ckpt_ratio={self.options.selective_ckpt_ratio} needs "
                                 "activation recompute: set recompute_granularity='selective' (with "
                                 "'core_attn' in recompute_modules) or 'full' (--recompute-granularity)")
            self.selective_cache = SelectiveAttentionCache(
                name=f"layer {self.layer_number}'s selective-checkpoint store")

        head_dim = config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scale by layer_number and multiplies
        # the scores back by it inside the softmax (an fp16 overflow guard): the net scale is
        # unchanged, so it is deliberately not applied here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """q [s, b, hq, d], k/v [s, b, hkv, d] (this rank's tokens in the layout) -> [s, b, hq*d].

        ``attention_mask`` is not read: causality comes from global token positions (see
        :func:`megatron_burst.get_batch_on_this_cp_rank`, which checks the mask is causal).
        ``packed_seq_params`` carries documents (megatron_burst.megatron.packed): qkv_format "thd"
        (q [t, hq, d], k/v [t, hkv, d] -> [t, hq*d]; TransformerEngine's per-sequence zigzag) or
        "sbhd" (documents of a [b, s] batch from --reset-attention-mask, in the model's layout; under
        --cp-layout balanced they carry the batch's plan, which every layer reuses).
        """
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by megatron-burst attention")
        causal = self.causal if attn_mask_type is None else _mask_is_causal(attn_mask_type)
        opts = self.options
        layout, fmt, documents = opts.layout, "sbhd", None
        if packed_seq_params is not None:
            cp_size = dist.get_world_size(self.cp_group) if dist.is_initialized() else 1
            packed = packed_seq_params.qkv_format == "thd"
            documents, _ = documents_of(packed_seq_params, query.shape[0], 1 if packed else query.shape[1], cp_size)
            if packed:
                layout, fmt = THD, "thd"
        # the batch was sliced by a balanced plan iff its params carry one: the layers must agree
        balanced_batch = documents is not None and documents.layout == BALANCED
        if (opts.layout == BALANCED) != balanced_batch:
            sliced = "a balanced plan" if balanced_batch else (
                "TransformerEngine's THD partitioning" if layout == THD else "no balanced plan")
            raise ValueError(f"layer {self.layer_number}: core attention runs --cp-layout {opts.layout} but the "
                             f"batch's packed_seq_params carry {sliced}: slice batches with "
                             f"get_batch_on_this_cp_rank(..., layout={opts.layout!r}) (packed THD batches: "
                             f"get_thd_batch_on_this_cp_rank(..., layout={opts.layout!r})) and pass its "
                             "packed_seq_params to the model")
        if balanced_batch:
            layout = BALANCED
        s, b = query.shape[0], (1 if fmt == "thd" else query.shape[1])
        if self.sparse is not None and fmt == "thd":
            raise ValueError(f"layer {self.layer_number}: --sparse-attention vertical_slash with a packed THD batch "
                             "(packed_seq_params.qkv_format='thd'): the sparse pattern runs on [b, s] batches only. "
                             "Train on [b, s] samples whose documents end at EOD tokens (--reset-attention-mask), "
                             "not packed sequences, or drop --sparse-attention")
        if self.dropout_p > 0 and self.training:
            if documents is not None:
                raise ValueError("attention dropout with documents (packed_seq_params) is not supported by "
                                 "megatron-burst: set --attention-dropout 0")
            out = self._local_attention_with_dropout(query, key, value, causal)
        else:
            kw = dict(group=self.cp_target, algo=opts.algo, layout=layout, causal=causal, ring=opts.ring,
                      softmax_scale=self.softmax_scale, qkv_format=fmt, stripe=opts.stripe, cu_seqlens=documents,
                      ulysses_size=opts.ulysses_size if opts.algo == "usp" else None, window=self.window,
                      pattern=self.sparse)
            if self.selective_cache is not None and self.training and _checkpointing():
                # First forward: store only when Megatron will recompute it (not in a no-grad
                # scoring pass); the recompute itself (grad enabled) always takes its entry.
                store = torch.is_grad_enabled() or self.recompute_follows is not False
                out = selective_cp_attention(query, key, value, cache=self.selective_cache,
                                             stored_fraction=opts.selective_ckpt_ratio, store=store, **kw)
            else:
                call = prepare(query, key, value, **kw)
                self.resolved_algo = call.backward_algo if call.backward_algo != "ulysses" else (
                    "ulysses" if call.cfg.world_size == 1 else f"usp{call.cfg.ulysses_size}/{call.ring_backward}")
                if self.sparse is not None:
                    self.resolved_algo += " sparse"
                out = call.apply()
        return out.reshape(s, -1) if fmt == "thd" else out.reshape(s, b, -1)

    def _local_attention_with_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      causal: bool) -> torch.Tensor:
        """CP = 1 only (checked in __init__): attention dropout needs the whole row of probabilities
        on one rank, so this path uses torch's SDPA instead of the CP engine."""
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2) if rep > 1 else k
        v = v.repeat_interleave(rep, dim=2) if rep > 1 else v
        to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731  [s, b, h, d] -> [b, h, s, d]
        out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v),
                                             dropout_p=self.dropout_p, is_causal=causal,
                                             scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3)


# The former name (it runs every algorithm, not only BurstAttention): deprecated, kept for imports.
BurstCoreAttention = CPCoreAttention
