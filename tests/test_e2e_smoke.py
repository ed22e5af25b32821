"""scripts/e2e_gpu.sh's driver, examples/e2e_gpt_1b.py, end to end at its --smoke size on CPU: every
variant that runs without CUDA trains, and the figures it reports are consistent (about 30 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import pythonpath

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_e2e_smoke_runs_every_cpu_variant(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import e2e_gpt_1b as e2e
    finally:
        sys.path.pop(0)
    from megatron_burst.world import LAUNCHER_VARIABLES

    assert e2e.LAUNCHER_ENV == LAUNCHER_VARIABLES  # the orchestrator's copy (it imports no torch)
    # the documented full-size figures
    assert e2e.param_count(e2e.FULL) == 1_170_049_024
    assert e2e.flops_megatron(e2e.FULL) == pytest.approx(e2e.flops_6n(e2e.FULL), rel=1e-3)

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "examples/e2e_gpt_1b.py", "--smoke", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--peak-tflops", "1", "--variants", *e2e.ALL_VARIANTS],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "e2e_results.json").read_text())
    assert data["model"]["parameters"] == e2e.param_count(e2e.SMOKE)
    results = {r["variant"]: r for r in data["results"]}
    assert list(results) == e2e.ALL_VARIANTS
    for name in ("megatron_local", *e2e.MLM_VARIANTS):  # Megatron's attention / Megatron-LM's loop
        assert "needs CUDA" in results[name]["skipped"], results[name]
    ran = [results[name] for name in ("burst", "burst_recompute", "burst_recompute_selckpt", "sdpa")]
    for r in ran:
        assert r["returncode"] == 0 and r["precision"] == "bf16", r
        assert r["parameters_trainer"] == data["model"]["parameters"], r  # the trainer's own count
        assert len(r["lm_loss"]) == e2e.SMOKE["iters"] and r["tokens_per_s"] > 0 and r["mfu"] > 0, r
        # the same model, weights and batches: every attention path starts from the same loss
        assert r["lm_loss"][0] == pytest.approx(ran[0]["lm_loss"][0], rel=1e-2), (r["variant"], r["lm_loss"])
    assert ran[0]["kernels"] and not results["sdpa"]["kernels"]  # sdpa replaced our core attention
    assert (out / "e2e.log").exists()


def test_megatron_lm_log_parsing():
    """The mlm_* variants read pretrain_gpt.py's own log: per-iteration time, its TFLOP/s per GPU
    and lm loss from training_log's line, the largest "max allocated" from report_memory's (lines
    as Megatron-LM core_v0.16.1 prints them with --log-throughput and --log-memory-interval 1)."""
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import e2e_gpt_1b as e2e
    finally:
        sys.path.pop(0)
    log = "\n".join([
        "> compiling dataset index builder ...",
        " [2026-11-26 16:20:01.123456] iteration        1/       6 | consumed samples:            1 | elapsed time "
        "per iteration (ms): 9123.4 | throughput per GPU (TFLOP/s/GPU): 25.0 | learning rate: 1.000000E-04 | "
        "global batch size:     1 | lm loss: 1.051234E+01 | loss scale: 1.0 | grad norm: 3.142 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |",
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 9000.00 | max allocated: 30000.50 | "
        "reserved: 31000.00 | max reserved: 31000.00",
        " [2026-11-26 16:20:02.5] iteration        2/       6 | consumed samples:            2 | elapsed time per "
        "iteration (ms): 512.0 | throughput per GPU (TFLOP/s/GPU): 445.5 | learning rate: 1.000000E-04 | "
        "global batch size:     1 | lm loss: 9.876000E+00 | loss scale: 1.0 | grad norm: 2.000 |",
        "[Rank 0] (after 2 iterations) memory (MB) | allocated: 9000.00 | max allocated: 31000.25 | "
        "reserved: 32000.00 | max reserved: 32000.00",
    ])
    got = e2e.parse_mlm_log(log)
    assert got["iterations"] == [1, 2] and got["elapsed_s"] == [9.1234, 0.512]
    assert got["megatron_tflops"] == [25.0, 445.5] and got["lm_loss"] == [10.51234, 9.876]
    assert got["max_memory_allocated_bytes"] == 31000.25 * 2 ** 20
    assert e2e.parse_mlm_log("no iterations")["elapsed_s"] == []


def test_megatron_lm_worker_runs_pretrain_gpt_with_the_wheel_fitted_start_up(tmp_path):
    """The mlm_* variants' worker runs ``.mlm/pretrain_gpt.py`` as ``python pretrain_gpt.py argv``
    (as __main__, with its argv), after fitting Megatron-LM's two start-up build steps to a pip
    megatron-core: compile_helpers does not run ``make`` (the wheel's helpers_cpp is compiled) and a
    legacy fused-kernel loader that fails for want of nvcc is skipped. A stand-in pretrain_gpt.py
    and megatron.legacy record what they saw (the real ones come from scripts/mlm_bundle.sh)."""
    mlm = tmp_path / "mlm"
    (mlm / "megatron" / "legacy" / "fused_kernels").mkdir(parents=True)
    (mlm / "megatron" / "legacy" / "__init__.py").write_text("")
    (mlm / "megatron" / "legacy" / "fused_kernels" / "__init__.py").write_text(
        "def load(args):\n    raise TypeError(\"unsupported operand type(s) for +: 'NoneType' and 'str'\")\n")
    (mlm / "pretrain_gpt.py").write_text(
        "import sys\n"
        "from megatron.core.datasets.utils import compile_helpers\n"
        "from megatron.legacy import fused_kernels\n"
        "compile_helpers()\n"
        "fused_kernels.load(None)\n"
        "print('ran as', __name__, 'with', sys.argv[1:])\n")
    driver = ("import sys; sys.path.insert(0, sys.argv[1]); import e2e_gpt_1b as e; e.MLM_DIR = sys.argv[2]; "
              "e.main(['--mlm-worker', '--', '--num-layers', '2'])")
    env = {**os.environ, "PYTHONPATH": pythonpath(str(mlm), REPO)}
    proc = subprocess.run([sys.executable, "-c", driver, os.path.join(REPO, "examples"), str(mlm)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dataset index helpers: compiled in the megatron-core wheel" in proc.stdout
    assert "legacy fused kernels: none to build; nvcc not usable here (TypeError" in proc.stdout
    assert "ran as __main__ with ['--num-layers', '2']" in proc.stdout


def test_profiled_iteration_writes_its_kernel_table_and_categories(tmp_path):
    """--profile-iter N (E2E_PROFILE_ITER / E2E_PROFILE_OUT in the worker): the N-th call of
    Megatron-LM's train_step runs under torch's profiler -- only that one -- and leaves its table and
    {category: ms} beside it (on CPU: CPU time). A stand-in megatron.training.training counts calls."""
    mlm = tmp_path / "mlm"
    (mlm / "megatron" / "training").mkdir(parents=True)
    (mlm / "megatron" / "training" / "__init__.py").write_text("")
    (mlm / "megatron" / "legacy" / "fused_kernels").mkdir(parents=True)
    (mlm / "megatron" / "legacy" / "__init__.py").write_text("")
    (mlm / "megatron" / "legacy" / "fused_kernels" / "__init__.py").write_text("def load(args):\n    pass\n")
    (mlm / "megatron" / "training" / "training.py").write_text(
        "import torch\ncalls = []\n"
        "def train_step(i):\n    calls.append(i)\n    a = torch.ones(64, 64)\n    return float((a @ a).sum())\n")
    (mlm / "pretrain_gpt.py").write_text(
        "from megatron.training import training\n"
        "out = [training.train_step(i) for i in range(4)]\n"
        "assert training.calls == [0, 1, 2, 3] and out == [64.0 ** 3] * 4, (training.calls, out)\n"
        "print('steps ran:', len(out))\n")
    out_file = tmp_path / "mlm_burst_profile.txt"
    driver = ("import sys; sys.path.insert(0, sys.argv[1]); import e2e_gpt_1b as e; e.MLM_DIR = sys.argv[2]; "
              "e.main(['--mlm-worker', '--'])")
    env = {**os.environ, "PYTHONPATH": pythonpath(str(mlm), REPO),
           "E2E_PROFILE_ITER": "3", "E2E_PROFILE_OUT": str(out_file)}
    proc = subprocess.run([sys.executable, "-c", driver, os.path.join(REPO, "examples"), str(mlm)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps ran: 4" in proc.stdout and proc.stdout.count("> profiled iteration") == 1
    assert "aten::mm" in out_file.read_text()
    summary = json.loads((tmp_path / "mlm_burst_profile.txt.json").read_text())
    assert summary["iteration"] == 3 and summary["time"] == "cpu" and summary["wall_ms"] > 0
    assert set(summary["ms"]) == {"gemm", "attention", "fused loss", "rope", "optimizer", "copies",
                                  "elementwise and other"}


def test_a_variants_output_is_in_the_log_while_it_runs(tmp_path):
    """The GPU session kills the driver from outside when its share ends: what a variant printed so
    far must already be in e2e.log (stdout) and beside it (stderr), not held in a pipe. A run past
    its own timeout reports "timeout" with what it printed."""
    import threading
    import time

    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import e2e_gpt_1b as e2e
    finally:
        sys.path.pop(0)
    child = ("import sys, time; print('iteration 1 lm loss 9.5', flush=True); "
             "print('boom', file=sys.stderr, flush=True); time.sleep(60)")
    path = tmp_path / "e2e.log"
    result = {}
    with open(path, "a") as log:
        runner = threading.Thread(target=lambda: result.update(r=e2e._run_logged(
            "v", [sys.executable, "-c", child], str(tmp_path), dict(os.environ), 4, log)))
        runner.start()
        err_path = tmp_path / "e2e.log.v.stderr"
        deadline = time.time() + 3.5
        while not ("iteration 1" in path.read_text() and err_path.exists() and err_path.read_text()) \
                and time.time() < deadline:
            time.sleep(0.2)
        try:
            assert "iteration 1 lm loss 9.5" in path.read_text()  # while the variant still runs
            assert err_path.read_text().strip() == "boom"
            assert runner.is_alive()
        finally:
            runner.join()
    rc, out, err, _ = result["r"]
    assert rc == "timeout" and out.strip() == "iteration 1 lm loss 9.5" and err.strip() == "boom"
    assert "--- stderr (tail)\nboom" in path.read_text()
