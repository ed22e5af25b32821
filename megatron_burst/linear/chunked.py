"""One rank's share of (decayed) linear attention, computed in chunks, differentiable by autograd.

A rank holds its tokens as *segments*: runs of consecutive global positions (one for the contiguous
layout, two for zigzag, one per stripe for block-striped). For every segment this module computes,
from the segment's q, k, v and log-decay g alone:

* :func:`segment_state`: ``M``, the state the segment leaves from a zero start,
  sum_j diag(exp(G_last - G_j)) k_j^T v_j, and ``a``, its total decay exp(G_last) (G = cumulative g
  from the segment start) -- what LASP exchanges;
* :func:`segment_output`: the output as if the state entering the segment were zero, in chunks of
  ``CHUNK`` tokens: each chunk's own scores, plus the state entering it (the chunks' states
  composed by :func:`affine_prefix`). The entering state S_in then adds scale * (q_t * exp(G_t)) S_in.

Every exponent is a difference G_t - G_j with t >= j (or G_t itself), so it is <= 0: no overflow
for any decay strength. States and sums are fp32 (fp64 for fp64 inputs).

Documents (``doc``: each token's document index, :mod:`megatron_burst.linear.docs`): the state
starts again from zero at each document's first token. Every weight exp(G_t - G_j) then also needs
j and t in one document, the state carried between chunks keeps only the tokens of the chunk's
last document (and passes through a chunk only when no document starts in it), and the state
entering a chunk reaches only the tokens before the chunk's first document start. G stays the
plain cumulative decay: the masks, not -inf log-decays, cut the sums.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

CHUNK = 64


def _cumulative(g: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(g, dim=-2)


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G: Optional[torch.Tensor],
                 same: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal scores inside one chunk: A[t, j] = sum_c q_tc k_jc exp(G_tc - G_jc) for j <= t, else 0.

    q, k [..., C, dk]; G [..., C, dkg] cumulative log-decay from the chunk start, or None;
    ``same`` [..., C, C] (bool, broadcastable): t and j in one document (None: no documents).
    """
    C = q.shape[-2]
    visible = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if same is not None:
        visible = visible & same
    if G is None:
        return (q @ k.transpose(-1, -2)).masked_fill(~visible, 0.0)
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., t, j, dkg] = G_t - G_j
    diff = diff.masked_fill(~visible[..., None], float("-inf"))  # exp -> 0 above the diagonal
    if G.shape[-1] == 1:  # one decay per token: a [C, C] weight on the plain scores
        return (q @ k.transpose(-1, -2)) * torch.exp(diff[..., 0])
    return torch.einsum("...tc,...jc,...tjc->...tj", q, k, torch.exp(diff))


CHANNEL_BLOCK = 16  # chunks whose [C, C, dk] decay weights exist at once (decay per key channel)


def _own_scores_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: Optional[torch.Tensor],
                    same: Optional[torch.Tensor]) -> torch.Tensor:
    """Every chunk's output from its own tokens: q, k [..., n, C, dk], v [..., n, C, dv] -> [..., n, C, dv].
    A decay per key channel weighs each score by a [C, C, dk] tensor: those are built CHANNEL_BLOCK
    chunks at a time, so without autograd (evaluation) the peak does not grow with the length (split,
    not slices: split's backward concatenates the gradients once)."""
    n = q.shape[-3]
    if G is None or G.shape[-1] == 1 or n <= CHANNEL_BLOCK:
        return _intra_chunk(q, k, G, same) @ v
    split = lambda t: t.split(CHANNEL_BLOCK, dim=-3)  # noqa: E731
    parts = zip(split(q), split(k), split(v), split(G), split(same) if same is not None else [None] * n)
    return torch.cat([_intra_chunk(qb, kb, Gb, sb) @ vb for qb, kb, vb, Gb, sb in parts], dim=-3)


def segment_state(k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], doc: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(M, a, G) of each segment: the state it leaves from a zero start, its total decay, and the
    cumulative log-decay from its start. k [..., L, dk], v [..., L, dv], g [..., L, dkg] or None;
    M [..., dk, dv], a [..., dkg], G [..., L, dkg] (None without decay). ``doc`` [..., L]: each
    token's document (broadcastable): M keeps the segment's last document only; ``a`` stays the
    plain decay (a document start inside the segment is applied by the exchange, from the
    documents every rank holds)."""
    if g is None and doc is None:
        return k.transpose(-1, -2) @ v, None, None
    G = weight = a = None
    if g is not None:
        G = _cumulative(g)
        last = G[..., -1:, :]
        weight, a = torch.exp(last - G), torch.exp(last[..., 0, :])
    if doc is not None:
        in_last = (doc == doc[..., -1:]).unsqueeze(-1).to(k.dtype)
        weight = in_last if weight is None else weight * in_last
    return (k * weight).transpose(-1, -2) @ v, a, G


def segment_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                   scale: float, doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each segment's output from a zero entering state (causal), in chunks of CHUNK tokens: every
    chunk's own scores at once, the states entering the chunks by one scan over the chunks.
    q, k [..., L, dk], v [..., L, dv], g [..., L, dkg] or None -> [..., L, dv]. ``doc`` [..., L]:
    each token's document (broadcastable; None: one document)."""
    L = q.shape[-2]
    pad = (-L) % CHUNK  # padding tokens: k = v = 0 and no decay (identity steps), outputs dropped
    n = (L + pad) // CHUNK

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [..., L, x] -> [..., n, C, x]
        t = F.pad(t, (0, 0, 0, pad)) if pad else t
        return t.reshape(t.shape[:-2] + (n, CHUNK, t.shape[-1]))

    qc, kc, vc = chunked(q), chunked(k), chunked(v)
    G = None if g is None else _cumulative(chunked(g))  # [..., n, C, dkg] from each chunk's start
    same = from_state = carry = in_last = None
    if doc is not None:
        d = torch.cat([doc, doc[..., -1:].expand(doc.shape[:-1] + (pad,))], dim=-1) if pad else doc
        d = d.reshape(d.shape[:-1] + (n, CHUNK))  # padding tokens stay in the last document
        same = d.unsqueeze(-1) == d.unsqueeze(-2)  # [..., n, C, C]
        prev = torch.cat([d[..., :1, :1], d[..., :-1, -1:]], dim=-2)  # [..., n, 1]: the document entering
        from_state = (d == prev).unsqueeze(-1).to(q.dtype)  # [..., n, C, 1]  (chunk 0's state is zero)
        carry = (d[..., -1:] == prev).unsqueeze(-1).to(q.dtype)  # [..., n, 1, 1]: no document starts in it
        in_last = (d == d[..., -1:]).unsqueeze(-1).to(q.dtype)  # [..., n, C, 1]
    out = _own_scores_out(qc, kc, vc, G, same)  # [..., n, C, dv]
    if n > 1:
        # the state each chunk leaves from a zero start (its last document's tokens) and its transition
        k_end = kc if G is None else kc * torch.exp(G[..., -1:, :] - G)
        if in_last is not None:
            k_end = k_end * in_last
        M = k_end.transpose(-1, -2) @ vc  # [..., n, dk, dv]
        a = None if G is None else torch.exp(G[..., -1, :]).unsqueeze(-1)  # [..., n, dkg, 1]
        if carry is not None:
            a = carry if a is None else a * carry
        S = affine_prefix(a, M)[1] if a is not None else torch.cumsum(M, dim=-3)  # through each chunk
        q_state = qc[..., 1:, :, :] if G is None else qc[..., 1:, :, :] * torch.exp(G[..., 1:, :, :])
        if from_state is not None:
            q_state = q_state * from_state[..., 1:, :, :]
        out = torch.cat([out[..., :1, :, :], out[..., 1:, :, :] + q_state @ S[..., :-1, :, :]], dim=-3)
    out = scale * out.reshape(out.shape[:-3] + (n * CHUNK, out.shape[-1]))
    return out[..., :L, :] if pad else out


# A chunk's (or segment's) state map is affine, S -> a S + b, with ``a`` a diagonal decay [..., dkg, 1]
# (broadcast over dv; LASP) or a matrix [..., dk, dk] (``matrix``: the delta rule). Applying map i
# then map j is (a_j a_i, a_j b_i + b_j): associative, so the maps' prefixes take log2(n)
# batched steps instead of n dependent ones (n = a segment's chunks: ~2000 for 128K tokens, each
# step a few kernel launches on a GPU).
def _then(a_first, b_first, a_then, b_then, matrix: bool):
    mul = torch.matmul if matrix else torch.mul
    return mul(a_then, a_first), mul(a_then, b_first) + b_then


def affine_prefix(a: torch.Tensor, b: torch.Tensor, matrix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The map through each of n maps: entry i applies maps 0 .. i in order (recursive doubling on
    pairs, 2n compositions in all). a [..., n, x, y], b [..., n, dk, dv] -> the same shapes."""
    n = a.shape[-3]
    if n == 1:
        return a, b
    m = n // 2  # pairs (2j, 2j + 1): the prefix through 2j + 1 is the pairs' prefix j
    odd_a, odd_b = affine_prefix(*_then(a[..., 0:2 * m:2, :, :], b[..., 0:2 * m:2, :, :], a[..., 1:2 * m:2, :, :],
                                        b[..., 1:2 * m:2, :, :], matrix), matrix)
    # through 2j (j >= 1): map 2j after the prefix through 2j - 1
    before = (n + 1) // 2 - 1
    step_a, step_b = _then(odd_a[..., :before, :, :], odd_b[..., :before, :, :], a[..., 2::2, :, :],
                           b[..., 2::2, :, :], matrix)
    even_a, even_b = torch.cat([a[..., :1, :, :], step_a], -3), torch.cat([b[..., :1, :, :], step_b], -3)

    def interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
        both = torch.stack([even[..., :m, :, :], odd], dim=-3)  # [..., m, 2, x, y]
        both = both.reshape(both.shape[:-4] + (2 * m,) + tuple(both.shape[-2:]))
        return torch.cat([both, even[..., m:, :, :]], -3) if n % 2 else both

    return interleave(even_a, odd_a), interleave(even_b, odd_b)


def segments_to_local(o: torch.Tensor, sbhd: bool, dtype: torch.dtype) -> torch.Tensor:
    """A rank's segment outputs o [nseg, b, h, L, dv] (segment i holds local tokens i * L ... (i + 1) * L - 1)
    -> [s, b, h, dv] (``sbhd``) or [b, s, h, dv] in ``dtype``, s = nseg * L: reordered and rounded in one
    copy (rounding is elementwise, so before or after the reorder gives the same values)."""
    nseg, b, h, L, dv = o.shape
    o = o.permute(0, 3, 1, 2, 4) if sbhd else o.permute(1, 0, 3, 2, 4)  # [nseg, L, b, h] / [b, nseg, L, h]
    out = o.to(dtype, memory_format=torch.contiguous_format)
    return out.reshape((nseg * L, b, h, dv) if sbhd else (b, nseg * L, h, dv))


def entering_rows(a: torch.Tensor, G: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                  acc: torch.dtype) -> torch.Tensor:
    """a * exp(G) * mask in ``acc`` (shapes as :func:`entering_term` takes them): the rows the state
    entering a segment multiplies (LASP-1's chain takes them as they are)."""
    rows = a.to(acc)
    if G is not None:
        rows = rows * torch.exp(G.to(acc))
    return rows if mask is None else rows * mask.to(acc)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is all of its storage, else a copy of just its elements (in its dtype): a
    view into a larger tensor (q sliced out of a fused QKV projection, o_in out of the wide output)
    kept for the backward would keep all of that tensor."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


class _EnteringTerm(torch.autograd.Function):
    """scale * ((a * exp(G) * mask) @ S) in fp32 (or wider), keeping for the backward only ``a`` in its
    own dtype (:func:`_compact`), G, the mask and S: the decayed rows are formed again there (an
    elementwise pass) instead of keeping a's fp32 copy, exp(G) and the fp32 rows."""

    @staticmethod
    def forward(ctx, a, S, G, mask, scale):
        acc = torch.promote_types(torch.promote_types(a.dtype, S.dtype), torch.float32)
        ctx.save_for_backward(_compact(a), S, G, mask)
        ctx.acc, ctx.scale = acc, scale
        return scale * (entering_rows(a, G, mask, acc) @ S.to(acc))

    @staticmethod
    def backward(ctx, grad):
        a, S, G, mask = ctx.saved_tensors
        acc = ctx.acc
        grad = ctx.scale * grad.to(acc)
        need_a, need_S, need_G = ctx.needs_input_grad[:3]
        rows = entering_rows(a, G, mask, acc) if (need_S or need_G) else None
        da = dS = dG = None
        if need_S:
            dS = (rows.transpose(-1, -2) @ grad).to(S.dtype)
        if need_a or need_G:
            d_rows = grad @ S.to(acc).transpose(-1, -2)
            if need_a:
                factor = entering_rows(torch.ones((), dtype=acc, device=a.device), G, mask, acc)
                da = (d_rows * factor).to(a.dtype)
            if need_G:  # d rows / dG = rows (per channel), summed where G broadcasts
                dG = (d_rows * rows).sum_to_size(G.shape).to(G.dtype)
        return da, dS, dG, None, None


def entering_term(a: torch.Tensor, S: torch.Tensor, G: Optional[torch.Tensor] = None,
                  mask: Optional[torch.Tensor] = None, scale: float = 1.0) -> torch.Tensor:
    """What the state entering each segment adds to its outputs: scale * ((a * exp(G) * mask) @ S).

    a [..., L, dk] (queries, or the gated delta rule's o_in; any float dtype), S [..., dk, dv] (fp32),
    G [..., L, 1 or dk] (the cumulative log-decay from the segment start; None: no decay), mask
    [..., L, 1] (0 for tokens the entering state does not reach: after a document start; None: all)
    -> [..., L, dv] in fp32 (fp64 for fp64 inputs); differentiable in a, S and G. Kept for the
    backward: ``a`` in its own dtype (itself when it is all of its storage, else a copy of its
    elements), S, G and the mask."""
    return _EnteringTerm.apply(a, S, G, mask, scale)

