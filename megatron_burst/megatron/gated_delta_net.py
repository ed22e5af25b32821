"""``CPGatedDeltaNet``: Megatron-Core's ``GatedDeltaNet`` layer (Qwen3-Next's linear attention) with
context parallelism, in any of megatron-burst's sequence layouts.

It is a subclass of ``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` with the same constructor
arguments, parameters (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``)
and (sharded) state dict, so a checkpoint moves between the two. What differs is the forward:

* the short causal conv1d over q, k, v reads, at the start of each of this rank's segments (runs
  of consecutive global positions), the previous ``kernel - 1`` tokens of the global sequence
  from whichever rank holds them (:func:`~megatron_burst.linear.exchange.previous_tokens`: one
  small all-gather);
* the core is :func:`megatron_burst.gated_delta_rule` over the CP group (one all-gather of
  per-segment affine maps; fla's Triton kernel forms the outputs when installed on CUDA);
* q and k are l2-normalized by fla's ``l2norm`` when installed, else by :func:`l2norm` (the same
  formula in torch), so the layer runs on CPU without fla or causal-conv1d.

Tensor parallelism is Megatron's (heads split over TP ranks). Inference caches are refused, as
Megatron's class does.

Documents (``--reset-attention-mask``: ``packed_seq_params`` with qkv_format "sbhd", as the
softmax layers get them) make every document its own sequence, as flash-linear-attention's
varlen kernels (``cu_seqlens``) treat packed sequences: the conv1d reads no token of an earlier
document (its window is zero-padded at each document start) and the gated delta rule's state
starts again from zero at each document's first token. Packed THD batches and batches sliced by a
balanced plan run in their placement, as the softmax layers do: each run of consecutive positions
is a segment, its conv halo read from the runs before it (:mod:`megatron_burst.linear.runs`).

``cp_comm_type``: Megatron's ``TransformerLayer`` passes every attention module its layer's
``--cp-comm-type`` under CP (the trainer's per-layer list arrives as ``cp_layer_comm_types``). The
layer's one exchange, an all-gather of per-segment state maps, serves the ring and all-gather types
(p2p -- Megatron-LM's default --, allgather/all_gather, and ring/burst/auto); a2a and a2a+p2p
(head all-to-alls) are refused at construction, naming the layer and the value
(:func:`megatron_burst.megatron.comm_types.check_gated_delta_net_comm_type`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

import megatron_burst
from megatron_burst.megatron.comm_types import check_gated_delta_net_comm_type
from megatron_burst.linear.checks import segment_order, segments_per_rank
from megatron_burst.linear.docs import document_index
from megatron_burst.linear.exchange import SegmentMap, previous_tokens
from megatron_burst.linear.runs import RUN_LAYOUTS, Runs, rank_runs, run_map
from megatron_burst.megatron.linear_attention import LinearCPLayer, _device
from megatron_burst.megatron.linear_variants import GATED_DELTA_NET

try:  # fla's fused kernel when installed; the torch formula below otherwise
    from fla.modules.l2norm import l2norm as _fla_l2norm
except ImportError:  # pragma: no cover - depends on the environment
    _fla_l2norm = None

__all__ = ["CPGatedDeltaNet", "l2norm", "GATED_DELTA_NET"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``l2norm`` in torch: x / sqrt(sum(x^2) + eps) over the last dim, in fp32, in x's dtype."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return _fla_l2norm(x) if _fla_l2norm is not None and x.is_cuda else l2norm(x)


class CPGatedDeltaNet(LinearCPLayer, GatedDeltaNet):
    """GatedDeltaNet under context parallelism over ``pg_collection.cp``; ``cp_layout`` and
    ``cp_stripe`` come from the spec's params (the flag boundary fills them; None: the model's layout).

    hidden_states [s, b, hidden] are this CP rank's tokens in the layout's order ([s/tp, ...] under
    sequence parallelism); returns (output [s, b, hidden], bias), like Megatron's class.
    """

    _layout_noun = "gated delta net"

    def __init__(self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules, layer_number: int = None,
                 bias: bool = False, conv_bias: bool = False, conv_init: Optional[float] = None,
                 use_qk_l2norm: bool = True, A_init_range: Tuple[float, float] = (1, 16),
                 pg_collection: Optional[ProcessGroupCollection] = None, cp_comm_type: Optional[str] = None, *,
                 cp_layout: Optional[str] = None, cp_stripe: Optional[int] = None,
                 cp_layer_comm_types: Optional[tuple] = None) -> None:
        # Megatron's __init__ needs fla and CUDA; this one builds the same modules on any device.
        MegatronModule.__init__(self, config)
        if A_init_range[0] < 0 or A_init_range[1] < A_init_range[0]:
            raise ValueError(f"A_init_range={A_init_range} must be 0 <= low <= high")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.config, self.pg_collection = config, pg_collection
        self.cp_group = pg_collection.cp
        self.layer_number, self.bias, self.conv_bias, self.conv_init = layer_number, bias, conv_bias, conv_init
        self.A_init_range, self.use_qk_l2norm = A_init_range, use_qk_l2norm
        self.tp_size = pg_collection.tp.size() if pg_collection.tp is not None else 1
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        self.hidden_size, self.act_fn = config.hidden_size, config.activation_func
        self.activation = self.act_fn.__name__
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self._check_sizes()
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
        self.in_proj = build_module(submodules.in_proj, self.hidden_size, self.in_proj_dim, config=config,
                                    init_method=config.init_method, gather_output=False, bias=bias,
                                    skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
                                    tp_group=pg_collection.tp)
        self.conv_dim = self.qk_dim * 2 + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        device = _device(config)
        self.conv1d = nn.Conv1d(self.conv_dim_local_tp, self.conv_dim_local_tp, bias=conv_bias,
                                kernel_size=self.conv_kernel_dim, groups=self.conv_dim_local_tp,
                                padding=self.conv_kernel_dim - 1, device=device, dtype=config.params_dtype)
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads_local_tp, dtype=config.params_dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads_local_tp, dtype=config.params_dtype, device=device))
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log):
            if p is not None:  # split by channel / head over TP, like Megatron's; partition_dim for tools
                set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                     eps=config.layernorm_epsilon)
        self.out_proj = build_module(submodules.out_proj, self.v_dim, self.hidden_size, config=config,
                                     init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True,
                                     skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
                                     tp_group=pg_collection.tp)
        self._resolve_cp_options(None, cp_layout, cp_stripe)
        if cp_layer_comm_types is not None:  # a per-layer --cp-comm-type list: this layer's entry
            if not 1 <= (layer_number or 0) <= len(cp_layer_comm_types):
                raise ValueError(f"layer {layer_number}: --cp-comm-type lists {len(cp_layer_comm_types)} values: give "
                                 "one per layer")
            cp_comm_type = cp_layer_comm_types[layer_number - 1]
        self.cp_comm_type = cp_comm_type
        # the exchange this layer runs: its per-segment maps, all-gathered (None: one rank, no exchange)
        self.cp_exchange: Optional[str] = None
        if self.cp_size > 1:
            self.cp_exchange = (check_gated_delta_net_comm_type(cp_comm_type, layer_number) if cp_comm_type is not None
                                else "allgather")
        self.reset_parameters()

    def _check_sizes(self) -> None:
        names = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads")
        for name in names:
            if getattr(self.config, name, None) is None:
                raise ValueError(f"gated delta net needs config.{name} (--{name.replace('_', '-')})")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.num_key_heads}")
        if self.num_key_heads % self.tp_size:
            raise ValueError(f"gated delta net: {self.num_key_heads} key heads cannot be split over {self.tp_size} "
                             "tensor-parallel ranks (--linear-num-key-heads, --tensor-model-parallel-size)")

    def reset_parameters(self) -> None:
        """Megatron's initialization (conv weights U(-conv_init, conv_init) when set, dt_bias = 1,
        A = U(A_init_range) stored as log A), on any device; the CUDA RNG tracker only on CUDA."""
        if not self.config.perform_initialization:
            return
        on_cuda = self.A_log.is_cuda
        if on_cuda:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            ctx = get_cuda_rng_tracker().fork()
        else:
            import contextlib

            ctx = contextlib.nullcontext()
        with ctx, torch.no_grad():
            if self.conv_init is not None:
                nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            A = torch.empty_like(self.A_log).uniform_(*self.A_init_range)
            self.A_log.copy_(torch.log(A))

    # ------------------------------------------------------------------ forward

    def _segment_map(self, s: int, layout: str, stripe: int, documents=None) -> Tuple[SegmentMap, Optional[Runs], int]:
        """(segment map, runs or None, segments per rank) of this call's layout: the fixed layouts' equal
        segments, or a data-derived layout's runs (:mod:`megatron_burst.linear.runs`)."""
        W = self.cp_size
        rank = dist.get_rank(self.cp_group) if W > 1 else 0
        if layout in RUN_LAYOUTS and W > 1:
            runs = rank_runs(documents, W)
            return run_map(self.cp_group, rank, W, runs), runs, len(runs.order[rank])
        layout = "contiguous" if layout in RUN_LAYOUTS else layout  # one rank: the sequence in order
        per_rank = segments_per_rank(layout, s, stripe)
        order = tuple(segment_order(layout, W, r, per_rank) for r in range(W))
        return SegmentMap(self.cp_group, rank, W, order, True), None, per_rank

    def _causal_conv(self, qkv: torch.Tensor, smap: SegmentMap, per_rank: int, documents=None,
                     runs: Optional[Runs] = None) -> torch.Tensor:
        """Megatron's short causal conv1d + activation over the global sequence. qkv [s, b, d] in
        layout order -> [s, b, d]. ``documents``: no tap reads a token of an earlier document.
        ``runs`` (THD, balanced): each run's halo is read from the runs before it, however short."""
        s, b, d = qkv.shape
        width = self.conv_kernel_dim - 1
        if runs is not None:
            return self.act_fn(self._run_conv(qkv, smap, runs, documents, width))
        L = s // per_rank
        if L < width and smap.total > 1:
            raise ValueError(f"gated delta net: segments of {L} tokens are shorter than the conv1d's kernel - 1 = "
                             f"{width}: use a longer sequence or fewer CP ranks")
        segs = qkv.reshape(per_rank, L, b, d)
        if width > 0 and smap.total == 1:  # the whole sequence: zeros before it, any length
            segs = torch.cat([segs.new_zeros(1, width, b, d), segs], dim=1)
        elif width > 0:
            segs = torch.cat([previous_tokens(segs, width, smap), segs], dim=1)  # [nseg, width + L, b, d]
        if documents is None:
            x = segs.permute(0, 2, 3, 1).reshape(per_rank * b, d, L + width)
            y = F.conv1d(x, self.conv1d.weight, self.conv1d.bias, groups=d)  # no padding: the halo is the context
            y = y.reshape(per_rank, b, d, L).permute(0, 3, 1, 2)  # [nseg, L, b, d]
        else:
            y = self._document_conv(segs, smap, documents, L, width)
        return self.act_fn(y).reshape(s, b, d)

    def _document_conv(self, segs: torch.Tensor, smap: SegmentMap, documents, L: int, width: int) -> torch.Tensor:
        """The depthwise causal conv of equal segments segs [nseg, width + L, b, d] (halo first) under
        documents -> [nseg, L, b, d] (:meth:`_document_taps`)."""
        nseg, _, b, d = segs.shape
        dev = segs.device
        starts = torch.tensor([gi * L for gi in smap.order[smap.rank]], device=dev)
        pos = (starts[:, None] + torch.arange(-width, L, device=dev)).reshape(-1)  # global position of each row
        rows = (torch.arange(nseg, device=dev)[:, None] * (width + L) + width + torch.arange(L, device=dev)).reshape(-1)
        y = self._document_taps(segs.reshape(-1, b, d), pos, rows, documents, width)
        return y.view(nseg, L, b, d)

    def _run_conv(self, qkv: torch.Tensor, smap: SegmentMap, runs: Runs, documents, width: int) -> torch.Tensor:
        """The depthwise causal conv over a data-derived layout's runs: qkv [s, b, d] (local order) ->
        [s, b, d]. Each run is preceded by its halo (:func:`previous_tokens` over the runs)."""
        s, b, d = qkv.shape
        mine = runs.per_rank[smap.rank]
        halo = previous_tokens(qkv, width, smap, runs.starts)  # [nseg, width, b, d]
        blocks = [x for h, r in zip(halo.unbind(0), qkv.split([n for _, n in mine])) for x in (h, r)]
        pos = torch.cat([torch.arange(a - width, a + n) for a, n in mine])  # host arithmetic, one copy each
        first = torch.tensor([0] + [width + n for _, n in mine[:-1]]).cumsum(0) + width
        rows = torch.cat([f + torch.arange(n) for f, (_, n) in zip(first.tolist(), mine)])
        return self._document_taps(torch.cat(blocks), pos.to(qkv.device), rows.to(qkv.device), documents, width)

    def _document_taps(self, x: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, documents,
                       width: int) -> torch.Tensor:
        """The depthwise causal conv at ``rows`` of x [n, b, d] (every output row preceded in x by the
        ``width`` rows its taps read), every tap that would read a token of an earlier document dropped
        (fla's varlen causal_conv1d zero-pads each sequence's start). ``pos`` [n]: each row's global
        position (< 0: before the sequence). -> [len(rows), b, d]; one multiply-add per tap."""
        every = document_index(documents, x.shape[1], x.device)  # [b, S]
        doc = torch.where(pos[:, None] >= 0, every[:, pos.clamp(min=0)].T, -1)  # [n, b]
        weight = self.conv1d.weight[:, 0, :]  # [d, kernel]: tap i reads the token kernel - 1 - i before
        y = None
        for i in range(width + 1):
            src = rows - width + i
            same = (doc[src] == doc[rows]).unsqueeze(-1).to(x.dtype)  # [n_out, b, 1]
            term = x[src] * same * weight[:, i]
            y = term if y is None else y + term
        return y if self.conv1d.bias is None else y + self.conv1d.bias

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value_states: Optional[torch.Tensor] = None, inference_context=None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None, sequence_len_offset=None,
                *, inference_params=None, **kwargs):
        """hidden_states [s, b, hidden] -> (out [s, b, hidden], bias). The mask is not read:
        causality follows global token positions; ``packed_seq_params`` (qkv_format "sbhd": the
        documents of --reset-attention-mask) keeps the conv1d and the state inside each document."""
        if inference_context is not None or inference_params is not None:
            raise ValueError("gated delta net: inference contexts (state caches) are not supported")
        qkvzba, _ = self.in_proj(hidden_states)
        s, b = qkvzba.shape[:2]
        documents, layout, stripe = self._placement(packed_seq_params, s, b)
        tp = self.tp_size
        qkv, gate, beta, alpha = torch.split(
            qkvzba, [self.conv_dim // tp, self.v_dim // tp, self.num_value_heads // tp, self.num_value_heads // tp],
            dim=-1)
        smap, runs, per_rank = self._segment_map(s, layout, stripe, documents)
        qkv = self._causal_conv(qkv, smap, per_rank, documents, runs)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = query.reshape(s, b, -1, self.key_head_dim)
        key = key.reshape(s, b, -1, self.key_head_dim)
        value = value.reshape(s, b, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query, key = _l2norm(query), _l2norm(key)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        acc = torch.promote_types(alpha.dtype, torch.float32)  # Megatron's fp32 decay (fp64 for fp64 models)
        g = -self.A_log.to(acc).exp() * F.softplus(alpha.to(acc) + self.dt_bias.to(acc))  # [s, b, h]
        core = megatron_burst.gated_delta_rule(query, key, value, g, beta.sigmoid(), group=self.cp_group,
                                               layout=layout, stripe=stripe, qkv_format="sbhd", cu_seqlens=documents)
        norm_out = self._gated_norm(core, gate)
        return self.out_proj(norm_out.reshape(s, b, -1))

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Megatron's output norm per head and act(gate) output gate (what its jit-compiled
        ``_apply_gated_norm`` computes)."""
        dtype = x.dtype
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        y = y * self.act_fn(gate.reshape(-1, x.shape[-1]).float())
        return y.to(dtype)
