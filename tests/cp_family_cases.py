"""Rank-side bodies of the all-gather / Ulysses / USP tests (run by harness.run_ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_burst as mb
from attention_cases import HEADS, refusal_messages, run_case
from megatron_burst.topology import build_usp_topology


def run_family_matrix(algo, layout, heads_list=tuple(HEADS), ulysses_size=None, ranks_per_node=None, **kw):
    """{causal, full} x heads for one algorithm; usp builds its 2-D groups first (collectively)."""
    group = None
    if algo == "usp":
        group = build_usp_topology(None, ulysses_size, ranks_per_node)
    results = {}
    for causal in (True, False):
        for heads in heads_list:
            results[(causal, heads)] = run_case(algo, layout, causal, heads, group=group, **kw)
    return results


def usp_group(ulysses_size, ranks_per_node=None):
    """The 2-D topology over the default group (collective: every rank calls it)."""
    return build_usp_topology(None, ulysses_size, ranks_per_node)


def run_usp_case(layout, causal, heads, ulysses_size, ranks_per_node=None, ring=None, **kw):
    """run_case for algo='usp' after building its groups (flat ring, or double with ranks_per_node)."""
    group = usp_group(ulysses_size, ranks_per_node)
    return run_case("usp", layout, causal, heads, group=group, ring=ring, **kw)


def family_schedule(algo, layout="zigzag", heads="gqa4", ulysses_size=None, ranks_per_node=None,
                    ring_backward="auto", ring=None):
    """One forward + backward of ``algo`` recorded on every rank and replayed under NCCL's rules."""
    from megatron_burst.comm import record_schedule
    from nccl_cases import _replays

    group = usp_group(ulysses_size, ranks_per_node) if algo == "usp" else None
    with record_schedule() as trace:
        errs = run_case(algo, layout, True, heads, group=group, ring=ring, ring_backward=ring_backward)
    result = _replays(trace)
    result["max_err"] = max(errs[n] for n in ("out", "dq", "dk", "dv"))
    result["kinds"] = sorted({op.kind for kind, batch in trace.events if kind == "post" for op in batch.ops})
    return result


def bad_family_inputs():
    """Each bad input raises ValueError locally, before any collective; the group still works."""
    mk = lambda s=8, h=4, d=8: torch.randn(s, 1, h, d)  # noqa: E731
    cases = {
        "ulysses_heads": dict(q=mk(h=6), k=mk(h=6), v=mk(h=6), algo="ulysses"),  # 6 % 4
        "ulysses_kv_heads": dict(q=mk(h=12), k=mk(h=6), v=mk(h=6), algo="ulysses"),  # 6 vs 4: no nesting
        "usp_size_not_dividing": dict(q=mk(), k=mk(), v=mk(), algo="usp", ulysses_size=3),
        "usp_without_size": dict(q=mk(), k=mk(), v=mk(), algo="usp"),
        "usp_without_groups": dict(q=mk(), k=mk(), v=mk(), algo="usp", ulysses_size=2),
        "usp_heads": dict(q=mk(h=3), k=mk(h=3), v=mk(h=3), algo="usp", ulysses_size=2),
        "ring_backward": dict(q=mk(), k=mk(), v=mk(), algo="usp", ulysses_size=2, ring_backward="p2p"),
        "allgather_seq": dict(q=mk(s=5), k=mk(s=5), v=mk(s=5), algo="allgather"),
    }
    return refusal_messages(cases)


def auto_choice(heads, ulysses_size=None, local_len=6, d=8):
    """What algo='auto' runs (its bytes) with an optional usp topology registered, and its errors."""
    group = None
    if ulysses_size is not None:
        usp_group(ulysses_size)
    errs = run_case("auto", "zigzag", True, heads, group=group, local_len=local_len, d=d)
    return errs


def link_split(algo, ranks_per_node):
    """Bytes by (phase, link) of one call on a node topology (usp: Ulysses groups inside a node)."""
    from topology_cases import topology

    if algo == "usp":
        group = usp_group(ranks_per_node, ranks_per_node)
    else:
        group = topology(ranks_per_node)
    errs = run_case(algo, "zigzag", True, "mha", group=group)
    return errs["links"], errs["bytes"]


def selective_fallback(algo="ulysses"):
    """selective_cp_attention with an algorithm that computes every row: a plain call, nothing stored."""
    from megatron_burst.activation_store import SelectiveAttentionCache, selective_cp_attention
    from attention_cases import full_inputs

    W, r = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=5)
    sh = lambda t: mb.shard(t, 0, r, W, "zigzag").clone().requires_grad_()  # noqa: E731
    cache = SelectiveAttentionCache()
    with torch.no_grad():
        first = selective_cp_attention(sh(q), sh(k), sh(v), cache=cache, stored_fraction=0.5, algo=algo)
    leaves = [sh(t) for t in (q, k, v)]
    again = selective_cp_attention(*leaves, cache=cache, stored_fraction=0.5, algo=algo)
    again.backward(sh(dout).detach())
    plain_leaves = [sh(t) for t in (q, k, v)]
    plain = mb.cp_attention(*plain_leaves, algo=algo)
    plain.backward(sh(dout).detach())
    same = all(torch.equal(a, b) for a, b in [(first, plain.detach()), (again.detach(), plain.detach())]
               + [(x.grad, y.grad) for x, y in zip(leaves, plain_leaves)])
    return same, cache.hits


def usp_doc_case(layout, bounds, local_len, ulysses_size=2):
    """run_doc_case for usp (causal and full, GQA 8:2) after building its 2-D groups."""
    from document_cases import run_doc_case

    usp_group(ulysses_size)  # registered: cp_attention finds it for the default group
    out = {}
    for causal in (True, False):
        errs = run_doc_case("usp", layout, (8, 2), bounds, local_len, causal=causal, ulysses_size=ulysses_size)
        out[causal] = errs
    return {k: (max(e[k] for e in out.values()) if k != "finite" else all(e[k] for e in out.values()))
            for k in ("out", "dq", "dk", "dv", "finite")}
