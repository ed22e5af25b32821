"""``python -m megatron_burst.bench gpu --smoke`` runs every section end to end on this machine (tiny
sizes; on a CPU in fp32, GPU-only baselines recorded as explicit skips): each section produces
measurement lines with timings or a skip reason, every line carries the environment and the kernel
choice, the JSON lines on stdout match ``--out``, and the markdown table is printed; ``bench verdict`` reads the file as a GPU session leaves it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from megatron_burst.bench import verdict as vd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("dense", "rank_block", "documents", "sparse", "multi_rank")
# lines that measure the engine: they must never carry an error (baselines may, on a GPU machine
# whose peer libraries fail; on CPU nothing may)
ENGINE_VARIANTS = {"engine_w1_burst", "engine_blocks", "dense_engine_w1_burst", "sparse_static", "sparse_static_tiles",
                   "sparse_static_isolated", "sparse_dynamic", "sparse_dynamic_pools",
                   "burst", "ring", "run", "single_rank_reference", "inputs", "plan", "-"}
SUMMARY_PREFIXES = ("ratio", "speedup")


def test_gpu_bench_smoke(tmp_path):
    out = tmp_path / "bench_gpu.jsonl"  # the name scripts/gpu_session.sh gives it (the verdict reads it)
    proc = subprocess.run([sys.executable, "-m", "megatron_burst.bench", "gpu", "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    printed = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert printed == lines, "the JSON lines printed differ from --out"
    on_cuda = torch.cuda.is_available()
    for sec in SECTIONS:
        mine = [l for l in lines if l["section"] == sec and l["variant"] != "done"]
        assert mine, f"section {sec} produced no lines"
        assert any(l["section"] == sec and l["variant"] == "done" for l in lines), f"section {sec} did not finish"
        timed = [l for l in mine if isinstance(l.get("ms"), (int, float)) and l["ms"] > 0]
        assert timed, f"section {sec} has no timing: {[(l['name'], l['variant']) for l in mine]}"
        for l in mine:
            what = f"{sec} {l['name']} {l['variant']}"
            for key in ("device", "torch", "triton", "kernels"):
                assert key in l, f"{what}: no {key!r}"
            if "error" in l:
                tolerated = on_cuda and l["variant"] not in ENGINE_VARIANTS  # a peer baseline on a GPU machine
                assert tolerated, f"{what} raised: {l['error']}\n{l.get('traceback', '')}"
                assert l["error"].strip(), what
                continue
            if "skipped" in l:
                assert isinstance(l["skipped"], str) and l["skipped"].strip(), f"{what}: empty skip reason"
                continue
            if l["variant"].startswith(SUMMARY_PREFIXES):
                assert l.get("ratio", l.get("speedup")) is not None and l.get("baseline"), what
                continue
            assert isinstance(l.get("ms"), (int, float)) and l["ms"] > 0, f"{what}: neither a timing nor a skip"
            for key in ("dtype", "shape", "tflops"):
                assert key in l, f"{what}: no {key!r}"
            if sec != "multi_rank":
                assert "peak_mib" in l and "fwd_ms" in l, what
    # every GPU-only baseline is a visible skip on CPU, never silently missing
    if not on_cuda:
        skipped = {(l["section"], l["variant"]) for l in lines if "skipped" in l}
        for need in (("dense", "sdpa_cudnn"), ("documents", "varlen_flash"), ("documents", "flex_attention"),
                     ("sparse", "dense_sdpa_cudnn"), ("rank_block", "one_call_sdpa_cudnn")):
            assert need in skipped, f"{need} neither ran nor was recorded as skipped"
        # the multi-rank sanity: W ranks agree with the single-rank engine
        for l in lines:
            if l["section"] == "multi_rank" and "rel_diff_vs_w1_engine" in l:
                assert max(l["rel_diff_vs_w1_engine"].values()) < 1e-5, l["rel_diff_vs_w1_engine"]
    assert "## bench gpu results" in proc.stdout
    table = proc.stdout.split("## bench gpu results", 1)[1]
    assert "| section | name | variant |" in table
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| section")]
    assert len(rows) == len([l for l in lines if l["variant"] != "done"])
    if not on_cuda:  # the verdict finds every attention bar in this file: CPU figures are "missing", shown
        rows, machines = vd.verdict(str(tmp_path))
        assert machines and all("cpu" in m for m in machines)
        rank = [r for r in rows if r.bar.startswith("rank block")]
        assert len(rank) == 3 and all("(not on a GPU)" in r.figure for r in rank), rank
        dense = [r for r in rows if r.bar.startswith("dense")]
        assert dense[0].status == vd.MISSING and "no timing of" in dense[0].figure  # the smoke size is not 32K
        assert {r.status for r in rows} == {vd.MISSING}


def test_time_interleaved_warms_every_case_first_and_goes_round_robin():
    """Several cases: one untimed call of each first (first-use work lands on none of them), then
    each case's own warm-up, then the repeats in turns; a case failing early maps to its exception
    while the others are still timed. One case: no extra call (time_fwd_bwd as before)."""
    import torch

    from megatron_burst.bench.gpu import time_fwd_bwd, time_interleaved

    calls = []

    def case(name, fail=False):
        def fwd():
            calls.append(name)
            if fail:
                raise RuntimeError(f"{name} broke")
            return name
        return fwd, (lambda state: None), None

    cpu = torch.device("cpu")
    got = time_interleaved({"a": case("a"), "b": case("b"), "c": case("c", fail=True)}, cpu, warmup=2, repeats=3,
                           max_seconds=60)
    assert calls == ["a", "b", "c"] + ["a", "a"] + ["b", "b"] + ["a", "b"] * 3, calls
    assert got["a"]["repeats"] == got["b"]["repeats"] == 3 and isinstance(got["c"], RuntimeError)
    calls.clear()
    time_fwd_bwd(*case("a")[:2], cpu, warmup=2, repeats=3, max_seconds=60)
    assert calls == ["a"] * 5
