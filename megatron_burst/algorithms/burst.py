"""BurstAttention's backward: K,V,dK,dV stay home; Q, dO, D, lse circulate and dQ travels (fp32).

(BurstEngine Algorithm 2 / BurstAttention GAO backward.) The forward is ring's K,V circulation.
Each rank computes, for the visiting query block of rank s, the block gradients against its own
K,V: dK,dV accumulate at home, dQ is added to the travelling dQ of block s.

Bytes per rank in the backward (n local tokens, batch b, hq query heads, head dim d, e = input
element size): (W-1) * (2*b*hq*n*d*e  [Q, dO] + b*hq*n*d*4  [dQ] + 2*b*hq*n*4  [D, lse]).
For multi-head attention that is 3/4 of ring's backward (at fp32 gradients in flight) plus the
small D/lse term; with GQA the Q side carries hq heads against ring's hkv, so at hq/hkv >= 2 ring
is cheaper (see ``algo="auto"``).
"""
from __future__ import annotations

import torch

from megatron_burst.algorithms.schedule import CPConfig, cp_ring_pass
from megatron_burst.kernels import block_backward


def burst_backward(dout, q, k, v, D, lse, cfg: CPConfig, out=None):
    """Q,dO,D,lse,dQ circulate. q/dout [b, hq, n, d], k/v [b, hkv, n, d], D/lse [b, hq, n] fp32;
    ``out`` [b, hq, n, d] this rank's final output (optional: used for its own query block only,
    visiting blocks carry D instead)."""
    n = q.shape[2]
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    dq_like = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def visit(owner, travel):
        qdo, dl = travel
        dq = torch.zeros_like(dq_like)
        # the visiting queries are rank ``owner``'s, the keys are ours
        for bs, mask in cfg.blocks(owner, cfg.rank, n):
            own_out = out[bs] if out is not None and owner == cfg.rank else None
            dqb, dkb, dvb = block_backward(qdo[1][bs], qdo[0][bs], k[bs], v[bs], dl[0][bs], dl[1][bs], mask,
                                           cfg.scale, cfg.kernel, own_out)
            dq[bs, :, mask.q_slice] += dqb
            mask.add_kv_grad(dk[bs], dkb)
            mask.add_kv_grad(dv[bs], dvb)
        return dq

    travel = [torch.stack([q, dout.to(q.dtype)]), torch.stack([D, lse])]
    dq = cp_ring_pass(cfg, travel, visit, "backward", grad_like=dq_like,
                      needs=cfg.member_needs(transpose=True) or (lambda holder, owner: cfg.has_work(owner, holder, n)))
    return dq, dk, dv


def backward_bytes(b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int) -> int:
    """Bytes one rank sends in the burst backward."""
    return (world_size - 1) * (2 * b * hq * n * d * elem + b * hq * n * d * 4 + 2 * b * hq * n * 4)
