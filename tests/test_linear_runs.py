"""The data-derived layouts in the linear-attention family: packed THD batches (TransformerEngine's
per-sequence zigzag) and the balanced layout (megatron_burst.dispatch.plan_dispatch). linear_attention
(LASP-2, every decay form) and gated_delta_rule at W = 2, 3, 4 equal the plain recurrence run on each
document alone -- output and every gradient -- with one-token chunks, padding tails, documents split
over ranks and placed whole, per-sample balanced boundaries; each all-gather carries one state per
run slot (exact bytes); through fla's varlen kernels (the stand-in) they equal the torch path; what
they refuse is refused before any collective."""
from __future__ import annotations

import pytest

from harness import run_ranks
from linear_cases import B, DK, DV, FP32_TOL, H
from linear_run_cases import (exchange_saved_states, fla_run_layout_cases, run_halo_case, run_layout_cases,
                              run_layout_refusals)

pytestmark = pytest.mark.usefixtures("fresh_kernel_choices")  # tests/conftest.py


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_thd_and_balanced_match_the_per_document_recurrence(world_size):
    results = run_ranks(world_size, run_layout_cases, timeout=300)
    failures = []
    for rank, res in enumerate(results):
        runs = res.pop("runs")
        assert len(res) == 2 * 5 + 2 + (world_size == 1), sorted(res)
        for case, errs in res.items():
            sent = errs.pop("sent", None)
            failures += [f"rank {rank} {case}: {name} relative error {err:.2e} > {FP32_TOL:.0e}"
                         for name, err in errs.items() if not err <= FP32_TOL]
            if sent is not None and case.endswith("g=None") and world_size > 1:
                # one fp32 state [b, h, dk, dv] per slot, the slots padded to the most runs a rank holds
                b = 1 if "thd" in case else B
                slots = max(runs["thd" if "thd" in case else "balanced"])
                assert sent == ((world_size - 1) * slots * b * H * DK * DV * 4,) * 2, (case, sent, runs)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


def test_thd_and_balanced_through_fla_equal_the_torch_path():
    failures = []
    for rank, res in enumerate(run_ranks(3, fla_run_layout_cases, timeout=300)):
        assert len(res) == 2 * 6, sorted(res)
        unused = [case for case, errs in res.items() if not errs.pop("fla_calls") > 0]
        assert not unused, f"rank {rank}: the stand-in fla was not called for {unused}"
        failures += [f"rank {rank} {case}: {name} relative error {err:.2e}" for case, errs in res.items()
                     for name, err in errs.items() if not err <= 1e-5]
    assert not failures, "\n".join(failures[:30])


def test_run_layouts_refused_before_any_collective():
    for res in run_ranks(2, run_layout_refusals):
        m = res["messages"]
        assert res["group_ok"] and res["moved"] == 0, res
        assert "pass them as cu_seqlens" in m["no_documents"]
        assert "run LASP-2" in m["lasp1"]
        assert "placed for layout 'thd'" in m["wrong_layout"] and "layout='thd'" in m["wrong_layout"]
        assert "placed for layout 'thd'" in m["thd_as_balanced"] and "balanced_documents" in m["thd_as_balanced"]
        assert "not divisible by 2 x CP size" in m["not_divisible"]
        assert "pass the Documents the batch was sliced with" in m["balanced_raw"]
        assert "built for another CP size" in m["thd_other_cp"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_conv_halo_over_runs_reaches_back_past_short_runs(world_size):
    """Gated DeltaNet's conv halo over THD runs: runs shorter than the window make a halo span several runs."""
    for res in run_ranks(world_size, run_halo_case):
        assert res["shortest"] < 3 and res["halo"] == 0.0 and res["grad"] < 1e-6, res
        assert res["sent"] == (world_size - 1) * res["slots"] * 3 * 2 * 3 * 4  # width x b x d fp32 per slot


def test_exchange_keeps_this_ranks_entering_states_only():
    """The backward needs every run's transition but only this rank's entering states: a layer keeps
    nseg states, not T (a THD batch has about 2 runs per sequence on every rank)."""
    for res in run_ranks(3, exchange_saved_states):
        assert res["saved_states"] == res["mine"] < res["total"], res


def test_run_layout_moves_runs_by_index_not_one_op_per_run():
    """RunLayout: stacking a rank's runs by chunk count and putting the outputs back is a round trip
    (padding zero, or the run's last entry), fla's varlen rows are run-major for b > 1 and invert, and
    the number of tensor ops depends on the groups, not on the runs (~100 per rank in a THD batch)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_burst.linear.runs import run_layout

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    lengths = [5, 64, 70, 3, 130, 64, 1, 127]
    s, b = sum(lengths), 3
    lay = run_layout(lengths, 64, b, torch.device("cpu"))
    x = torch.arange(b * 2 * s * 4, dtype=torch.float64).view(b, 2, s, 4)  # [b, h, s, d]
    parts = lay.stack(x, 2)
    assert [tuple(p.shape) for p in parts] == [(5, b, 2, 64, 4), (2, b, 2, 128, 4), (1, b, 2, 192, 4)]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for p, grp in zip(parts, lay.groups):  # each run's tokens, then zeros
        for row, i in enumerate(grp.index):
            n = lengths[i]
            assert torch.equal(p[row, :, :, :n], x[:, :, starts[i]:starts[i] + n])
            assert not p[row, :, :, n:].any()
    last = lay.stack(x, 2, replicate=True)
    for p, grp in zip(last, lay.groups):
        for row, i in enumerate(grp.index):
            assert torch.equal(p[row, :, :, lengths[i]:], x[:, :, starts[i] + lengths[i] - 1:starts[i] + lengths[i]]
                               .expand(-1, -1, grp.length - lengths[i], -1))
    assert torch.equal(lay.unstack(parts, 2), x)
    rows = lay.in_run_order([torch.tensor(grp.index) for grp in lay.groups])
    assert rows.tolist() == list(range(len(lengths)))
    t = torch.randn(s, b, 2, 4)  # sbhd
    flat = lay.to_flat(t, True)
    want = torch.cat([t[a:a + n].transpose(0, 1).reshape(-1, 2, 4) for a, n in zip(starts, lengths)])
    assert torch.equal(flat[0], want) and torch.equal(lay.from_flat(flat, b, True), t)

    counts = []
    for n_runs in (8, 64):  # the same two chunk counts, 8x the runs
        lens = [5, 70] * (n_runs // 2)
        lay = run_layout(lens, 64, 1, torch.device("cpu"))
        y = torch.randn(1, 2, sum(lens), 4)
        Count.ops = 0
        with Count():
            lay.unstack(lay.stack(y, 2), 2)
        counts.append(Count.ops)
    assert counts[0] == counts[1], counts
