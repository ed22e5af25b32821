"""Start W local gloo ranks for a benchmark (or join the ones torchrun started) and gather results."""
from __future__ import annotations

import io
import os
import queue as queue_module
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_burst.world import exit_rank, free_port


COLLECTIVE_TIMEOUT_S = 120


def _entry(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    # a rank that fails inside a collective (say, out of memory) leaves its peers waiting: each
    # collective gives up after COLLECTIVE_TIMEOUT_S instead of gloo's default 30 minutes
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = fn(*args)
    except Exception:
        traceback.print_exc()
        exit_rank(1)
    # by value: torch's queue would pass tensors as shared-memory handles, which die with this process
    buf = io.BytesIO()
    torch.save(result, buf)
    queue.put((rank, buf.getvalue()))
    queue.close()
    queue.join_thread()  # the queue's feeder thread must hand the result over before os._exit
    exit_rank(0)  # barrier, then end without gloo's teardown (it can abort a finished rank)


# glibc settings that keep freed memory in the process (no mmap / munmap and page faults per
# multi-MB temporary): a kernel made of many mid-sized torch ops otherwise spends much of its time
# faulting pages in (bench sparse: 2x). Values are the maxima glibc accepts for the mmap threshold.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, threads: int = 1,
              env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned gloo ranks; returns per-rank results.
    ``env``: variables the ranks start with (those the caller's environment sets win)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, threads, fn, args, queue)) for r in range(world_size)]
    added = {k: v for k, v in (env or {}).items() if k not in os.environ}
    os.environ.update(added)  # a spawned process starts with the parent's environment
    try:
        for p in procs:
            p.start()
    finally:
        for k in added:
            del os.environ[k]
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a benchmark rank failed (exit codes {[p.exitcode for p in procs]})")
            try:
                rank, blob = queue.get(timeout=1.0)
            except queue_module.Empty:  # poll the exit codes again
                continue
            results[rank] = torch.load(io.BytesIO(blob), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
