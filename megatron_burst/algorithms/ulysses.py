"""Ulysses (DeepSpeed-Ulysses) and USP: all-to-all from sequence-sharded to head-sharded attention.

Ulysses group of U ranks: one all-to-all turns each rank's n tokens x all heads into the group's
U*n tokens x 1/U of the heads (q, k, v in one message); attention over those tokens runs locally;
a second all-to-all returns the output to the sequence sharding. The backward mirrors it: dO goes
to the head sharding, dQ,dK,dV (fp32) come back. The gathered sequence is the group's shards in CP
rank order (layout order, not global order); the visible regions are the layout's per-rank-pair
masks (:meth:`CPConfig.visible` with ``ulysses_size`` = U), so every layout works unpermuted.

USP (blog 004, "2-D" sequence parallelism): with U < W, the head-sharded sequences of the W/U
Ulysses groups are then combined by the ring schedule of ring/burst (algorithms/schedule.py, flat
or double ring over the groups; a ring member's block is a U x U grid of CP-rank blocks). U = W is
Ulysses (a ring of one), U = 1 is the ring.

GQA/MQA: hq must be divisible by U. KV heads split over the group when hkv % U == 0; with fewer KV
heads than U (U % hkv == 0) each is repeated U/hkv times before the all-to-all and the repeats'
gradients are summed after it. Other head counts raise ValueError (use usp with a smaller U).

Bytes per rank (a2a counts what leaves a rank: (U-1)/U of its buffer; hkv' = max(hkv, U) when
repeated, e = input element size; n local tokens):
  forward  (U-1)/U * b*n*d*e * (hq + 2*hkv' [q,k,v] + hq [out])      + ring forward over W/U members
  backward (U-1)/U * b*n*d * (hq*e [dO] + (hq + 2*hkv')*4 [dq,dk,dv]) + ring/burst backward over W/U
where the ring part is ring.py's / burst.py's formula for W/U members of U*n tokens and hq/U,
hkv'/U heads.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from megatron_burst import comm
from megatron_burst.algorithms import burst, ring
from megatron_burst.algorithms.schedule import CPConfig
from megatron_burst.kernels import row_dot
from megatron_burst.kernels.reference import expand_kv, reduce_kv

_BACKWARD = {"ring": ring.ring_backward, "burst": burst.burst_backward}
# link class of the all-to-all's bytes: one class, or per peer (its rank in the Ulysses group)
LinkOf = Union[str, Callable[[int], str]]


def check_heads(hq: int, hkv: int, ulysses_size: int, algo: str = "ulysses") -> None:
    """Raise ValueError unless the heads split over a Ulysses group of ``ulysses_size`` ranks."""
    U = ulysses_size
    if hq % U:
        raise ValueError(f"algo={algo!r}: {hq} query heads are not divisible by the Ulysses group size {U}; "
                         f"use algo='usp' with a ulysses_size dividing {hq} (the rest of the CP group as a ring)")
    if hkv % U and U % hkv:
        raise ValueError(f"algo={algo!r}: {hkv} key/value heads neither split over nor repeat evenly to the "
                         f"Ulysses group size {U}; use algo='usp' with a ulysses_size dividing {hkv}")


def kv_heads_sent(hkv: int, ulysses_size: int) -> int:
    """KV heads after repetition to the group: hkv when it splits over U ranks, else U."""
    return hkv if hkv % ulysses_size == 0 else ulysses_size


def seq_to_heads(tensors: list[torch.Tensor], group, U: int, phase: str, link: LinkOf) -> list[torch.Tensor]:
    """[b, h_i, n, d] per tensor (this rank's tokens, all heads) -> [b, h_i/U, U*n, d] (the group's
    tokens in CP-rank order, this rank's 1/U of the heads). One all-to-all for all tensors."""
    if U == 1:
        return [t.contiguous() for t in tensors]
    b, _, n, d = tensors[0].shape
    parts = [t.reshape(b, U, t.shape[1] // U, n, d).transpose(0, 1) for t in tensors]  # [U, b, h/U, n, d]
    send = torch.cat(parts, dim=2).contiguous()
    recv = torch.empty_like(send)  # [U (source rank), b, sum h/U, n, d]
    comm.all_to_all(recv, send, group, phase, link, label=f"{phase} a2a seq->heads").wait()
    whole = recv.permute(1, 2, 0, 3, 4).reshape(b, send.shape[2], U * n, d)
    return [x.contiguous() for x in whole.split([t.shape[1] // U for t in tensors], dim=1)]


def heads_to_seq(tensors: list[torch.Tensor], group, U: int, phase: str, link: LinkOf) -> list[torch.Tensor]:
    """Inverse of :func:`seq_to_heads`: [b, h_i/U, U*n, d] -> [b, h_i, n, d]."""
    if U == 1:
        return list(tensors)
    b, _, un, d = tensors[0].shape
    n = un // U
    send = torch.cat([t.reshape(b, t.shape[1], U, n, d) for t in tensors], dim=1).permute(2, 0, 1, 3, 4)
    send = send.contiguous()  # [U (destination rank), b, sum h/U, n, d]
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group, phase, link, label=f"{phase} a2a heads->seq").wait()
    out = []
    start = 0
    for t in tensors:
        h = t.shape[1]
        out.append(recv[:, :, start:start + h].permute(1, 0, 2, 3, 4).reshape(b, U * h, n, d))
        start += h
    return out


class UlyssesAttention(torch.autograd.Function):
    """Ulysses exchange around the ring schedule. q/k/v [b, h, n, d] views in the caller's layout.

    ``cfg`` is the ring over Ulysses groups (``cfg.ulysses_size`` = U; a ring of one for plain
    Ulysses). Returns the output [b, hq, n, d] in q's dtype. Saves the head-sharded q, k, v, out,
    lse only (the same size as the local tensors).
    """

    @staticmethod
    def forward(ctx, q, k, v, cfg: CPConfig, group: Optional[dist.ProcessGroup], link: LinkOf,
                backward_algo: str):
        U, hkv = cfg.ulysses_size, k.shape[1]
        sent = kv_heads_sent(hkv, U)
        kx, vx = expand_kv(k, sent), expand_kv(v, sent)
        qs, ks, vs = seq_to_heads([q, kx, vx], group, U, "forward", link)
        acc, lse = ring.kv_ring_forward(qs, ks, vs, cfg)
        out_s = acc.to(q.dtype)
        (out,) = heads_to_seq([out_s], group, U, "forward", link)
        ctx.save_for_backward(qs, ks, vs, out_s, lse)
        ctx.cfg, ctx.group, ctx.link, ctx.backward_algo, ctx.hkv = cfg, group, link, backward_algo, hkv
        return out

    @staticmethod
    def backward(ctx, dout):
        qs, ks, vs, out_s, lse = ctx.saved_tensors
        cfg, U = ctx.cfg, ctx.cfg.ulysses_size
        (dout_s,) = seq_to_heads([dout.to(qs.dtype)], ctx.group, U, "backward", ctx.link)
        D = row_dot(dout_s, out_s)
        dq, dk, dv = _BACKWARD[ctx.backward_algo](dout_s, qs, ks, vs, D, lse, cfg)
        dq, dk, dv = heads_to_seq([dq, dk, dv], ctx.group, U, "backward", ctx.link)
        dk, dv = reduce_kv(dk, ctx.hkv), reduce_kv(dv, ctx.hkv)
        return dq.to(qs.dtype), dk.to(qs.dtype), dv.to(qs.dtype), None, None, None, None


def a2a_forward_bytes(b: int, hq: int, hkv: int, n: int, d: int, elem: int, U: int) -> int:
    """Bytes one rank sends in the forward's two all-to-alls (q,k,v in; out back)."""
    kv = kv_heads_sent(hkv, U)
    return (U - 1) * (b * n * d * elem * (hq + 2 * kv) // U + b * n * d * elem * hq // U)


def a2a_backward_bytes(b: int, hq: int, hkv: int, n: int, d: int, elem: int, U: int) -> int:
    """Bytes one rank sends in the backward's two all-to-alls (dO in; dq,dk,dv fp32 back)."""
    kv = kv_heads_sent(hkv, U)
    return (U - 1) * (b * n * d * elem * hq // U + b * n * d * 4 * (hq + 2 * kv) // U)
