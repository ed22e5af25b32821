"""The gated delta rule (Gated DeltaNet) under context parallelism: one all-gather of per-segment
affine maps.

    out = megatron_burst.gated_delta_rule(q, k, v, g, beta, group=cp_group, layout="zigzag")

One token is an affine map of the state S [dk, dv]:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,

so a run of tokens is one too: S_out = A S_in + B with A [dk, dk], B [dk, dv]. Each rank computes
(A, B) of its segments from a zero start (chunked, below), all-gathers them (sizes independent of
the sequence length), composes the prefix to get the state entering each of its segments
(:class:`~megatron_burst.linear.exchange.Lasp2Exchange` with ``matrix=True``: LASP-2's scan with a
matrix in place of the diagonal decay), and adds that state's contribution to its outputs.

Chunked form (one chunk of C tokens entering with state S_0; G = cumulative g from the chunk
start; Gam[t, j] = exp(G_t - G_j) for j <= t, else 0). Unrolling the recurrence,
S_t = exp(G_t) S_0 + sum_{j<=t} Gam[t, j] k_j u_j^T, and u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
becomes the unit lower-triangular system

    (I + Lo) U = beta*V - (beta*exp(G)*K) S_0,   Lo[t, j] = beta_t Gam[t, j] k_t.k_j  (j < t),

so U = U0 - W S_0 with U0 = (I + Lo)^-1 (beta*V), W = (I + Lo)^-1 (beta*exp(G)*K) (one
triangular solve: the WY/UT form). Then, with Kt_j = exp(G_C - G_j) k_j and QK = (Q K^T) * Gam:

    O   = scale * (Qin S_0 + QK U0),   Qin = exp(G)*Q - QK W
    S_C = Ac S_0 + Bc,                 Ac = exp(G_C) I - Kt^T W,  Bc = Kt^T U0

Chunks compose along the segment (P_c = A_{c-1} ... A_0, S0_c the zero-start state entering chunk
c): the segment's (A, B) = (P_n, S0_n), its zero-start output Qin S0_c + QK U0, and q_in = Qin P_c
so that the entering state adds scale * q_in S_in. Every exponent is <= 0; everything is fp32 and
differentiable by autograd (exact gradients for q, k, v, g and beta).

Documents: a document's first token t sees a zero state, i.e. its factor exp(g_t) becomes 0. The
derivation above holds with every decay product replaced by the masked one: Gam[t, j] also needs
t and j in one document, exp(G_t) (the chunk-start decay) needs t before the chunk's first
document start, exp(G_C - G_j) needs j in the chunk's last document, and exp(G_C) is zero when a
document starts in the chunk. Such a chunk's Ac is exactly zero: Kt is nonzero only on the
chunk's last document, whose rows of W are zero (the masked system does not couple documents,
and that document's right-hand side beta*exp(G)*K is masked to zero). So a segment where a
document starts has A = 0: the all-gathered maps carry the resets, with no extra data.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_burst.masks.documents import CuSeqlens, Documents
from megatron_burst.linear.checks import check_qkv, segment_order, segments_per_rank
from megatron_burst.linear.chunked import CHUNK, affine_prefix, entering_term, segments_to_local
from megatron_burst.linear import fla_adapter, kernel_choice
from megatron_burst.linear.docs import check_documents, segment_documents, unplaced
from megatron_burst.linear.exchange import Lasp2Exchange, Resets, SegmentMap, local_entering_states, post_state_gather
from megatron_burst.linear.runs import RUN_LAYOUTS, rank_runs, run_documents, run_layout, run_map

__all__ = ["gated_delta_rule", "delta_segment_maps", "delta_segment_outputs", "GDN_KERNELS"]

GDN_KERNELS = ("auto", "torch", "fla")


def fla_chunk_gated_delta_rule():
    """flash-linear-attention's Triton ``chunk_gated_delta_rule`` (q, k, v [N, T, H, d], g, beta
    [N, T, H], initial_state [N, H, dk, dv]), or None when fla is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


class DeltaChunks(NamedTuple):
    """Per-chunk pieces of one rank's segments ([nseg, b, h, n_chunks, ...]); see the module docstring."""

    qin: torch.Tensor  # [.., n, C, dk]
    qk: torch.Tensor  # [.., n, C, C]
    u0: torch.Tensor  # [.., n, C, dv]
    P: torch.Tensor  # [.., n, dk, dk] map from the segment start to each chunk start
    S0: torch.Tensor  # [.., n, dk, dv] zero-start state entering each chunk
    length: int  # the segment length before padding to whole chunks


def delta_segment_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, doc: Optional[torch.Tensor] = None, enter: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, DeltaChunks]:
    """(A, B, chunks) of each segment: S_out = A S_in + B. q, k [..., L, dk], v [..., L, dv],
    g, beta [..., L] (fp32) -> A [..., dk, dk], B [..., dk, dv] and the chunks' pieces the outputs
    need (:func:`delta_segment_outputs`). Documents: ``doc`` [..., L] each token's
    document and ``enter`` [...] the document of the token before the segment (broadcastable
    over the heads; see :mod:`megatron_burst.linear.docs`)."""
    L, dk, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    pad = (-L) % CHUNK  # padded tokens (k = v = g = beta = 0) are identity maps at the end
    n = (L + pad) // CHUNK
    chunked = lambda t: t.reshape(t.shape[:-2] + (n, CHUNK, t.shape[-1]))  # noqa: E731
    k, v = (chunked(F.pad(t, (0, 0, 0, pad))) for t in (k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    g, beta = (t.reshape(t.shape[:-1] + (n, CHUNK)) for t in (g, beta))
    G = torch.cumsum(g, dim=-1)
    ones = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device)
    incl, strict = ones.tril(), ones.tril(-1)
    last = G[..., -1:]  # [.., n, 1]
    start_decay, end_decay, through = torch.exp(G), torch.exp(last - G), torch.exp(last)
    if doc is not None:  # the masked decay products of the module docstring
        d = torch.cat([doc, doc[..., -1:].expand(doc.shape[:-1] + (pad,))], dim=-1) if pad else doc
        d = d.reshape(d.shape[:-1] + (n, CHUNK))  # padded tokens stay in the last document
        prev = torch.cat([enter.unsqueeze(-1), d[..., :-1, -1]], dim=-1)  # [.., n]: the document entering each chunk
        same = d.unsqueeze(-1) == d.unsqueeze(-2)
        incl, strict = incl & same, strict & same
        from_start = (d == prev.unsqueeze(-1)).to(k.dtype)
        start_decay = start_decay * from_start
        end_decay = end_decay * (d == d[..., -1:]).to(k.dtype)
        through = through * from_start[..., -1:]
    gam = torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~incl, float("-inf")))  # [.., C(t), C(j)]
    kk = k @ k.transpose(-1, -2)
    lower = (beta.unsqueeze(-1) * kk * gam).masked_fill(~strict, 0.0)
    eye_c = torch.eye(CHUNK, dtype=k.dtype, device=k.device)
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * start_decay).unsqueeze(-1) * k], dim=-1)
    sol = torch.linalg.solve_triangular(eye_c + lower, rhs, upper=False, unitriangular=True)
    u0, w = sol[..., :dv], sol[..., dv:]
    kt = end_decay.unsqueeze(-1) * k
    eye_k = torch.eye(dk, dtype=k.dtype, device=k.device)
    a_chunk = through.unsqueeze(-1) * eye_k - kt.transpose(-1, -2) @ w  # [.., n, dk, dk]
    b_chunk = kt.transpose(-1, -2) @ u0  # [.., n, dk, dv]
    A_upto, B_upto = affine_prefix(a_chunk, b_chunk, matrix=True)  # through each chunk; entering it: shifted by one
    P = torch.cat([eye_k.expand(k.shape[:-3] + (1, dk, dk)), A_upto[..., :-1, :, :]], dim=-3)
    S0 = torch.cat([k.new_zeros(k.shape[:-3] + (1, dk, dv)), B_upto[..., :-1, :, :]], dim=-3)
    q = chunked(F.pad(q, (0, 0, 0, pad)))
    qk = (q @ k.transpose(-1, -2)) * gam
    qin = start_decay.unsqueeze(-1) * q - qk @ w
    return A_upto[..., -1, :, :], B_upto[..., -1, :, :], DeltaChunks(qin, qk, u0, P, S0, L)


def delta_segment_outputs(chunks: DeltaChunks, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o0, q_in) of each segment: the output from a zero entering state [..., L, dv] and the rows
    q_in [..., L, dk] with which the entering state S_in adds scale * q_in @ S_in."""
    o0 = scale * (chunks.qin @ chunks.S0 + chunks.qk @ chunks.u0)
    q_in = chunks.qin @ chunks.P

    def unchunk(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(t.shape[:-3] + (t.shape[-3] * t.shape[-2], t.shape[-1]))
        return t[..., :chunks.length, :]

    return unchunk(o0), unchunk(q_in)


def _choose_kernel(kernel: str, q: torch.Tensor, dv: int, documents: bool):
    """fla's kernel for the outputs, or None for the plain-torch chunked kernel (the decision and
    its self-check: :func:`megatron_burst.linear.kernel_choice.choose`, op "gdn")."""
    if kernel not in GDN_KERNELS:
        raise ValueError(f"unknown gated delta rule kernel {kernel!r}: choose one of {', '.join(GDN_KERNELS)}")
    # the hook is looked up at call time (module attribute), so tests can stand a fake in for fla
    _, fla = kernel_choice.choose("gdn", "token", q.device, q.dtype, q.shape[-1], dv, kernel, documents=documents,
                                  load=lambda: fla_chunk_gated_delta_rule(), gdn_torch_terms=torch_segment_terms)
    return fla


def torch_segment_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float, doc: Optional[torch.Tensor] = None, enter: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our chunked path's (o0, o_in, A, B) of segments (what fla's kernel is self-checked against,
    :func:`megatron_burst.linear.fla_adapter.gdn_terms`): q, k [..., L, dk], v [..., L, dv],
    g, beta [..., L] -> o0 [..., L, dv], o_in [..., L, dk], A [..., dk, dk], B [..., dk, dv]; an
    entering state S_in gives the outputs o0 + o_in @ S_in and leaves A S_in + B. ``doc`` [..., L]
    / ``enter`` [...] (broadcastable over the heads): documents, as :func:`delta_segment_maps`
    takes them."""
    A, B, chunks = delta_segment_maps(q, k, v, g, beta, doc, enter)
    o0, q_in = delta_segment_outputs(chunks, scale)
    return o0, scale * q_in, A, B


def _validate(q, k, v, g, beta, *, world_size, layout, stripe, qkv_format, cu_seqlens=None) -> Optional[Documents]:
    """Raise ValueError for any input gated_delta_rule cannot take; returns the validated
    documents (None without). Local checks only."""
    s, b, h, dk = check_qkv(q, k, v, world_size=world_size, layout=layout, stripe=stripe, qkv_format=qkv_format)
    want = (s, b, h) if qkv_format == "sbhd" else (b, s, h)
    for name, t in (("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor of shape {want} (per token and head), got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{name} {tuple(t.shape)} must be {want} (per token and head) for q {tuple(q.shape)} "
                             f"({qkv_format})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if layout in RUN_LAYOUTS and cu_seqlens is None:
        raise ValueError(f"layout={layout!r} places tokens by the batch's documents: pass them as cu_seqlens "
                         "(boundaries, or the Documents the batch was sliced with)")
    return None if cu_seqlens is None else check_documents(cu_seqlens, s * world_size, b, layout, world_size)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous", stripe: int = 1,
                     scale: Optional[float] = None, qkv_format: str = "sbhd", kernel: str = "auto",
                     cu_seqlens: "Optional[CuSeqlens | Documents]" = None) -> torch.Tensor:
    """Context-parallel gated delta rule; exact, differentiable in q, k, v, g and beta.

    q, k [s, b, h, dk], v [s, b, h, dv], g (log-decay <= 0) and beta (in (0, 1)) [s, b, h] hold this
    rank's s tokens in ``layout``'s order (``qkv_format="bshd"``: [b, s, ...]). Returns o [s, b, h, dv]
    in q's dtype, over the global token order with S [dk, dv], S_0 = 0:
    S <- exp(g_t) S; u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = scale * S^T q_t.
    q and k are used as given (Gated DeltaNet l2-normalizes them first). ``scale`` None: dk ** -0.5.
    States and maps are held in fp32 whatever the input dtype (the fla path computes them in fla's
    kernels from the input dtype, accumulating in fp32).

    Communication: one all-gather of every segment's (A [dk, dk], B [dk, dv]) forward (the torch
    path posts it before forming the local outputs; fla's one call forms both first), and one
    all-gather of the entering-state gradients [dk, dv] backward; ``comm_counter`` counts (W - 1) x
    this rank's part, independent of s for the contiguous and zigzag layouts. Layouts: contiguous,
    zigzag, block-striped with stripe >= 64, and the data-derived "thd" and "balanced" (need
    ``cu_seqlens``; a rank's runs of consecutive positions are its segments, one map each:
    :mod:`megatron_burst.linear.runs`).

    ``kernel``: "torch" (the chunked kernel above, everywhere), "fla" (flash-linear-attention's
    Triton kernel forms the zero-start outputs, the rows the entering state multiplies and every
    segment's map (A, B) in one call per layer, :func:`~megatron_burst.linear.fla_adapter.gdn_terms`;
    its backward gives their gradients; the exchange and the entering state's term stay ours),
    "auto" (fla on CUDA when installed, after a self-check against the torch path; torch on CPU;
    on CUDA without fla a one-time SlowKernelWarning). See
    :mod:`megatron_burst.linear.kernel_choice` (environment overrides, what is loud).

    ``cu_seqlens``: packed documents, as :func:`megatron_burst.cp_attention` takes them (global
    boundaries [0, ..., S], S = s x CP size, the same on every rank; one per sample in a list; or
    a validated :class:`~megatron_burst.masks.documents.Documents`): the state starts again from zero at
    every document's first token, across rank boundaries, in every layout; the bytes sent are
    unchanged. fla's kernel takes documents too: each rank's segments cut at the document starts
    run as its varlen sequences (``cu_seqlens``), a segment's map starting at its first piece only
    when no document starts at the segment's first token.
    """
    pg = group
    world_size = dist.get_world_size(pg) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(pg) if world_size > 1 else 0
    documents = _validate(q, k, v, g, beta, world_size=world_size, layout=layout, stripe=stripe,
                          qkv_format=qkv_format, cu_seqlens=cu_seqlens)
    fla = _choose_kernel(kernel, q, v.shape[-1], documents is not None)
    sbhd = qkv_format == "sbhd"
    s, b, h, dk = q.shape if sbhd else (q.shape[1], q.shape[0], q.shape[2], q.shape[3])
    scale = dk ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    if layout in RUN_LAYOUTS:
        if world_size > 1:
            return _gdn_runs(fla, q, k, v, g, beta, documents, pg, rank, world_size, sbhd, scale, acc)
        layout, documents = "contiguous", unplaced(documents)  # one rank holds the sequence in order
    if fla is not None and world_size == 1:  # one fla call, no maps
        return fla_adapter.one_rank(lambda rows, pieces: fla_adapter.gdn_rows(fla, *rows, scale, pieces),
                                    (q, k, v, g, beta), documents, sbhd)
    per_rank = segments_per_rank(layout, s, stripe)
    L = s // per_rank

    def segments(t: torch.Tensor) -> torch.Tensor:  # sbhd/bshd -> [nseg, b, h, L, d] ([nseg, b, h, L] for g, beta)
        t = t.unsqueeze(-1) if t.dim() == 3 else t
        t = t.permute(1, 2, 0, 3) if sbhd else t.permute(0, 2, 1, 3)
        return t.reshape(b, h, per_rank, L, t.shape[-1]).permute(2, 0, 1, 3, 4).to(acc)

    smap = SegmentMap(pg, rank, world_size, tuple(segment_order(layout, world_size, r, per_rank)
                                                   for r in range(world_size)), True)
    # fla runs documents as pieces (rows cut at document starts, fla_adapter.row_pieces)
    pieces = None if fla is None else fla_adapter.row_pieces(documents, b, smap.order[rank], smap.total, q.device)
    sd = segment_documents(documents, b, smap.order[rank], smap.total, q.device)
    doc, enter, resets = (None, None, None) if sd is None else (sd.doc, sd.enter, sd.resets)
    if fla is not None:  # outputs and maps (A = 0 where a document starts) by one fla call
        return _fla_outputs(fla, q, k, v, g, beta, per_rank, smap, sbhd, scale, pieces, resets)
    ks, vs = (segments(t) for t in (k, v))
    gs, bs = (segments(t)[..., 0] for t in (g, beta))
    A, B, chunks = delta_segment_maps(segments(q), ks, vs, gs, bs, doc, enter)
    pending = None
    if world_size > 1:  # overlaps with the local outputs below
        gathered, pending = post_state_gather(B, A, smap, label="gdn (A, B) all-gather")
    o, q_in = delta_segment_outputs(chunks, scale)
    if world_size > 1:
        pending.wait()
        o = o + scale * (q_in @ Lasp2Exchange.apply(B, A, gathered, smap, True, resets))
    elif per_rank > 1:  # the local segments are the global ones: no exchange
        o = o + scale * (q_in @ local_entering_states(B, A, matrix=True, keep=resets))
    return segments_to_local(o, sbhd, q.dtype)


def _fla_outputs(fla, q, k, v, g, beta, nseg: int, smap: SegmentMap, sbhd: bool, scale: float,
                 pieces: Optional[fla_adapter.RowPieces] = None, resets: Optional[Resets] = None) -> torch.Tensor:
    """The fixed layouts by fla at W > 1 (``nseg`` local segments): each segment a
    batch row; one call gives every row's zero-start outputs, its map (A, B) and the rows o_in
    (:func:`fla_adapter.gdn_terms`; with ``pieces``, documents: the rows cut into varlen pieces);
    the exchange gives each row's entering state S_in, which adds o_in @ S_in."""
    def rows(t: torch.Tensor) -> torch.Tensor:  # sbhd/bshd -> [nseg * b, L, h, ...] (segment-major rows)
        return fla_adapter.to_rows(t, nseg, sbhd)

    terms = fla_adapter.gdn_terms(fla, rows(q), rows(k), rows(v), rows(g), rows(beta), scale, pieces)
    N, h, dk, dv = terms.B.shape
    A, B = terms.A.reshape(nseg, N // nseg, h, dk, dk), terms.B.reshape(nseg, N // nseg, h, dk, dv)
    gathered, pending = post_state_gather(B, A, smap, label="gdn (A, B) all-gather")
    pending.wait()
    S_in = Lasp2Exchange.apply(B, A, gathered, smap, True, resets)
    o = fla_adapter.add_entering(terms, S_in.reshape(N, h, dk, dv))
    return fla_adapter.rows_to_local(o, nseg, sbhd).to(q.dtype, memory_format=torch.contiguous_format)


def _gdn_runs(fla, q, k, v, g, beta, documents: Documents, pg, rank: int, world_size: int, sbhd: bool,
              scale: float, acc) -> torch.Tensor:
    """The gated delta rule over a data-derived layout (THD, balanced; W > 1): each of this rank's runs is
    a segment of its own length (:mod:`megatron_burst.linear.runs`) with its own map (A, B); the exchange
    composes every run's map in global order; outputs and maps by our chunked kernel or by one fla
    call (the runs as its varlen rows, :func:`fla_adapter.gdn_terms`), the entering states added after."""
    b = q.shape[1] if sbhd else q.shape[0]
    runs = rank_runs(documents, world_size)
    smap = run_map(pg, rank, world_size, runs)
    lengths = runs.lengths(rank)
    rd = run_documents(documents, b, runs, rank, q.device)
    lay = run_layout(lengths, CHUNK, b, q.device)  # runs of one chunk count: one batched call
    bhsd = (lambda t: t.permute(1, 2, 0, 3)) if sbhd else (lambda t: t.permute(0, 2, 1, 3))  # noqa: E731
    if fla is not None:  # every run a varlen row (pieces: cut at document starts): one call for all
        pieces = fla_adapter.run_pieces(documents, b, runs.per_rank[rank], q.device)
        terms = fla_adapter.gdn_terms(fla, *(lay.to_flat(t, sbhd) for t in (q, k, v, g, beta)), scale, pieces)
        _, h, dk, dv = terms.B.shape
        A, B = terms.A.reshape(-1, b, h, dk, dk), terms.B.reshape(-1, b, h, dk, dv)
    else:
        stacked = lambda t: lay.stack(bhsd(t.unsqueeze(-1) if t.dim() == 3 else t).to(acc), 2)  # noqa: E731
        ks, vs = stacked(k), stacked(v)
        gs, bs = ([x[..., 0] for x in stacked(t)] for t in (g, beta))
        docs = lay.stack(rd.doc, 1, replicate=True)  # [n, b, length]; broadcast over the heads below
        maps = [delta_segment_maps(qg, kg, vg, gg, bg, dg.unsqueeze(2), rd.enter.index_select(0, rows))
                for qg, kg, vg, gg, bg, dg, rows in zip(stacked(q), ks, vs, gs, bs, docs, lay.rows)]
        A, B = (lay.in_run_order([m[j] for m in maps]) for j in (0, 1))
    gathered, pending = post_state_gather(B, A, smap, label="gdn (A, B) all-gather")
    pending.wait()
    # [nseg, b, h, dk, dv]; A = 0 where a run resets already: the flags cut the scan into short chains
    S_in = Lasp2Exchange.apply(B, A, gathered, smap, True, rd.resets)
    if fla is not None:  # o0 + o_in @ S_in, the runs' rows stacked by chunk count for the product
        o_in = lay.stack(bhsd(lay.from_flat(terms.o_in, b, sbhd)), 2)  # gathered copies, in o_in's dtype
        o = bhsd(lay.from_flat(terms.o0, b, sbhd)) + lay.unstack(  # fp32: the fp32 terms promote o0
            [entering_term(x, S_in.index_select(0, rows)) for x, rows in zip(o_in, lay.rows)], 2)
    else:
        outs = []
        for (_, _, ch), rows in zip(maps, lay.rows):
            o0, q_in = delta_segment_outputs(ch, scale)
            outs.append(o0 + scale * (q_in @ S_in.index_select(0, rows)))
        o = lay.unstack(outs, 2)  # [b, h, s, dv]
    out = o.permute(2, 0, 1, 3) if sbhd else o.permute(0, 2, 1, 3)
    return out.to(q.dtype, memory_format=torch.contiguous_format)  # rounded and laid out in one pass
