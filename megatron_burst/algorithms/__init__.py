"""Context-parallel attention: the functional API (:func:`cp_attention`), the package face.

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

The package's modules, one concept each: ``validate`` (accepted names, local checks),
``prepare`` (a validated call: masks as data, algorithm and kernels chosen), ``function`` (the
autograd Function and the CP forward), ``auto`` (the cost model's picks), ``schedule`` (the ring
passes and CPConfig), ``ring``, ``burst``, ``allgather``, ``ulysses`` (the schemes). This face
holds :func:`cp_attention` and re-exports what other modules import from ``megatron_burst.algorithms``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.algorithms.auto import backward_bytes, choose_algo, resolve_algo
from megatron_burst.algorithms.function import attention_forward, from_bhsd, single_block, to_bhsd
from megatron_burst.algorithms.prepare import Prepared, choose_kernels, prepare
from megatron_burst.algorithms.validate import (CP_ALGOS, PATTERN_ALGOS, QKV_FORMATS, RING_BACKWARDS,
                                                check_pattern_call, validate)
from megatron_burst.masks.documents import CuSeqlens
from megatron_burst.masks.dynamic import Dynamic
from megatron_burst.masks.vertical_slash import VerticalSlash
from megatron_burst.topology import CPTopology, USPTopology

__all__ = ["cp_attention", "CP_ALGOS", "PATTERN_ALGOS", "QKV_FORMATS", "RING_BACKWARDS", "Prepared", "prepare",
           "choose_kernels", "validate", "check_pattern_call", "attention_forward", "single_block", "to_bhsd",
           "from_bhsd", "backward_bytes", "choose_algo", "resolve_algo"]


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
    "bshd") hold this rank's s local tokens in ``layout``'s order (see megatron_burst.masks.layout; one of
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
    sample), or a :class:`~megatron_burst.masks.documents.Documents` validated once per batch (Megatron
    layers do this). Attention stays inside each document: causal within it (``causal=True``) or full within
    it (``causal=False``). Block pairs sharing no document skip compute; bytes sent are unchanged.
    See megatron_burst.masks.documents.
    Packed THD batches (TransformerEngine's partitioning, Megatron's PackedSeqParams):
    ``layout="thd"`` with ``cu_seqlens`` (real sequence boundaries) and ``cu_seqlens_padded``
    (padded ones, each a multiple of 2 x CP size; None: unpadded): rank r holds chunks r and 2W-1-r
    of every sequence. ``qkv_format="thd"`` takes and returns [t, h, d] tensors.
    ``layout="balanced"``: tokens placed by the documents (megatron_burst.masks.dispatch.plan_dispatch: long
    documents split over groups of ranks, short ones whole on one rank, S / W tokens per rank, S
    divisible by W). Needs ``cu_seqlens``: raw boundaries (planned on their union when per sample,
    cached per boundaries), or better the :class:`~megatron_burst.masks.documents.Documents` of
    :func:`~megatron_burst.masks.documents.balanced_documents` built once per batch; this rank's q, k, v
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
    offsets), ``"dynamic"`` or a :class:`~megatron_burst.masks.dynamic.Dynamic` (estimated from
    this call's q and k first, the same on every rank). Intersected with causality, ``cu_seqlens``
    and ``window`` (megatron_burst.masks.vertical_slash). Ring and burst only (``auto`` picks one of them),
    causal, not with THD. Block pairs, query tiles and key columns with nothing visible skip
    compute; the ring carries every block unless a window prunes it.
    """
    return prepare(q, k, v, group=group, algo=algo, layout=layout, causal=causal, ring=ring,
                   softmax_scale=softmax_scale, qkv_format=qkv_format, stripe=stripe, dropout_p=dropout_p,
                   attn_bias=attn_bias, kernel=kernel, ulysses_size=ulysses_size,
                   ring_backward=ring_backward, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
                   window=window, pattern=pattern).apply()
