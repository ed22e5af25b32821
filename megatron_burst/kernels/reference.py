"""Naive attention: materializes the full score matrix in fp32. Obviously correct; tests compare to it.

All kernels share one interface on tensors laid out [b, h, s, d] (q has hq heads, k/v hkv heads,
hq % hkv == 0):

  forward(q, k, v, kind, block, scale) -> (out [b, hq, sq, d], lse [b, hq, sq]), fp32 (fp64 for fp64
                                          inputs): unrounded, so CP merges do not add roundings
  backward(dout, q, k, v, D, lse, kind, block, scale) -> (dq, dk, dv)   (fp32 or input dtype)

``kind`` is "full", "causal" (row i sees column j iff i >= j), "block_causal" (iff
i // block >= j // block) or "positions" (iff kv_pos[j] <= q_pos[i] and q_doc[i] == kv_doc[j]; the
keyword argument ``positions=(q_pos, kv_pos, q_doc, kv_doc, band)`` gives global positions and document
ids (and the band (left, right) of a sliding window: q_pos - left <= kv_pos <= q_pos + right), LongTensors [sq] / [sk], either pair possibly None; a row that sees nothing gets out 0 and lse
-inf: see megatron_burst.masks.block.BlockMask and megatron_burst.masks.documents). D = rowsum(dout * out) is passed in, not recomputed: a rank that received
a remote Q block never has the remote output.
"""
from __future__ import annotations

import torch

from megatron_burst.masks.block import positions_visibility


def visibility(kind: str, block: int, sq: int, sk: int, device: torch.device,
               positions: tuple | None = None) -> torch.Tensor | None:
    """Boolean [sq, sk] visible-mask for ``kind``, or None for "full"."""
    if kind == "full":
        return None
    if kind == "positions":
        return positions_visibility(*positions, sq, sk, device)
    rows = torch.arange(sq, device=device)[:, None]
    cols = torch.arange(sk, device=device)[None, :]
    if kind == "causal":
        return rows >= cols
    if kind == "block_causal":
        return rows // block >= cols // block
    raise ValueError(f"unknown mask kind {kind!r}")


def expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Repeat kv heads [b, hkv, s, d] to [b, hq, s, d] (local compute only; never before sending)."""
    g = hq // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def reduce_kv(dx: torch.Tensor, hkv: int) -> torch.Tensor:
    """Sum gradients of repeated kv heads [b, hq, s, d] back to [b, hkv, s, d]."""
    b, hq, s, d = dx.shape
    g = hq // hkv
    return dx if g == 1 else dx.view(b, hkv, g, s, d).sum(2)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Compute in fp32, or fp64 when given fp64 (the exactness tests use it)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, kind, block, scale, positions=None):
    s = torch.einsum("bhqd,bhkd->bhqk", _acc(q), _acc(expand_kv(k, q.shape[1]))) * scale
    vis = visibility(kind, block, q.shape[2], k.shape[2], q.device, positions)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that sees nothing) replaced by 0, so exp(s - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def forward(q, k, v, kind="full", block=1, scale=1.0, positions=None):
    s = _scores(q, k, kind, block, scale, positions)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - finite_lse(lse)[..., None])
    out = torch.einsum("bhqk,bhkd->bhqd", p, _acc(expand_kv(v, q.shape[1])))
    return out, lse


def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, positions=None):
    hkv = k.shape[1]
    s = _scores(q, k, kind, block, scale, positions)
    p = torch.exp(s - finite_lse(_acc(lse))[..., None])
    do = _acc(dout)
    ve = _acc(expand_kv(v, q.shape[1]))
    dv = torch.einsum("bhqk,bhqd->bhkd", p, do)
    dp = torch.einsum("bhqd,bhkd->bhqk", do, ve)
    ds = p * (dp - _acc(D)[..., None])
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, _acc(expand_kv(k, q.shape[1]))) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, _acc(q)) * scale
    return dq, reduce_kv(dk, hkv), reduce_kv(dv, hkv)
