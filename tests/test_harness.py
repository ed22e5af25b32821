"""Tests of the multi-rank harness itself (tests/harness.py)."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import harness
from harness import RankFailure, run_ranks

# ----------------------------------------------------------- rank bodies (module-level: picklable)


def _rank_and_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _scaled_tensor(x: torch.Tensor, *, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    return x * scale + offset + dist.get_rank()


def _process_info() -> dict:
    return {"pid": os.getpid(), "backend": dist.get_backend(), "threads": torch.get_num_threads(),
            "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}}


def _raise_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    return dist.get_rank()


def _raise_then_others_block() -> None:
    if dist.get_rank() == 0:
        raise KeyError("rank 0 gives up before the all_reduce")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 does not join


def _recv_never_sent() -> int:
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends
    return dist.get_rank()


def _exit_abruptly() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _leak_state() -> None:
    torch.set_default_dtype(torch.float64)
    os.environ["RUN_RANKS_LEAK"] = "1"
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    assert parallel_state.get_context_parallel_world_size() == dist.get_world_size()
    import megatron_burst
    from megatron_burst import kernels

    megatron_burst.topology.register_cp_topology(megatron_burst.build_cp_topology(None, 1))
    kernels._VERIFIED[("leaked", "cuda", torch.bfloat16)] = True


def _observe_state() -> tuple:
    from megatron.core import parallel_state

    import megatron_burst.topology
    from megatron_burst import kernels

    return (torch.get_default_dtype(), os.environ.get("RUN_RANKS_LEAK"),
            parallel_state.model_parallel_is_initialized(), torch.rand(1).item(),
            megatron_burst.topology.registered_cp_topology(None), dict(kernels._VERIFIED))


# ----------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_results_per_rank(world_size: int) -> None:
    total = float(sum(range(world_size)))
    assert run_ranks(world_size, _rank_and_sum) == [(r, world_size, total) for r in range(world_size)]


def test_args_kwargs_and_tensors() -> None:
    x = torch.arange(4.0)
    out = run_ranks(3, _scaled_tensor, x, scale=2.0, offset=0.5)
    for rank, t in enumerate(out):
        torch.testing.assert_close(t, x * 2.0 + 0.5 + rank)


def test_workers_are_reused_and_configured() -> None:
    first = run_ranks(2, _process_info)
    second = run_ranks(2, _process_info)
    pids = [info["pid"] for info in first]
    assert pids == [info["pid"] for info in second] == harness.worker_pids(2)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for rank, info in enumerate(first):
        assert info["backend"] == "gloo" and info["threads"] == 1
        assert info["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}


def test_state_is_reset_between_tasks() -> None:
    fresh = run_ranks(2, _observe_state)
    run_ranks(2, _leak_state)
    after = run_ranks(2, _observe_state)
    assert after == fresh  # dtype, env, megatron parallel state and torch RNG all restored
    assert after[0][:3] == (torch.float32, None, False)
    assert after[0][4:] == (None, {})  # no registered CP topology, no kernel self-check verdicts


def test_raising_rank_reports_its_traceback() -> None:
    pids = harness.worker_pids(3) or [info["pid"] for info in run_ranks(3, _process_info)]
    with pytest.raises(RankFailure) as excinfo:
        run_ranks(3, _raise_on, 1)  # ranks 0 and 2 return normally: still a failure
    message = str(excinfo.value)
    assert "rank(s) [1] failed" in message
    assert "----- rank 1 failed -----" in message and "rank 0 failed" not in message
    assert "Traceback (most recent call last)" in message
    assert "in _raise_on" in message and "ValueError: boom from rank 1" in message
    assert excinfo.value.hung == [] and list(excinfo.value.errors) == [1]
    # The pool was replaced: the next call works on fresh processes.
    assert run_ranks(3, _raise_on, -1) == [0, 1, 2]
    assert not set(pids) & set(harness.worker_pids(3))


def test_raise_while_others_block_in_collective() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as excinfo:
        run_ranks(2, _raise_then_others_block, timeout=3.0)
    elapsed = time.monotonic() - start
    message = str(excinfo.value)
    assert 2.5 < elapsed < 10.0
    assert "KeyError: 'rank 0 gives up before the all_reduce'" in message
    assert "rank(s) [1] did not finish within 3 s" in message
    assert "rank 1 hung" in message and "in _raise_then_others_block" in message  # its stack dump
    assert run_ranks(2, _rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_error_grace_cuts_the_wait_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "ERROR_GRACE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] did not finish within 0\.5\d* s"):
        run_ranks(2, _raise_then_others_block, timeout=60.0)
    assert time.monotonic() - start < 5.0


def test_timeout_kills_pool_and_next_call_works() -> None:
    old_pids = [info["pid"] for info in run_ranks(2, _process_info)]
    start = time.monotonic()
    with pytest.raises(RankFailure) as excinfo:
        run_ranks(2, _recv_never_sent, timeout=3.0)
    elapsed = time.monotonic() - start
    assert 2.5 < elapsed < 10.0
    assert excinfo.value.hung == [0] and excinfo.value.errors == {}
    message = str(excinfo.value)
    assert "rank(s) [0] did not finish within 3 s" in message
    assert "in _recv_never_sent" in message and "in recv" in message  # faulthandler stack
    for pid in old_pids:  # killed and reaped, not left as zombies
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run_ranks(2, _rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]
    assert not set(old_pids) & set(harness.worker_pids(2))


def test_dead_worker_is_reported() -> None:
    with pytest.raises(RankFailure, match=r"rank 1 failed -----\nworker process died \(exit code 3\)"):
        run_ranks(2, _exit_abruptly, timeout=10.0)
    assert run_ranks(2, _raise_on, -1) == [0, 1]


def test_unpicklable_fn_is_rejected_without_touching_the_pool() -> None:
    pids = harness.worker_pids(1) or [run_ranks(1, _process_info)[0]["pid"]]
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(1, lambda: 0)
    assert harness.worker_pids(1) == pids


def test_shutdown_and_restart() -> None:
    pids = [info["pid"] for info in run_ranks(2, _process_info)]
    harness.shutdown_pools()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert harness.worker_pids(2) == []
    assert run_ranks(2, _rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_forkserver_preloads_nothing_that_initializes_cuda_on_a_cuda_machine(monkeypatch):
    """On a CUDA machine megatron.core's import initialized CUDA in the forkserver, and every forked
    rank failed ("Cannot re-initialize CUDA in forked subprocess"): it is not preloaded there."""
    import torch

    import harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "megatron.core" not in harness._preload_modules() and "torch" in harness._preload_modules()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "megatron.core" in harness._preload_modules()


def test_a_pool_whose_port_was_taken_starts_again_on_another(monkeypatch) -> None:
    """A port can be taken between picking it and rank 0 listening on it (2 xdist workers start ranks
    side by side): the pool starts again on a new port instead of failing the test."""
    import socket

    harness.shutdown_pools()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    real, picks = harness._free_port, []

    def first_taken() -> int:
        picks.append(taken.getsockname()[1] if not picks else real())
        return picks[-1]

    monkeypatch.setattr(harness, "_free_port", first_taken)
    try:
        assert run_ranks(2, _rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]
    finally:
        taken.close()
    assert len(picks) == 2 and picks[0] != picks[1]


def test_run_bytecode_writes_what_is_missing_and_removes_only_that(tmp_path) -> None:
    """harness.RunBytecode: write() compiles the modules that have no bytecode (a fresh python that
    writes none then imports from it), remove() deletes exactly those files and the __pycache__
    folders it made; bytecode that was there before, and its folder, stay."""
    import subprocess
    import sys

    (tmp_path / "pkg" / "old").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "mod.py").write_text("Y = 2\n")
    (tmp_path / "pkg" / "old" / "__init__.py").write_text("Z = 3\n")
    subprocess.run([sys.executable, "-c", "import compileall, sys; compileall.compile_file(sys.argv[1], quiet=1)",
                    str(tmp_path / "pkg" / "old" / "__init__.py")], check=True)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.pyc"))
    assert len(before) == 1 and before[0].startswith("pkg/old/__pycache__/"), before

    run = harness.RunBytecode(str(tmp_path), dirs=("pkg", "absent"))
    assert run.write() == 2
    assert sorted(os.path.basename(p).split(".")[0] for p in run.written) == ["__init__", "mod"]
    assert run.made_folders == [str(tmp_path / "pkg" / "__pycache__")]
    # a python that writes no bytecode loads the modules from it (python -v says which file it read)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import pkg.mod; print(pkg.mod.Y)"
    loaded = subprocess.run([sys.executable, "-B", "-v", "-c", code, str(tmp_path)], capture_output=True, text=True,
                            check=True)
    assert loaded.stdout.strip() == "2"
    for path in run.written:
        assert f"code object from '{path}'" in loaded.stderr, path
    run.remove()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.pyc")) == before
    assert not (tmp_path / "pkg" / "__pycache__").exists() and (tmp_path / "pkg" / "old" / "__pycache__").exists()
