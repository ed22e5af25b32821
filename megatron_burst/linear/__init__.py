"""Linear attention under context parallelism: LASP-2 (one all-gather of d x d states), LASP-1 baseline.

    out = megatron_burst.linear_attention(q, k, v, group=cp_group, g=log_decay, layout="zigzag")

Modules: :mod:`~megatron_burst.linear.reference` (the token-by-token recurrence tests compare
against), :mod:`~megatron_burst.linear.chunked` (one rank's segments, chunked),
:mod:`~megatron_burst.linear.exchange` (the states that enter the segments: LASP-2's all-gather or
LASP-1's chain), :mod:`~megatron_burst.linear.delta` (the gated delta rule: one all-gather of
per-segment affine maps), :mod:`~megatron_burst.linear.docs` (documents: where the state resets),
:mod:`~megatron_burst.linear.runs` (packed THD batches and the balanced layout: a rank's runs as segments).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.masks.documents import CuSeqlens, Documents
from megatron_burst.linear.checks import MIN_STRIPE, check_qkv, segment_order, segments_per_rank
from megatron_burst.linear.chunked import (CHUNK, entering_rows, entering_term, segment_output, segment_state,
                                            segments_to_local)
from megatron_burst.linear.docs import check_documents, segment_documents, unplaced
from megatron_burst.linear import fla_adapter, kernel_choice
from megatron_burst.linear.exchange import (Lasp1Chain, Lasp2Exchange, SegmentMap, local_entering_states,
                                            post_state_gather)
from megatron_burst.linear.delta import gated_delta_rule
from megatron_burst.linear.runs import RUN_LAYOUTS, rank_runs, run_documents, run_layout, run_map
from megatron_burst.linear.reference import expand_log_decay, naive_gated_delta_rule, naive_linear_attention

__all__ = ["linear_attention", "naive_linear_attention", "gated_delta_rule", "naive_gated_delta_rule", "LINEAR_CP_ALGOS", "MIN_STRIPE"]

LINEAR_CP_ALGOS = ("lasp2", "lasp1")


def _validate(q, k, v, g, *, world_size, causal, layout, stripe, algo, qkv_format,
              cu_seqlens=None, kernel="auto") -> Optional[Documents]:
    """Raise ValueError for any input linear_attention cannot take; returns the validated
    documents (None without). Local checks only."""
    if kernel not in kernel_choice.LINEAR_KERNELS:
        raise ValueError(f"unknown linear attention kernel {kernel!r}: choose one of "
                         f"{', '.join(kernel_choice.LINEAR_KERNELS)}")
    if kernel == "fla" and not causal:
        raise ValueError("kernel='fla' needs causal=True: bidirectional linear attention has no intra-segment "
                         "work for fla (its sums are one matmul, in torch); use kernel='auto' or 'torch'")
    if algo not in LINEAR_CP_ALGOS:
        raise ValueError(f"unknown linear attention algo {algo!r}: choose one of {', '.join(LINEAR_CP_ALGOS)}")
    s, b, h, dk = check_qkv(q, k, v, world_size=world_size, layout=layout, stripe=stripe, qkv_format=qkv_format)
    if g is not None:
        if not causal:
            raise ValueError("a decay g needs causal=True: bidirectional linear attention has no order to decay "
                             "along (pass g=None)")
        allowed = {(h,), (s, b, h), (s, b, h, dk)} if qkv_format == "sbhd" else {(h,), (b, s, h), (b, s, h, dk)}
        if tuple(g.shape) not in allowed:
            raise ValueError(f"g {tuple(g.shape)} must be one of {sorted(allowed, key=len)} (per head; per token and "
                             f"head; per key channel) for q {tuple(q.shape)} ({qkv_format})")
        if g.device != q.device:
            raise ValueError(f"g is on {g.device}, q on {q.device}")
    if layout in RUN_LAYOUTS:
        if cu_seqlens is None:
            raise ValueError(f"layout={layout!r} places tokens by the batch's documents: pass them as cu_seqlens "
                             "(boundaries, or the Documents the batch was sliced with)")
        if algo != "lasp2" and world_size > 1:  # one rank holds the sequence in order: any algo
            raise ValueError(f"algo={algo!r} with layout={layout!r}: the data-derived layouts run LASP-2 (algo='lasp2')")
    if cu_seqlens is None:
        return None
    if not causal:
        raise ValueError("documents (cu_seqlens) need causal=True: bidirectional linear attention over packed "
                         "documents is not supported")
    return check_documents(cu_seqlens, s * world_size, b, layout, world_size)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     group: Optional[dist.ProcessGroup] = None, g: Optional[torch.Tensor] = None,
                     causal: bool = True, layout: str = "contiguous", stripe: int = 1, algo: str = "lasp2",
                     scale: Optional[float] = None, qkv_format: str = "sbhd",
                     cu_seqlens: "Optional[CuSeqlens | Documents]" = None, kernel: str = "auto") -> torch.Tensor:
    """Context-parallel (decayed) linear attention; exact, differentiable in q, k, v and g.

    q, k [s, b, h, dk], v [s, b, h, dv] (``qkv_format="sbhd"``; or [b, s, h, d] for "bshd") hold
    this rank's s tokens in ``layout``'s order. Returns o [s, b, h, dv] in q's dtype:
    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t and o_t = scale * q_t S_t over the global token order
    (the current token included, S_0 = 0); ``causal=False``: o_t = scale * q_t sum_j k_j^T v_j.

    ``g``: log-decay (<= 0): None, [h] (per head: Lightning Attention, RetNet), [s, b, h] (per token
    and head: Mamba-2, simple GLA) or [s, b, h, dk] (per key channel: GLA), in q's token order.
    ``scale`` None: dk ** -0.5. States and sums are fp32 whatever the input dtype.

    ``algo="lasp2"``: one all-gather of every segment's d_k x d_v state (and its decay) forward,
    posted before the intra-segment work so they overlap, and one all-gather of the state gradients
    backward. ``"lasp1"``: the state passes from rank to rank (W - 1 sequential hops for contiguous).
    Layouts: contiguous, zigzag, block-striped with stripe >= 64 (a rank holds s / stripe
    segments), and the data-derived "thd" (packed sequences, TransformerEngine's partitioning) and
    "balanced" (:func:`megatron_burst.dispatch.plan_dispatch`), which need ``cu_seqlens`` and run
    LASP-2: a rank's runs of consecutive positions are its segments (:mod:`megatron_burst.linear.runs`).
    ``comm_counter`` counts an all-gather as (W - 1) x this rank's contribution sent;
    for contiguous and zigzag that does not depend on the sequence length.

    ``cu_seqlens``: packed documents, as :func:`megatron_burst.cp_attention` takes them -- an int
    tensor [0, ..., S] of global boundaries over the full sequence (S = s x CP size, the same on
    every rank), a list of b such tensors (one per sample), or a validated
    :class:`~megatron_burst.masks.documents.Documents`. The state starts again from zero at every
    document's first token, across rank boundaries, in every layout (``causal=True`` only). The
    bytes sent are unchanged: every rank derives the segments' reset flags from the boundaries.

    ``kernel`` (the local, intra-segment work; causal only): "auto" (flash-linear-attention's
    chunk kernels on CUDA when installed, after a self-check; our torch path on CPU), "torch"
    (our chunked path everywhere) or "fla" (fla's kernels, required). fla computes each
    segment's zero-start output and the state M it leaves (``chunk_simple_gla`` for no / per-head /
    per-token decays, ``chunk_gla`` per channel; :mod:`megatron_burst.linear.fla_adapter`); the
    exchange and the entering states' term stay ours. Documents go to fla too: each rank's
    segments cut at the document starts, as fla's varlen sequences (``cu_seqlens``). See :mod:`megatron_burst.linear.kernel_choice`
    for the environment overrides and what is loud.
    """
    pg = group
    world_size = dist.get_world_size(pg) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(pg) if world_size > 1 else 0
    documents = _validate(q, k, v, g, world_size=world_size, causal=causal, layout=layout, stripe=stripe, algo=algo,
                          qkv_format=qkv_format, cu_seqlens=cu_seqlens, kernel=kernel)
    sbhd = qkv_format == "sbhd"
    s, b, h, dk = q.shape if sbhd else (q.shape[1], q.shape[0], q.shape[2], q.shape[3])
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if sbhd else (lambda t: t.permute(0, 2, 1, 3))  # noqa: E731
    if layout in RUN_LAYOUTS:
        if world_size > 1:
            return _lasp2_runs(q, k, v, g, documents, pg, rank, world_size, sbhd, scale, acc, kernel, to_bhsd)
        layout, documents = "contiguous", unplaced(documents)  # one rank holds the sequence in order
    fla_fn = None
    form = kernel_choice.decay_form(g)
    if causal:  # bidirectional: the local work is one matmul per segment, always torch
        _, fla_fn = kernel_choice.choose("lasp2", form, q.device, q.dtype, dk, dv, kernel,
                                         documents=documents is not None)
    if fla_fn is not None and world_size == 1:  # one fla call, no final state
        g_rows = fla_adapter.decay_rows(g, form, 1, b, s, sbhd)
        return fla_adapter.one_rank(lambda rows, pieces: fla_adapter.lasp2_segments(
            fla_fn, form, *rows, g, g_rows, scale, pieces, final_state=False)[0], (q, k, v), documents, sbhd)
    per_rank = segments_per_rank(layout, s, stripe)
    L = s // per_rank

    def segments(t: torch.Tensor) -> torch.Tensor:  # [b, h, s, d] -> [nseg, b, h, L, d]
        return t.reshape(b, h, per_rank, L, t.shape[-1]).permute(2, 0, 1, 3, 4)

    smap = SegmentMap(pg, rank, world_size, tuple(segment_order(layout, world_size, r, per_rank)
                                                   for r in range(world_size)), causal)
    # fla runs documents as pieces (rows cut at document starts, fla_adapter.row_pieces)
    pieces = None if fla_fn is None else fla_adapter.row_pieces(documents, b, smap.order[rank], smap.total, q.device)
    # the entering state's masks and the exchange's reset flags: the same for both local kernels
    sd = segment_documents(documents, b, smap.order[rank], smap.total, q.device)
    doc, keep = (None, None) if sd is None else (sd.doc, sd.resets)
    if fla_fn is not None:
        o, M, a, G, qs = _fla_local(fla_fn, form, q, k, v, g, per_rank, b, h, s, dk, dv, L, sbhd, scale, acc,
                                    segments, to_bhsd, pieces)
    else:
        qs, ks, vs = (segments(to_bhsd(t).to(acc)) for t in (q, k, v))
        gs = None
        if g is not None:
            g_sbhd = g if (sbhd or g.dim() == 1) else g.transpose(0, 1)
            gs = segments(expand_log_decay(g_sbhd, b, h, s, dk).to(acc))
        M, a, G = segment_state(ks, vs, gs, doc)
    pending = None
    if algo == "lasp2" and world_size > 1:
        gathered, pending = post_state_gather(M, a, smap)  # overlaps with the intra-segment work below
    if causal and fla_fn is None:
        o = segment_output(qs, ks, vs, gs, scale, doc)
    # the entering state S_in adds scale * (qs * exp(G)) @ S_in to the tokens before the segment's
    # first document start (entering_term: the decayed rows formed again in the backward, not kept)
    reach = None if sd is None else sd.from_entering.unsqueeze(-1).to(acc)
    if world_size == 1:  # the local segments are the global ones: no exchange
        S_in = local_entering_states(M, a, keep=keep) if causal else M.sum(0, keepdim=True).expand_as(M)
        inter = entering_term(qs, S_in, G, reach, scale)
    elif algo == "lasp2":
        pending.wait()
        inter = entering_term(qs, Lasp2Exchange.apply(M, a, gathered, smap, False, keep), G, reach, scale)
    else:  # LASP-1 computes the inter-segment term inside its chain, as the paper's Algorithm 6
        q_in = entering_rows(qs, G, reach, acc)
        inter = Lasp1Chain.apply(q_in, M, a, scale, smap, keep)
    o = o + inter if causal else inter  # fp32 (fla's o in q's dtype promotes: the same sum as in fp32)
    return segments_to_local(o, sbhd, q.dtype)


def _fla_local(fla_fn, form, q, k, v, g, nseg, b, h, s, dk, dv, L, sbhd, scale, acc, segments, to_bhsd,
               pieces=None):
    """This rank's local work by fla: (o, M, a, G, qs) as the torch path forms them -- o [nseg, b, h,
    L, dv] the zero-start outputs (q's dtype, a view of fla's; adding the fp32 entering term promotes
    them without an fp32 copy) and M [nseg, b, h, dk, dv] the states the segments leave, from fla;
    a [nseg, b, h, 1 or dk] and G [nseg, b, h, L, 1 or dk] (the segments' total and cumulative
    decays; None without decay) in torch, and qs (the queries as segments, a view of q in its
    dtype) for the entering state's term.
    ``pieces`` (documents, :func:`~megatron_burst.linear.fla_adapter.row_pieces`): o and M by fla's
    varlen mode (M keeps the segment's last document); a stays the plain decay, as in the torch
    path (the exchange's ``keep`` applies a document start)."""
    q_rows, k_rows, v_rows = (fla_adapter.to_rows(t, nseg, sbhd) for t in (q, k, v))
    g_rows = fla_adapter.decay_rows(g, form, nseg, b, L, sbhd)
    o_rows, M_rows = fla_adapter.lasp2_segments(fla_fn, form, q_rows, k_rows, v_rows, g, g_rows, scale, pieces)
    o = fla_adapter.rows_to_segments(o_rows, nseg)
    M = M_rows.view(nseg, b, h, dk, dv).to(acc)
    a = G = None
    if g is not None:
        g_sbhd = g if (sbhd or g.dim() == 1) else g.transpose(0, 1)
        a, G = _decays(segments(expand_log_decay(g_sbhd, b, h, s, dk).to(acc)))
    return o, M, a, G, segments(to_bhsd(q))


def _lasp2_runs(q, k, v, g, documents: Documents, pg, rank: int, world_size: int, sbhd: bool, scale: float, acc,
                kernel: str, to_bhsd) -> torch.Tensor:
    """LASP-2 over a data-derived layout (THD, balanced; W > 1): each of this rank's runs is a segment of
    its own length (:mod:`megatron_burst.linear.runs`), computed by the same kernels as the fixed layouts'
    segments, and the exchange scans every run's (M, a) in global order."""
    s, b, h, dk = q.shape if sbhd else (q.shape[1], q.shape[0], q.shape[2], q.shape[3])
    dv = v.shape[-1]
    form = kernel_choice.decay_form(g)
    _, fla_fn = kernel_choice.choose("lasp2", form, q.device, q.dtype, dk, dv, kernel, documents=True)
    runs = rank_runs(documents, world_size)
    smap = run_map(pg, rank, world_size, runs)
    lengths = runs.lengths(rank)
    rd = run_documents(documents, b, runs, rank, q.device)
    lay = run_layout(lengths, CHUNK, b, q.device)
    # runs of one chunk count stack into one batched call (linear.runs.RunLayout: padding tokens are
    # identity steps); per group: its stacked q, decay, document indices and entering documents
    # per group [n, b, h, length, dk]; fp32 for our kernels, q's dtype when only the entering term reads it
    qs = lay.stack(to_bhsd(q).to(acc) if fla_fn is None else to_bhsd(q), 2)
    gs = [None] * len(lay.groups)
    if g is not None:
        g_sbhd = g if (sbhd or g.dim() == 1) else g.transpose(0, 1)
        gs = lay.stack(expand_log_decay(g_sbhd, b, h, s, dk).to(acc), 2)
    docs = [d.unsqueeze(2) for d in lay.stack(rd.doc, 1, replicate=True)]  # [n, b, 1, length]
    enters = [rd.enter.index_select(0, r) for r in lay.rows]  # [n, b, 1]
    if fla_fn is None:
        ks, vs = lay.stack(to_bhsd(k).to(acc), 2), lay.stack(to_bhsd(v).to(acc), 2)
        maps = [segment_state(kg, vg, gg, dg) for kg, vg, gg, dg in zip(ks, vs, gs, docs)]
        M = lay.in_run_order([m[0] for m in maps])
    else:  # fla: every run's zero-start output and the state it leaves, in one varlen call
        pieces = fla_adapter.run_pieces(documents, b, runs.per_rank[rank], q.device)
        flat = [lay.to_flat(t, sbhd) for t in (q, k, v)]
        o_flat, M = fla_adapter.lasp2_segments(fla_fn, form, *flat, g, fla_adapter.decay_flat(
            g, form, lambda t: lay.to_flat(t, sbhd), b * s), scale, pieces)
        M = M.view(len(lengths), b, h, dk, dv).to(acc)
        o_fla = lay.from_flat(o_flat, b, False).permute(0, 2, 1, 3)  # [b, h, s, dv] in q's dtype (the sum promotes)
        maps = [(None,) + _decays(gg) for gg in gs]
    a = None if g is None else lay.in_run_order([m[1] for m in maps])
    gathered, pending = post_state_gather(M, a, smap)  # overlaps with the runs' own outputs
    own = None
    if fla_fn is None:
        own = [segment_output(qg, kg, vg, gg, scale, dg) for qg, kg, vg, gg, dg in zip(qs, ks, vs, gs, docs)]
    pending.wait()
    S_in = Lasp2Exchange.apply(M, a, gathered, smap, False, rd.resets)
    terms = []
    for j, (qg, m, dg, eg, rows) in enumerate(zip(qs, maps, docs, enters, lay.rows)):
        reach = (dg == eg.unsqueeze(-1)).unsqueeze(-1).to(acc)  # the entering document's tokens
        term = entering_term(qg, S_in.index_select(0, rows), m[2], reach, scale)
        terms.append(term if own is None else own[j] + term)
    o = lay.unstack(terms, 2)  # [b, h, s, dv]
    if fla_fn is not None:
        o = o_fla + o
    out = o.permute(2, 0, 1, 3) if sbhd else o.permute(0, 2, 1, 3)
    return out.to(q.dtype, memory_format=torch.contiguous_format)  # rounded and laid out in one pass


def _decays(g: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(a, G) of a segment's log-decay g [..., L, dkg]: its total decay and the cumulative one (None, None
    without decay), as :func:`~megatron_burst.linear.chunked.segment_state` forms them."""
    if g is None:
        return None, None
    G = torch.cumsum(g, dim=-2)
    return torch.exp(G[..., -1, :]), G
