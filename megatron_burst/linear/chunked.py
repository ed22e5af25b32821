"""One rank's share of (decayed) linear attention, computed in chunks, differentiable by autograd.

A rank holds its tokens as *segments*: runs of consecutive global positions (one for the contiguous
layout, two for zigzag, one per stripe for block-striped). For every segment this module computes,
from the segment's q, k, v and log-decay g alone:

* :func:`segment_state`: ``M``, the state the segment leaves from a zero start,
  sum_j diag(exp(G_last - G_j)) k_j^T v_j, and ``a``, its total decay exp(G_last) (G = cumulative g
  from the segment start) -- what LASP exchanges;
* :func:`segment_output`: the output as if the state entering the segment were zero, walked in
  chunks of ``CHUNK`` tokens with the state carried from chunk to chunk. The entering state S_in
  then adds scale * (q_t * exp(G_t)) S_in.

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
    """Each segment's output from a zero entering state (causal), walked in chunks of CHUNK tokens.
    q, k [..., L, dk], v [..., L, dv], g [..., L, dkg] or None -> [..., L, dv]. ``doc`` [..., L]:
    each token's document (broadcastable; None: one document)."""
    state = torch.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    # split, not a slice per chunk: a slice's backward writes a zero-filled full-length gradient per
    # chunk (quadratic in L); split's backward concatenates the chunk gradients once
    chunks = [t.split(CHUNK, dim=-2) for t in (q, k, v)]
    n = len(chunks[0])
    g_chunks = g.split(CHUNK, dim=-2) if g is not None else [None] * n
    doc_chunks = doc.split(CHUNK, dim=-1) if doc is not None else [None] * n
    outs = []
    prev = None  # [..., 1]: the document of the state carried into the chunk (its previous token's)
    for i, (qc, kc, vc, gc, dc) in enumerate(zip(*chunks, g_chunks, doc_chunks)):
        last_chunk = i == n - 1
        same = from_state = in_last = carry = None
        if dc is not None:
            same = dc.unsqueeze(-1) == dc.unsqueeze(-2)  # [..., C, C]
            if prev is not None:  # (the first chunk's state is zero)
                from_state = (dc == prev).unsqueeze(-1).to(q.dtype)  # [..., C, 1]
                carry = (dc[..., -1:] == prev).unsqueeze(-1).to(q.dtype)  # [..., 1, 1]: no start in the chunk
            in_last = (dc == dc[..., -1:]).unsqueeze(-1).to(q.dtype)  # [..., C, 1]
            prev = dc[..., -1:]
        G = None if gc is None else _cumulative(gc)
        q_state = qc if G is None else qc * torch.exp(G)
        if from_state is not None:
            q_state = q_state * from_state
        outs.append(scale * (q_state @ state + _intra_chunk(qc, kc, G, same) @ vc))
        if last_chunk:
            break
        if G is None:
            k_end = kc if in_last is None else kc * in_last
            state = (state if carry is None else carry * state) + k_end.transpose(-1, -2) @ vc
            continue
        last = G[..., -1:, :]  # [..., 1, dkg]
        decay = torch.exp(last).transpose(-1, -2)  # [..., dkg, 1]
        k_end = kc * torch.exp(last - G)
        if carry is not None:
            decay = decay * carry
        if in_last is not None:
            k_end = k_end * in_last
        state = decay * state + k_end.transpose(-1, -2) @ vc
    return torch.cat(outs, dim=-2)
