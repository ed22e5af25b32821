"""Rank-side bodies of the sliding-window tests (run on every rank by harness.run_ranks).

The reference is a dense masked softmax over the whole sequence (fp64 math on fp32 data,
autograd): token i sees j iff i - left <= j <= i + right (and j <= i when causal), and both lie in
one document when documents are given. Expected traffic is derived from the same dense mask: a
block travels as far as the last rank (in ring order) with a visible pair against it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.comm import record_schedule
from megatron_burst.nccl_check import check_on_all_ranks

DTYPE = torch.float32


def window_mask(seq: int, window, causal: bool, bounds=None) -> torch.Tensor:
    """Boolean [seq, seq]: query i sees key j (Megatron's window_size; -1 = unbounded)."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    vis = torch.ones(seq, seq, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if left != -1:
        vis &= j >= i - left
    if right != -1:
        vis &= j <= i + right
    if causal:
        vis &= j <= i
    if bounds is not None:
        doc = torch.bucketize(torch.arange(seq), torch.tensor(bounds[1:-1]), right=True)
        vis &= doc[:, None] == doc[None, :]
    return vis


def dense_masked_reference(q, k, v, dout, vis, scale):
    """out, dq, dk, dv [s, b, h, d] of softmax attention under ``vis`` ([s, s] or [hq, s, s] bool).
    A row that sees nothing gets output 0 and no gradient (FlashAttention's convention)."""
    leaves = [t.detach().double().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in leaves)  # [b, h, s, d]
    g = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    empty = ~vis.any(-1, keepdim=True)  # rows seeing nothing: softmax over all, then zeroed
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~(vis | empty), float("-inf"))
    out = (torch.softmax(scores, -1) * ~empty) @ vh
    out.permute(2, 0, 1, 3).backward(dout.double())
    return (out.permute(2, 0, 1, 3).detach(),) + tuple(t.grad for t in leaves)


def last_steps_from_mask(vis: torch.Tensor, W: int, layout: str, stripe: int, kv_side: bool) -> list[int]:
    """Per owner rank o: the last ring step t whose holder o+t has a visible pair with o's block.
    ``kv_side``: the travelling block is o's keys (ring, forward) or o's queries (burst backward)."""
    seq = vis.shape[-1]
    idx = [mb.layout_indices(seq, r, W, layout, stripe) for r in range(W)]
    any_vis = vis.reshape(-1, seq, seq).any(0)
    need = lambda q_rank, kv_rank: bool(any_vis[idx[q_rank]][:, idx[kv_rank]].any())  # noqa: E731
    return [max([t for t in range(1, W) if (need((o + t) % W, o) if kv_side else need(o, (o + t) % W))],
                default=0) for o in range(W)]


def expected_sends(last: list[int], rank: int) -> tuple[int, int]:
    """(activation blocks, gradient blocks) ``rank`` sends on a pruned flat ring."""
    W = len(last)
    acts = sum(1 for o in range(W) if (rank - o) % W < last[o])
    grads = sum(1 for o in range(W) if 1 <= (rank - o) % W <= last[o])
    return acts, grads


def run_window_case(algo: str, layout: str, heads: tuple, local_len: int, windows: list, *, stripe: int = 1,
                    causal: bool = True, b: int = 2, d: int = 8, seed: int = 0, ranks_per_node: Optional[int] = None,
                    ring: Optional[str] = None, bounds=None, replay: bool = False, **cp_kw) -> list[dict]:
    """For each window: max abs errors of out, dq, dk, dv vs the dense reference on this rank, the
    bytes sent per phase, the expected ones on a flat ring, and (``replay``) the NCCL replay."""
    group = mb.build_cp_topology(None, ranks_per_node) if ranks_per_node else None
    if cp_kw.get("ulysses_size", 0) > 1 and cp_kw["ulysses_size"] < dist.get_world_size():
        group = mb.build_usp_topology(None, cp_kw["ulysses_size"], ranks_per_node or 1)
    W, r = dist.get_world_size(), dist.get_rank()
    hq, hkv = heads
    seq = local_len * W
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(seq, b, h, d, generator=gen, dtype=DTYPE)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    scale = d ** -0.5
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    results = []
    for window in windows:
        vis = window_mask(seq, window, causal, bounds)
        ref = dense_masked_reference(q, k, v, dout, vis, scale)
        ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
        with mb.comm_counter() as counter, record_schedule() as trace:
            out = mb.cp_attention(ql, kl, vl, group=group, algo=algo, layout=layout, causal=causal,
                                  softmax_scale=scale, stripe=stripe, ring=ring, window=window, cu_seqlens=cu, **cp_kw)
            out.backward(sh(dout))
        got = (out, ql.grad, kl.grad, vl.grad)
        res = {name: (a.double() - sh(e)).abs().max().item() for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
        res["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
        res["bytes"] = {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}
        kv_blk, q_blk = 2 * b * hkv * local_len * d * 4, b * hq * local_len * d * 4
        fa, fg = expected_sends(last_steps_from_mask(vis, W, layout, stripe, True), r)
        ba, bg = expected_sends(last_steps_from_mask(vis, W, layout, stripe, False), r)
        res["expected"] = {"forward": fa * kv_blk, "ring_backward": (fa + fg) * kv_blk,  # K,V and fp32 dK,dV
                           "burst_backward": ba * (2 * q_blk + 2 * b * hq * local_len * 4) + bg * q_blk}
        if replay:
            reports = [check_on_all_ranks(trace, serialize_communicators=s) for s in (False, True)]
            res["replay"] = [(rep.ok, str(rep), rep.total) for rep in reports]
        results.append(res)
    return results
