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

from megatron_burst.world import exit_rank, free_port, port_taken


COLLECTIVE_TIMEOUT_S = 120
AGREE_TIMEOUT_S = 30  # how long ranks wait for each other after a variant (they leave its last barrier together)
_gave_up = False  # this rank gave up its remaining variants: it leaves without the final barrier
# A rank's exit status when the rendezvous port was taken between free_port() and the bind (another
# process on the machine, e.g. a parallel test); run_local then starts the ranks again on a new port.
PORT_TAKEN_EXIT = 98
PORT_ATTEMPTS = 3


def _entry(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    # a rank that fails inside a collective (say, out of memory) leaves its peers waiting: each
    # collective gives up after COLLECTIVE_TIMEOUT_S instead of gloo's default 30 minutes
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001
        if port_taken(e):
            os._exit(PORT_TAKEN_EXIT)  # another process took the port after free_port: run_local retries
        raise
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
    # barrier, then end without gloo's teardown (it can abort a finished rank); after giving up
    # (in_step) a peer may wait in a collective: leaving at once ends its wait with an error
    exit_rank(0, barrier=not _gave_up)


def in_step(variants: list[str], body: Callable[[str, Callable[[], None]], None],
            agree_timeout_s: float = AGREE_TIMEOUT_S) -> dict[str, str]:
    """Run ``body(variant, sync)`` for every variant on every rank of the default group, in step;
    returns this rank's {variant: error text} (a variant absent from it ran). ``sync()`` is a barrier
    for the body's timings, on a group of its own: the default group then carries only the measured
    op's communication, which is what tells a refusal from a failure in mid-exchange (below).

    A variant that raises on one rank can leave its peers inside a collective it never joined. So
    after each variant the ranks compare notes on a separate gloo group with a short timeout
    (``agree_timeout_s``): nobody failed -> the next variant; every rank failed before any
    communication of the variant (each rank's gloo sequence number unchanged: a refusal) -> the
    next variant; otherwise (a rank missing: stuck in a collective; or the
    collectives out of step) the remaining variants are given up on every rank that can still
    tell, and this process leaves without its final barrier, so a peer stuck in a collective gets
    a connection error at once. Either way a failure costs at most ``agree_timeout_s``, not the
    collective timeout once per remaining variant. A failure on every rank after communicating (an
    out-of-memory in every backward, say) gives up too: nothing tells whether every message was
    matched. Once per process: after giving up, a second call
    raises (the process's collectives are out of step).
    """
    global _gave_up
    if _gave_up:
        raise RuntimeError("in_step gave up its variants earlier in this process: its collectives are out of step "
                           "with the other ranks; run the next variants on new ranks (a new run_local)")
    world = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=agree_timeout_s))
    timing = dist.new_group(backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def sync() -> None:
        dist.barrier(group=timing)

    errors: dict[str, str] = {}
    for i, variant in enumerate(variants):
        before = _sequence_number(world)
        try:
            body(variant, sync)
        except Exception as e:  # noqa: BLE001
            errors[variant] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        # failed here; this rank's communication calls before and after the variant (gloo counts its
        # collectives and point-to-point ops; a send can count on its sender only)
        note = torch.tensor([int(variant in errors), before, _sequence_number(world)], dtype=torch.int64)
        notes = [torch.empty_like(note) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(notes, note, group=control)
        except Exception as e:  # noqa: BLE001  (a peer stuck in a collective, or gone)
            why = f"a rank did not report after {variant!r} ({type(e).__name__})"
        else:
            failed = [bool(n[0]) for n in notes]
            if not any(failed):
                continue
            # a failure everywhere is harmless only where no rank had communicated in the variant yet: a
            # message posted and never matched would meet the next variant's
            if all(failed) and all(int(n[1]) == int(n[2]) >= 0 for n in notes):
                continue
            why = f"{variant!r} failed on ranks {[r for r, f in enumerate(failed) if f]} only" if not all(failed) \
                else f"{variant!r} failed on every rank after some had communicated"
        for rest in variants[i + 1:]:
            errors[rest] = f"not run: gave up the remaining variants ({why}; see the first failure)"
        _gave_up = True
        break
    return errors


def _sequence_number(group) -> int:
    """How many collectives ``group`` has run on this rank (-1 where torch does not say)."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001  (a private API)
        return -1


# glibc settings that keep freed memory in the process (no mmap / munmap and page faults per
# multi-MB temporary): a kernel made of many mid-sized torch ops otherwise spends much of its time
# faulting pages in (bench sparse: 2x). Values are the maxima glibc accepts for the mmap threshold.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, threads: int = 1,
              env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned gloo ranks; returns per-rank results.
    ``env``: variables the ranks start with (those the caller's environment sets win). A port taken
    before the rendezvous bound it starts the ranks again on another (PORT_ATTEMPTS in all)."""
    for _ in range(PORT_ATTEMPTS):
        results = _run_local_once(world_size, fn, args, threads, env)
        if results is not None:
            return results
    raise RuntimeError(f"the benchmark ranks' rendezvous port was taken {PORT_ATTEMPTS} times in a row "
                       "(EADDRINUSE): other processes are opening ports fast on this machine")


def _run_local_once(world_size: int, fn: Callable[..., Any], args: tuple, threads: int,
                    env: Optional[dict[str, str]]) -> Optional[list[Any]]:
    """One start of :func:`run_local`'s ranks; None when the rendezvous port was taken."""
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
                while len(results) < world_size:  # results queued before a failed exit still count
                    try:
                        rank, blob = queue.get(timeout=1.0)
                    except queue_module.Empty:
                        break
                    results[rank] = torch.load(io.BytesIO(blob), weights_only=False)
                if len(results) == world_size:
                    break
                codes = [p.exitcode for p in procs]
                for p in procs:  # the others may wait in a collective with it: end them now, not after a join
                    if p.is_alive():
                        p.kill()
                if PORT_TAKEN_EXIT in codes:
                    return None
                raise RuntimeError(f"a benchmark rank failed (exit codes {codes})")
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
