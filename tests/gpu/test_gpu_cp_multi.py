"""(c) cp_attention at W = 2, 3, 4: W processes sharing cuda:0 over gloo with the host-staged
transport (harness.run_ranks_on_one_gpu); each rank shards the full inputs, the test reassembles
every rank's output and gradients and compares them with the fp32 reference of the whole sequence."""
from __future__ import annotations

import functools

import pytest

import megatron_burst as mb

from gpu import ranks
from gpu.common import DEV, L, MASKS, ON_CPU, STRIPE_WIDE, check, doc_bounds, errors, inputs, kernel_failures, \
    rank_failures, reference, run_on_ranks, sdpa_errors, visibility

SEQ = L(1536)  # divisible by 2W and by W x 64 for W = 2, 3, 4; not a power of two
B, D = 1, (128 if not ON_CPU else 32)
HEADS = (8, 2)  # GQA 8/2
LAYOUTS = (("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", STRIPE_WIDE))
ALGOS = {2: ("ring", "burst", "allgather", "ulysses"),
         3: ("ring", "burst", "allgather"),  # ulysses at W=3 runs with heads 6/3 (8 query heads do not split in 3)
         4: ("ring", "burst", "allgather", "ulysses", "usp")}  # usp: Ulysses groups of 2, a ring of 2 across them
EXTRA = {3: [("ulysses", (6, 3))]}
SEED = 5


@functools.lru_cache(maxsize=None)
def _reference(hq: int, hkv: int, mask: str):
    """(full inputs on the device, fp32 reference, SDPA's bf16 errors) of one heads/mask pair."""
    q, k, v, dout = (t.to(DEV) for t in inputs(SEQ, B, hq, hkv, D, seed=SEED))
    causal, vis = mask != "full", visibility(mask, SEQ)
    ref = reference(q, k, v, dout, causal=causal, mask=vis)
    return ref, sdpa_errors(q, k, v, dout, causal, vis, ref)


def _cases(W: int, mask: str) -> list:
    cases = [(algo, layout, stripe, mask) for algo in ALGOS[W] for layout, stripe in LAYOUTS]
    return cases


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cp_attention_ranks_on_one_gpu(world_size, mask):
    """W = 2, 3, 4 ranks on one GPU, bf16, GQA 8/2, head dim 128, 1536 tokens: ring, burst,
    allgather, ulysses (W=2, 4; at W=3 with heads 6/3) and usp (W=4, ulysses_size 2) x layouts
    contiguous, zigzag, striped stripe 1 and 64 x masks causal, full, documents, window, documents +
    window: the reassembled out, dq, dk, dv within 1.5x torch's bf16 SDPA error of the fp32
    reference; every rank's kernel choice fused; no plain-torch kernel on any rank."""
    W = world_size
    runs = [(HEADS, _cases(W, mask))]
    for algo, heads in EXTRA.get(W, []):
        runs.append((heads, [(algo, layout, stripe, mask) for layout, stripe in LAYOUTS]))
    fails, table = [], []
    for (hq, hkv), cases in runs:
        per_rank = run_on_ranks(W, ranks.cp_cases, cases, SEQ, B, hq, hkv, D, seed=SEED)
        ref, sdpa = _reference(hq, hkv, mask)
        fails += rank_failures(per_rank, f"W={W} heads {hq}/{hkv}")
        for case in cases:
            algo, layout, stripe, _ = case
            what = f"W={W} heads {hq}/{hkv} {mask} {algo} {layout}/{stripe}"
            if any(case not in res["results"] for res in per_rank):
                continue  # reported above
            got = [mb.unshard([res["results"][case][i] for res in per_rank], 0, layout, stripe) for i in range(4)]
            engine = errors(got, ref)
            table.append(f"{what}: " + " ".join(f"{n} {e:.2e}" for n, e in engine.items()))
            fails += check(engine, sdpa, what)
            for rank, res in enumerate(per_rank):
                fails += kernel_failures(res["kernels"][case], f"{what} rank {rank}")
    assert not fails, "\n".join(fails[:40]) + f"\n({len(fails)} failures)\nSDPA bf16: {sdpa}\n" + "\n".join(table)


@pytest.mark.parametrize("world_size", [3, 4])
def test_balanced_layout_ranks_on_one_gpu(world_size):
    """layout "balanced" (documents placed by the dispatch planner, K,V sent only where the mask needs
    them: schedule.direct_pass) at W = 3, 4 on one GPU, bf16, GQA 8/2: ring, burst, allgather (and
    usp at W=4) x masks documents and documents + window; reassembled out, dq, dk, dv within 1.5x
    torch's bf16 SDPA error of the fp32 reference; every kernel fused."""
    W = world_size
    algos = ("ring", "burst", "allgather") + (("usp",) if W == 4 else ())
    masks = ("documents", "documents_window")
    cases = [(algo, "balanced", 1, mask) for algo in algos for mask in masks]
    per_rank = run_on_ranks(W, ranks.cp_cases, cases, SEQ, B, *HEADS, D, seed=SEED)
    fails, table = [], []
    fails += rank_failures(per_rank, f"W={W}")
    for case in cases:
        algo, layout, stripe, mask = case
        if any(case not in res["results"] for res in per_rank):
            continue  # reported above
        ref, sdpa = _reference(*HEADS, mask)
        got = [mb.unshard([res["results"][case][i] for res in per_rank], 0, layout, cu_seqlens=doc_bounds(SEQ))
               for i in range(4)]
        engine = errors(got, ref)
        what = f"W={W} balanced {mask} {algo}"
        table.append(f"{what}: " + " ".join(f"{n} {e:.2e}" for n, e in engine.items()))
        fails += check(engine, sdpa, what)
        for rank, res in enumerate(per_rank):
            fails += kernel_failures(res["kernels"][case], f"{what} rank {rank}")
    assert not fails, "\n".join(fails[:40]) + f"\n({len(fails)} failures)\n" + "\n".join(table)
