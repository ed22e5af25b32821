"""A vertical-slash pattern composed with documents and sliding windows: cp_attention(pattern=...,
cu_seqlens=..., window=...) computes pattern AND causal AND same document AND window, exactly.

* the planner alone (megatron_burst.sparse_plan.plan_pair / column_counts with cu_seqlens and
  window): counts equal the definition's, tiles and gathered rows partition exactly the
  intersection, every layout, tile size, column mode and split threshold; on the pattern's device
  with the same constant number of read-backs per pair; pairs the dense mask empties are skipped;
* the attention at W = 2, 3, 4, ring and burst, striped (16) and zigzag, forward and gradients in
  fp32 against a dense masked reference built from the definitions (tests/sparse_mask_cases.py),
  documents shared by the batch and per sample, static and dynamic patterns; under a window the
  ring is pruned as the dense window's is (bytes checked) and the schedule replays under NCCL's
  rules;
* validation names what cannot run, before any collective; sparse_cp_attention is the wrapper.
"""
import pytest
import torch

from harness import run_ranks
import megatron_burst as mb
from megatron_burst import sparse_plan
from megatron_burst.masks.documents import check_cu_seqlens
from megatron_burst.masks.layout import layout_indices_on
from megatron_burst.masks.vertical_slash import (LONG_RUN, VerticalSlash, column_counts, key_floor, pattern_blocks,
                                                 plan_pair)
import sparse_mask_cases as smc
from sparse_cases import definition_mask
from sync_counter import SyncCounter
from window_cases import window_mask

TOL = 1e-5
CPU = torch.device("cpu")


def _floor_pattern(S: int, h: int, g: torch.Generator) -> VerticalSlash:
    """Vertical lines (repeated), a run of exactly LONG_RUN offsets, one just below it from offset 0,
    a long band and isolated offsets."""
    vertical = torch.randint(0, S, (h, 6), generator=g)
    vertical[:, 1] = vertical[:, 0]
    slash = torch.randint(0, S, (h, 3 * LONG_RUN), generator=g)
    start = int(torch.randint(0, S - 2 * LONG_RUN, (1,), generator=g))
    slash[0, :LONG_RUN] = torch.arange(start, start + LONG_RUN)
    slash[h - 1, :LONG_RUN - 1] = torch.arange(LONG_RUN - 1)
    slash[1 % h, :2 * LONG_RUN] = torch.arange(3, 3 + 2 * LONG_RUN)
    return VerticalSlash(vertical, slash)


def _want(pattern, S, q_pos, kv_pos, bounds, window):
    full = definition_mask(pattern, S) & window_mask(S, window, True, bounds)[None]
    return full[:, q_pos][:, :, kv_pos]


def _partition(tiles, groups, shape):
    got = torch.zeros(shape, dtype=torch.int64)
    for t in tiles:
        got[:, t.q0:t.q1][:, :, t.cols] += t.vis.long()
    for grp in groups:
        for hh in range(shape[0]):
            for i, r in enumerate(grp.rows.tolist()):
                got[hh, r, grp.idx[hh, i][grp.valid[hh, i]]] += 1
    return got


@pytest.mark.parametrize("layout,stripe,W", [("contiguous", 1, 2), ("zigzag", 1, 3), ("striped", 1, 4),
                                             ("striped", 16, 2)])
def test_plan_is_the_intersection(layout, stripe, W):
    """plan_pair with documents and a window: the counts equal the definition's, and tiles plus
    row groups hold every pair of pattern AND causal AND document AND window exactly once."""
    S = 96 * W * (2 if layout == "zigzag" else 1)
    h = 3
    g = torch.Generator().manual_seed(W)
    pattern = _floor_pattern(S, h, g)
    masks = [(smc.bounds_of(S, (0.13, 0.4, 0.41, 0.77)), None), (None, (S // 7, 0)), (None, (5, 3)),
             (smc.bounds_of(S, (0.3, 0.62)), (S // 5, 0)), ([0, S], (0, 0))]
    for bounds, window in masks:
        for q_rank, kv_rank in ((W - 1, 0), (0, 0), (W - 1, W - 1)):
            q_pos = mb.layout_indices(S, q_rank, W, layout, stripe)
            kv_pos = mb.layout_indices(S, kv_rank, W, layout, stripe)
            want = _want(pattern, S, q_pos, kv_pos, bounds, window)
            for tile in (64, 16):
                pad = (-q_pos.numel()) % tile
                per_tile = torch.nn.functional.pad(want.sum(0), (0, 0, 0, pad)).view(-1, tile, kv_pos.numel()).sum(1)
                counts = column_counts(pattern, S, q_pos, kv_pos, tile, cu_seqlens=bounds, window=window)
                assert torch.equal(counts, per_tile.int()), (bounds, window, tile)
                for columns in ("exact", "tiles"):
                    for dense_column in (0.0, 0.0625, 0.5):
                        tiles, groups = plan_pair(pattern, S, q_pos, kv_pos, tile, columns, dense_column,
                                                  cu_seqlens=bounds, window=window)
                        got = _partition(tiles, groups, want.shape)
                        assert (got.numel() == 0 or int(got.max()) <= 1) and torch.equal(got.bool(), want), \
                            (bounds, window, tile, columns, dense_column)
                        if not want.any():
                            assert not tiles and groups == ()


def test_key_floor():
    """The floor is the document start and q - left, whichever is later; None without either."""
    q = torch.tensor([0, 3, 9, 10, 11, 30])
    assert key_floor(q) is None and key_floor(q, [0, 40]) is None and key_floor(q, None, (None, 2)) is None
    assert key_floor(q, [0, 10, 40]).tolist() == [0, 0, 0, 10, 10, 10]
    assert key_floor(q, None, (4, 0)).tolist() == [0, 0, 5, 6, 7, 26]  # keys start at 0
    assert key_floor(q, [0, 10, 40], (4, 0)).tolist() == [0, 0, 5, 10, 10, 26]


def test_blocks_skip_pairs_the_dense_mask_empties_and_follow_sample_groups():
    """pattern_blocks under documents/windows: a pair the dense mask leaves empty has no block (and
    no plan is built for it); per-sample documents give one plan per group of samples; the plans
    of at most PLAN_MASKS masks stay cached on the pattern."""
    S, W, local = 256, 4, 64
    pattern = smc.mask_pattern(S, 2)
    docs = check_cu_seqlens(torch.tensor([0, 64, 256]), S, 2)
    # contiguous: rank 2's queries and rank 0's keys lie in different documents; a window of 10 too
    assert pattern_blocks(pattern, "contiguous", 2, 0, W, local, documents=docs) == []
    assert pattern_blocks(pattern, "contiguous", 3, 1, W, local, window=(10, 0)) == []
    plans = pattern._masks[(None, 10)]["plans"]
    assert not any(key[1:3] == (3, 1) for key in plans)  # skipped before planning
    got = pattern_blocks(pattern, "contiguous", 3, 2, W, local, documents=docs, window=(10, 0))
    assert got and all(bs == slice(0, 2) for bs, _ in got)
    per_sample = check_cu_seqlens([torch.tensor([0, 64, 256]), torch.tensor([0, 192, 256])], S, 2)
    got = pattern_blocks(pattern, "contiguous", 3, 1, W, local, documents=per_sample)
    assert {bs.start for bs, _ in got} == {0}  # sample 1: rank 3 (192..255) is a document of its own
    got = pattern_blocks(pattern, "contiguous", 3, 3, W, local, documents=per_sample)
    assert {(bs.start, bs.stop) for bs, _ in got} == {(0, 1), (1, 2)}
    for left in range(20, 20 + sparse_plan.PLAN_MASKS + 2):
        pattern_blocks(pattern, "striped", 1, 0, W, local, 16, window=(left, 0))
    assert len(pattern._masks) == sparse_plan.PLAN_MASKS


def _count_pair(S: int, W: int, dense_column: float):
    local = S // W
    g = torch.Generator().manual_seed(0)
    pattern = _floor_pattern(S, 2, g)
    q_pos, kv_pos = (layout_indices_on(S, r, W, "striped", 16, CPU) for r in (2, 1))
    bounds = smc.bounds_of(S, (0.31, 0.5, 0.77))
    with SyncCounter() as counter:
        tiles, rows = plan_pair(pattern, S, q_pos, kv_pos, dense_column=dense_column, cu_seqlens=bounds,
                                window=(S // 3, 0))
    assert local and (rows == ()) == (dense_column == 0.0)
    return counter, tiles.tiles


@pytest.mark.parametrize("dense_column", [sparse_plan.CPU_DENSE_COLUMN, 0.0])
def test_composed_plan_syncs_do_not_grow_with_tiles(dense_column):
    """Documents and a window add no read-back that grows with the pair: a pair of 4x the tiles
    synchronises equally often, at most 3 times (the pattern's runs, the plan's sizes, the row groups')."""
    small, t_small = _count_pair(4 * 256, 4, dense_column)
    large, t_large = _count_pair(4 * 1024, 4, dense_column)
    assert t_large > 2 * t_small >= 4
    assert small.count == large.count <= 3, (small.ops, large.ops)


def test_composed_planner_names_its_device():
    """Under a meta default device, the composed planner (floor, counts, tiles, gathered rows) makes
    every tensor on the pattern's device, and plans what it plans without the trap."""
    S, W = 320, 4
    q_pos, kv_pos = (layout_indices_on(S, r, W, "striped", 16, CPU) for r in (3, 1))
    bounds = smc.bounds_of(S, (0.3, 0.6))
    want = plan_pair(smc.mask_pattern(S, 2), S, q_pos, kv_pos, cu_seqlens=bounds, window=(90, 0))
    pattern = smc.mask_pattern(S, 2)  # on the CPU, fresh (its tables are built under the trap)
    torch.set_default_device("meta")
    try:
        assert torch.empty(1).device.type == "meta"
        got = plan_pair(pattern, S, q_pos, kv_pos, cu_seqlens=bounds, window=(90, 0))
    finally:
        torch.set_default_device(None)
    assert got[0] and got[1]
    for a, b in zip(got[0], want[0]):
        assert (a.q0, a.q1) == (b.q0, b.q1) and torch.equal(a.cols, b.cols) and torch.equal(a.vis, b.vis)
    for a, b in zip(got[1], want[1]):
        assert all(torch.equal(x, y) for x, y in ((a.rows, b.rows), (a.idx, b.idx), (a.valid, b.valid)))


def _check(rows, what, window_bytes=True):
    for rank, per_rank in enumerate(rows):
        for res in per_rank:
            label = f"{what} {res['algo']} {res['mask']} rank {rank}"
            assert res["finite"], label
            for name in ("out", "dq", "dk", "dv"):  # relative to the largest entry when that exceeds 1
                allowed = TOL * max(1.0, res["scale"][name])
                assert res[name] < allowed, f"{label}: {name} off by {res[name]:.2e} (allowed {allowed:.2e})"
            assert 0.5 < res["sparsity"] < 1, label
            if "window" in res["mask"] and window_bytes:  # pruned as the dense window's ring
                assert res["bytes"]["forward"] == res["expected"]["forward"], label
                assert res["bytes"]["backward"] == res["expected"]["backward"], label
            elif "window" not in res["mask"]:
                assert res["bytes"]["forward"] == res["full_ring_forward"], label


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("layout,stripe", [("striped", 16), ("zigzag", 1)])
def test_pattern_with_documents_and_window_exact(W, layout, stripe):
    """Ring and burst, documents / window / both / per-sample documents and a window: forward and
    gradients within 1e-5 (fp32; relative to the largest entry where that exceeds 1) of the dense
    masked reference; rows that see nothing get 0."""
    local = 80 if layout == "striped" else 72  # a partial 64-row tile
    rows = run_ranks(W, smc.run_mask_cases, layout, stripe, local, seed=W)
    assert any(res["empty_rows"] for res in rows[0])
    _check(rows, f"{layout}/{stripe} W={W}")


@pytest.mark.parametrize("W,layout,stripe", [(1, "contiguous", 1), (2, "zigzag", 1), (3, "striped", 16)])
def test_shared_runs_as_dense_blocks_exact(W, layout, stripe):
    """A pattern whose heads share a band, pools and vertical lines, planned as on CUDA (runs and
    the vertical keys as positions blocks, no sparse tiles; the vertical keys in one block per pair,
    the runs cut out of it as holes), ring and burst, with documents and a window: exact against the
    dense reference, rows that see nothing get 0; at W = 2 its recorded schedule completes under
    NCCL's rules."""
    rows = run_ranks(W, smc.run_mask_cases, layout, stripe, 72 if W < 3 else 80, seed=W, shared_runs=True,
                     masks=smc.MASKS[:3], replay=W == 2)
    kinds = set()
    for per_rank in rows:
        for res in per_rank:
            kinds |= set(res["kinds"])
            assert res["gathered_per_pair"] <= 1, res["gathered_per_pair"]  # one lines block, runs as holes
            assert all(ok for ok, _, _ in res.get("replay", [(True, "", 0)])), res["replay"]
    assert kinds == {"positions", "positions per head gathered holes"}, kinds
    assert any(res["empty_rows"] for res in rows[0])
    _check(rows, f"shared runs {layout}/{stripe} W={W}")


@pytest.mark.parametrize("W,layout,stripe", [(2, "striped", 16), (3, "zigzag", 1)])
def test_per_head_runs_as_dense_blocks_exact(W, layout, stripe):
    """The heads' own lines (mask_pattern: a band per head, the last head's shifted), planned as on
    CUDA: each head's band in per-head positions blocks (HeadBands), its vertical lines gathered in
    one per-head block at the offsets outside the band (HeadBands.keys, the runs as holes), the isolated offsets in sparse
    tiles without the lines' pairs; ring and burst with documents and windows: exact against the
    dense reference."""
    rows = run_ranks(W, smc.run_mask_cases, layout, stripe, 80 if layout == "striped" else 72, seed=W,
                     runs_apart=True, masks=smc.MASKS[:3])
    kinds = {kind for per_rank in rows for res in per_rank for kind in res["kinds"]}
    assert kinds == {"positions per head", "positions per head gathered holes", "sparse"}, kinds
    assert all(res["gathered_per_pair"] <= 1 for per_rank in rows for res in per_rank)
    _check(rows, f"per-head runs {layout}/{stripe} W={W}")


@pytest.mark.parametrize("W", [2, 4])
def test_window_prunes_the_sparse_ring_and_replays_under_nccl(W):
    """Contiguous, a narrow window: the sparse ring stops where the dense window's does (bytes below
    the full ring's at W = 4), exact, and its recorded schedule completes under NCCL's rules."""
    masks = (("window", None, 0.1), ("documents_window", (0.3, 0.34, 0.62), 0.1))
    rows = run_ranks(W, smc.run_mask_cases, "contiguous", 1, 64, masks=masks, replay=True)
    _check(rows, f"contiguous W={W}")
    for per_rank in rows:
        for res in per_rank:
            assert all(ok for ok, _, _ in res["replay"]), res["replay"]
    if W == 4:
        assert rows[0][0]["bytes"]["forward"] < rows[0][0]["full_ring_forward"]


@pytest.mark.parametrize("W,layout,stripe", [(2, "zigzag", 1), (3, "striped", 8)])
def test_dynamic_pattern_with_documents_and_window_exact(W, layout, stripe):
    """MTraining's dynamic pattern, estimated as without masks, then intersected."""
    masks = (("documents_window", (0.3, 0.34, 0.62), 0.3),)
    rows = run_ranks(W, smc.run_mask_cases, layout, stripe, 48, masks=masks, dynamic=True)
    _check(rows, f"dynamic {layout}/{stripe} W={W}", window_bytes=False)  # the estimate all-reduces too


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_double_ring_with_documents_and_window(algo):
    rows = run_ranks(4, smc.run_mask_cases, "striped", 16, 64, algos=(algo,), masks=smc.MASKS[2:3],
                     ranks_per_node=2, ring="double")
    _check(rows, f"double ring {algo}", window_bytes=False)


def test_validation_names_what_cannot_run():
    """Before any collective: algorithms other than ring/burst/auto, non-causal, THD, a USP group,
    bad patterns; sparse_cp_attention is a wrapper of cp_attention(pattern=...) with its defaults."""
    q = torch.zeros(16, 1, 2, 4)
    ok = VerticalSlash(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long))
    for kw, needle in ((dict(algo="allgather"), "'ring' or 'burst'"), (dict(algo="ulysses"), "'ring' or 'burst'"),
                       (dict(algo="usp", ulysses_size=1), "'ring' or 'burst'"),
                       (dict(causal=False), "pattern is causal"),
                       (dict(layout="thd", cu_seqlens=torch.tensor([0, 16])), "packed THD")):
        with pytest.raises(ValueError, match=needle):
            mb.cp_attention(q, q, q, pattern=ok, **kw)
    with pytest.raises(ValueError, match="packed THD"):
        mb.cp_attention(q[:, 0], q[:, 0], q[:, 0], pattern=ok, qkv_format="thd", cu_seqlens=torch.tensor([0, 16]))
    with pytest.raises(ValueError, match=r"VerticalSlash\(vertical, slash\)"):
        mb.cp_attention(q, q, q, pattern="static")
    with pytest.raises(ValueError, match="window="):
        mb.cp_attention(q, q, q, pattern=ok, window=(-3, 0))
    # the wrapper: the same numbers as cp_attention with its defaults, at world size 1
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(128, 1, 2, 8, generator=g) for _ in range(3)]
    pattern = smc.mask_pattern(128, 2)
    want = mb.cp_attention(*x, pattern=pattern, layout="striped", stripe=64, algo="burst")
    torch.testing.assert_close(mb.sparse_cp_attention(*x, pattern), want, atol=0, rtol=0)
    torch.testing.assert_close(mb.sparse_cp_attention(*x, pattern, cu_seqlens=torch.tensor([0, 50, 128]),
                                                      window=(30, 0)),
                               mb.cp_attention(*x, pattern=pattern, layout="striped", stripe=64,
                                               cu_seqlens=torch.tensor([0, 50, 128]), window=(30, 0)),
                               atol=0, rtol=0)


def test_prepared_call_carries_the_pattern():
    """The pattern is part of the validated call (prepare): cfg.pattern set, sparse kernels chosen,
    nothing to change afterwards; 'auto' resolves to ring or burst."""
    from megatron_burst.algorithms import prepare

    q = torch.zeros(64, 1, 2, 4)
    pattern = smc.mask_pattern(64, 2)
    call = prepare(q, q, q, pattern=pattern, algo="auto", layout="contiguous", window=(8, 0),
                   cu_seqlens=torch.tensor([0, 20, 64]))
    assert call.cfg.pattern is pattern and call.backward_algo in ("ring", "burst")
    assert call.cfg.mask_kinds == ("sparse", "gather") and call.cfg.kernel.get("sparse", "forward")
    assert call.cfg.window == (8, 0) and call.cfg.documents is not None and call.cfg.prune
