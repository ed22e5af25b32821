"""The packed-document dispatch planner (megatron_burst.dispatch, issue L part 1) and the documents'
load-balance measure (megatron_burst.documents.imbalance, part 5).

Mixes (S = 131072 tokens, causal within each document), as the bench builds them:
* lognormal: 47 documents, lognormal lengths (sigma 1.0, numpy seed 46) scaled to S, mean 2789;
* 64K+short: one 65536-token document first, then lognormal short ones (median 1024, sigma 0.8,
  seed 0), the last cut to fit;
* 16x8K: 16 documents of 8192.
The issue's table does not give its document lengths, so its zigzag / contiguous / block-striped
numbers are reproduced approximately (lognormal) or exactly (the other two, which it defines).
"""
import time

import numpy as np
import pytest
import torch

from megatron_burst.bench.documents import lognormal_mix, long_plus_short, uniform_mix
from megatron_burst.masks import layout
from megatron_burst.masks.dispatch import ATTEMPTS, MAX_IMBALANCE, MAX_STEP_IMBALANCE, level_chain, plan_dispatch
from megatron_burst.masks.documents import dense_document_mask
from megatron_burst.masks.imbalance import document_imbalance, thd_padded

S = 131072
MIXES = {"lognormal": lognormal_mix(S), "64K+short": long_plus_short(S), "16x8K": uniform_mix(S, 16)}
WORLDS = (8, 32)
CASES = [(mix, W) for mix in MIXES for W in WORLDS]


def fuzz_mix(seed: int, seq: int = S) -> list:
    """Realistic random mixes: lognormal lengths (sigma 0.4-1.5, 16-256 documents), every third one with
    a long document (5-30x the others) somewhere in it."""
    g = np.random.default_rng(1000 + seed)
    n = int(g.integers(16, 257))
    x = g.lognormal(0.0, g.uniform(0.4, 1.5), n)
    if seed % 3 == 0:
        x[g.integers(n)] *= g.uniform(5, 30)
    lengths = np.maximum(1, np.floor(x / x.sum() * seq)).astype(np.int64)
    lengths[np.argmax(lengths)] += seq - lengths.sum()
    return [0] + np.cumsum(lengths).tolist()


@pytest.fixture(scope="module")
def plans():
    return {(mix, W): plan_dispatch(MIXES[mix], W) for mix, W in CASES}


@pytest.mark.parametrize("mix,W", CASES)
def test_plan_is_a_permutation_in_equal_increasing_lists(plans, mix, W):
    plan = plans[(mix, W)]
    idx = plan.index_array()
    assert idx.shape == (W, S // W)
    assert all((np.diff(row) > 0).all() for row in idx)  # increasing within a rank: a layout
    assert np.array_equal(np.sort(idx.ravel()), np.arange(S))  # every token exactly once
    owner = plan.owner()
    for r in range(W):
        assert torch.equal(plan.indices(r), torch.from_numpy(idx[r]))
        assert (owner[idx[r]] == r).all()
    assert [t.tolist() for t in plan.all_indices()] == idx.tolist()


def test_plan_is_deterministic_and_input_agnostic():
    bounds = MIXES["lognormal"]
    a = plan_dispatch(bounds, 32)
    b = plan_dispatch(torch.tensor(bounds, dtype=torch.int32), 32)
    c = plan_dispatch(tuple(bounds), 32)
    assert a.runs == b.runs == c.runs and a.levels == b.levels == c.levels
    assert np.array_equal(a.work, b.work)


def test_divisibility_rule():
    with pytest.raises(ValueError, match="not divisible by world_size=8.*pad the batch"):
        plan_dispatch([0, 100, 1001], 8)
    with pytest.raises(ValueError, match="strictly increasing"):
        plan_dispatch([0, 10, 10, 16], 2)
    odd = plan_dispatch([0, 700, 1500, 8 * 1001], 8)  # S divisible by W but not 2W: fine (no halves needed)
    assert odd.index_array().shape == (8, 1001)
    one = plan_dispatch([0, 3, 10], 1)
    assert one.runs == ((0, 3, 0), (3, 7, 0)) and one.metrics()["worker_total"] == 1.0


def _ranks_per_document(plan, bounds):
    owner = plan.owner()
    return np.array([len(np.unique(owner[a:b])) for a, b in zip(bounds, bounds[1:])])


def test_short_documents_stay_on_one_rank(plans):
    """Documents shorter than an eighth of a rank's tokens live on one rank, except the few cut to make
    every rank's token count exact, where there are several documents per rank (W = 8 here, and 1000
    documents at W = 64). With ~1.5 documents per rank (lognormal at W = 32) equal tokens and equal
    work need most documents split; fewer than W documents are ever cut to fill."""
    big = lognormal_mix(1 << 20, 1000, 1.0, 0)
    cases = [(MIXES[mix], plans[(mix, 8)], 8) for mix in MIXES] + [(big, plan_dispatch(big, 64), 64)]
    for bounds, plan, W in cases:
        lengths = np.diff(bounds)
        short = lengths <= (bounds[-1] // W) // 8
        spread = _ranks_per_document(plan, bounds)
        if short.any():
            assert (spread[short] == 1).mean() >= 0.85
            assert all(plan.levels[d] == 0 for d in np.flatnonzero(short & (spread > 1)))  # fill cuts only
        whole = np.array(plan.levels) == 1
        assert (spread[whole] == 1).all()
    for plan in plans.values():
        assert sum(1 for k in plan.levels if k == 0) < plan.world_size


@pytest.mark.parametrize("mix,W", CASES)
def test_balanced_meets_the_bounds_on_the_issue_mixes(plans, mix, W):
    plan = plans[(mix, W)]
    m = document_imbalance(MIXES[mix], W, plan)
    assert m["worker_total"] <= 1.05, m["worker_total"]
    assert m["worker"] <= 1.15, m["worker"]
    # the planner's own exact count (from its pieces) is the generic count from token ownership
    assert np.array_equal(np.asarray(m["work"]), plan.work.astype(np.int64))
    assert plan.metrics() == pytest.approx({k: m[k] for k in ("worker_total", "worker")})
    assert sum(map(sum, m["work"])) == sum(n * (n + 1) // 2 for n in np.diff(MIXES[mix]).tolist())


@pytest.mark.parametrize("W", WORLDS)
def test_balanced_meets_the_bounds_on_random_mixes(W):
    level_w = 0
    for seed in range(12):
        bounds = fuzz_mix(seed)
        plan = plan_dispatch(bounds, W)
        m = plan.metrics()
        assert m["worker_total"] <= 1.05 and m["worker"] <= 1.15, (seed, m)
        idx = plan.index_array()
        assert np.array_equal(np.sort(idx.ravel()), np.arange(S))
        level_w += plan.attempt == len(ATTEMPTS) - 1
    assert level_w <= 4  # every document over all ranks (the last resort, THD-like traffic) stays rare


@pytest.mark.parametrize("W", WORLDS)
def test_balanced_sends_at_most_half_of_zigzag_on_the_lognormal_mix(plans, W):
    bounds = MIXES["lognormal"]
    zigzag = document_imbalance(bounds, W, "zigzag")
    balanced = document_imbalance(bounds, W, plans[("lognormal", W)])
    assert max(zigzag["kv_sent"]) == W - 1
    assert max(balanced["kv_sent"]) <= 0.5 * max(zigzag["kv_sent"])
    assert max(balanced["kv_sent"]) <= plans[("lognormal", W)].group_size - 1 + 2  # cosets (+ fill cuts)


ISSUE = {  # the issue's worker-level (max / mean) table: zigzag, contiguous, block-striped (64)
    ("lognormal", 8): (1.94, 2.06, 1.01),
    ("lognormal", 32): (2.69, 2.89, 1.05),
    ("64K+short", 8): (1.86, 3.36, 1.01),
    ("16x8K", 32): (1.00, 1.50, 1.24),
}


@pytest.mark.parametrize("mix,W", list(ISSUE))
def test_imbalance_reproduces_the_issue_table(mix, W):
    got = [document_imbalance(MIXES[mix], W, layout, stripe=stripe)["worker_total"]
           for layout, stripe in (("zigzag", 1), ("contiguous", 1), ("striped", 64))]
    want = ISSUE[(mix, W)]
    tol = 0.2 if mix == "lognormal" else 0.05  # the issue's lognormal lengths are not given
    assert got == pytest.approx(want, abs=tol), got
    if mix != "16x8K":  # qualitative: contiguous worst, zigzag far from balanced, block-striped balanced
        assert got[1] > got[0] > 1.5 and got[2] < 1.1


def _dense_pairs(bounds, owner, W, causal):
    vis = dense_document_mask(bounds, len(owner), causal).numpy()
    return np.array([[vis[np.ix_(owner == r, owner == o)].sum() for o in range(W)] for r in range(W)])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped", "thd", "balanced", "explicit"])
def test_imbalance_equals_a_dense_count(layout, causal):
    W, bounds = 4, [0, 5, 37, 38, 90, 128]
    S_ = bounds[-1]
    stripe = 4 if layout == "striped" else 1
    if layout == "thd":
        padded, docs = thd_padded(bounds, W)
        assert padded == (0, 8, 40, 48, 104, 144)
        owner = np.zeros(padded[-1], dtype=np.int64)
        from megatron_burst.masks.layout import thd_indices
        for r in range(W):
            owner[thd_indices(padded, r, W).numpy()] = r
        arg, dense_bounds = "thd", docs
    elif layout == "balanced":
        plan = plan_dispatch(bounds, W, causal=causal)
        owner, arg, dense_bounds = plan.owner(), plan, bounds
    elif layout == "explicit":
        perm = np.random.default_rng(0).permutation(S_)
        lists = [torch.from_numpy(np.sort(perm[r::W])) for r in range(W)]
        owner = np.zeros(S_, dtype=np.int64)
        for r, idx in enumerate(lists):
            owner[idx.numpy()] = r
        arg, dense_bounds = lists, bounds
    else:
        from megatron_burst.masks.layout import layout_indices
        owner = np.zeros(S_, dtype=np.int64)
        for r in range(W):
            owner[layout_indices(S_, r, W, layout, stripe).numpy()] = r
        arg, dense_bounds = layout, bounds
    m = document_imbalance(bounds, W, arg, stripe=stripe, causal=causal)
    pairs = _dense_pairs(dense_bounds, owner, W, causal)
    work = np.array([[pairs[r, (r - t) % W] for t in range(W)] for r in range(W)])
    assert np.array_equal(np.asarray(m["work"]), work)
    mean = work.sum() / W
    assert m["worker_total"] == pytest.approx(work.sum(1).max() / mean)
    assert m["worker"] == pytest.approx(work.max(0).sum() / mean)
    assert m["kv_needed"] == [int((pairs[:, o] > 0).sum() - (pairs[o, o] > 0)) for o in range(W)]
    ring = layout in ("contiguous", "zigzag", "striped", "thd")
    assert m["kv_sent"] == ([W - 1] * W if ring else m["kv_needed"])
    assert m["padding"] == (16 if layout == "thd" else 0)
    if layout == "balanced":
        assert np.array_equal(plan.work.astype(np.int64), work)


def test_level_chain():
    assert level_chain(1) == [1]
    assert level_chain(8) == [1, 2, 4, 8]
    assert level_chain(24) == [1, 3, 6, 12, 24]
    assert level_chain(7) == [1, 7]


def test_planner_speed_1m_tokens_1000_documents_64_ranks(capsys):
    """The issue asks for <= 5 ms on one CPU core; 50 ms is a loose bound for shared CI machines."""
    bounds = lognormal_mix(1 << 20, 1000, 1.0, 3)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan_dispatch(bounds, 64)  # warm
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan = plan_dispatch(bounds, 64)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan.index_array()
        index_time = time.perf_counter() - t0
    finally:
        torch.set_num_threads(torch_threads)
    median = sorted(times)[2]
    with capsys.disabled():
        print(f"\nplan_dispatch: 1M tokens, 1000 documents, W=64: median {median * 1e3:.1f} ms "
              f"(min {min(times) * 1e3:.1f} ms, attempt {plan.attempt}); index lists {index_time * 1e3:.1f} ms; "
              f"{plan.metrics()}")
    assert median < 0.05
    m = plan.metrics()
    assert m["worker_total"] <= 1.05 and m["worker"] <= 1.15


# ------------------------------------------------------------------------ node-aware placement
NODE_CASES = [(mix, W, R) for mix in MIXES for W in WORLDS for R in (4, 8)]


def _node_plans(plans, mix, W, R):
    return plans[(mix, W)], plan_dispatch(MIXES[mix], W, ranks_per_node=R)


@pytest.mark.parametrize("mix,W,R", NODE_CASES)
def test_node_placement_renames_ranks_only(plans, mix, W, R):
    """Placed for nodes of R ranks: the same plan in plan positions (work per position and step,
    metrics, levels), its tokens on CP rank member_order[p]; still a layout (a permutation in equal
    increasing lists), and each CP rank's work (from token ownership) is its position's."""
    one, placed = _node_plans(plans, mix, W, R)
    N = W // R
    order = placed.member_order
    assert order == tuple((p % N) * R + p // N for p in range(W)) and placed.ranks_per_node == R
    assert one.member_order == tuple(range(W)) and one.ranks_per_node == W
    assert np.array_equal(placed.work, one.work) and placed.metrics() == one.metrics()
    assert placed.levels == one.levels and placed.attempt == one.attempt
    idx = placed.index_array()
    assert np.array_equal(np.sort(idx.ravel()), np.arange(S)) and all((np.diff(row) > 0).all() for row in idx)
    one_idx = one.index_array()
    for p in range(W):
        assert np.array_equal(idx[order[p]], one_idx[p])
        assert torch.equal(layout.layout_indices(S, order[p], W, "balanced", plan=placed), torch.from_numpy(one_idx[p]))
    work = np.asarray(document_imbalance(MIXES[mix], W, placed)["work"])  # [CP rank][CP-rank ring step]
    assert np.array_equal(work.sum(1)[list(order)], placed.work.sum(1).astype(np.int64))
    if R < W:  # a different placement: plans key caches, so they must not compare equal
        assert hash(placed) != hash(one) and placed != one
    else:  # R = W is one node: the same plan
        assert placed == one and hash(placed) == hash(one)


@pytest.mark.parametrize("mix,W,R", NODE_CASES)
def test_node_placement_keeps_documents_at_levels_dividing_R_inside_a_node(plans, mix, W, R):
    """What the placement guarantees: a document split over a k-coset with k | R (and a whole one)
    lies inside one node, so every K,V send across nodes (sends_to) is explained by a document at a
    level not dividing R (or cut to fill holes, level 0) held on both ends."""
    one, placed = _node_plans(plans, mix, W, R)
    bounds = MIXES[mix]
    owner = placed.owner()
    node = lambda rank: rank // R  # noqa: E731
    crossing = set()  # (sender, receiver) pairs that documents at other levels may need
    for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
        holders = sorted(set(owner[a:b].tolist()))
        k = placed.levels[d]
        if k >= 1 and R % k == 0:
            assert len({node(r) for r in holders}) == 1, (d, k, holders)
        else:
            crossing |= {(o, r) for o in holders for r in holders if o != r}
    inter = {(o, r) for o, targets in enumerate(placed.sends_to()) for r in targets if node(o) != node(r)}
    assert inter <= crossing, sorted(inter - crossing)
    one_inter = {(o, r) for o, targets in enumerate(one.sends_to()) for r in targets if node(o) != node(r)}
    assert len(inter) <= len(one_inter)
    if mix == "lognormal" and W == 8 and R == 4:  # the bench's mix on 2 x 4: no level above R is used,
        # and the documents cut to fill holes stay in their top-level group (made exactly W/2 x S/W
        # tokens), whose positions {p = A mod 2} the placement puts on node A: nothing crosses
        assert max(placed.levels) <= R
        assert inter == set() and len(one_inter) > 0


def test_node_placement_refuses_a_node_size_not_dividing_W():
    with pytest.raises(ValueError, match=r"ranks_per_node=3 does not divide world_size=8"):
        plan_dispatch(MIXES["16x8K"], 8, ranks_per_node=3)
    with pytest.raises(ValueError, match="positive int"):
        plan_dispatch(MIXES["16x8K"], 8, ranks_per_node=0)
    assert plan_dispatch(MIXES["16x8K"], 8, ranks_per_node=8) == plan_dispatch(MIXES["16x8K"], 8)


# ------------------------------------------------------------------------ the planner against the old one
def test_plan_is_no_worse_than_the_reference_planner():
    """The planner (issue L: <= 5 ms at 1M tokens, 1000 documents, W = 64) against the frozen pre-speed-up
    copy (tests/dispatch_reference.py) on random mixes, several W (prime factors 2 and 3), node placements,
    both causalities and the issue's size: never a later attempt (more splitting) nor a larger group
    (more traffic), and the planner's own targets met wherever the reference met them. Split documents
    now go to the coset with the least work per ring step, so the plans differ where some are split."""
    from dispatch_reference import reference_plan_dispatch

    cases = [(fuzz_mix(seed, S - S % W), W, R, causal)
             for seed, W, R, causal in ((0, 8, None, True), (1, 32, 8, True), (2, 64, None, True), (3, 12, 4, False),
                                        (4, 24, None, True), (5, 6, None, True), (6, 64, 16, True), (7, 1, None, True))]
    cases += [(lognormal_mix(1 << 20, 1000, 1.0, seed), 64, None, True) for seed in (3, 2, 7)]  # the issue's size
    cases.append(([0, 3, 10, 11, 40], 4, None, True))  # tiny: fill cuts dominate
    for bounds, W, R, causal in cases:
        plan = plan_dispatch(bounds, W, ranks_per_node=R, causal=causal)
        _, _, group_size, attempt, work = reference_plan_dispatch(bounds, W, ranks_per_node=R, causal=causal)
        assert plan.attempt <= attempt and plan.group_size <= group_size, (W, R, plan.attempt, attempt)
        mean = work.sum() / W  # the reference's worker_total / worker (per ring step), as plan.metrics()
        if work.sum(1).max() / mean <= MAX_IMBALANCE and work.max(0).sum() / mean <= MAX_STEP_IMBALANCE:
            m = plan.metrics()
            assert m["worker_total"] <= MAX_IMBALANCE and m["worker"] <= MAX_STEP_IMBALANCE, (W, R, m)
