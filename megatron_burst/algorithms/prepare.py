"""A cp_attention call prepared: validated before any collective, its masks resolved into data
(documents, window, sparse pattern), its algorithm and kernels chosen (:func:`prepare` ->
:class:`Prepared`, whose :meth:`~Prepared.apply` runs the differentiable attention).

The only collectives are the last steps, after every check: a dynamic pattern's estimate (called
through :mod:`megatron_burst.masks.dynamic`, so wrapping ``megatron_burst.masks.dynamic.estimate``
sees the pattern) and the kernel agreement on CUDA (:func:`choose_kernels`). Nothing is changed on
a prepared call afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_burst.algorithms import ulysses
from megatron_burst.algorithms.auto import choose_algo, resolve_algo
from megatron_burst.algorithms.function import _CPAttention, attention_forward, from_bhsd, to_bhsd
from megatron_burst.algorithms.schedule import CPConfig
from megatron_burst.algorithms.validate import check_pattern_call, validate
from megatron_burst.kernels.choice import KernelPolicy, agree, choose
from megatron_burst.masks import dynamic
from megatron_burst.masks.documents import (THD, CuSeqlens, Documents, balanced_documents, check_cu_seqlens,
                                            check_thd)
from megatron_burst.masks.dynamic import Dynamic
from megatron_burst.masks.layout import BALANCED
from megatron_burst.masks.vertical_slash import VerticalSlash
from megatron_burst.masks.window import check_window
from megatron_burst.topology import RING_SHAPES, CPTopology, USPTopology, registered_usp_topology, single_node_topology

__all__ = ["Prepared", "prepare", "choose_kernels"]

@dataclass
class Prepared:
    """A validated call: q, k, v in the caller's format, its CP configuration and scheme.

    ``backward_algo`` is the scheme: "ring", "burst", "allgather", or "ulysses" (Ulysses/USP:
    ``cfg`` is then the ring over Ulysses groups, ``exchange`` the all-to-all group and its link,
    ``ring_backward`` the ring part's backward).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cfg: CPConfig
    backward_algo: str
    qkv_format: str  # of q, k, v here: a caller's "thd" is held as "sbhd" with b = 1
    exchange: Optional[tuple] = None
    ring_backward: str = "ring"
    packed: bool = False  # the caller passed "thd": outputs drop the batch dim again

    @property
    def supports_row_cache(self) -> bool:
        """Whether the forward can compute a subset of rows (sequence-level selective checkpointing)."""
        return self.backward_algo != "ulysses"

    def apply(self, q_rows: Optional[int] = None, out_tail: Optional[torch.Tensor] = None,
              lse_tail: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The differentiable CP attention of this call (output in the caller's format)."""
        if self.backward_algo == "ulysses":
            if q_rows is not None:
                raise ValueError("ulysses/usp attention computes every row; selective row recompute needs "
                                 "ring, burst or allgather")
            fmt = self.qkv_format
            out = ulysses.UlyssesAttention.apply(to_bhsd(self.q, fmt), to_bhsd(self.k, fmt), to_bhsd(self.v, fmt),
                                                 self.cfg, *self.exchange, self.ring_backward)
            out = from_bhsd(out, fmt).contiguous()
        else:
            out = _CPAttention.apply(self.q, self.k, self.v, self.cfg, self.backward_algo, self.qkv_format,
                                     q_rows, out_tail, lse_tail)
        return out.squeeze(1) if self.packed else out

    def forward_no_grad(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward alone: (out in the caller's format, its [b, h, s, d] view, lse fp32)."""
        if not self.supports_row_cache:
            raise ValueError("forward_no_grad (selective checkpointing's store) needs ring, burst or allgather")
        qh, kh, vh = (to_bhsd(t, self.qkv_format).contiguous() for t in (self.q, self.k, self.v))
        out, out_h, lse = attention_forward(qh, kh, vh, self.cfg, self.qkv_format, scheme=self.backward_algo)
        return (out.squeeze(1) if self.packed else out), out_h, lse


def choose_kernels(cfg: CPConfig, q: torch.Tensor, head_dim: int, kernel: Optional[str], cp_group) -> None:
    """Resolve the local kernels of every mask kind ``cfg`` can produce (self-checked on first use,
    megatron_burst.kernels.choice) into ``cfg.kernel``; on CUDA every rank of the CP group must
    agree (one small all-gather per group and choice, before the first block)."""
    policy, kinds = KernelPolicy.from_env(kernel), cfg.mask_kinds
    # where causal blocks run a dense op, every block_causal block is split into causal + positions
    # (CPConfig.splits_block_causal): then no kernel of its own is chosen, self-checked or compiled
    if "block_causal" in kinds:
        cfg.kernel = choose(q.device, q.dtype, head_dim, tuple(k for k in kinds if k != "block_causal"), policy)
    if "block_causal" not in kinds or not cfg.splits_block_causal:
        cfg.kernel = choose(q.device, q.dtype, head_dim, kinds, policy)
    if q.is_cuda:
        agree(cfg.kernel, cp_group)


def _usp_topology(group, world_size: int, U: int) -> USPTopology:
    """The 2-D topology of a usp call: given, or the one built for this CP group (no collective)."""
    if isinstance(group, USPTopology):
        if group.ulysses_size != U:
            raise ValueError(f"ulysses_size={U} but the given USPTopology was built with {group.ulysses_size}")
        return group
    pg = group.group if isinstance(group, CPTopology) else group
    topo = registered_usp_topology(pg, U)
    if topo is None:
        raise ValueError(f"algo='usp' with ulysses_size={U} < CP size {world_size} needs its 2-D process groups: "
                         f"call megatron_burst.build_usp_topology(cp_group, {U}) once on every rank and pass it "
                         "as group=")
    return topo


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, algo: str = "burst",
            layout: str = "zigzag", causal: bool = True, ring: Optional[str] = None,
            softmax_scale: Optional[float] = None, qkv_format: str = "sbhd", stripe: int = 1,
            dropout_p: float = 0.0, attn_bias: Optional[torch.Tensor] = None,
            kernel: Optional[str] = None, ulysses_size: Optional[int] = None,
            ring_backward: str = "auto", cu_seqlens: Optional[CuSeqlens] = None,
            cu_seqlens_padded: Optional[CuSeqlens] = None, window: Optional[tuple[int, int]] = None,
            pattern: "VerticalSlash | Dynamic | str | None" = None) -> Prepared:
    """Validate a cp_attention call (before any collective) and resolve its configuration.

    The only collectives are the last steps, after every check: a dynamic pattern's estimate and
    the kernel agreement on CUDA (``choose_kernels``)."""
    if pattern is not None:
        pattern = check_pattern_call(pattern, algo=algo, layout=layout, qkv_format=qkv_format, causal=causal,
                                     group=group)
    window = check_window(window)
    if window is not None and window[0] is None and (window[1] is None or causal):
        window = None  # unbounded on every side the mask has: plain (causal) attention, the dense path
    packed = qkv_format == "thd"
    if packed:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise ValueError(f"qkv_format='thd' takes {name} as [tokens, heads, head_dim], got shape "
                                 f"{tuple(t.shape)}")
        q, k, v, qkv_format = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), "sbhd"
    if layout == THD and cu_seqlens is None:
        raise ValueError("layout='thd' places tokens by their packed sequences: pass cu_seqlens (and "
                         "cu_seqlens_padded when sequences are padded)")
    if layout == BALANCED and cu_seqlens is None:
        raise ValueError("layout='balanced' places tokens by the batch's documents: pass cu_seqlens=[0, ..., S] "
                         "(global boundaries, the same on every rank), or the Documents of "
                         "megatron_burst.documents.balanced_documents(cu_seqlens, S, batch, CP size) built once per "
                         "batch; each rank's tokens are plan.indices(rank) of the full sequence")
    if cu_seqlens_padded is not None and layout != THD:
        raise ValueError(f"cu_seqlens_padded describes THD partitioning: use layout='thd', not {layout!r}")
    if isinstance(group, USPTopology):
        ulysses_size = group.ulysses_size if ulysses_size is None else ulysses_size
        topo = group.ring if group.ulysses_size == 1 else None
        cp_group = group.cp_group
    else:
        topo = group if isinstance(group, CPTopology) else single_node_topology(group)
        cp_group = topo.group
    world_size = group.world_size if isinstance(group, USPTopology) else topo.world_size
    ring = ring or (group.ring.default_ring if isinstance(group, USPTopology) else topo.default_ring)
    if ring not in RING_SHAPES:
        raise ValueError(f"unknown ring {ring!r}: choose one of {', '.join(RING_SHAPES)}")
    if ring == "double" and not isinstance(group, (CPTopology, USPTopology)):
        raise ValueError("ring='double' needs group=megatron_burst.build_cp_topology(cp_group, ranks_per_node)")
    validate(q, k, v, world_size=world_size, algo=algo, layout=layout, qkv_format=qkv_format, stripe=stripe,
             dropout_p=dropout_p, attn_bias=attn_bias, ulysses_size=ulysses_size, ring_backward=ring_backward)
    b, hq, n, d = to_bhsd(q, qkv_format).shape
    hkv = to_bhsd(k, qkv_format).shape[1]
    # the balanced layout is placed node-aware for the CP group's nodes (masks.dispatch.placement_order)
    ranks_per_node = group.ranks_per_node if isinstance(group, USPTopology) else topo.ranks_per_node
    documents: Optional[Documents] = None
    if isinstance(cu_seqlens, Documents):  # validated once per batch by the caller (no host read per layer)
        documents = cu_seqlens
        wanted = layout if layout in (THD, BALANCED) else None  # the data-derived layouts carry a partition
        if documents.layout != wanted:
            how = {THD: "megatron_burst.documents.check_thd", BALANCED: "megatron_burst.documents.balanced_documents",
                   None: "megatron_burst.documents.check_cu_seqlens"}[wanted]
            raise ValueError(f"documents placed for layout {documents.layout or 'any fixed layout'!r} do not fit "
                             f"layout {layout!r}: build them with {how}")
        if documents.seq_len != n * world_size:
            raise ValueError(f"documents for {documents.seq_len} tokens do not fit this call: {n} local tokens x "
                             f"{world_size} ranks")
        if documents.plan is not None and documents.plan.world_size != world_size:
            raise ValueError(f"the balanced plan of these documents is for {documents.plan.world_size} ranks, the CP "
                             f"group has {world_size}: build them with balanced_documents(..., world_size={world_size})")
        if documents.plan is not None and documents.plan.ranks_per_node != ranks_per_node:
            raise ValueError(f"the balanced plan of these documents is placed for {documents.plan.ranks_per_node} "
                             f"ranks per node, the CP topology has {ranks_per_node}: build them with "
                             f"balanced_documents(..., ranks_per_node={ranks_per_node}) (the topology's "
                             "ranks_per_node), so batch slicing and attention agree on which rank holds which token")
        if any(end > b for _, end, _ in documents.groups):
            raise ValueError(f"documents describe {documents.groups[-1][1]} samples, the batch has {b}")
    elif layout == THD:
        documents = check_thd(cu_seqlens, cu_seqlens_padded, n, world_size, b)
    elif layout == BALANCED:  # planned with the default causal=True, as layout_indices(cu_seqlens=...) does
        documents = balanced_documents(cu_seqlens, n * world_size, b, world_size, ranks_per_node=ranks_per_node)
    elif cu_seqlens is not None:
        documents = check_cu_seqlens(cu_seqlens, n * world_size, b)
    if isinstance(pattern, Dynamic):
        pattern.check(n * world_size)
    elif pattern is not None:
        pattern.check(n * world_size, hq)  # one read-back of the lines' extremes
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    nodes = group.num_nodes if isinstance(group, USPTopology) else topo.num_nodes
    if algo == "auto" and pattern is None:  # with a pattern, resolve_algo below picks ring or burst
        if isinstance(group, USPTopology):  # its 2-D groups: Ulysses over the whole group, or usp at its U
            sizes, algos = (group.ulysses_size,), ("ulysses", "usp")
        else:
            pg = topo.group
            sizes = tuple(u for u in range(2, world_size) if registered_usp_topology(pg, u) is not None)
            algos = ("ring", "burst", "allgather", "ulysses", "usp")
        algo, ulysses_size = choose_algo(b, hq, hkv, n, d, q.element_size(), world_size, nodes=nodes, ring=ring,
                                         causal=causal, usp_sizes=sizes, algos=algos)
    if algo == "ulysses":
        algo, ulysses_size = "usp", world_size
    if algo == "usp" and ulysses_size == 1:
        algo = ring_backward
    if algo != "usp":
        if topo is None:  # a USPTopology with U > 1 asked for a ring-family algorithm
            raise ValueError(f"algo={algo!r} runs over a CP group or CPTopology, not a USPTopology")
        backward_algo = resolve_algo(algo, b, hq, hkv, n, d, q.element_size(), world_size, nodes=topo.num_nodes,
                                     ring=ring, causal=causal)
        if isinstance(pattern, Dynamic):  # every local check passed: the estimate's collectives may run
            # through the module: benches and GPU tests wrap masks.dynamic.estimate to see the pattern
            pattern = dynamic.estimate(to_bhsd(q, qkv_format), to_bhsd(k, qkv_format), pattern,
                                       group=topo.group, layout=layout, stripe=stripe, softmax_scale=scale)
        if pattern is not None:
            pattern = pattern.to(q.device)  # plans are built and kept on q's device
        cfg = CPConfig(topo, ring, layout, stripe, causal, scale, kernel, documents, window=window, pattern=pattern)
        choose_kernels(cfg, q, d, kernel, cp_group)
        return Prepared(q, k, v, cfg, backward_algo, qkv_format, packed=packed)
    U = ulysses_size
    if U == world_size:  # plain Ulysses: the CP group is the all-to-all group, the ring is a single member
        rank_topo, a2a_group = CPTopology(None, 0, 1, 1, None), cp_group
        link = topo.link_of if topo is not None else "intra"
        if isinstance(group, USPTopology):
            a2a_group, link = group.ulysses_group, group.ulysses_link
    else:
        usp = _usp_topology(group, world_size, U)
        rank_topo, a2a_group, link = usp.ring, usp.ulysses_group, usp.ulysses_link
    kv_sent = ulysses.kv_heads_sent(hkv, U)
    members = world_size // U
    if ring == "double" and rank_topo.num_nodes == 1:
        ring = "flat"
    ring_scheme = resolve_algo(ring_backward, b, hq // U, kv_sent // U, n * U, d, q.element_size(), members,
                               nodes=rank_topo.num_nodes, ring=ring, causal=causal) if members > 1 else "ring"
    cfg = CPConfig(rank_topo, ring, layout, stripe, causal, scale, kernel, documents, ulysses_size=U, window=window)
    choose_kernels(cfg, q, d, kernel, cp_group)
    return Prepared(q, k, v, cfg, "ulysses", qkv_format, (a2a_group, link), ring_scheme, packed)
