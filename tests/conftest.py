"""pytest setup: make `harness` and `megatron_burst` importable; stop rank pools at session end."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)

# Test modules import each other as plain modules (`from harness import run_ranks`); the harness
# workers get this sys.path too, so functions defined in test modules unpickle there.
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
# Use the source tree when the package is not installed (find_spec does not import it).
if importlib.util.find_spec("megatron_burst") is None:
    sys.path.insert(0, _REPO_ROOT)

import harness  # noqa: E402  (needs the sys.path entry above)

# Every process of the run, this one, its pytest-xdist workers and whatever they start, defers
# megatron.core's torch.compile decorations to their first call (tests/startup/sitecustomize.py):
# 2.3 s of CPU less in each process that imports megatron.core.
_STARTUP_DIR = os.path.join(_TESTS_DIR, "startup")
if _STARTUP_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = harness.pythonpath(_STARTUP_DIR)
harness.load_test_startup().install()

# The run's processes read this checkout's bytecode where Python writes none itself (harness.RunBytecode):
# written once here, by the run's first process (workers and nested runs inherit the mark), removed at its end.
_BYTECODE_MARK = "MEGATRON_BURST_TEST_BYTECODE"
_RUN_BYTECODE = None
if sys.dont_write_bytecode and _BYTECODE_MARK not in os.environ:
    os.environ[_BYTECODE_MARK] = str(os.getpid())
    _RUN_BYTECODE = harness.RunBytecode(_REPO_ROOT)
    _RUN_BYTECODE.write()

# Each pytest-xdist worker gets its share of the cores for torch's (OpenMP) threads, and what it starts
# inherits it: two workers of two threads each on two cores spin against each other, a fifth more
# wall time for the in-process tests (133-144 s against 174-179 s for four modules, 2026-11-27). A
# value the caller set is kept; one process without xdist keeps torch's default.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 0 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS))
    if "torch" in sys.modules:  # OpenMP read the variable when torch loaded
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Modules whose tests take the longest in all, longest first (--durations=0, one 2-core run, 2026-11-27:
# 1091 s of tests in 565 s). make test runs the suite in pytest-xdist workers, which take tests in
# collection order: starting these first lets the workers finish together instead of one running a
# long test alone at the end (392 s against 428 s in collection order, 2026-11-26). Order only:
# nothing is skipped.
LONGEST_FIRST = ("test_functional_tests", "test_megatron_train", "test_e2e_smoke", "test_sparse_masks",
                 "test_gpu_suite_dry_run", "test_fused_loss", "test_world", "test_triton_masked", "test_nccl_schedule",
                 "test_linear_documents", "test_fused_loss_memory", "test_sparse", "test_gpu_bench_smoke",
                 "test_linear_hybrid_gpt", "test_gpu_session_dry_run", "test_triton_block_sparse", "test_linear_attention", "test_bench_loss",
                 "test_linear_hybrid_documents")


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__ if item.module else "", len(rank)))  # stable


def pytest_sessionfinish(session, exitstatus) -> None:
    """Workers (and the forkserver) exit before pytest reports, leaving no orphan processes."""
    harness.shutdown_pools(stop_forkserver=True)
    if _RUN_BYTECODE is not None:  # the process that wrote it
        _RUN_BYTECODE.remove()


@pytest.fixture(autouse=True)
def no_launcher_env_leak():
    """Fail a test that changes the launcher variables of this process (they are put back first): one
    left behind makes every later subprocess join that world instead of making its own
    (`python -m megatron_burst.train` then binds the leaked MASTER_PORT: EADDRINUSE in CI)."""
    # imported here, not at collection: the package imports torch and megatron.core
    from megatron_burst.world import LAUNCHER_VARIABLES as LAUNCHER_ENV

    before = {name: os.environ.get(name) for name in LAUNCHER_ENV}
    yield
    after = {name: os.environ.get(name) for name in LAUNCHER_ENV}
    if after != before:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        changed = {k: (before[k], after[k]) for k in LAUNCHER_ENV if before[k] != after[k]}
        pytest.fail(f"the test left launcher variables changed in the pytest process (before, after): {changed}; "
                    f"restore them (monkeypatch.setenv/delenv records only variables that existed)")


@pytest.fixture
def fresh_kernel_choices(monkeypatch):
    """No kernel decision, verdict or warning from another test and no MEGATRON_BURST_* kernel
    overrides, for the linear and the attention kernel choices alike (before and after the test)."""
    from megatron_burst.kernels import choice as attention_choice
    from megatron_burst.linear import kernel_choice

    for name in ("MEGATRON_BURST_LINEAR_KERNEL", "MEGATRON_BURST_ALLOW_SLOW_KERNELS", "MEGATRON_BURST_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    kernel_choice.reset()
    attention_choice.reset()
    yield
    kernel_choice.reset()
    attention_choice.reset()
