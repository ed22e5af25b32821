"""Sequence-level selective checkpointing: exact gradients, half the stored bytes, less recompute."""
import pytest

from checkpoint_cases import selective_vs_plain, stale_entry_is_never_served
from harness import run_ranks


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)])
@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_recompute_of_earlier_rows_gives_exact_gradients(layout, stripe, algo):
    results = run_ranks(2, selective_vs_plain, layout, algo, 0.5, stripe=stripe)
    for res in results:
        for name, err in res["errs"].items():
            assert err <= 1e-6, (name, err)
        assert res["left"] == 0 and res["hits"] == 1  # the entry was used once and removed
        assert res["stored"] * 2 == res["all_bytes"]  # every rank stores (out, lse) of its later half
    # and the recompute covers at most half of the attention area the full forward did
    assert sum(r["recompute_area"] for r in results) <= 0.5 * sum(r["full_area"] for r in results)
    # early queries see only early keys: the recompute circulates only the K,V prefix they need
    # (8 local rows, 4 recomputed: zigzag and striped need 4 K,V rows, block-striped 2 stripes of 2;
    # contiguous all 8: rank 1's earliest queries see all of rank 0's keys)
    for res in results:
        expected = res["full_fwd_bytes"] if layout == "contiguous" else res["full_fwd_bytes"] // 2
        assert res["recompute_fwd_bytes"] == expected, (layout, res["recompute_fwd_bytes"])


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_other_fractions(fraction):
    for res in run_ranks(3, selective_vs_plain, "zigzag", "burst", fraction, local_len=6):
        assert max(res["errs"].values()) <= 1e-6
        assert res["left"] == 0


def test_stale_entry_is_never_served():
    for err, hits, misses in run_ranks(2, stale_entry_is_never_served):
        assert err <= 1e-6 and hits == 0 and misses == 1
