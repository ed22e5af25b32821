"""GPU suite setup (``make gpu-test``).

* Every test in tests/gpu is marked ``gpu`` and skipped, with the reason below, when this machine
  has no CUDA device (``make test`` on a CPU machine lists them as skipped; nothing else changes).
* No test may run a plain-torch kernel on CUDA: ``SlowKernelWarning`` is an error in every test here
  (a pytest filterwarnings mark), and since the engine warns once per process and key, an autouse
  fixture also fails any test during which a new "slow kernel" key was recorded.
* fp32 references run in real fp32 (TF32 matmuls off).
* ``MEGATRON_BURST_GPU_TESTS_ON_CPU=1``: the dry run on CPU (see gpu/common.py), nothing skipped
  except the CUDA-only assertions.
* Tests parametrized by ``world_size`` (W processes sharing cuda:0 through a rank pool) are grouped
  per W for ``--dist loadgroup``: one xdist worker holds each W's pool, so pools of different W run
  side by side and no two workers start a pool of the same W.
* ``GPU_TEST_FAILLOG=<file>``: each failure's report is appended to the file the moment it happens
  (a device call that runs out of time keeps the reasons; pytest prints them only at the end), with
  xdist workers too (the controller gets every report, a crashed worker's included).
"""
from __future__ import annotations

import os

import pytest
import torch

from gpu.common import ON_CPU, slow_kernel_keys

GPU_DIR = os.path.dirname(os.path.abspath(__file__))
SKIP_REASON = "needs a CUDA device (make gpu-test on a GPU machine)"

if torch.cuda.is_available():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def pytest_report_header(config):
    if ON_CPU:
        return ["tests/gpu: DRY RUN on CPU (MEGATRON_BURST_GPU_TESTS_ON_CPU=1): tiny sizes, fp32, absolute bounds, "
                "no kernel-choice or self-check assertions"]
    if torch.cuda.is_available():
        return [f"tests/gpu: {torch.cuda.get_device_name(0)}, torch {torch.__version__}"]
    return []


def pytest_collection_modifyitems(config, items):
    run = ON_CPU or torch.cuda.is_available()
    for item in items:
        if not str(item.path).startswith(GPU_DIR + os.sep):
            continue
        item.add_marker(pytest.mark.gpu)
        item.add_marker(pytest.mark.filterwarnings("error::megatron_burst.kernels.choice.SlowKernelWarning"))
        world = getattr(getattr(item, "callspec", None), "params", {}).get("world_size")
        if world is not None:  # one xdist worker per world size (--dist loadgroup): one rank pool each
            item.add_marker(pytest.mark.xdist_group(f"ranks{world}"))
        if not run:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


def pytest_runtest_logreport(report):
    path = os.environ.get("GPU_TEST_FAILLOG")
    if not path or not report.failed:
        return
    text = report.longreprtext
    if len(text) > 8000:  # the assertion message is at the end of a long traceback
        text = text[:2000] + "\n[...]\n" + text[-6000:]
    with open(path, "a") as f:
        f.write(f"===== {report.nodeid} ({report.when}) FAILED\n{text}\n")


@pytest.fixture(autouse=True)
def _no_plain_kernels_on_cuda(request):
    if not str(request.node.path).startswith(GPU_DIR + os.sep):
        yield
        return
    before = set(slow_kernel_keys())
    yield
    new = sorted(set(slow_kernel_keys()) - before)
    assert not new, f"a CUDA block ran a plain-torch kernel (SlowKernelWarning): {new}"
