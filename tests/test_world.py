"""megatron_burst.world: the shared free_port, and exit_rank ending spawned benchmark ranks
(megatron_burst.bench.launch.run_local) with their results delivered and failures reported."""
from __future__ import annotations

import socket

import pytest


def test_free_port_is_bindable():
    from megatron_burst.world import free_port

    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def _ring_sum(scale: float) -> float:
    """A P2P send/recv around the ring (the traffic that can make gloo's teardown abort)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return scale * got.item()


def _fail_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return dist.get_rank()


def test_run_local_gathers_results_and_reports_a_failing_rank():
    from megatron_burst.bench.launch import run_local

    assert run_local(3, _ring_sum, 10.0) == [20.0, 0.0, 10.0]  # rank r received rank r - 1's value
    with pytest.raises(RuntimeError, match="a benchmark rank failed"):
        run_local(2, _fail_on_rank_1)


# Three ranks exchange one tensor around a ring with gloo point-to-point sends, then end through
# exit_rank: the traffic after which, on this torch, gloo's teardown aborts a finished process now and
# then ("terminate called without an active exception", roughly 1 run in 10 without exit_rank).
_P2P_EXIT_SCRIPT = """
import torch, torch.distributed as dist
from megatron_burst.world import exit_rank
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
got = torch.zeros(1)
ops = [dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % world),
       dist.P2POp(dist.irecv, got, (rank - 1) % world)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
print(f"rank {rank} got {int(got.item())}", flush=True)
exit_rank(0)
"""
P2P_EXIT_RUNS = 10


def test_p2p_jobs_end_cleanly_every_time(tmp_path):
    """exit_rank (what the trainer, the bench launchers, check_megatron_lm's ranks and so every
    functional-test run end through) after P2P traffic: every rank of every one of many 3-rank jobs
    exits 0, with its output delivered."""
    import os
    import subprocess
    import sys

    from megatron_burst.world import free_port

    script = tmp_path / "p2p_exit.py"
    script.write_text(_P2P_EXIT_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for run in range(P2P_EXIT_RUNS):
        env = {**os.environ, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
        procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, cwd=repo,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
        outs = [p.communicate(timeout=120) for p in procs]
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"job {run + 1}/{P2P_EXIT_RUNS} rank {r}: status {p.returncode}\n{err[-2000:]}"
            assert f"rank {r} got {(r - 1) % 3}" in out and "terminate called" not in err
