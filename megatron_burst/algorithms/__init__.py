"""Context-parallel attention: the functional API and the autograd Function behind it.

``cp_attention`` takes this rank's tokens (in the layout's order) and returns this rank's output.

* ``ring``: K,V circulate; in the backward K,V,dK,dV circulate (TransformerEngine's p2p scheme).
* ``burst``: K,V circulate; in the backward Q,dO,D,lse,dQ circulate (BurstAttention).
* ``allgather``: K,V all-gathered in pieces, dK,dV reduce-scattered (Llama 3; allgather.py).
* ``ulysses``: all-to-all to head sharding, local attention, all-to-all back (ulysses.py).
* ``usp``: Ulysses inside groups of ``ulysses_size`` ranks, the ring (``ring_backward``: ring,
  burst or auto; flat or double) across the groups.
* ``auto``: per call shape, dtype and topology, the algorithm the cost model (megatron_burst.cost_model)
  predicts fastest. When the ring family wins, the backward is the one sending fewer bytes: for
  multi-head attention burst; with GQA at hq/hkv >= 2 ring (in bf16 already from hq/hkv > 1.5).

Masks are data in the validated call (``Prepared.cfg``): causal/full, documents (``cu_seqlens``),
a sliding window (``window``) and a vertical-slash sparse pattern (``pattern``, ring and burst),
intersected; nothing is changed on a prepared call afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.algorithms import allgather, burst, ring, ulysses
from megatron_burst.algorithms.schedule import CPConfig
from megatron_burst.masks.documents import CuSeqlens, THD, Documents, balanced_documents, check_cu_seqlens, check_thd
from megatron_burst.masks.window import check_window
from megatron_burst import dynamic_pattern
from megatron_burst.masks.dynamic import Dynamic
from megatron_burst.kernels import block_backward, block_forward, reads_output, row_dot
from megatron_burst.kernels.choice import KernelPolicy, agree, choose
from megatron_burst.masks.block import BlockMask
from megatron_burst.masks.layout import BALANCED, check_layout, check_local_len
from megatron_burst.masks.vertical_slash import VerticalSlash
from megatron_burst.topology import (RING_SHAPES, CPTopology, USPTopology, check_ulysses_size,
                                     registered_usp_topology, single_node_topology)

CP_ALGOS = ("ring", "burst", "auto", "allgather", "ulysses", "usp")
RING_BACKWARDS = ("ring", "burst", "auto")
PATTERN_ALGOS = ("ring", "burst", "auto")  # the algorithms a sparse pattern runs on ("auto": ring or burst)
QKV_FORMATS = ("sbhd", "bshd", "thd")  # "thd": [t, h, d], one packed sequence (sbhd with b = 1)

_FORWARD = {"ring": ring.kv_ring_forward, "burst": ring.kv_ring_forward, "allgather": allgather.allgather_forward}
_BACKWARD = {"ring": ring.ring_backward, "burst": burst.burst_backward, "allgather": allgather.allgather_backward}
_BACKWARD_BYTES = {"ring": ring.backward_bytes, "burst": burst.backward_bytes,
                   "allgather": allgather.backward_bytes}


def resolve_algo(algo: str, b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int,
                 nodes: int = 1, ring: str = "flat", causal: bool = True) -> str:
    """``auto`` -> the backward scheme the cost model (megatron_burst.cost_model) predicts faster on this
    topology and ring; with equal hop counts for both schemes that is the one sending fewer bytes."""
    if algo != "auto":
        return algo
    if world_size == 1:
        return "burst"
    # imported here so that `python -m megatron_burst.cost_model` does not find itself pre-imported
    from megatron_burst.cost_model import AttnShape, Cluster, choose_backward

    cluster = Cluster(nodes=nodes, gpus_per_node=world_size // nodes)
    shape = AttnShape(seq=n * world_size, heads=hq, kv_heads=hkv, head_dim=d, batch=b, elem=elem, causal=causal)
    return choose_backward(cluster, shape, ring if nodes > 1 else "flat")


def choose_algo(b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int, nodes: int = 1,
                ring: str = "flat", causal: bool = True, usp_sizes: tuple[int, ...] = (),
                algos: tuple[str, ...] = ("ring", "burst", "allgather", "ulysses", "usp")) -> tuple[str, Optional[int]]:
    """``algo="auto"`` -> (algorithm, Ulysses size or None) the cost model predicts fastest for this
    shape and topology (megatron_burst.cost_model.choose_algorithm). usp is considered only for the sizes
    in ``usp_sizes`` (those whose 2-D process groups were built); ties go to the ring family."""
    if world_size == 1:
        return "burst", None
    from megatron_burst.cost_model import AttnShape, Cluster, choose_algorithm

    cluster = Cluster(nodes=nodes, gpus_per_node=world_size // nodes)
    shape = AttnShape(seq=n * world_size, heads=hq, kv_heads=hkv, head_dim=d, batch=b, elem=elem, causal=causal)
    algo, U = choose_algorithm(cluster, shape, ring, usp_sizes=usp_sizes, algos=algos)
    return algo, (U if algo in ("ulysses", "usp") else None)


def backward_bytes(algo: str, b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int) -> int:
    """Bytes one rank sends in ``algo``'s backward for n local tokens (see each algorithm's docstring)."""
    scheme = resolve_algo(algo, b, hq, hkv, n, d, elem, world_size)
    return _BACKWARD_BYTES[scheme](b, hq, hkv, n, d, elem, world_size)


class _CPAttention(torch.autograd.Function):
    """Ring forward (K,V circulate), backward by ``backward_algo``.

    Takes q, k, v in the caller's format and returns the output in that format, contiguous: a
    [s, b, h, d] output reshapes to Megatron's [s, b, h*d] as a view, and the same storage is what
    the backward keeps (the output is stored once). With ``q_rows`` and a cached tail (sequence-level
    selective checkpointing's recompute), the forward computes only local query rows [0, q_rows)
    and takes (out, lse) of the other rows from the cache; the backward is the same exact backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, cfg: CPConfig, backward_algo: str, qkv_format: str, q_rows: Optional[int] = None,
                out_tail: Optional[torch.Tensor] = None, lse_tail: Optional[torch.Tensor] = None):
        qh, kh, vh = (to_bhsd(t, qkv_format).contiguous() for t in (q, k, v))
        out, _, lse = attention_forward(qh, kh, vh, cfg, qkv_format, q_rows, out_tail, lse_tail, backward_algo)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.cfg, ctx.backward_algo, ctx.qkv_format = cfg, backward_algo, qkv_format
        return out

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, out, lse = ctx.saved_tensors
        fmt = ctx.qkv_format
        dout_h = to_bhsd(dout, fmt).contiguous()
        out_h = to_bhsd(out, fmt)
        whole = single_block(ctx.cfg, qh.shape[2])
        if whole is not None:  # a kernel that reads the output itself needs no D
            D = None if reads_output(qh, whole.kind, ctx.cfg.kernel) else row_dot(dout_h, out_h)
            dq, dk, dv = block_backward(dout_h, qh, kh, vh, D, lse, whole, ctx.cfg.scale, ctx.cfg.kernel, out=out_h)
        else:
            D = row_dot(dout_h, out_h)
            dq, dk, dv = _BACKWARD[ctx.backward_algo](dout_h, qh, kh, vh, D, lse, ctx.cfg, out=out_h)
        grads = (from_bhsd(g.to(qh.dtype), fmt) for g in (dq, dk, dv))
        return (*grads, None, None, None, None, None, None)


def single_block(cfg: CPConfig, n: int) -> Optional[BlockMask]:
    """The one block that covers every local query row of every sample when the call has nothing
    to exchange (one rank, no sparse plan): then the forward and backward are one kernel call each,
    with no fp32 accumulator and no merge. None otherwise."""
    if cfg.world_size != 1 or cfg.pattern is not None or cfg.ulysses_size != 1:
        return None
    blocks = cfg.blocks(0, 0, n)
    if len(blocks) != 1:
        return None
    batch, mask = blocks[0]
    whole_batch = batch.start in (None, 0) and batch.stop is None and batch.step in (None, 1)
    return mask if whole_batch and mask.q_start == 0 and mask.q_stop == n else None


def to_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """[s, b, h, d] ("sbhd") or [b, s, h, d] ("bshd") -> a [b, h, s, d] view."""
    return t.permute(1, 2, 0, 3) if qkv_format == "sbhd" else t.permute(0, 2, 1, 3)


def from_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """Inverse of :func:`to_bhsd` (a view)."""
    return t.permute(2, 0, 1, 3) if qkv_format == "sbhd" else t.permute(0, 2, 1, 3)


def attention_forward(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, cfg: CPConfig, qkv_format: str,
                      q_rows: Optional[int] = None, out_tail: Optional[torch.Tensor] = None,
                      lse_tail: Optional[torch.Tensor] = None, scheme: str = "ring"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CP forward on contiguous [b, h, s, d] q/k/v.

    Returns (out in the caller's format, contiguous; the same storage viewed [b, h, s, d];
    lse [b, h, s] fp32). Blocks merge in fp32; the output is rounded to q's dtype once, at the end.
    ``q_rows``/``out_tail``/``lse_tail``: rows [q_rows, s) come from a selective-checkpoint store.
    ``scheme``: "allgather" gathers K,V; ring and burst circulate them.
    """
    b, h, s, d = qh.shape
    shape = (s, b, h, vh.shape[-1]) if qkv_format == "sbhd" else (b, s, h, vh.shape[-1])
    out = torch.empty(shape, dtype=qh.dtype, device=qh.device)
    out_h = to_bhsd(out, qkv_format)
    whole = single_block(cfg, s) if q_rows is None else None
    if whole is not None:
        o, lse = block_forward(qh, kh, vh, whole, cfg.scale, cfg.kernel)
        out_h.copy_(o)
        return out, out_h, lse
    # fp32 inputs accumulate straight into the output; others through one fp32 buffer
    acc = out_h if qh.dtype == torch.float32 else None
    acc, lse = _FORWARD[scheme](qh, kh, vh, cfg, q_rows=q_rows, out=acc)
    if q_rows is not None:
        acc[:, :, q_rows:] = out_tail
        lse[:, :, q_rows:] = lse_tail
    if acc is not out_h:
        out_h.copy_(acc)
    return out, out_h, lse


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int, algo: str, layout: str,
             qkv_format: str, stripe: int, dropout_p: float, attn_bias: Optional[torch.Tensor],
             ulysses_size: Optional[int] = None, ring_backward: str = "auto") -> None:
    """Raise ValueError for anything cp_attention cannot do. Local checks only: safe before collectives."""
    if algo not in CP_ALGOS:
        raise ValueError(f"unknown algo {algo!r}: choose one of {', '.join(CP_ALGOS)}")
    if ring_backward not in RING_BACKWARDS:
        raise ValueError(f"unknown ring_backward {ring_backward!r}: choose one of {', '.join(RING_BACKWARDS)}")
    if layout != THD:
        check_layout(layout, stripe)
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"unknown qkv_format {qkv_format!r}: choose one of {', '.join(QKV_FORMATS)}")
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: attention dropout is not supported under context "
                         "parallelism; set attention dropout to 0 (Megatron: --attention-dropout 0)")
    if attn_bias is not None:
        raise ValueError("attn_bias is not supported by cp_attention; remove the attention bias "
                         "(ALiBi/relative bias) or run without context parallelism")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {qkv_format} [.., .., heads, head_dim], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in sequence/batch dims "
                         f"(format {qkv_format})")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} != k head dim {k.shape[3]}")
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not divisible by key/value heads {hkv} (GQA needs hq % hkv == 0)")
    local_len = q.shape[0] if qkv_format == "sbhd" else q.shape[1]
    if layout != THD:
        check_local_len(local_len, world_size, layout, stripe)
    if algo == "usp" and ulysses_size is None:
        raise ValueError("algo='usp' needs ulysses_size=U (the Ulysses group size; Megatron: "
                         "--hierarchical-context-parallel-sizes U W/U)")
    if algo in ("ulysses", "usp"):
        U = world_size if algo == "ulysses" else ulysses_size
        check_ulysses_size(world_size, U)
        ulysses.check_heads(hq, hkv, U, algo)


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
    cfg.kernel = choose(q.device, q.dtype, head_dim, cfg.mask_kinds, KernelPolicy.from_env(kernel))
    if q.is_cuda:
        agree(cfg.kernel, cp_group)


def check_pattern_call(pattern: object, *, algo: str, layout: str, qkv_format: str, causal: bool, group=None
                       ) -> "VerticalSlash | Dynamic":
    """The local checks of a call with a sparse ``pattern`` that need no shapes (before any
    collective); returns the pattern, "dynamic" as ``Dynamic()``. Names what cannot run: other
    algorithms than ring/burst (auto picks one of them), non-causal attention, packed THD."""
    if isinstance(pattern, str) and pattern == "dynamic":
        pattern = Dynamic()
    if not isinstance(pattern, (VerticalSlash, Dynamic)):
        raise ValueError(f"pattern={pattern!r}: pass megatron_burst.VerticalSlash(vertical, slash), 'dynamic' or "
                         "megatron_burst.dynamic_pattern.Dynamic(p_v, p_s, last_q)")
    if algo not in PATTERN_ALGOS:
        raise ValueError(f"algo={algo!r}: sparse attention runs on the ring schedules, choose 'ring' or 'burst' "
                         "(or 'auto', which picks one of them)")
    if isinstance(group, USPTopology) and group.ulysses_size > 1:
        raise ValueError("a sparse pattern runs on ring and burst over the CP group (or a CPTopology), not over a "
                         "USPTopology's Ulysses groups")
    if not causal:
        raise ValueError("causal=False with a sparse pattern: a vertical-slash pattern is causal (query i sees keys "
                         "j <= i only); pass causal=True")
    if layout == THD or qkv_format == "thd":
        raise ValueError("a sparse pattern does not run on packed THD batches (layout/qkv_format 'thd'): pass the "
                         "documents as cu_seqlens with layout 'contiguous', 'zigzag' or 'striped'")
    if layout == BALANCED:  # sparse plans are built from the fixed layouts' positions (sparse_plan)
        raise ValueError("a sparse pattern does not run on layout 'balanced' (placed by documents): use layout "
                         "'zigzag', 'contiguous' or 'striped' with the documents as cu_seqlens")
    return pattern


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
        if any(end > b for _, end, _ in documents.groups):
            raise ValueError(f"documents describe {documents.groups[-1][1]} samples, the batch has {b}")
    elif layout == THD:
        documents = check_thd(cu_seqlens, cu_seqlens_padded, n, world_size, b)
    elif layout == BALANCED:  # planned with the default causal=True, as layout_indices(cu_seqlens=...) does
        documents = balanced_documents(cu_seqlens, n * world_size, b, world_size)
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
            # through the module: benches and GPU tests wrap dynamic_pattern.estimate to see the pattern
            pattern = dynamic_pattern.estimate(to_bhsd(q, qkv_format), to_bhsd(k, qkv_format), pattern,
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


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 group: Optional[dist.ProcessGroup | CPTopology | USPTopology] = None,
                 algo: str = "burst", layout: str = "zigzag", causal: bool = True, ring: Optional[str] = None,
                 softmax_scale: Optional[float] = None, qkv_format: str = "sbhd", stripe: int = 1,
                 dropout_p: float = 0.0, attn_bias: Optional[torch.Tensor] = None,
                 kernel: Optional[str] = None, ulysses_size: Optional[int] = None,
                 ring_backward: str = "auto", cu_seqlens: Optional[CuSeqlens] = None,
                 cu_seqlens_padded: Optional[CuSeqlens] = None, window: Optional[tuple[int, int]] = None,
                 pattern: "VerticalSlash | Dynamic | str | None" = None) -> torch.Tensor:
    """Context-parallel softmax attention over the ranks of ``group``.

    q [s, b, hq, d], k/v [s, b, hkv, d] (``qkv_format="sbhd"``, Megatron's; or [b, s, h, d] for
    "bshd") hold this rank's s local tokens in ``layout``'s order (see megatron_burst.layout; one of
    ``ENGINE_LAYOUTS`` or "thd").
    Returns this rank's output, same shape and dtype as q, contiguous (so Megatron's reshape to
    [s, b, hq*d] is a view). Differentiable; gradients are exact.
    ``group`` None means the default process group (or a single process if none is initialized);
    a :class:`CPTopology` from ``build_cp_topology`` makes the ring topology-aware: ``ring="double"``
    (the default when it spans several nodes) runs intra-node rings inside an inter-node ring, and
    ``ring="flat"`` one ring whose bytes are still classed intra/inter.
    ``algo="usp"`` needs ``ulysses_size`` U and the 2-D groups of ``build_usp_topology`` (passed as
    ``group``, or built earlier for this CP group); ``ring_backward`` picks its ring part's backward.
    ``kernel`` forces a local attention backend (megatron_burst.kernels.BACKENDS).
    ``cu_seqlens``: packed documents, int tensor [0, ..., S] of global document boundaries over the
    full sequence (S = s x CP size; the same on every rank), or a list of b such tensors (one per
    sample), or a :class:`~megatron_burst.documents.Documents` validated once per batch (Megatron
    layers do this). Attention stays inside each document: causal within it (``causal=True``) or full within
    it (``causal=False``). Block pairs sharing no document skip compute; bytes sent are unchanged.
    See megatron_burst.documents.
    Packed THD batches (TransformerEngine's partitioning, Megatron's PackedSeqParams):
    ``layout="thd"`` with ``cu_seqlens`` (real sequence boundaries) and ``cu_seqlens_padded``
    (padded ones, each a multiple of 2 x CP size; None: unpadded): rank r holds chunks r and 2W-1-r
    of every sequence. ``qkv_format="thd"`` takes and returns [t, h, d] tensors.
    ``layout="balanced"``: tokens placed by the documents (megatron_burst.dispatch.plan_dispatch: long
    documents split over groups of ranks, short ones whole on one rank, S / W tokens per rank, S
    divisible by W). Needs ``cu_seqlens``: raw boundaries (planned on their union when per sample,
    cached per boundaries), or better the :class:`~megatron_burst.documents.Documents` of
    :func:`~megatron_burst.documents.balanced_documents` built once per batch; this rank's q, k, v
    are then the full sequence's rows ``documents.plan.indices(rank)`` (increasing global order;
    ``megatron_burst.shard(..., "balanced", plan=...)``). Every algorithm, ring shape, window and
    per-sample boundaries run it exactly; K,V travel the full ring (every block, as in the other
    layouts). Not with ``pattern`` (refused).
    ``window=(left, right)``: sliding-window attention with Megatron's ``window_size`` meaning
    (-1 = unbounded): query i sees keys i-left ... i+right (i-left ... i when causal; causal
    sliding-window attention is (left, 0)), intersected with documents if given. Block pairs
    outside the window skip compute, and ring/burst stop circulating a block once no later rank
    needs it, so traffic shrinks with the window (schedule.ring_pass).
    ``pattern``: a vertical-slash sparse pattern (MTraining): a :class:`~megatron_burst.VerticalSlash`
    (query i of head h sees key j <= i iff j is one of h's vertical lines or i - j one of its slash
    offsets), ``"dynamic"`` or a :class:`~megatron_burst.dynamic_pattern.Dynamic` (estimated from
    this call's q and k first, the same on every rank). Intersected with causality, ``cu_seqlens``
    and ``window`` (megatron_burst.sparse_plan). Ring and burst only (``auto`` picks one of them),
    causal, not with THD. Block pairs, query tiles and key columns with nothing visible skip
    compute; the ring carries every block unless a window prunes it.
    """
    return prepare(q, k, v, group=group, algo=algo, layout=layout, causal=causal, ring=ring,
                   softmax_scale=softmax_scale, qkv_format=qkv_format, stripe=stripe, dropout_p=dropout_p,
                   attn_bias=attn_bias, kernel=kernel, ulysses_size=ulysses_size,
                   ring_backward=ring_backward, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
                   window=window, pattern=pattern).apply()
