"""scripts/e2e_gpu.sh's driver, examples/e2e_gpt_1b.py, end to end at its --smoke size on CPU: every
variant that runs without CUDA trains, and the figures it reports are consistent (about 30 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_e2e_smoke_runs_every_cpu_variant(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import e2e_gpt_1b as e2e
    finally:
        sys.path.pop(0)
    # the documented full-size figures
    assert e2e.param_count(e2e.FULL) == 1_170_049_024
    assert e2e.flops_megatron(e2e.FULL) == pytest.approx(e2e.flops_6n(e2e.FULL), rel=1e-3)

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "examples/e2e_gpt_1b.py", "--smoke", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--peak-tflops", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "e2e_results.json").read_text())
    assert data["model"]["parameters"] == e2e.param_count(e2e.SMOKE)
    results = {r["variant"]: r for r in data["results"]}
    assert list(results) == list(e2e.VARIANTS)
    assert "needs CUDA" in results["megatron_local"]["skipped"]
    ran = [results[name] for name in ("burst", "burst_recompute", "burst_recompute_selckpt", "sdpa")]
    for r in ran:
        assert r["returncode"] == 0 and r["precision"] == "bf16", r
        assert r["parameters_trainer"] == data["model"]["parameters"], r  # the trainer's own count
        assert len(r["lm_loss"]) == e2e.SMOKE["iters"] and r["tokens_per_s"] > 0 and r["mfu"] > 0, r
        # the same model, weights and batches: every attention path starts from the same loss
        assert r["lm_loss"][0] == pytest.approx(ran[0]["lm_loss"][0], rel=1e-2), (r["variant"], r["lm_loss"])
    assert ran[0]["kernels"] and not results["sdpa"]["kernels"]  # sdpa replaced our core attention
    assert (out / "e2e.log").exists()
