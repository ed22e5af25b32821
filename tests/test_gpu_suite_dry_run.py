"""The GPU suite's code on CPU: ``make test`` leaves tests/gpu out (it needs CUDA, ``make gpu-test``);
this runs it as its dry run (MEGATRON_BURST_GPU_TESTS_ON_CPU=1: tiny sizes, fp32, CPU ranks, every
comparison against its reference, no CUDA-only assertion), so a broken GPU test shows up in CI
before a GPU session spends device time on it."""
import os
import re
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real suite (make gpu-test)")
def test_gpu_suite_runs_on_cpu_as_a_dry_run():
    env = dict(os.environ, MEGATRON_BURST_GPU_TESTS_ON_CPU="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, "gpu")],
                          cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary and int(summary.group(1)) >= 50, tail
    assert "failed" not in proc.stdout.splitlines()[-1], tail
