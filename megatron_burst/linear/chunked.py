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
"""
from __future__ import annotations

from typing import Optional

import torch

CHUNK = 64


def _cumulative(g: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(g, dim=-2)


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal scores inside one chunk: A[t, j] = sum_c q_tc k_jc exp(G_tc - G_jc) for j <= t, else 0.

    q, k [..., C, dk]; G [..., C, dkg] cumulative log-decay from the chunk start, or None.
    """
    C = q.shape[-2]
    visible = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if G is None:
        return (q @ k.transpose(-1, -2)).masked_fill(~visible, 0.0)
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., t, j, dkg] = G_t - G_j
    diff = diff.masked_fill(~visible[..., None], float("-inf"))  # exp -> 0 above the diagonal
    if G.shape[-1] == 1:  # one decay per token: a [C, C] weight on the plain scores
        return (q @ k.transpose(-1, -2)) * torch.exp(diff[..., 0])
    return torch.einsum("...tc,...jc,...tjc->...tj", q, k, torch.exp(diff))


def segment_state(k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor]
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(M, a, G) of each segment: the state it leaves from a zero start, its total decay, and the
    cumulative log-decay from its start. k [..., L, dk], v [..., L, dv], g [..., L, dkg] or None;
    M [..., dk, dv], a [..., dkg], G [..., L, dkg] (None without decay)."""
    if g is None:
        return k.transpose(-1, -2) @ v, None, None
    G = _cumulative(g)
    last = G[..., -1:, :]
    return (k * torch.exp(last - G)).transpose(-1, -2) @ v, torch.exp(last[..., 0, :]), G


def segment_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                   scale: float) -> torch.Tensor:
    """Each segment's output from a zero entering state (causal), walked in chunks of CHUNK tokens.
    q, k [..., L, dk], v [..., L, dv], g [..., L, dkg] or None -> [..., L, dv]."""
    state = torch.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    # split, not a slice per chunk: a slice's backward writes a zero-filled full-length gradient per
    # chunk (quadratic in L); split's backward concatenates the chunk gradients once
    chunks = [t.split(CHUNK, dim=-2) for t in (q, k, v)]
    g_chunks = g.split(CHUNK, dim=-2) if g is not None else [None] * len(chunks[0])
    outs = []
    for i, (qc, kc, vc, gc) in enumerate(zip(*chunks, g_chunks)):
        last_chunk = i == len(g_chunks) - 1
        if gc is None:
            outs.append(scale * (qc @ state + _intra_chunk(qc, kc, None) @ vc))
            if not last_chunk:
                state = state + kc.transpose(-1, -2) @ vc
            continue
        G = _cumulative(gc)
        outs.append(scale * ((qc * torch.exp(G)) @ state + _intra_chunk(qc, kc, G) @ vc))
        if not last_chunk:
            last = G[..., -1:, :]  # [..., 1, dkg]
            state = torch.exp(last).transpose(-1, -2) * state + (kc * torch.exp(last - G)).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=-2)
