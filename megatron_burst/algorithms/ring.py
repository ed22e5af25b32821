"""Ring attention (the TransformerEngine p2p baseline).

Forward: K,V circulate; each rank merges the visible part of every block into its (out, lse).
The visible parts come from ``cfg.blocks`` (causal/full, or one rectangle per document with
cu_seqlens, intersected with a sliding window); a block pair with none is skipped. On the ring the
bytes sent do not depend on the mask, except under a sliding window: then a block travels only as
far as the last rank that needs it and its gradient goes home from there (schedule.ring_pass).
With direct traffic (``cfg.traffic``, schedule.direct_pass) a block goes only to the ranks that
need it. Either way the figures below become upper bounds.
Backward: K,V circulate again and dK,dV travel with them (fp32), accumulated by every rank whose
queries see the block; dQ stays home.

Bytes per rank (n local tokens, batch b, hkv kv heads, head dim d, e = input element size):
  forward  (W-1) * 2*b*hkv*n*d*e
  backward (W-1) * (2*b*hkv*n*d*e + 2*b*hkv*n*d*4)
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst.algorithms.schedule import CPConfig, cp_ring_pass
from megatron_burst.kernels import block_backward, block_forward, empty_accumulator, merge_into


def kv_ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: CPConfig,
                    q_rows: Optional[int] = None, out: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of ring and burst. q [b, hq, n, d], k/v [b, hkv, n, d] -> (out, lse [b, hq, n]), both fp32.

    Block outputs arrive from the kernels in fp32 and merge in fp32: nothing is rounded to q's
    dtype here. ``out`` optionally gives the fp32 [b, hq, n, d] accumulator (any strides; e.g. a
    view of the caller's output buffer). ``q_rows`` limits the work to local query rows
    [0, q_rows) (the others come back as 0 / -inf): sequence-level selective checkpointing
    recomputes only those. K,V still travel whole.
    """
    n = q.shape[2]
    out, lse = empty_accumulator(q, v.shape[-1], out)

    def visit(owner, kv):
        for bs, mask in cfg.blocks(cfg.rank, owner, n, q_rows):
            o, l = block_forward(q[bs], kv[0][bs], kv[1][bs], mask, cfg.scale, cfg.kernel)
            merge_into(out[bs, :, mask.q_slice], lse[bs, :, mask.q_slice], o, l)

    if q_rows == 0:  # every row comes from the selective-checkpoint store: nothing to compute or send
        return out, lse
    kv_len = n if q_rows is None else needed_kv_rows(cfg, n, q_rows)
    cp_ring_pass(cfg, [torch.stack([k[:, :, :kv_len], v[:, :, :kv_len]])], lambda owner, t: visit(owner, t[0]),
                 "forward", needs=cfg.member_needs() or (lambda holder, owner: cfg.has_work(holder, owner, n, q_rows)))
    return out, lse


def needed_kv_rows(cfg: CPConfig, n: int, q_rows: int) -> int:
    """How many leading K,V rows of any block some rank's query rows [0, q_rows) can see.

    Under causal masking early queries see only early keys, so a recompute of the earlier rows
    circulates only that prefix of every K,V block (the same length on every rank: q_rows is).
    """
    if not cfg.causal or cfg.pattern is not None:  # a sparse plan's blocks span the whole K,V block
        return n
    W = cfg.world_size
    return max((mask.kv_stop for i in range(W) for j in range(W) for _, mask in cfg.blocks(i, j, n, q_rows)),
               default=0)


def ring_backward(dout, q, k, v, D, lse, cfg: CPConfig, out=None):
    """K,V,dK,dV circulate. Shapes as in the forward; D, lse [b, hq, n] fp32; ``out`` [b, hq, n, d]
    the final output (optional, for kernels that read it). Returns fp32 (dq, dk, dv)."""
    n = q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_like = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=q.device)

    def visit(owner, travel):
        kv = travel[0]
        dkv = torch.zeros_like(dkv_like)
        for bs, mask in cfg.blocks(cfg.rank, owner, n):
            dqb, dkb, dvb = block_backward(dout[bs], q[bs], kv[0][bs], kv[1][bs], D[bs], lse[bs], mask, cfg.scale,
                                           cfg.kernel, None if out is None else out[bs])
            dq[bs, :, mask.q_slice] += dqb
            mask.add_kv_grad(dkv[0][bs], dkb)
            mask.add_kv_grad(dkv[1][bs], dvb)
        return dkv

    dkv = cp_ring_pass(cfg, [torch.stack([k, v])], visit, "backward", grad_like=dkv_like,
                       needs=cfg.member_needs() or (lambda holder, owner: cfg.has_work(holder, owner, n)))
    return dq, dkv[0], dkv[1]


def backward_bytes(b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int) -> int:
    """Bytes one rank sends in the ring backward."""
    return (world_size - 1) * (2 * b * hkv * n * d * elem + 2 * b * hkv * n * d * 4)


def forward_bytes(b: int, hkv: int, n: int, d: int, elem: int, world_size: int) -> int:
    """Bytes one rank sends in the K,V-circulating forward (ring and burst)."""
    return (world_size - 1) * 2 * b * hkv * n * d * elem
