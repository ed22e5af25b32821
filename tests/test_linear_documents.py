"""Documents (cu_seqlens) in the linear-attention family: linear_attention (LASP-2 in every decay
form our variants use, LASP-1) and gated_delta_rule at W = 2, 3, 4 equal the plain recurrence run
on each document alone from a zero state -- output and every gradient, every layout, documents
starting inside segments, exactly on segment starts, single-token documents, one document over
every rank, per-sample documents -- and send exactly the bytes they send without documents."""
import pytest

from harness import run_ranks
from linear_cases import FP32_TOL
from linear_doc_cases import document_cases, refusals


def _failures(results: list) -> list:
    failures = []
    for rank, res in enumerate(results):
        for case, errs in res.items():
            sent, plain = errs.pop("bytes")
            if sent != plain:
                failures.append(f"rank {rank} {case}: bytes {sent} with documents, {plain} without")
            failures += [f"rank {rank} {case}: {name} relative error {err:.2e} > {FP32_TOL:.0e}"
                         for name, err in errs.items() if not err <= FP32_TOL]
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_documents_match_the_per_document_recurrence(world_size):
    results = run_ranks(world_size, document_cases, lasp1=world_size < 4, gdn=True)
    assert len(results[0]) >= 40
    failures = _failures(results)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


def test_documents_at_one_rank():
    """W = 1 (every layout is the identity order of its segments): the same cases, no exchange."""
    failures = _failures(run_ranks(1, document_cases, lasp1=False))
    assert not failures, "\n".join(failures[:30])


def test_documents_refused_before_any_collective():
    for res in run_ranks(2, refusals):
        m = res["messages"]
        assert res["group_ok"] and res["moved"] == 0, res
        assert "causal=True" in m["bidirectional"]
        assert "last boundary must be 16" in m["last_bound"]
        assert "2 per-sample" in m["samples"]
        assert "placed for layout 'thd'" in m["thd"] and "pass layout='thd'" in m["thd"]  # tests/test_linear_runs.py
        assert "strictly increasing" in m["gdn_bounds"]
