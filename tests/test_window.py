"""Sliding-window attention (Megatron's window_size) under every CP algorithm and layout.

Each case runs several windows on one pool call: left smaller than, equal to and larger than a
rank's share of the sequence, a window covering everything (= dense), and a two-sided one, against
a dense masked reference (forward and gradients). Ring and burst traffic is checked to the byte
against the pruned-ring rule derived from the dense mask, and the recorded schedules replay under
NCCL's rules.
"""
import pytest
import torch

from harness import run_ranks
import megatron_burst as mb
import window_cases as wc

TOL = 2e-5
LOCAL = 8  # tokens per rank


def _windows(W, local=LOCAL):
    return [(local // 2 - 1, 0), (local, 0), (local + 3, 0), (local * W, 0), (3, 2)]


def _check(results, W, algo, windows, counted=True):
    for rank, per_window in enumerate(results):
        for window, res in zip(windows, per_window):
            what = f"{algo} W={W} rank {rank} window={window}"
            assert res["finite"], what
            for name in ("out", "dq", "dk", "dv"):
                assert res[name] < TOL, f"{what}: {name} off by {res[name]:.2e}"
            if counted:
                assert res["bytes"]["forward"] == res["expected"]["forward"], what
                key = "burst_backward" if algo == "burst" else "ring_backward"
                assert res["bytes"]["backward"] == res["expected"][key], what
            if "replay" in res:
                for ok, text, total in res["replay"]:
                    assert ok and total > 0, f"{what}: {text}"


@pytest.mark.parametrize("W", [2, 3, 4, 8])
@pytest.mark.parametrize("algo", ["ring", "burst"])
@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)])
def test_window_ring_and_burst_exact_and_counted(W, algo, layout, stripe):
    heads = (4, 2) if (W + len(layout)) % 2 else (2, 2)  # GQA and MHA spread over the grid
    windows = _windows(W)
    res = run_ranks(W, wc.run_window_case, algo, layout, heads, LOCAL, windows, stripe=stripe, replay=W in (3, 4))
    _check(res, W, algo, windows)


def test_window_traffic_shrinks_with_the_window():
    """W=8 contiguous: a window inside one rank's share sends each block one hop (7 of 8 ranks send
    one K,V block); a window covering everything still prunes: block o is needed up to rank 7 only,
    so rank p relays blocks 0..p (p + 1 sends, rank 7 none): 28 blocks against a full ring's 56."""
    windows = [(3, 0), (LOCAL * 8, 0)]
    res = run_ranks(8, wc.run_window_case, "ring", "contiguous", (2, 2), LOCAL, windows)
    kv_blk = 2 * 2 * 2 * LOCAL * 8 * 4
    assert [r[0]["bytes"]["forward"] for r in res] == [kv_blk] * 7 + [0]
    assert [r[1]["bytes"]["forward"] for r in res] == [kv_blk * t for t in (1, 2, 3, 4, 5, 6, 7, 0)]
    _check(res, 8, "ring", windows)


@pytest.mark.parametrize("algo,W,kw", [("allgather", 3, {}), ("allgather", 4, {}), ("ulysses", 2, {}),
                                       ("ulysses", 4, {}), ("usp", 4, {"ulysses_size": 2})])
def test_window_allgather_ulysses_usp(algo, W, kw):
    windows = _windows(W)
    for layout in ("zigzag", "striped"):
        res = run_ranks(W, wc.run_window_case, algo, layout, (4, 2) if algo != "ulysses" else (4, 4), LOCAL, windows,
                        **kw)
        _check(res, W, algo, windows, counted=False)


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_window_double_ring(algo):
    windows = _windows(8)
    res = run_ranks(8, wc.run_window_case, algo, "zigzag", (4, 2), LOCAL, windows, ranks_per_node=4, ring="double",
                    replay=True)
    _check(res, 8, algo, windows, counted=False)
    dense = run_ranks(8, wc.run_window_case, algo, "zigzag", (4, 2), LOCAL, [None], ranks_per_node=4, ring="double")
    assert res[0][0]["bytes"]["forward"] < dense[0][0]["bytes"]["forward"]


def test_window_non_causal_and_with_documents():
    windows = [(2, 5), (5, -1), (-1, 3)]
    res = run_ranks(3, wc.run_window_case, "burst", "zigzag", (4, 2), LOCAL, windows, causal=False, replay=True)
    _check(res, 3, "burst", windows)
    windows = [(3, 0), (9, 0)]
    res = run_ranks(4, wc.run_window_case, "ring", "striped", (4, 2), LOCAL, windows, bounds=[0, 5, 6, 20, 32])
    _check(res, 4, "ring", windows)


def test_window_validation_names_the_value():
    q = torch.zeros(8, 1, 2, 4)
    for bad in ((3,), (-2, 0), (1.5, 0), "4096"):
        with pytest.raises(ValueError, match="window"):
            mb.cp_attention(q, q, q, window=bad)
    # (-1, 0) causal is plain causal attention
    torch.testing.assert_close(mb.cp_attention(q, q, q, window=(-1, 0), layout="contiguous"),
                               mb.cp_attention(q, q, q, layout="contiguous"))


def test_window_single_process_against_reference():
    """W = 1 (Megatron at CP = 1) takes the same path: the window changes the result, exactly."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 2, h, 8, generator=g) for h in (4, 2, 2))
    for window, causal in (((3, 0), True), ((5, 2), False), ((24, 0), True)):
        out = mb.cp_attention(q, k, v, window=window, causal=causal, layout="contiguous")
        ref = wc.dense_masked_reference(q, k, v, torch.zeros_like(q), wc.window_mask(24, window, causal), 8 ** -0.5)[0]
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)
    assert not torch.allclose(mb.cp_attention(q, k, v, window=(3, 0)), mb.cp_attention(q, k, v))
