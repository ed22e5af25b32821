"""Rank-side bodies of the direct-traffic tests (run on every rank by harness.run_ranks).

A call is prepared with ``megatron_burst.algorithms.prepare`` and its ``cfg.traffic`` set to
"ring" or "direct" before ``apply()``. The reference is a dense masked softmax over the whole
sequence (window_cases.dense_masked_reference). Expected bytes come from the dense mask and the
layout's positions, not from the engine's block logic: a block goes from its owner to exactly the
ranks with a visible pair against it, and a gradient goes home from exactly those.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.algorithms import prepare
from megatron_burst.algorithms.schedule import direct_pass
from megatron_burst.comm import forget_communicators, record_schedule
from megatron_burst.nccl_check import check_on_all_ranks
from megatron_burst.topology import single_node_topology
from window_cases import dense_masked_reference, window_mask

DTYPE = torch.float32


def _replays(trace, lazy_init: bool = True) -> list:
    """(ok, text, groups) of the NCCL replay, per-communicator FIFO and one FIFO per rank.
    ``lazy_init`` False: the communicator was created before the trace (every member joined)."""
    return [(r.ok, str(r), r.total) for r in (check_on_all_ranks(trace, serialize_communicators=s,
                                                                 lazy_init=lazy_init) for s in (False, True))]


def visible_pairs(vis: torch.Tensor, W: int, layout: str, stripe: int = 1) -> list[list[bool]]:
    """``pairs[i][j]``: some query of rank i sees some key of rank j under the dense mask ``vis``."""
    seq = vis.shape[-1]
    idx = [mb.layout_indices(seq, r, W, layout, stripe) for r in range(W)]
    return [[bool(vis[idx[i]][:, idx[j]].any()) for j in range(W)] for i in range(W)]


def expected_bytes(pairs, rank: int, algo: str, b: int, hq: int, hkv: int, n: int, d: int, elem: int = 4) -> dict:
    """Bytes ``rank`` sends under direct traffic: each needed block once, each gradient once home."""
    W = len(pairs)
    kv_readers = sum(1 for h in range(W) if h != rank and pairs[h][rank])  # ranks whose queries see our keys
    kv_sources = sum(1 for o in range(W) if o != rank and pairs[rank][o])  # ranks whose keys our queries see
    kv_blk = 2 * b * hkv * n * d * elem
    fwd = kv_readers * kv_blk
    if algo == "ring":  # K,V to their readers; dK,dV (fp32) home from what we read
        bwd = kv_readers * kv_blk + kv_sources * 2 * b * hkv * n * d * 4
    else:  # burst: Q,dO and D,lse to the ranks whose keys we see; dQ (fp32) home from our readers
        bwd = kv_sources * (2 * b * hq * n * d * elem + 2 * b * hq * n * 4) + kv_readers * b * hq * n * d * 4
    return {"forward": fwd, "backward": bwd}


def run_direct_case(algo: str, layout: str, heads: tuple, bounds: Optional[list], local_len: int, *,
                    window=None, causal: bool = True, stripe: int = 1, b: int = 2, d: int = 8, seed: int = 0,
                    ranks_per_node: Optional[int] = None, ring: Optional[str] = None, ulysses_size: int = 1,
                    replay: bool = False) -> dict:
    """One configuration under traffic "ring" and "direct": errors of each against the dense
    reference, the largest difference between the two, bytes sent per phase (and per link) of each,
    the expected direct bytes, and (``replay``) the NCCL replay of the direct run."""
    W, r = dist.get_world_size(), dist.get_rank()
    if ulysses_size > 1:
        group = mb.build_usp_topology(None, ulysses_size, ranks_per_node)
        algo_kw = dict(algo="usp", ulysses_size=ulysses_size, ring_backward=algo)
    else:
        group = mb.build_cp_topology(None, ranks_per_node) if ranks_per_node else None
        algo_kw = dict(algo=algo)
    hq, hkv = heads
    seq = local_len * W
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(seq, b, h, d, generator=gen, dtype=DTYPE)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    scale = d ** -0.5
    vis = window_mask(seq, window, causal, bounds)
    ref = dense_masked_reference(q, k, v, dout, vis, scale)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    res: dict = {}
    got_by_traffic = {}
    for traffic in ("ring", "direct"):
        leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
        call = prepare(*leaves, group=group, layout=layout, causal=causal, softmax_scale=scale, stripe=stripe,
                       ring=ring, cu_seqlens=cu, window=window, **algo_kw)
        call.cfg.traffic = traffic
        with mb.comm_counter() as counter, record_schedule() as trace:
            out = call.apply()
            out.backward(sh(dout))
        got = (out, *(t.grad for t in leaves))
        got_by_traffic[traffic] = got
        res[traffic] = {name: (a.double() - sh(e)).abs().max().item()
                        for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
        res[traffic]["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
        res[traffic]["bytes"] = {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}
        res[traffic]["links"] = {link: counter.bytes("sent", link=link) for link in ("intra", "inter")}
        if traffic == "direct":
            res["direct_forward_inter"] = counter.bytes("sent", phase="forward", link="inter")
        res[traffic]["resolved"] = call.cfg.resolved_traffic
        if traffic == "direct" and replay:
            res["replay"] = _replays(trace)
    res["ring_vs_direct"] = max((a - c).abs().max().item()
                                for a, c in zip(got_by_traffic["ring"], got_by_traffic["direct"]))
    pairs = visible_pairs(vis, W, layout, stripe)
    res["expected"] = expected_bytes(pairs, r, algo, b, hq, hkv, local_len, d)
    ranks_per_node = ranks_per_node or W
    node = r // ranks_per_node
    res["expected_inter_forward"] = sum(2 * b * hkv * local_len * d * 4 for h in range(W)
                                        if h != r and pairs[h][r] and h // ranks_per_node != node)
    return res


def synthetic_schedule(seed: int, with_grad: bool = True) -> dict:
    """:func:`direct_pass` alone on a random needs table (the same on every rank): which owners
    each rank visits and with what, its home gradient, the bytes it sends, and the NCCL replay.

    Rank o's block is [o] * 4 (fp32); the contribution of holder h to owner o's gradient is
    [100 h + o] * 3, so a home gradient tells exactly which holders contributed."""
    W, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    table = (torch.rand(W, W, generator=gen) < 0.4).tolist()
    ring = single_node_topology(None).flat
    visits = []

    def visit(owner, tensors):
        visits.append((owner, tensors[0].tolist()))
        return torch.full((3,), 100.0 * r + owner)

    forget_communicators()  # record from the group's first use, as on a fresh NCCL communicator
    with mb.comm_counter() as counter, record_schedule() as trace:
        home = direct_pass(ring, [torch.full((4,), float(r))], visit, "backward",
                           torch.zeros(3) if with_grad else None, needs=lambda h, o: table[h][o])
    return {"table": table, "visits": visits, "home": None if home is None else home.tolist(),
            "sent": counter.bytes("sent"), "received": counter.bytes("received"),
            "posted": sum(1 for kind, _ in trace.events if kind == "post"),
            "replay": _replays(trace), "replay_established": _replays(trace, lazy_init=False)}
