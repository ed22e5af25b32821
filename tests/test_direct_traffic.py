"""Direct traffic (schedule.direct_pass, ``CPConfig.traffic = "direct"``): a block goes from its
owner straight to the ranks whose mask needs it, and a gradient straight home.

Results equal the ring's and a dense masked reference (fp32, forward and gradients) for ring and
burst backwards, MHA and GQA, documents with and without a sliding window, W = 2, 3, 4; the bytes
sent are exactly the needed blocks (derived from the dense mask); the recorded schedules replay
under NCCL's rules. The layouts here are the fixed ones (the "balanced" layout, which resolves to
direct traffic by default, comes from a document plan)."""
import numpy as np
import pytest

import direct_traffic_cases as dc
from harness import run_ranks
from megatron_burst.algorithms.schedule import CPConfig, PairNeeds, direct_steps, last_steps, needs_table

TOL = 1e-5
LOCAL = 8


def mixed_bounds(W: int) -> list:
    """Short documents inside rank 0, one spanning ranks 0-1, a 2-token one, one spanning the rest."""
    return [0, 3, 4, LOCAL + 4, LOCAL + 6, LOCAL * W] if W > 2 else [0, 3, 4, LOCAL + 4, LOCAL * W]


def _check_exact(res, what):
    for traffic in ("ring", "direct"):
        assert res[traffic]["finite"], what
        for name in ("out", "dq", "dk", "dv"):
            assert res[traffic][name] <= TOL, f"{what} {traffic}: {name} off by {res[traffic][name]:.2e}"
    assert res["ring_vs_direct"] <= TOL, f"{what}: ring and direct differ by {res['ring_vs_direct']:.2e}"
    assert res["direct"]["bytes"] == res["expected"], (what, res["direct"]["bytes"], res["expected"])


def _check_replay(res, what):
    for ok, text, total in res["replay"]:
        assert ok, f"{what}: {text}"


@pytest.mark.parametrize("algo", ["ring", "burst"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_direct_equals_ring_and_reference_and_sends_only_needed_blocks(world_size, algo):
    """Documents on contiguous (GQA 4:1) and zigzag (MHA), and documents with a sliding window."""
    bounds = mixed_bounds(world_size)
    cases = [("contiguous", (8, 2), None), ("zigzag", (4, 4), None), ("contiguous", (4, 2), (5, 0))]
    for layout, heads, window in cases:
        what = f"{algo} W={world_size} {layout} heads={heads} window={window}"
        for rank, res in enumerate(run_ranks(world_size, dc.run_direct_case, algo, layout, heads, bounds, LOCAL,
                                             window=window, replay=window is None)):
            _check_exact(res, f"{what} rank {rank}")
            if window is None:
                _check_replay(res, f"{what} rank {rank}")
            assert res["direct"]["bytes"]["forward"] <= res["ring"]["bytes"]["forward"], what


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_documents_inside_one_rank_send_nothing(algo):
    """Contiguous, every document inside one rank's share: no block travels, forward or backward
    (the ring sends every block W - 1 hops)."""
    W = 4
    for res in run_ranks(W, dc.run_direct_case, algo, "contiguous", (8, 2), [0, 5, 8, 16, 20, 24, 32], LOCAL):
        _check_exact(res, f"{algo} all local")
        assert res["direct"]["bytes"] == {"forward": 0, "backward": 0}
        assert res["ring"]["bytes"]["forward"] == (W - 1) * 2 * 2 * 2 * LOCAL * 8 * 4


def test_mixed_case_bytes_ring_vs_direct():
    """The mixed documents at W = 4 (contiguous, GQA 4:1, ring backward): rank 0's keys reach rank 1
    only, rank 1's ranks 2 and 3, rank 2's rank 3; the ring sends every block 3 hops."""
    W, b, hkv, d = 4, 2, 2, 8
    kv_blk = 2 * b * hkv * LOCAL * d * 4
    results = run_ranks(W, dc.run_direct_case, "ring", "contiguous", (8, 2), mixed_bounds(W), LOCAL)
    assert [res["direct"]["bytes"]["forward"] for res in results] == [kv_blk, 2 * kv_blk, kv_blk, 0]
    assert [res["ring"]["bytes"]["forward"] for res in results] == [3 * kv_blk] * W
    # backward: K,V out as in the forward, plus dK,dV (fp32) home for each block read
    assert [res["direct"]["bytes"]["backward"] for res in results] == [kv_blk, 3 * kv_blk, 2 * kv_blk, 2 * kv_blk]
    for res in results:
        _check_exact(res, "mixed")


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_direct_on_two_emulated_nodes_is_flat_and_classed_by_link(algo):
    """W = 4 as 2 nodes x 2 with ring="double": the direct pass runs over the flat CP group, and
    bytes to the other node count as inter-node (a block needed by two ranks of a remote node
    crosses twice, where the double ring sends it across once: direct saves the blocks nobody needs)."""
    for rank, res in enumerate(run_ranks(4, dc.run_direct_case, algo, "zigzag", (4, 2), mixed_bounds(4), LOCAL,
                                         ranks_per_node=2, ring="double", replay=True)):
        _check_exact(res, f"{algo} double rank {rank}")
        _check_replay(res, f"{algo} double rank {rank}")
        links = res["direct"]["links"]
        assert links["intra"] + links["inter"] == sum(res["direct"]["bytes"].values())
        if algo == "ring":  # the forward's K,V sends to the other node, from the dense mask
            assert res["direct_forward_inter"] == res["expected_inter_forward"], rank


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_direct_under_usp(algo):
    """USP at W = 4, U = 2: the ring members are Ulysses groups and ``has_work`` on members decides;
    documents inside each group's half need no ring traffic at all."""
    for res in run_ranks(4, dc.run_direct_case, algo, "contiguous", (4, 4), [0, 5, 16, 20, 32], LOCAL,
                         ulysses_size=2):
        assert res["direct"]["finite"] and res["ring_vs_direct"] <= TOL
        for name in ("out", "dq", "dk", "dv"):
            assert res["direct"][name] <= TOL, name
        assert res["direct"]["bytes"]["forward"] < res["ring"]["bytes"]["forward"]


@pytest.mark.parametrize("seed", range(4))
def test_synthetic_needs_table(seed):
    """direct_pass alone, W = 5, a random needs table: each rank visits exactly the owners it needs
    with their data, every home gradient is the sum of exactly the needing holders' contributions,
    bytes are one block (16 B) per needed pair and one gradient (12 B) back, and it replays under
    NCCL's rules, also from the group's first use: a rank the table leaves without any traffic
    posts no transfer, so before the first transfer every member joins one all-reduce that creates
    the communicator (RingComm.ensure_communicator; without it, NCCL's lazy creation would leave
    the others waiting for the idle rank)."""
    W = 5
    results = run_ranks(W, dc.synthetic_schedule, seed)
    table = results[0]["table"]
    isolated = [r for r in range(W) if not any(table[r][o] or table[o][r] for o in range(W) if o != r)]
    traffic = any(table[h][o] for h in range(W) for o in range(W) if h != o)
    for r, res in enumerate(results):
        needed = [o for o in range(W) if o != r and table[r][o]]
        assert sorted(o for o, _ in res["visits"]) == sorted([r] + needed)
        assert all(data == [float(o)] * 4 for o, data in res["visits"])
        holders = [h for h in range(W) if h != r and table[h][r]]
        assert res["home"] == [float(sum(100 * h + r for h in [r] + holders))] * 3
        assert res["sent"] == 16 * len(holders) + 12 * len(needed)
        for ok, text, _ in res["replay_established"]:
            assert ok, f"seed {seed} rank {r}: {text}"
        for ok, text, _ in res["replay"]:
            assert ok, f"seed {seed} rank {r} isolated {isolated}: {text}"
        assert res["posted"] >= (1 if traffic else 0)  # the communicator init, when anything travels


def test_steps_nobody_needs_are_skipped():
    table = needs_table(4, lambda h, o: (h - o) % 4 == 2)
    assert direct_steps(table) == [2]
    assert direct_steps(needs_table(4, lambda h, o: False)) == []
    assert all(not table[i][i] for i in range(4))


def test_traffic_resolves_by_layout_and_refuses_unknown_kinds():
    cfg = CPConfig(None, "flat", "zigzag", 1, True, 1.0)
    assert cfg.resolved_traffic == "ring"
    cfg.layout = "balanced"
    assert cfg.resolved_traffic == "direct"
    cfg.traffic = "ring"
    assert cfg.resolved_traffic == "ring"
    cfg.traffic = "hops"
    with pytest.raises(ValueError, match="traffic='hops'"):
        cfg.resolved_traffic


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("W,U", [(4, 1), (6, 1), (8, 2)])
def test_balanced_pair_table_equals_the_block_masks(causal, W, U):
    """has_work under the balanced layout reads balanced_pair_table (built from the plan's runs):
    exactly the pairs whose block masks are non-empty without a window (per-sample boundaries
    planned on their union included), a superset of them with one (never missing a visible pair)."""
    import random

    from megatron_burst.masks.documents import balanced_documents
    from megatron_burst.masks.visible import visible_blocks
    from megatron_burst.topology import CPTopology

    rng = random.Random(W * 10 + U + causal)
    S = W * 24
    for trial in range(6):
        samples = [sorted({0, S, *rng.sample(range(1, S), rng.randint(0, 9))}) for _ in range(rng.choice((1, 2)))]
        docs = balanced_documents(samples if len(samples) > 1 else samples[0], S, len(samples), W)
        for window in (None, (rng.randint(0, 30), 0 if causal else rng.randint(0, 30))):
            cfg = CPConfig(CPTopology(None, 0, W // U, W // U, None), "flat", "balanced", 1, causal, 1.0, None, docs,
                           ulysses_size=U, window=window)
            M, n = W // U, S // W * U
            fast = [[cfg.has_work(q, kv, n) for kv in range(M)] for q in range(M)]
            exact = [[q != kv and bool(cfg.blocks(q, kv, n)) for kv in range(M)] for q in range(M)]
            off = [[fast[q][kv] and q != kv for kv in range(M)] for q in range(M)]
            if window is None:
                assert off == exact, (trial, samples)
            else:
                assert all(off[q][kv] or not exact[q][kv] for q in range(M) for kv in range(M)), (trial, window)


@pytest.mark.parametrize("causal", [True, False])
def test_balanced_pair_table_on_arbitrary_runs(causal):
    """balanced_pair_table against brute force over tokens, on hand-made placements whose pieces of
    a document sit on ranks in any order (a planner's hole-filling cuts see only one way)."""
    import random

    from megatron_burst.masks.dispatch import balanced_pair_table
    from megatron_burst.masks.dispatch import DispatchPlan

    rng = random.Random(7 + causal)
    W, S = 5, 60
    for trial in range(20):
        bounds = tuple(sorted({0, S, *rng.sample(range(1, S), rng.randint(0, 4))}))
        cuts = sorted({*bounds, *rng.sample(range(1, S), rng.randint(1, 12))})  # runs inside documents
        runs, owner = [], []
        for a, b in zip(cuts, cuts[1:]):
            r = rng.randrange(W)
            runs.append((a, b - a, r))
            owner += [r] * (b - a)
        plan = DispatchPlan(S, W, bounds, tuple(runs), (), 1)
        window = rng.choice((None, (rng.randint(0, 9), 0 if causal else rng.randint(0, 9))))
        got = balanced_pair_table(plan, ((0, 1, bounds),), causal, window)
        doc = [max(i for i, x in enumerate(bounds) if x <= t) for t in range(S)]
        exact = [[False] * W for _ in range(W)]
        for i in range(S):
            for j in range(S):
                if doc[i] == doc[j] and (j <= i or not causal):
                    if window is None or (i - window[0] <= j <= i + window[1]):
                        exact[owner[i]][owner[j]] = True
        for q in range(W):
            for kv in range(W):
                if window is None:
                    assert bool(got[q][kv]) == exact[q][kv] or q == kv, (trial, q, kv, runs, bounds)
                else:
                    assert got[q][kv] or not exact[q][kv] or q == kv, (trial, q, kv, window)


def test_a_pair_table_gives_the_per_pair_answers():
    """PairNeeds (the balanced plan's pair table, read whole) gives the tables, steps and last steps that
    asking the same needs pair by pair gives, also reordered (a node-aware plan's member order)."""
    g = np.random.default_rng(0)
    for size in (1, 2, 3, 8, 64):
        for density in (0.0, 0.05, 0.5, 1.0):
            m = g.random((size, size)) < density
            fast, slow = PairNeeds(m), (lambda h, o, m=m: bool(m[h, o]))
            table = needs_table(size, fast)
            reference = [[h != o and slow(h, o) for o in range(size)] for h in range(size)]
            assert table.tolist() == reference
            assert direct_steps(table) == direct_steps(reference) == [
                t for t in range(1, size) if any(reference[(o + t) % size][o] for o in range(size))]
            assert last_steps(size, fast) == last_steps(size, slow) == [
                max((t for t in range(1, size) if slow((o + t) % size, o)), default=0) for o in range(size)]
            order = g.permutation(size).tolist()
            assert needs_table(size, fast.reordered(order)).tolist() == needs_table(
                size, lambda h, o: slow(order[h], order[o])).tolist()
    with pytest.raises(ValueError, match="cannot serve a ring of 4"):
        needs_table(4, PairNeeds(np.zeros((3, 3), dtype=bool)))
    with pytest.raises(ValueError, match="square bool matrix"):
        PairNeeds(np.zeros((3, 3), dtype=int))
