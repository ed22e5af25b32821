"""megatron_burst.world: the shared free_port, and exit_rank ending spawned benchmark ranks
(megatron_burst.bench.launch.run_local) with their results delivered and failures reported."""
from __future__ import annotations

import socket

import pytest

from harness import pythonpath


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
# One launcher imports torch once and forks every rank of every job (each rank makes its own gloo
# group after the fork, as a spawned rank does): 18 fresh interpreters cost 40 s of CPU here.
_P2P_EXIT_LAUNCHER = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from megatron_burst.world import exit_rank, free_port

def rank_main(rank, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    got = torch.zeros(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % 3),
           dist.P2POp(dist.irecv, got, (rank - 1) % 3)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    print(f"rank {rank} got {int(got.item())}", flush=True)
    exit_rank(0)

jobs, folder = int(sys.argv[1]), sys.argv[2]
results = []
for job in range(jobs):
    port, pids = free_port(), []
    for rank in range(3):
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, kind in ((1, "out"), (2, "err")):
                os.dup2(os.open(f"{folder}/{job}.{rank}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            try:
                rank_main(rank, port)  # ends in exit_rank's os._exit
            except BaseException:
                import traceback
                traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)  # never return into the launcher's loop
        pids.append(pid)
    deadline, statuses = time.monotonic() + 120, [None] * 3
    while None in statuses and time.monotonic() < deadline:
        for r, pid in enumerate(pids):
            if statuses[r] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[r] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for r, pid in enumerate(pids):
        if statuses[r] is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    read = lambda job, r, kind: open(f"{folder}/{job}.{r}.{kind}").read()
    results.append([(statuses[r], read(job, r, "out"), read(job, r, "err")) for r in range(3)])
print(json.dumps(results))
"""
P2P_EXIT_RUNS = 6
RENDEZVOUS_RETRIES = 3  # a job that never got to exchange (a port taken by another process) is relaunched


def _p2p_jobs(launcher, repo, folder, jobs):
    """``jobs`` 3-rank jobs, one after another: per job, [(status, stdout, stderr)] per rank (status
    None: the rank was killed after 120 s)."""
    import json
    import os
    import subprocess
    import sys

    os.makedirs(folder, exist_ok=True)
    proc = subprocess.run([sys.executable, str(launcher), str(jobs), str(folder)], cwd=repo, capture_output=True,
                          text=True, timeout=150 * jobs, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _exchanged(ranks) -> bool:
    return all(f"rank {r} got {(r - 1) % 3}" in out for r, (_, out, _) in enumerate(ranks))


def test_p2p_jobs_end_cleanly_every_time(tmp_path):
    """exit_rank (what the trainer, the bench launchers, check_megatron_lm's ranks and so every
    functional-test run end through) after P2P traffic: every rank of every one of many 3-rank jobs
    that exchanged its tensor exits 0, with its output delivered. (A job whose rendezvous failed, e.g.
    another process took its port on this shared machine, exchanged nothing: it is relaunched.)"""
    import os

    launcher = tmp_path / "p2p_exit.py"
    launcher.write_text(_P2P_EXIT_LAUNCHER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    jobs = _p2p_jobs(launcher, repo, tmp_path / "runs", P2P_EXIT_RUNS)
    assert len(jobs) == P2P_EXIT_RUNS
    for run, ranks in enumerate(jobs):
        for retry in range(RENDEZVOUS_RETRIES):
            if _exchanged(ranks):
                break
            ranks = _p2p_jobs(launcher, repo, tmp_path / f"retry{run}.{retry}", 1)[0]
        for r, (status, out, err) in enumerate(ranks):
            assert status == 0, f"job {run + 1}/{P2P_EXIT_RUNS} rank {r}: status {status}\n{err[-2000:]}"
            assert f"rank {r} got {(r - 1) % 3}" in out and "terminate called" not in err
