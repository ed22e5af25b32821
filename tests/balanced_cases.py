"""Rank-side bodies of the balanced-layout tests (run on every rank by harness.run_ranks).

The reference is a dense masked softmax over the whole packed sequence (fp64 math on fp32 data,
autograd), per sample: token t sees u iff both lie in one of the sample's documents, u <= t when
causal, and u is inside the sliding window when one is given. Each rank's tokens are the plan's
indices (taken here from ``megatron_burst.dispatch.plan_dispatch`` directly, not from the engine's
layout code), so a wrong placement or a wrong mask shows as an O(1) error.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.masks.dispatch import plan_dispatch
from megatron_burst.topology import build_usp_topology

DTYPE = torch.float32


def mixed_bounds(seq: int) -> list[int]:
    """One long document (a little over half the sequence: the planner splits it over ranks) between
    a 2-token document and a run of short ones (kept whole on one rank each)."""
    long_end = 2 + seq // 2 + 3
    bounds, x = [0, 2, long_end], long_end
    for length in (5, 1, 3, 4, 2, 6, 3, 7, 4, 2, 5, 1, 8, 3):
        if x + length < seq:
            x += length
            bounds.append(x)
    return bounds + [seq]


def union(per_sample: list[list[int]]) -> list[int]:
    return sorted({x for bounds in per_sample for x in bounds})


def visibility(seq: int, bounds: list[int], causal: bool, window=None) -> torch.Tensor:
    """Boolean [seq, seq] of one sample (Megatron's window_size meaning; -1 = unbounded)."""
    pos = torch.arange(seq)
    doc = torch.bucketize(pos, torch.tensor(bounds[1:-1]), right=True)
    vis = doc[:, None] == doc[None, :]
    if causal:
        vis &= pos[None, :] <= pos[:, None]
    if window is not None:
        left, right = window
        if left != -1:
            vis &= pos[None, :] >= pos[:, None] - left
        if right != -1:
            vis &= pos[None, :] <= pos[:, None] + right
    return vis


def dense_reference(q, k, v, dout, vis, scale):
    """out, dq, dk, dv [s, b, h, d] of softmax attention under ``vis`` [b, s, s] (every row sees a key)."""
    leaves = [t.detach().double().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in leaves)  # [b, h, s, d]
    g = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~vis[:, None], float("-inf"))
    out = torch.softmax(scores, -1) @ vh
    out.permute(2, 0, 1, 3).backward(dout.double())
    return (out.permute(2, 0, 1, 3).detach(),) + tuple(t.grad for t in leaves)


def inputs(seq: int, b: int, heads: tuple, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    return tuple(torch.randn(seq, b, h, d, generator=gen, dtype=DTYPE) for h in (hq, hkv, hkv, hq))


def run_case(algo: str, heads: tuple, local_len: int, *, bounds: Optional[list] = None,
             per_sample: Optional[list] = None, causal: bool = True, window=None, b: int = 2, d: int = 8,
             seed: int = 0, group=None, ring: Optional[str] = None, prebuilt: bool = False, **cp_kw) -> dict:
    """Max abs errors of out, dq, dk, dv vs the dense reference on this rank (layout "balanced").

    ``bounds``: cu_seqlens shared by the batch; ``per_sample``: one list per sample instead.
    ``prebuilt``: pass the Documents of balanced_documents (planned once) instead of raw cu_seqlens.
    """
    W, r = dist.get_world_size(), dist.get_rank()
    seq = local_len * W
    all_bounds = per_sample if per_sample is not None else [bounds] * b
    q, k, v, dout = inputs(seq, b, heads, d, seed)
    scale = d ** -0.5
    vis = torch.stack([visibility(seq, x, causal, window) for x in all_bounds])
    ref = dense_reference(q, k, v, dout, vis, scale)
    # the placement, independently of the engine's layout code: the planner on the union of boundaries,
    # placed for the topology's nodes (cp_attention plans with its group's ranks per node)
    ranks_per_node = getattr(group, "ranks_per_node", None)
    idx = torch.from_numpy(plan_dispatch(union(all_bounds), W, ranks_per_node=ranks_per_node).index_array()[r])
    sh = lambda t: t[idx].clone()  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    if per_sample is not None:
        cu = [torch.tensor(x, dtype=torch.int32) for x in per_sample]
    else:
        cu = torch.tensor(bounds, dtype=torch.int32)
    if prebuilt:
        cu = mb.balanced_documents(cu, seq, b, W, ranks_per_node=ranks_per_node)
    out = mb.cp_attention(ql, kl, vl, group=group, algo=algo, layout="balanced", causal=causal,
                          softmax_scale=scale, ring=ring, cu_seqlens=cu, window=window, **cp_kw)
    out.backward(sh(dout))
    got = (out, ql.grad, kl.grad, vl.grad)
    errs = {name: (a.double() - sh(e)).abs().max().item() for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
    errs["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
    return errs


def heads_for(W: int) -> list[tuple[int, int]]:
    """MHA and GQA head counts that Ulysses can split at this world size."""
    return [(W, W), (2 * W, W)] if W == 3 else [(4, 4), (8, 2)]


def balanced_matrix(local_len: int, algos: tuple) -> dict:
    """Every algorithm x causal/full x MHA/GQA on the mixed documents; per-sample boundaries, a
    window with documents and the prebuilt Documents path on top. {case: errors}."""
    W = dist.get_world_size()
    seq = local_len * W
    bounds = mixed_bounds(seq)
    out = {}
    for algo in algos:
        for causal in (True, False):
            for heads in heads_for(W):
                out[(algo, causal, heads)] = run_case(algo, heads, local_len, bounds=bounds, causal=causal)
        other = [0, 1, seq // 3, seq - 4, seq]  # a one-token document, a long one, a short tail
        out[(algo, "per_sample")] = run_case(algo, heads_for(W)[1], local_len, per_sample=[bounds, other])
        out[(algo, "window")] = run_case(algo, heads_for(W)[1], local_len, bounds=bounds, window=(5, 0))
    out[("burst", "window_full")] = run_case("burst", heads_for(W)[1], local_len, bounds=bounds, causal=False,
                                             window=(4, 3))
    out[("ring", "prebuilt")] = run_case("ring", heads_for(W)[1], local_len, bounds=bounds, prebuilt=True)
    return out


def topology_matrix(local_len: int) -> dict:
    """W = 4 as 2 emulated nodes x 2: ring and burst on the double ring, and usp (U = 2) with the
    ring (flat) over the Ulysses groups."""
    seq = local_len * 4
    bounds = mixed_bounds(seq)
    out = {}
    nodes = mb.build_cp_topology(None, 2)
    for algo in ("ring", "burst"):
        for causal in (True, False):
            out[(algo, "double", causal)] = run_case(algo, (8, 2), local_len, bounds=bounds, causal=causal,
                                                     group=nodes, ring="double")
    usp = build_usp_topology(None, 2)
    for causal in (True, False):
        for heads in ((4, 4), (8, 2)):
            out[("usp", causal, heads)] = run_case("usp", heads, local_len, bounds=bounds, causal=causal, group=usp,
                                                   ulysses_size=2)
    out[("usp", "window")] = run_case("usp", (8, 2), local_len, bounds=bounds, window=(6, 0), group=usp,
                                      ulysses_size=2)
    return out


def selective_checkpoint(algo: str, local_len: int = 12, fraction: float = 0.5) -> tuple[int, float]:
    """The selective activation store under layout "balanced": the first (no-grad) forward stores the
    later rows, the recompute computes the earlier ones and takes the rest from the store; forward
    and gradients still equal the dense reference. Returns (store hits, max error)."""
    from megatron_burst.checkpoint import SelectiveAttentionCache, selective_cp_attention

    W, r = dist.get_world_size(), dist.get_rank()
    seq = local_len * W
    bounds = mixed_bounds(seq)
    q, k, v, dout = inputs(seq, 2, (4, 2), 8, seed=3)
    scale = 8 ** -0.5
    vis = torch.stack([visibility(seq, bounds, True)] * 2)
    ref = dense_reference(q, k, v, dout, vis, scale)
    idx = torch.from_numpy(plan_dispatch(bounds, W).index_array()[r])
    sh = lambda t: t[idx].clone()  # noqa: E731
    docs = mb.balanced_documents(torch.tensor(bounds), seq, 2, W)
    kw = dict(algo=algo, layout="balanced", softmax_scale=scale, cu_seqlens=docs)
    cache = SelectiveAttentionCache()
    with torch.no_grad():
        selective_cp_attention(sh(q), sh(k), sh(v), cache=cache, stored_fraction=fraction, **kw)
    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    out = selective_cp_attention(*leaves, cache=cache, stored_fraction=fraction, **kw)
    out.backward(sh(dout))
    got = (out, *(t.grad for t in leaves))
    return cache.hits, max((a.double() - sh(e)).abs().max().item() for a, e in zip(got, ref))


def refusals(local_len: int = 4) -> tuple[dict, int, bool]:
    """The ValueError of each call layout "balanced" cannot run, raised before any collective; then the
    group must still work. Returns (messages, bytes moved, group ok)."""
    W = dist.get_world_size()
    seq = local_len * W
    q, kv = torch.randn(local_len, 1, 4, 8), torch.randn(local_len, 1, 2, 8)
    cu = torch.tensor([0, 3, seq], dtype=torch.int32)
    cases = {
        "no_cu_seqlens": dict(),
        "pattern": dict(cu_seqlens=cu, algo="ring", pattern=mb.VerticalSlash(torch.zeros(4, 1, dtype=torch.long),
                                                                      torch.zeros(4, 1, dtype=torch.long))),
        "plain_documents": dict(cu_seqlens=mb.documents.check_cu_seqlens(cu, seq, 1)),
        "other_world_size": dict(cu_seqlens=mb.balanced_documents(cu, seq, 1, 2 * W)),  # seq = 4W: divisible
        "bad_end": dict(cu_seqlens=torch.tensor([0, 3, seq + 1], dtype=torch.int32)),
    }
    messages = {}
    with mb.comm_counter() as counter:
        for name, kw in cases.items():
            try:
                mb.cp_attention(q, kv, kv, **{"algo": "burst", "layout": "balanced", **kw})
                messages[name] = None
            except ValueError as e:
                messages[name] = str(e)
        try:
            mb.cp_attention(q, kv, kv, algo="burst", layout="zigzag", cu_seqlens=mb.balanced_documents(cu, seq, 1, W))
            messages["balanced_documents_zigzag"] = None
        except ValueError as e:
            messages["balanced_documents_zigzag"] = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    return messages, counter.bytes("sent") + counter.bytes("received"), t.item() == W


# documents at level 2 on W = 4 (cosets {r, r + 2}): they cross nodes of 2 unless the plan is placed for them
LEVEL_TWO_BOUNDS = [0, 12, 24, 30, 35, 38, 42, 45, 48]


def node_placement(local_len: int = 12) -> dict:
    """W = 4 as 2 emulated nodes x 2 (``build_cp_topology(None, 2)``): cp_attention plans raw
    cu_seqlens for the topology's nodes (node-aware placement, the direct pass in the plan's member
    order). Per algorithm: errors vs the dense reference and the bytes sent over inter-node links,
    for the node-aware run and for the one-node plan (``ranks_per_node=None``) on a one-node view of
    the same group whose links keep the nodes' classes. Also the mismatch refusal: Documents placed
    for one node passed with the 2-node topology (message, bytes moved before it, group ok after)."""
    from megatron_burst.topology import CPTopology

    W = dist.get_world_size()
    seq = local_len * W
    assert seq == LEVEL_TWO_BOUNDS[-1]
    nodes = mb.build_cp_topology(None, 2)
    one_node_view = CPTopology(nodes.group, nodes.rank, W, W, nodes.flat)  # links still classed by nodes
    out = {}
    for algo in ("ring", "burst", "allgather"):
        for name, group in (("nodes", nodes), ("one_node_plan", one_node_view)):
            with mb.comm_counter() as counter:
                errs = run_case(algo, (8, 2), local_len, bounds=LEVEL_TWO_BOUNDS, group=group)
            errs["inter_bytes"] = counter.bytes("sent", link="inter")
            errs["intra_bytes"] = counter.bytes("sent", link="intra")
            out[(algo, name)] = errs
        out[(algo, "prebuilt")] = run_case(algo, (8, 2), local_len, bounds=LEVEL_TWO_BOUNDS, group=nodes,
                                           prebuilt=True)
    q, kv = torch.randn(local_len, 1, 4, 8), torch.randn(local_len, 1, 2, 8)
    one_node_docs = mb.balanced_documents(torch.tensor(LEVEL_TWO_BOUNDS), seq, 1, W)
    with mb.comm_counter() as counter:
        try:
            mb.cp_attention(q, kv, kv, group=nodes, algo="burst", layout="balanced", cu_seqlens=one_node_docs)
            message = None
        except ValueError as e:
            message = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["mismatch"] = (message, counter.bytes("sent") + counter.bytes("received"), t.item() == W)
    return out
