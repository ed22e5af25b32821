"""``LinearSelfAttention``: a Megatron-Core ``self_attention`` module running linear attention
(LASP-2 under context parallelism) in one of the variants of
:mod:`megatron_burst.megatron.linear_variants` (basic, lightning, retention, gla).

It replaces ``SelfAttention`` in a ``TransformerLayer`` spec: same constructor arguments (config,
submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection), same forward (hidden
states [s, b, hidden] -> (output, bias)). Tensor parallelism is Megatron's: one column-parallel
projection makes q, k, v (and the full-rank output gate) with whole key/value groups per rank,
variants with a low-rank projection (Lightning's output gate, GLA's decay gates) add a
column-parallel pair, and a row-parallel projection makes the output; heads are split over TP
ranks, the per-head output norm and the decays follow their heads. Context parallelism happens
inside one call, :func:`_linear_attention_op`, over ``pg_collection.cp`` in the model's sequence
layout (``cp_layout``/``cp_stripe``, bound by BurstGPTModel like the softmax layers').

Documents (``--reset-attention-mask``) arrive as the softmax layers get them: Megatron's
``packed_seq_params`` (qkv_format "sbhd", :mod:`megatron_burst.megatron.packed`), validated once
per batch by :func:`~megatron_burst.megatron.packed.documents_of`; the state starts again from zero
at each document's first token. Packed THD batches (qkv_format "thd") run in TransformerEngine's
partitioning and batches sliced by a balanced plan (--cp-layout balanced) in that plan, as the softmax
layers do: a rank's runs of consecutive positions are its segments (:mod:`megatron_burst.linear.runs`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

import megatron_burst
from megatron_burst.megatron.attention import FollowsModelLayout
from megatron_burst.megatron.options import LinearCPOptions, make_linear_cp_options
from megatron_burst.megatron.linear_variants import (GLA_GATE_TEMPERATURE, LinearAttentionVariant, get_variant,
                                                     lightning_log_decay, retention_log_decay)
from megatron_burst.masks.layout import BALANCED
from megatron_burst.megatron.packed import documents_of

__all__ = ["LinearSelfAttention", "LinearCPLayer", "LinearSelfAttentionSubmodules", "HeadNorm"]

_FEATURE_MAPS = {None: lambda x: x, "elu+1": lambda x: F.elu(x) + 1.0, "silu": F.silu}


def _linear_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """The one call into the linear-attention op: q, k [s, b, h, dk], v [s, b, h, dv] (this CP
    rank's tokens in the layout's order) -> [s, b, h, dv]; every CP transfer happens inside."""
    return megatron_burst.linear_attention(q, k, v, **kw)


@dataclass
class LinearSelfAttentionSubmodules:
    """Module classes (or specs) of :class:`LinearSelfAttention`'s projections."""

    linear_qkv: Union[ModuleSpec, type] = None  # column parallel: q, k, v (and the full-rank gate)
    linear_proj: Union[ModuleSpec, type] = None  # row parallel: the output
    linear_low_rank: Union[ModuleSpec, type] = None  # column parallel: both halves of the low-rank projection


def _device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class HeadNorm(MegatronModule):
    """RMSNorm or LayerNorm of each head's vector, with a per-(head, channel) affine: RetNet's
    GroupNorm over heads. Weights [heads, head_dim] are split by head over TP ranks, so a rank
    normalizes and owns exactly its heads. Computes in fp32, returns the input's dtype."""

    def __init__(self, config: TransformerConfig, num_heads: int, head_dim: int, kind: str, eps: float,
                 tp_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(config=config)
        if kind not in ("rmsnorm", "layernorm"):
            raise ValueError(f"HeadNorm kind={kind!r}: choose rmsnorm or layernorm")
        self.kind, self.eps, self.tp_group = kind, eps, tp_group
        device = _device(config)
        self.weight = torch.nn.Parameter(torch.ones(num_heads, head_dim, dtype=config.params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.bias = None
        if kind == "layernorm":
            self.bias = torch.nn.Parameter(torch.zeros(num_heads, head_dim, dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., heads, head_dim] -> same shape and dtype."""
        y = x.float()
        if self.kind == "layernorm":
            y = y - y.mean(dim=-1, keepdim=True)
        y = y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """Distributed checkpoint entries: weight and bias sharded by head (axis 0) over TP."""
        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0, "bias": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


class _GatherLastDim(torch.autograd.Function):
    """All-gather over the last dim across ``group``; backward keeps this rank's slice. (Megatron's
    gather_from_tensor_model_parallel_region allocates on CUDA; this one runs on any device.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        width = grad.shape[-1] // dist.get_world_size(ctx.group)
        start = dist.get_rank(ctx.group) * width
        return grad[..., start:start + width].contiguous(), None


class LowRankProjection(MegatronModule):
    """x -> up(down(x)) through a rank-r bottleneck, both halves column parallel: the down half's
    r outputs are split over TP ranks and all-gathered (r must divide by TP), the up half's
    outputs stay split (by head)."""

    def __init__(self, config: TransformerConfig, linear: Union[ModuleSpec, type], input_size: int, rank: int,
                 output_size: int, up_bias: bool, tp_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config=config)
        self.tp_group = tp_group
        common = dict(init_method=config.init_method, gather_output=False, skip_bias_add=False, is_expert=False,
                      tp_group=tp_group)
        self.down = build_module(linear, input_size, rank, config=config, bias=False, **common)
        # The up half's input is the gathered bottleneck, whole on every rank: never sequence-sharded.
        up_config = copy.copy(config)
        up_config.sequence_parallel = False
        self.up = build_module(linear, rank, output_size, config=up_config, bias=up_bias, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp under SP), b, hidden] -> [s, b, output_size / tp]."""
        inner, _ = self.down(x)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            inner = _GatherLastDim.apply(inner, self.tp_group)
        out, _ = self.up(inner)
        return out


def _per_head_slice(values: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This TP rank's contiguous share of a per-(global)-head tensor."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return values
    per_rank = values.shape[0] // dist.get_world_size(tp_group)
    start = dist.get_rank(tp_group) * per_rank
    return values[start:start + per_rank]


class LinearCPLayer(FollowsModelLayout):
    """Mixin of the linear-family layers (LinearSelfAttention, CPGatedDeltaNet): resolves their CP
    options (spec params, which the flag boundary fills from the flags; else the model's layout /
    the defaults) and checks the CP group against the config. Sets ``options``, ``_layout_fixed`` and ``cp_size``;
    needs ``config`` and ``cp_group``."""

    def _resolve_cp_options(self, linear_cp_algo: Optional[str], cp_layout: Optional[str],
                            cp_stripe: Optional[int]) -> None:
        # The flag boundary passes the flags' values through the spec (hybrid_block_spec): a layout
        # given there is fixed, else it follows the model's (BurstGPTModel binds it).
        self._layout_fixed = cp_layout is not None or cp_stripe is not None
        self.options: LinearCPOptions = make_linear_cp_options(linear_cp_algo, cp_layout, cp_stripe)
        cp_size = dist.get_world_size(self.cp_group) if dist.is_initialized() and self.cp_group is not None else 1
        if self.config.context_parallel_size != cp_size:
            raise ValueError(f"config.context_parallel_size={self.config.context_parallel_size} but the CP process "
                             f"group has {cp_size} ranks: build the model after initialize_model_parallel(..., "
                             f"context_parallel_size={self.config.context_parallel_size}) or pass pg_collection "
                             "with that cp")
        self.cp_size = cp_size

    def _placement(self, packed_seq_params, local_len: int, batch: int) -> tuple:
        """(documents or None, layout, stripe) of this call, as the softmax layers read them from
        Megatron's ``packed_seq_params``: a packed THD batch runs in TransformerEngine's partitioning,
        a batch sliced by a balanced plan in that plan (and only under --cp-layout balanced), anything
        else in the layer's layout. One rank: the identity order."""
        opts, documents = self.options, None
        if packed_seq_params is not None:
            documents = documents_of(packed_seq_params, local_len, batch, self.cp_size)[0]
        balanced_batch = documents is not None and documents.layout == BALANCED
        if (opts.layout == BALANCED) != balanced_batch:
            sliced = "a balanced plan" if balanced_batch else "no balanced plan"
            raise ValueError(f"{self._layout_noun} (layer {self.layer_number}) runs --cp-layout {opts.layout} but "
                             f"the batch's packed_seq_params carry {sliced}: slice batches with "
                             f"get_batch_on_this_cp_rank(..., layout={opts.layout!r}) and pass its packed_seq_params "
                             "to the model")
        if documents is not None and documents.layout is not None:
            return documents, documents.layout, 1
        if self.cp_size == 1:
            return documents, "contiguous", 1
        return documents, opts.layout, opts.stripe


class LinearSelfAttention(LinearCPLayer, MegatronModule):
    """Linear self-attention with SelfAttention's signatures; the variant comes from the spec's
    params (``linear_attention``), and so do ``cp_layout``, ``cp_stripe`` and ``linear_cp_algo``
    (None: the model's layout / the defaults; the flag boundary fills them from the flags).

    Heads: ``num_attention_heads`` query heads of ``kv_channels`` dims; keys and values share
    ``num_query_groups`` heads in the variants that share them (repeated to the query heads before
    the op), one per query head otherwise. Parameters: ``linear_qkv`` (per key/value group:
    the group's query heads, their output-gate heads when the gate is full rank, one key, one
    value head), ``linear_low_rank`` (lightning, gla), ``out_norm`` (:class:`HeadNorm`),
    ``linear_proj``; Lightning and RetNet decays are fp32 buffers of this rank's heads.
    """

    _layout_noun = "linear attention"

    def __init__(
        self,
        config: TransformerConfig,
        submodules: LinearSelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: Optional[str] = None,  # softmax attention's; not read
        pg_collection: Optional[ProcessGroupCollection] = None,
        *,
        linear_attention: str = "lightning",
        cp_layout: Optional[str] = None,
        cp_stripe: Optional[int] = None,
        linear_cp_algo: Optional[str] = None,
    ) -> None:
        super().__init__(config=config)
        self.config = config
        self.layer_number = max(1, layer_number)
        self.variant: LinearAttentionVariant = get_variant(linear_attention)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group, self.cp_group = pg_collection.tp, pg_collection.cp
        self._resolve_cp_options(linear_cp_algo, cp_layout, cp_stripe)
        self.causal = self._causal(attn_mask_type)

        tp = dist.get_world_size(self.tp_group) if dist.is_initialized() else 1
        heads, head_dim = config.num_attention_heads, config.kv_channels
        groups = (config.num_query_groups or heads) if self.variant.shared_kv_heads else heads
        self._check_sizes(heads, groups, head_dim, tp)
        self.head_dim = head_dim
        self.heads_per_rank, self.groups_per_rank = heads // tp, groups // tp
        per_group = self.heads_per_rank // self.groups_per_rank
        full_gate = self.variant.output_gate == "swish"
        self._split = [per_group * head_dim, per_group * head_dim if full_gate else 0, head_dim, head_dim]
        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size, groups * sum(self._split), config=config,
            init_method=config.init_method, gather_output=False, bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False, is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.tp_group)
        rank = self.variant.low_rank_dim(head_dim)
        self.linear_low_rank = None
        if rank is not None:  # GLA: gates of the key heads (with b_alpha); TNL: the output gate (no bias)
            is_gla = self.variant.decay == "gla"
            self.linear_low_rank = LowRankProjection(
                config, submodules.linear_low_rank, config.hidden_size, rank,
                (groups if is_gla else heads) * head_dim, up_bias=is_gla, tp_group=self.tp_group)
        self.out_norm = HeadNorm(config, self.heads_per_rank, head_dim, self.variant.output_norm,
                                 config.layernorm_epsilon, self.tp_group)
        self.linear_proj = build_module(
            submodules.linear_proj, heads * head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj", tp_group=self.tp_group)
        decay = {"lightning": lambda: lightning_log_decay(heads, self.layer_number - 1, config.num_layers),
                 "retention": lambda: retention_log_decay(heads)}.get(self.variant.decay)
        self.log_decay: Optional[torch.Tensor]
        if decay is None:
            self.log_decay = None
        else:
            self.register_buffer("log_decay", _per_head_slice(decay(), self.tp_group).to(_device(config)),
                                 persistent=False)

    # ------------------------------------------------------------------ construction checks

    def _causal(self, attn_mask_type: AttnMaskType) -> bool:
        if attn_mask_type == AttnMaskType.causal:
            return True
        if attn_mask_type == AttnMaskType.no_mask and self.variant.decay is None:
            return False
        raise ValueError(f"attn_mask_type={attn_mask_type.name} with linear attention {self.variant.name!r}: linear "
                         "layers honour 'causal', and 'no_mask' (bidirectional) for variants without a decay")

    def _check_sizes(self, heads: int, groups: int, head_dim: int, tp: int) -> None:
        name = self.variant.name
        if heads % groups:
            raise ValueError(f"num_attention_heads={heads} is not divisible by num_query_groups={groups}")
        if heads % tp or groups % tp:
            raise ValueError(f"linear attention {name!r}: {heads} query / {groups} key-value heads cannot be split "
                             f"over {tp} tensor-parallel ranks: use head counts divisible by "
                             "--tensor-model-parallel-size (--num-attention-heads, --num-query-groups)")
        rank = self.variant.low_rank_dim(head_dim)
        if rank is not None and rank % tp:
            raise ValueError(f"linear attention {name!r}: its low-rank projection's {rank} outputs cannot be split "
                             f"over {tp} tensor-parallel ranks (--kv-channels for lightning, 16 for gla)")

    def _apply(self, fn, recurse: bool = True):
        # Follow device moves but never dtype casts: Megatron-LM's Float16Module calls .bfloat16() on
        # the whole model, and bf16 rounds RetNet's 1 - 2^-12 to 1.
        decay = self.log_decay
        super()._apply(fn, recurse)
        if decay is not None:
            self.log_decay = decay.to(device=self.log_decay.device, dtype=torch.float32)
        return self

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        key_value_states: Optional[torch.Tensor] = None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """hidden_states [s, b, hidden] (this CP rank's tokens; [s/tp, ...] under sequence
        parallelism) -> (output [s, b, hidden], bias or None), like SelfAttention. The mask is not
        read: causality follows global token positions, as in megatron-burst's softmax attention.
        ``packed_seq_params`` (qkv_format "sbhd": the documents of --reset-attention-mask) resets
        the state at every document start."""
        if key_value_states is not None:
            raise ValueError("linear attention is self-attention only (key_value_states must be None)")
        if inference_context is not None or inference_params is not None:
            raise ValueError("linear attention layers do not support inference contexts (KV/state caches) yet")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by linear attention")
        variant, d = self.variant, self.head_dim
        mixed, _ = self.linear_qkv(hidden_states)
        s, b = mixed.shape[:2]
        documents, layout, stripe = self._placement(packed_seq_params, s, b)
        q, gate, k, v = torch.split(mixed.view(s, b, self.groups_per_rank, -1), self._split, dim=3)
        q = _FEATURE_MAPS[variant.qk_feature_map](q.reshape(s, b, self.heads_per_rank, d))
        k = _FEATURE_MAPS[variant.qk_feature_map](k)
        v = _FEATURE_MAPS[variant.v_feature_map](v)
        if variant.rotary:
            q, k = self._rotate(q, k, rotary_pos_emb)
        g = self.log_decay
        if variant.decay == "gla":
            logits = self.linear_low_rank(hidden_states).view(s, b, self.groups_per_rank, d)
            g = F.logsigmoid(logits.float()) / GLA_GATE_TEMPERATURE
        repeat = self.heads_per_rank // self.groups_per_rank
        if repeat > 1:  # the key/value group's heads, in Megatron's order (group-major)
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
            if g is not None and g.dim() == 4:
                g = g.repeat_interleave(repeat, dim=2)
        out = _linear_attention_op(q, k, v, group=self.cp_group, g=g, causal=self.causal, layout=layout,
                                   stripe=stripe, algo=self.options.algo, scale=variant.scale, qkv_format="sbhd",
                                   cu_seqlens=documents)
        out = self.out_norm(out)
        if variant.output_gate == "swish":
            out = out * F.silu(gate.reshape(s, b, self.heads_per_rank, d))
        elif variant.output_gate == "sigmoid_low_rank":
            out = out * torch.sigmoid(self.linear_low_rank(hidden_states)).view(s, b, self.heads_per_rank, d)
        return self.linear_proj(out.reshape(s, b, self.heads_per_rank * d))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rotary_pos_emb) -> tuple:
        """RetNet's Theta: the model's RoPE rows (already this CP rank's positions) on q and k."""
        if rotary_pos_emb is None:
            raise ValueError(f"linear attention {self.variant.name!r} rotates queries and keys but the model passes "
                             "no rotary embedding: build the GPT with position_embedding_type='rope' "
                             "(--position-embedding-type rope)")
        q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
        q = apply_rotary_pos_emb(q, q_emb, config=self.config, cp_group=self.cp_group)
        k = apply_rotary_pos_emb(k, k_emb, config=self.config, cp_group=self.cp_group)
        return q, k
