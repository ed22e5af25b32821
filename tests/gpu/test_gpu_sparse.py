"""(d) sparse_cp_attention on the GPU: a static VerticalSlash pattern held in CUDA tensors, one whose
heads share a band and pools (run as dense positions blocks) and the dynamic pattern, at W=1 and
W=2, against the dense masked fp32 reference."""
from __future__ import annotations

import pytest
import torch

import megatron_burst as mb
from megatron_burst.kernels.choice import choose
from megatron_burst.masks.dynamic import Dynamic

from gpu import ranks
from gpu.common import DEV, DTYPE, L, ON_CPU, STRIPE_WIDE, check, errors, inputs, kernel_failures, \
    pattern_visibility, rank_failures, reference, run_on_ranks, sdpa_errors, shared_runs_pattern, static_pattern

SEQ = L(2048)
B, HQ, HKV, D = 1, 8, 2, (128 if not ON_CPU else 32)
SEED = 9
STATIC_CASES = [("static", algo, layout, stripe) for algo in ("burst", "ring")
                for layout, stripe in (("striped", STRIPE_WIDE), ("zigzag", 1), ("striped", 1))]
DYNAMIC_CASES = [("dynamic", "burst", "striped", STRIPE_WIDE), ("dynamic", "ring", "zigzag", 1),
                 ("dynamic_pools", "burst", "striped", STRIPE_WIDE)]


def _bar(q, k, v, dout, vis):
    """(fp32 reference, SDPA's bf16 errors) under the per-head mask ``vis`` [h, s, s]. Rows that see
    nothing (possible in a dynamic pattern) are 0 in the reference; SDPA cannot run such rows, so its
    error is measured on the same mask with those rows given their diagonal key (same rounding scale)."""
    ref = reference(q, k, v, dout, causal=True, mask=vis)
    seen = vis.any(-1, keepdim=True)
    if bool(seen.all()):
        return ref, sdpa_errors(q, k, v, dout, True, vis, ref)
    eye = torch.eye(vis.shape[-1], dtype=torch.bool)
    vis2 = vis | (eye & ~seen)
    return ref, sdpa_errors(q, k, v, dout, True, vis2, reference(q, k, v, dout, causal=True, mask=vis2))


def _compare(got, vis, q, k, v, dout, what, fails, cache):
    for seen_vis, bar in cache:  # the same mask (a static pattern across cases): reference computed once
        if seen_vis.shape == vis.shape and torch.equal(seen_vis, vis):
            ref, sdpa = bar
            break
    else:
        ref, sdpa = _bar(q, k, v, dout, vis)
        cache.append((vis, (ref, sdpa)))
    engine = errors(got, ref)
    fails += check(engine, sdpa, what)
    return f"{what}: " + " ".join(f"{n} {e:.2e}" for n, e in engine.items()) + f" | SDPA {sdpa}"


def test_sparse_one_rank():
    """W=1, bf16, GQA 8/2, head dim 128, 2048 tokens: a static vertical-slash pattern (per-head lines,
    held in CUDA tensors) under burst and ring x striped 64 / zigzag / striped 1, and the dynamic
    pattern (estimated from q, k by the call): out, dq, dk, dv within 1.5x torch's bf16 SDPA error
    (boolean per-head mask) of the dense masked fp32 reference; sparse tiles on triton_block_sparse."""
    q, k, v, dout = (t.to(DEV) for t in inputs(SEQ, B, HQ, HKV, D, seed=SEED))
    vertical, slash = static_pattern(SEQ, HQ, seed=SEED)
    pattern = mb.VerticalSlash(vertical.to(DEV), slash.to(DEV))
    assert pattern.device == DEV
    fails, table, cache = [], [], []
    fails += kernel_failures(choose(DEV, DTYPE, D, ("sparse",)).kernels, "sparse")
    static_vis = pattern_visibility(vertical, slash, SEQ)
    for kind, algo, layout, stripe in STATIC_CASES + DYNAMIC_CASES:
        what = f"W=1 {kind} {algo} {layout}/{stripe}"
        leaves = [mb.shard(t, 0, 0, 1, layout, stripe).clone().requires_grad_() for t in (q, k, v)]
        try:
            with ranks._Capture() as cap:
                o = mb.sparse_cp_attention(*leaves, {"static": pattern, "dynamic": "dynamic",
                                                     "dynamic_pools": Dynamic(slash_lines="pools")}[kind],
                                           algo=algo, layout=layout, stripe=stripe)
            o.backward(dout)
        except Exception as e:  # noqa: BLE001
            fails.append(f"{what}: raised {type(e).__name__}: {e}")
            continue
        vis = static_vis if kind == "static" else pattern_visibility(cap.patterns[-1].vertical,
                                                                     cap.patterns[-1].slash, SEQ)
        got = [o] + [t.grad for t in leaves]
        table.append(_compare(got, vis, q, k, v, dout, what, fails, cache))
    assert not fails, "\n".join(fails) + "\n" + "\n".join(table)


@pytest.mark.parametrize("world_size", [2])
def test_sparse_two_ranks_on_one_gpu(world_size):
    """W=2 ranks on one GPU (host-staged): the static pattern (CUDA tensors on every rank) under burst
    and ring x striped 64 / zigzag / striped 1, and the dynamic pattern (burst, striped 64; ring,
    zigzag), estimated identically on both ranks: the reassembled out, dq, dk, dv within 1.5x torch's
    bf16 SDPA error of the dense masked fp32 reference."""
    W = world_size
    vertical, slash = static_pattern(SEQ, HQ, seed=SEED)
    cases = STATIC_CASES + DYNAMIC_CASES
    per_rank = run_on_ranks(W, ranks.sparse_cases, cases, SEQ, B, HQ, HKV, D, vertical, slash, seed=SEED)
    q, k, v, dout = (t.to(DEV) for t in inputs(SEQ, B, HQ, HKV, D, seed=SEED))
    static_vis = pattern_visibility(vertical, slash, SEQ)
    fails, table, cache = [], [], []
    fails += rank_failures(per_rank, f"W={W}")
    for case in cases:
        kind, algo, layout, stripe = case
        what = f"W={W} {kind} {algo} {layout}/{stripe}"
        if any(case not in res["results"] for res in per_rank):
            continue
        if kind == "static":
            vis = static_vis
        else:
            lines = [res["patterns"][case] for res in per_rank]
            if not all(torch.equal(a, b) for other in lines[1:] for a, b in zip(lines[0], other)):
                fails.append(f"{what}: the ranks estimated different dynamic patterns")
                continue
            vis = pattern_visibility(*lines[0], SEQ)
        got = [mb.unshard([res["results"][case][i] for res in per_rank], 0, layout, stripe) for i in range(4)]
        table.append(_compare(got, vis, q, k, v, dout, what, fails, cache))
    assert not fails, "\n".join(fails) + "\n" + "\n".join(table)


@pytest.mark.parametrize("world_size", [1, 2])
def test_sparse_shared_runs(world_size):
    """Lines shared by every head, slash offsets a band and two pools of 64: on CUDA every block of
    the call is a dense positions block (the runs over all keys, the vertical keys gathered), no
    sparse tile; burst and ring x striped 64 / zigzag, W = 1 and 2 (host-staged on one GPU): out,
    dq, dk, dv within 1.5x torch's bf16 SDPA error of the dense masked fp32 reference."""
    from megatron_burst.masks import vertical_slash

    W = world_size
    vertical, slash = shared_runs_pattern(SEQ, HQ, seed=SEED)
    pattern = mb.VerticalSlash(vertical.to(DEV), slash.to(DEV))
    fails, table, cache = [], [], []
    if DEV.type == "cuda":
        kinds = {m.kind for q_rank in range(W) for kv_rank in range(W)
                 for _, m in vertical_slash.pattern_blocks(pattern, "striped", q_rank, kv_rank, W, SEQ // W,
                                                           STRIPE_WIDE)}
        if kinds != {"positions"}:
            fails.append(f"blocks of kinds {sorted(kinds)}: the shared runs were not split into positions blocks")
    cases = [("static", algo, layout, stripe) for algo in ("burst", "ring")
             for layout, stripe in (("striped", STRIPE_WIDE), ("zigzag", 1))]
    per_rank = run_on_ranks(W, ranks.sparse_cases, cases, SEQ, B, HQ, HKV, D, vertical, slash, seed=SEED)
    q, k, v, dout = (t.to(DEV) for t in inputs(SEQ, B, HQ, HKV, D, seed=SEED))
    vis = pattern_visibility(vertical, slash, SEQ)
    fails += rank_failures(per_rank, f"W={W}")
    for case in cases:
        _, algo, layout, stripe = case
        if any(case not in res["results"] for res in per_rank):
            continue
        got = [mb.unshard([res["results"][case][i] for res in per_rank], 0, layout, stripe) for i in range(4)]
        table.append(_compare(got, vis, q, k, v, dout, f"W={W} shared runs {algo} {layout}/{stripe}", fails, cache))
    assert not fails, "\n".join(fails) + "\n" + "\n".join(table)
