"""Static vertical-slash sparse attention (megatron_burst.sparse) under ring and burst, flat and
double ring, every layout, W in {2, 3, 4, 8}, MHA and GQA, against a dense masked reference
(forward and gradients); the block-sparse kernel alone; validation; imbalance degrees."""
import pytest
import torch

from harness import run_ranks
import megatron_burst as mb
from megatron_burst.kernels import block_sparse
from megatron_burst.sparse import VerticalSlash, imbalance, plan_tiles
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
    plan = plan_tiles(pattern, S, pos, pos)
    # tiles: 4 x 4 causal; column tiles 0 (verticals 0, 3, 5) and the diagonal (slash) are visible, plus
    # tile 3 from the vertical line at 200 and the tile before the diagonal where offset 7 crosses it
    assert [len(t.cols) // 64 for t in plan] == [1, 2, 3, 3]
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, h, S, 8, generator=g, dtype=torch.float64) for _ in range(4))
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
