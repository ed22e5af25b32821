"""Static vertical-slash sparse attention (megatron_burst.sparse) under ring and burst, flat and
double ring, every layout, W in {2, 3, 4, 8}, MHA and GQA, against a dense masked reference
(forward and gradients); the block-sparse kernel alone; validation; imbalance degrees."""
import pytest
import torch

from harness import run_ranks
import megatron_burst as mb
from megatron_burst.kernels import block_sparse, row_gather
from megatron_burst.masks.imbalance import pattern_imbalance
from megatron_burst.masks.vertical_slash import VerticalSlash, column_counts, plan_pair, plan_tiles
import sparse_cases as sc
from window_cases import dense_masked_reference

TOL = 2e-5


def _check(results, what):
    for rank, res in enumerate(results):
        assert res["finite"], f"{what} rank {rank}"
        for name in ("out", "dq", "dk", "dv"):
            assert res[name] < TOL, f"{what} rank {rank}: {name} off by {res[name]:.2e}"


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 16)])
def test_vertical_slash_exact(W, layout, stripe):
    local = 80 if layout == "striped" and stripe == 16 else 72  # tiles of 64 with a partial one
    for algo, heads in (("burst", (4, 2)), ("ring", (2, 2))):
        res = run_ranks(W, sc.run_sparse_case, algo, layout, heads, local, stripe=stripe, seed=W)
        assert res[0]["sparsity"] > 0.5
        _check(res, f"{algo} {layout}/{stripe} W={W} heads {heads}")


@pytest.mark.parametrize("algo", ["ring", "burst"])
@pytest.mark.parametrize("W,rpn", [(4, 2), (8, 4)])
def test_vertical_slash_double_ring(algo, W, rpn):
    res = run_ranks(W, sc.run_sparse_case, algo, "striped", (4, 2), 64, stripe=16, ranks_per_node=rpn, ring="double")
    _check(res, f"{algo} double {W // rpn}x{rpn}")


def test_rows_that_see_nothing_get_zero():
    res = run_ranks(3, sc.run_sparse_case, "burst", "zigzag", (4, 2), 24, diagonal=False, n_vertical=2, n_slash=2)
    assert res[0]["empty_rows"] > 0
    _check(res, "rows seeing nothing")


def test_block_sparse_kernel_skips_empty_tiles_and_matches_reference():
    S, h = 256, 2
    pattern = VerticalSlash(torch.tensor([[0, 3], [5, 200]]), torch.tensor([[0, 1], [0, 7]]))
    pos = torch.arange(S)
    tiled = plan_tiles(pattern, S, pos, pos, columns="tiles")
    # tiles: 4 x 4 causal; column tiles 0 (verticals 0, 3, 5) and the diagonal (slash) are visible, plus
    # tile 3 from the vertical line at 200 and the tile before the diagonal where offset 7 crosses it
    assert [len(t.cols) // 64 for t in tiled] == [1, 2, 3, 3]
    exact = plan_tiles(pattern, S, pos, pos, columns="exact")
    vis_all = pattern.dense(S)
    for t in exact:  # exactly the columns some row of the tile sees, in any head
        assert t.cols.tolist() == vis_all[:, t.q0:t.q1].any(0).any(0).nonzero().squeeze(1).tolist()
    assert sum(len(t.cols) for t in exact) < sum(len(t.cols) for t in tiled)
    plan = exact
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, h, S, 8, generator=g, dtype=torch.float64) for _ in range(4))
    for other in (tiled, plan_tiles(pattern, S, pos, pos, tile=16)):  # other tilings: the same result
        torch.testing.assert_close(block_sparse.forward(q, k, v, "sparse", 1, 0.3, plan=other)[0],
                                   block_sparse.forward(q, k, v, "sparse", 1, 0.3, plan=plan)[0])
    out, lse = block_sparse.forward(q, k, v, "sparse", 1, 0.3, plan=plan)
    vis = pattern.dense(S)
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~vis, float("-inf"))
    torch.testing.assert_close(out.double(), torch.softmax(s, -1) @ v, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)
    D = (do * out.double()).sum(-1)
    grads = block_sparse.backward(do, q, k, v, D, lse, "sparse", 1, 0.3, plan=plan)
    sbhd = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
    ref = dense_masked_reference(sbhd(q), sbhd(k), sbhd(v), sbhd(do), vis, 0.3)
    for got, exp in zip(grads, ref[1:]):
        torch.testing.assert_close(sbhd(got).double(), exp, atol=1e-5, rtol=0)


def _split_pattern(S: int, h: int = 4):
    """Vertical lines, a band of 40 slash offsets and isolated slashes, different per head."""
    g = torch.Generator().manual_seed(3)
    vertical = torch.cat([torch.arange(2).expand(h, 2), torch.randint(0, S, (h, 3), generator=g)], 1)
    slash = torch.cat([torch.arange(40).expand(h, 40), torch.randint(40, S, (h, 6), generator=g)], 1)
    return VerticalSlash(vertical, slash)


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("striped", 16)])
def test_plan_pair_puts_every_visible_pair_in_exactly_one_part(layout, stripe):
    """Tiles (dense columns) and row groups (scattered pairs) partition the pair's visibility:
    vertical lines and the band are tile columns, isolated slashes are gathered row by row, and
    row groups pad a row's widest head at most 2x (key counts rounded up to a power of two)."""
    S, W, h = 384, 2, 4
    pattern = _split_pattern(S, h)
    q_pos = mb.layout_indices(S, 1, W, layout, stripe)
    kv_pos = mb.layout_indices(S, 0, W, layout, stripe)
    want = pattern.visibility(S, q_pos, kv_pos)
    # whole column tiles: widened tile columns leave the gathered part
    tiles_w, groups_w = plan_pair(pattern, S, q_pos, kv_pos, columns="tiles")
    got_w = torch.zeros(h, q_pos.numel(), kv_pos.numel(), dtype=torch.int64)
    for t in tiles_w:
        got_w[:, t.q0:t.q1][:, :, t.cols] += t.vis.long()
    for grp in groups_w:
        for hh in range(h):
            for i, r in enumerate(grp.rows.tolist()):
                got_w[hh, r, grp.idx[hh, i][grp.valid[hh, i]]] += 1
    assert int(got_w.max()) == 1 and torch.equal(got_w.bool(), want)
    tiles, groups = plan_pair(pattern, S, q_pos, kv_pos)
    assert tiles and groups
    got = torch.zeros(h, q_pos.numel(), kv_pos.numel(), dtype=torch.int64)
    for t in tiles:
        got[:, t.q0:t.q1][:, :, t.cols] += t.vis.long()
    dense_part = got.clone()
    slots = 0
    for grp in groups:
        assert torch.equal(grp.rows, torch.sort(grp.rows).values)
        n = grp.idx.shape[2]
        counts = grp.valid.sum(-1).amax(0)
        assert bool((counts > n // 2).all()) and bool((counts <= n).all())  # the power-of-two bucket
        for hh in range(h):
            for i, r in enumerate(grp.rows.tolist()):
                got[hh, r, grp.idx[hh, i][grp.valid[hh, i]]] += 1
        slots += grp.valid.numel()
    assert int(got.max()) == 1 and torch.equal(got.bool(), want)
    widest = sum(int(grp.valid.sum(-1).amax(0).sum()) * h for grp in groups)  # rows padded to their widest head
    assert widest > 0 and slots <= 2 * widest
    # a vertical line seen by a whole tile is a tile column, never gathered
    first_tile_vertical = (want[:, :64].sum((0, 1)) == want.shape[0] * 64).nonzero().squeeze(1)
    assert first_tile_vertical.numel() and bool((dense_part[:, :64][:, :, first_tile_vertical] == 1).all())
    # with dense_column=0 everything is in the tiles
    tiles0, groups0 = plan_pair(pattern, S, q_pos, kv_pos, dense_column=0.0)
    assert groups0 == () and sum(int(t.vis.sum()) for t in tiles0) == int(want.sum())


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 16)])
def test_column_counts_equal_the_definition(layout, stripe):
    """The planner's per-(tile, column) counts, from the lines (binary search for runs of >= 16
    offsets, pair by pair for shorter ones, vertical lines counted once), equal the definition's."""
    S, W, h = 480, 3, 4
    pattern = _split_pattern(S, h)  # band 0..39 (a long run), isolated slashes, vertical lines
    for q_rank, kv_rank in ((2, 0), (1, 1)):
        q_pos = mb.layout_indices(S, q_rank, W, layout, stripe)
        kv_pos = mb.layout_indices(S, kv_rank, W, layout, stripe)
        want = pattern.visibility(S, q_pos, kv_pos).sum(0)  # [nq, sk]
        for tile in (64, 16):
            pad = (-q_pos.numel()) % tile
            per_tile = torch.nn.functional.pad(want, (0, 0, 0, pad)).view(-1, tile, kv_pos.numel()).sum(1)
            assert torch.equal(column_counts(pattern, S, q_pos, kv_pos, tile), per_tile), (layout, tile)


@pytest.mark.parametrize("b,heads", [(1, (2, 2)), (2, (4, 2))])
def test_sparse_kernels_together_match_dense_reference(b, heads):
    """block_sparse on the tiles + row_gather on the rows, merged by lse, equal the dense masked
    attention (forward, lse and gradients), MHA and GQA, batch 1 (2-D index_add path) and 2."""
    S, d = 320, 8
    hq, hkv = heads
    pattern = _split_pattern(S, hq)
    pos = torch.arange(S)
    tiles, groups = plan_pair(pattern, S, pos, pos)
    assert tiles and groups
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(b, hq, S, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, hkv, S, d, generator=g, dtype=torch.float64) for _ in range(2))
    o1, l1 = block_sparse.forward(q, k, v, "sparse", 1, 0.3, plan=tiles)
    o2, l2 = row_gather.forward(q, k, v, "gather", 1, 0.3, plan=groups)
    lse = torch.logaddexp(l1, l2)
    out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    vis = pattern.dense(S)
    sbhd = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
    ref = dense_masked_reference(sbhd(q), sbhd(k), sbhd(v), sbhd(do), vis, 0.3)
    torch.testing.assert_close(sbhd(out).double(), ref[0], atol=1e-5, rtol=0)
    kr = k.repeat_interleave(hq // hkv, 1)
    s = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~vis, float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)
    D = (do * out.double()).sum(-1)
    grads = [a + c for a, c in zip(block_sparse.backward(do, q, k, v, D, lse, "sparse", 1, 0.3, plan=tiles),
                                   row_gather.backward(do, q, k, v, D, lse, "gather", 1, 0.3, plan=groups))]
    for got, exp in zip(grads, ref[1:]):
        torch.testing.assert_close(sbhd(got).double(), exp, atol=1e-5, rtol=0)


def test_sparse_validation_names_the_value():
    q = torch.zeros(16, 1, 2, 4)
    ok = VerticalSlash(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long))
    for pattern, needle in ((VerticalSlash(torch.zeros(3, 1, dtype=torch.long), ok.slash), "3 heads"),
                            (VerticalSlash(torch.tensor([[0], [16]]), ok.slash), "outside [0, 16)"),
                            (VerticalSlash(ok.vertical.float(), ok.slash), "int32/int64"),
                            ("vs", "VerticalSlash(vertical, slash)")):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            mb.sparse_cp_attention(q, q, q, pattern, layout="contiguous", stripe=1)
    with pytest.raises(ValueError, match="'ring' or 'burst'"):
        mb.sparse_cp_attention(q, q, q, ok, algo="ulysses", layout="contiguous", stripe=1)


def _balance_pattern(S=32768, h=2, seed=0):
    """MTraining-like: 4 sink tokens and 12 random vertical lines, a local band of 1024 slash
    offsets and 64 random ones (93.6 % sparse at S = 32768)."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.cat([torch.arange(4).expand(h, 4), torch.randint(0, S, (h, 12), generator=g)], 1)
    slash = torch.cat([torch.arange(1024).expand(h, 1024), torch.randint(1024, S, (h, 64), generator=g)], 1)
    return VerticalSlash(vertical, slash)


def test_imbalance_block_striped_balances_zigzag_does_not():
    """The issue's Done-when at W = 8: block-striped worker-level <= 1.05 and step-level <= 1.2,
    zigzag's step-level >= 2 on the same 90 %+ sparse pattern."""
    S, W = 32768, 8
    pattern = _balance_pattern(S)
    block = pattern_imbalance(pattern, S, W, "striped", stripe=64)
    zigzag = pattern_imbalance(pattern, S, W, "zigzag")
    total = sum(map(sum, block["work"]))
    assert total == sum(map(sum, zigzag["work"]))  # the same pairs, dealt differently
    assert 1 - total / (2 * S * (S + 1) / 2) > 0.9
    assert block["worker"] <= 1.05 and block["step"] <= 1.2, block
    assert zigzag["step"] >= 2, zigzag
    assert zigzag["worker"] > block["worker"]


def _prefix_heavy_pattern(S=32768, h=2, seed=0):
    """Heavy-hitter keys clustered in the prefix (4 sinks + 512 vertical lines in the first 4096
    tokens, e.g. a long system prompt or a document's head), a local band of 512 slash offsets and
    64 random ones: 94.0 % sparse at S = 32768."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.cat([torch.arange(4).expand(h, 4), torch.randint(4, 4096, (h, 512), generator=g)], 1)
    slash = torch.cat([torch.arange(512).expand(h, 512), torch.randint(512, S, (h, 64), generator=g)], 1)
    return VerticalSlash(vertical, slash)


def test_imbalance_zigzag_worker_level_with_prefix_heavy_keys():
    """The issue's Done-when with the paper's contrast at W = 8: on a 90 %+ sparse pattern whose
    vertical lines cluster in the prefix, zigzag holds the prefix on two ranks, so at every ring
    step two ranks carry all the vertical work: worker-level >= 2 (paper 2.61) and step-level >= 2;
    block-striped (64) and the hierarchical ring deal the prefix's stripes to every rank:
    worker <= 1.05, step <= 1.2 (paper 1.03 / 1.16)."""
    S, W = 32768, 8
    pattern = _prefix_heavy_pattern(S)
    zigzag = pattern_imbalance(pattern, S, W, "zigzag")
    total = sum(map(sum, zigzag["work"]))
    assert 1 - total / (2 * S * (S + 1) / 2) > 0.9
    assert zigzag["worker"] >= 2 and zigzag["step"] >= 2, zigzag
    for ring in ("flat", "double"):
        block = pattern_imbalance(pattern, S, W, "striped", stripe=64, ring=ring, ranks_per_node=4)
        assert sum(map(sum, block["work"])) == total
        assert block["worker"] <= 1.05 and block["step"] <= 1.2, (ring, block["worker"], block["step"])


def test_imbalance_counts_pairs_exactly():
    """pair_work (per-line counting with FFT correlations) equals the dense mask's count, and the
    work table puts pair (rank, owner) at the ring's step, flat and double."""
    S, W = 512, 4
    g = torch.Generator().manual_seed(1)
    pattern = VerticalSlash(torch.randint(0, S, (2, 9), generator=g), torch.randint(0, S, (2, 7), generator=g))
    vis = sc.definition_mask(pattern, S)
    for ring in ("flat", "double"):
        res = pattern_imbalance(pattern, S, W, "striped", stripe=4, ring=ring, ranks_per_node=2)
        for r in range(W):
            for step in range(W):
                if ring == "flat":
                    owner = (r - step) % W
                else:
                    T, t = divmod(step, 2)
                    owner = ((r // 2 - T) % 2) * 2 + (r % 2 - t) % 2
                qi = mb.layout_indices(S, r, W, "striped", 4)
                ki = mb.layout_indices(S, owner, W, "striped", 4)
                assert res["work"][r][step] == int(vis[:, qi][:, :, ki].sum()), (ring, r, step)


@pytest.mark.parametrize("W,layout,stripe", [(2, "zigzag", 1), (3, "striped", 8), (4, "contiguous", 1),
                                             (4, "striped", 8)])
def test_dynamic_pattern_identical_on_all_ranks_and_exact(W, layout, stripe):
    """MTraining's Algorithm 1 under CP: every rank estimates the same pattern, the one a single
    process estimates from the whole sequence; attention under it is exact."""
    res = run_ranks(W, sc.run_dynamic_case, layout, stripe, 48)
    whole = run_ranks(1, sc.run_dynamic_case, "contiguous", 1, 0, seq=48 * W)[0]["whole"]
    for rank, r in enumerate(res):
        assert r["pattern"] == res[0]["pattern"], f"rank {rank} estimated another pattern"
        assert r["pattern"] == whole, "the CP estimate differs from the whole-sequence one"
    assert 0.3 < res[0]["sparsity"] < 1
    _check(res, f"dynamic {layout}/{stripe} W={W}")


@pytest.mark.parametrize("W,layout,stripe", [(2, "zigzag", 1), (3, "striped", 8)])
def test_dynamic_pools_as_dense_blocks_exact(W, layout, stripe):
    """slash_lines="pools": every head's slash lines are whole pools of 16 offsets, the same on every
    rank as from the whole sequence; planned as on CUDA (the pools' runs in per-head dense blocks)
    the attention is exact."""
    res = run_ranks(W, sc.run_dynamic_case, layout, stripe, 64, slash_lines="pools", pool=16, runs_apart=True)
    whole = run_ranks(1, sc.run_dynamic_case, "contiguous", 1, 0, seq=64 * W, slash_lines="pools", pool=16)[0]["whole"]
    S = 64 * W
    for rank, r in enumerate(res):
        assert r["pattern"] == res[0]["pattern"] == whole, f"rank {rank}"
    for _, slash in res[0]["pattern"]:
        assert slash and set(slash) == {o for p in {x // 16 for x in slash} for o in range(16 * p, min(S, 16 * p + 16))}
    for rank, r in enumerate(res):  # relative to the largest entry where that exceeds 1 (peaky queries)
        assert r["finite"], rank
        for name in ("out", "dq", "dk", "dv"):
            allowed = TOL * max(1.0, r["scale"][name])
            assert r[name] < allowed, f"dynamic pools {layout}/{stripe} W={W} rank {rank}: {name} off by {r[name]:.2e}"


def test_dynamic_budgets_validated():
    from megatron_burst.masks.dynamic import Dynamic

    q = torch.zeros(16, 1, 2, 4)
    for bad, needle in ((Dynamic(p_v=0.0), "p_v=0.0"), (Dynamic(p_s=1.5), "p_s=1.5"), (Dynamic(last_q=17), "last_q=17"),
                        (Dynamic(last_q=8, slash_lines="runs"), "slash_lines=.runs.")):
        with pytest.raises(ValueError, match=needle):
            mb.sparse_cp_attention(q, q, q, bad, layout="contiguous", stripe=1)


def test_bench_sparse_runs_and_refuses_bad_lengths(capsys, tmp_path):
    from megatron_burst.bench import sparse as bench

    plot = tmp_path / "sparse.png"
    bench.main(["--world-size", "2", "--ranks-per-node", "1", "--seq", "512", "--band", "32", "--verticals", "2",
                "--slashes", "4", "--repeats", "1", "--warmup", "0", "--plot", str(plot)])
    out = capsys.readouterr().out
    for name in ("dense", "zigzag", "token-striped", "block-striped", "hierarchical"):
        assert f"| {name} |" in out, out
    assert plot.exists() or "plot skipped: matplotlib is not installed" in out
    with pytest.raises(SystemExit) as exc:
        bench.main(["--world-size", "4", "--seq", "384"])
    assert exc.value.code == 2 and "schedule block-striped" in capsys.readouterr().err
