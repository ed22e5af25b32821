"""Sequence-level selective checkpointing: exact gradients, half the stored bytes, less recompute;
the store serves each recompute its own entry, catches stale ones and never syncs the device."""
import os

import pytest
import torch

import activation_store_cases as cases
from harness import run_ranks
from megatron_burst import activation_store

# Attention area (q rows x kv rows of the rectangles handed to forward kernels) of the recompute
# of the earlier half vs the full forward, per rank, at W=2 with 8 local rows (16 tokens). A
# causal block is handed over as its whole rectangle (8x8 = 64 on the diagonal).
# zigzag: rank 0 = tokens 0-3 + 12-15, rank 1 = 4-11; the recompute (tokens 0-7, the earlier half
#   of the sequence) covers 16 of 96 and 32 of 96: exactly 1/4, the causal share of the earlier half.
# contiguous: rank 0 recomputes tokens 0-3 (16 of 64), rank 1 tokens 8-11, which see all of rank 0
#   (16 + 32 of 128): 1/3, as rank 0 stores its later rows although they are globally early.
# striped: rank r = tokens r, r+2, ...; the off-diagonal block is a 7x7 rectangle (rank 0) and the
#   recompute clips it to 3x3: 25 of 113 and 32 of 128 (57/241 ~ 0.24). With stripe 2 the
#   off-diagonal rectangle is 6x6, clipped to 2x2: 20 of 100 and 32 of 128 (52/228 ~ 0.23).
RECOMPUTE_AREA = {("contiguous", 1): [(16, 64), (48, 128)], ("zigzag", 1): [(16, 96), (32, 96)],
                  ("striped", 1): [(25, 113), (32, 128)], ("striped", 2): [(20, 100), (32, 128)]}


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)])
@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_recompute_of_earlier_rows_gives_exact_gradients(layout, stripe, algo):
    results = run_ranks(2, cases.selective_vs_plain, layout, algo, 0.5, stripe=stripe)
    for res in results:
        for name, err in res["errs"].items():
            assert err <= 1e-6, (name, err)
        assert res["left"] == 0 and res["hits"] == 1  # the entry was used once and removed
        assert res["released"] == 0  # nothing left over, nothing stale
        assert res["stored"] * 2 == res["all_bytes"]  # every rank stores (out, lse) of its later half
    areas = [(r["recompute_area"], r["full_area"]) for r in results]
    assert all(rec > 0 and full > 0 for rec, full in areas), areas
    assert areas == RECOMPUTE_AREA[(layout, stripe)], areas
    recompute, full = (sum(a) for a in zip(*areas))
    # the recompute covers at most a third of the full forward's area, a quarter with zigzag
    assert 3 * recompute <= full and (layout != "zigzag" or 4 * recompute == full)
    # early queries see only early keys: the recompute circulates only the K,V prefix they need
    # (8 local rows, 4 recomputed: zigzag and striped need 4 K,V rows, block-striped 2 stripes of 2;
    # contiguous all 8: rank 1's earliest queries see all of rank 0's keys)
    for res in results:
        expected = res["full_fwd_bytes"] if layout == "contiguous" else res["full_fwd_bytes"] // 2
        assert res["recompute_fwd_bytes"] == expected, (layout, res["recompute_fwd_bytes"])


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_other_fractions(fraction):
    for res in run_ranks(3, cases.selective_vs_plain, "zigzag", "burst", fraction, local_len=6):
        assert max(res["errs"].values()) <= 1e-6
        assert res["left"] == 0 and res["hits"] == 1 and res["released"] == 0


@pytest.mark.parametrize("change", ["shape", "options"])
def test_stale_entry_is_never_served(change):
    """An entry whose host key differs (other shapes, or a changed call) is dropped, not served."""
    for res in run_ranks(2, cases.stale_entry_is_never_served, change):
        assert res["err"] <= 1e-6 and res["hits"] == 0 and res["misses"] == 1
        assert res["dropped"] == 1 and res["left"] == 0 and res["nbytes"] == 0  # the store is empty
        assert len(res["warnings"]) == 1 and "dropped 1 entry" in res["warnings"][0]
        assert res["released"] == 0


@pytest.mark.parametrize("swap", ["sequences", "tokens"])
def test_reordered_batch_is_caught_at_release(swap):
    for res in run_ranks(2, cases.reordered_batch, swap):
        assert res["plain_sums_equal"]  # the old fingerprint (fp64 sums) matched the reordered batch
        assert not res["fingerprints_equal"]
        assert res["hits"] == 1 and res["left_before"] == 0  # same host key: the entry was served ...
        assert res["served_stale"] > 1e-3  # ... and it was wrong for these inputs
        assert res["error"] is not None and "1 of 1 recomputes" in res["error"]  # ... and release says so
        assert "end_iteration" in res["error"]
        assert res["left_after"] == 0 and res["released_again"] == 0  # the check is consumed


def test_misses_by_host_key_drop_the_stale_heads_and_warn_once():
    for res in run_ranks(2, cases.misses_warn_once):
        assert max(res["errs"]) <= 1e-6
        assert res["after_misses"] == dict(misses=2, dropped=2, hits=0, left=0)
        assert len(res["warnings"]) == 1, res["warnings"]  # two misses, one warning
        assert "never recomputed" in res["warnings"][0]
        # a stale head of other shapes in front of the right entry: dropped, then the entry serves
        assert res["hits"] == 1 and res["dropped"] == 3 and res["left"] == 0 and res["released"] == 0


def test_eval_step_in_between_leaves_the_fifo_intact():
    for res in run_ranks(2, cases.eval_step_in_between):
        assert max(res["errs"]) <= 1e-6, res["errs"]
        assert res["left_between"] == 1  # store=False calls neither store nor take
        assert res["hits"] == 1 and res["misses"] == 0 and res["released"] == 0


def test_skipped_backward_is_dropped_at_release():
    for res in run_ranks(2, cases.skipped_backward_then_release, True):
        assert res["released_1"] == 1 and res["left_1"] == 0  # iteration 1's entry is gone
        assert max(res["errs"]) <= 1e-6  # iteration 2's recompute was served its own entry
        assert res["hits"] == 1 and res["dropped"] == 1
        assert res["error"] is None and res["released_2"] == 0 and res["left"] == 0


def test_skipped_backward_without_release_is_caught():
    """Why the release matters: the left-over entry has the same shapes and is served."""
    for res in run_ranks(2, cases.skipped_backward_then_release, False):
        assert res["hits"] == 1 and max(res["errs"]) > 1e-3
        assert res["error"] is not None and "1 of 1 recomputes" in res["error"]
        assert res["left"] == 0  # the release emptied the store before raising


def test_byte_cap_stores_a_placeholder_and_keeps_order():
    for res in run_ranks(2, cases.byte_cap_keeps_order):
        # b=2, 4 heads, 4 of 8 local rows, d=8: out 2*4*4*8*4 bytes + lse 2*4*4*4
        assert res["one_entry"] == 1024 + 128
        assert res["held"] == (2, res["one_entry"])  # the entry and a placeholder
        assert max(res["errs"]) <= 1e-6  # nobody was served another batch's entry
        assert (res["hits"], res["misses"], res["refused"]) == (2, 1, 1)
        assert res["peak"] == res["one_entry"] and res["left"] == 0
        assert len(res["warnings"]) == 1 and "cap of 1152 bytes" in res["warnings"][0]
        assert res["released"] == 0


def test_default_byte_cap_shares_a_quarter_of_device_memory():
    stores = [activation_store.SelectiveAttentionCache() for _ in range(3)]
    live = len(activation_store._LIVE_STORES)
    assert live >= 3
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert stores[0].byte_cap(torch.device("cpu")) == int(memory * 0.25) // live
    assert activation_store.SelectiveAttentionCache(max_bytes=5).byte_cap(torch.device("cpu")) == 5
    with pytest.raises(ValueError, match="max_bytes=-1"):
        activation_store.SelectiveAttentionCache(max_bytes=-1)


def test_put_and_take_never_read_tensors_on_the_host():
    for res in run_ranks(2, cases.no_host_sync_in_put_and_take):
        assert res["calls"] == [] and res["failure"] is None, (res["calls"], res["failure"])
        assert res["hits"] == 1 and res["released"] == 0


def test_end_iteration_releases_every_store_of_a_model():
    for res in run_ranks(2, cases.end_iteration_releases_every_store):
        assert res["paths"] == ["0.selective_cache", "1.1.selective_cache"]
        assert "1.1.selective_cache: 1 of 1 recomputes" in res["error"]
        assert "0.selective_cache" not in res["error"]  # its entry was left over, not stale
        assert res["left"] == [0, 0] and res["dropped"] == 1


def _swap(t: torch.Tensor, dim: int) -> torch.Tensor:
    idx = torch.arange(t.shape[dim])
    idx[[0, 1]] = idx[[1, 0]]
    return t.index_select(dim, idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fingerprint_sees_order_that_sums_do_not(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randint(-8, 9, (6, 3, 4, 5), generator=g) / 4).to(dtype)  # sums exact in any order
    base = activation_store.fingerprint(t)
    assert base.dtype == torch.float64 and base.shape == (1,)
    assert torch.equal(base, activation_store.fingerprint(t.clone()))  # deterministic
    # other strides: the same value up to rounding (bitwise equality is needed only for equal
    # strides, which the host key guarantees)
    assert torch.allclose(base, activation_store.fingerprint(t.transpose(0, 1).contiguous().transpose(0, 1)), rtol=1e-6)
    for dim in range(4):
        swapped = _swap(t, dim)
        assert not torch.equal(swapped, t)
        assert swapped.sum(dtype=torch.float64) == t.sum(dtype=torch.float64)
        assert not torch.equal(activation_store.fingerprint(swapped), base), dim
    # the same elements laid out as another shape also differ (dimensions are weighted apart)
    assert not torch.equal(activation_store.fingerprint(t.reshape(3, 6, 4, 5)), base)


def test_fingerprint_chunks_like_one_pass(monkeypatch):
    t = torch.randn(7, 2, 3, 4, generator=torch.Generator().manual_seed(1))
    whole = activation_store.fingerprint(t)
    monkeypatch.setattr(activation_store, "_FINGERPRINT_CHUNK", 24)  # one row of dim 0 per chunk
    chunked = activation_store.fingerprint(t)
    assert torch.allclose(whole, chunked, rtol=1e-6, atol=0)


def test_recomputed_rows():
    assert activation_store.recomputed_rows(8, 0.5) == 4
    assert activation_store.recomputed_rows(6, 0.25) == 4  # round(1.5) = 2 stored
    assert activation_store.recomputed_rows(8, 1.0) == 0 and activation_store.recomputed_rows(8, 0.0) == 8
    with pytest.raises(ValueError, match="--seq-selective-ckpt-ratio"):
        activation_store.recomputed_rows(8, 1.5)
