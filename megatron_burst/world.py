"""Joining and leaving a torch.distributed world from an entry point.

    port = free_port()            # a rendezvous port for ranks this process starts itself
    ...                           # init_process_group, train / benchmark
    exit_rank(0)                  # barrier, flush, end the process without gloo's destructors

Why :func:`exit_rank` exists: with torch 2.13 and gloo, a process that used point-to-point
sends (the CP ring) can abort *after* its work is done -- ``terminate called without an active
exception`` (SIGABRT) from a gloo worker thread torn down by destroy_process_group or by the
interpreter's exit. Under torchrun one such rank fails the whole job. Once every rank has passed
a final barrier nothing is left to communicate, so the process ends with ``os._exit``, which runs
no destructors at all.
"""
from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import NoReturn, Optional

import torch
import torch.distributed as dist


# What a launcher (torchrun, the test harness) sets for each rank; a process that finds RANK set joins
# that world (megatron_burst.train), so a world of one must start without these.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it), for MASTER_PORT.

    Another process may take it before the rendezvous binds it; callers that start many worlds
    in one process and must never reuse a port (tests/harness.py) keep their own record.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(error: object) -> bool:
    """Whether an error (an exception or its text) says a rendezvous port was taken between
    :func:`free_port` and the bind (EADDRINUSE): then a launcher starts again on another port."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def group_timeout() -> Optional[timedelta]:
    """The timeout of the default process group (``init_process_group(timeout=...)``, Megatron-LM's
    ``--distributed-timeout-minutes``), for process groups made later; None without a world or
    where the backend does not report it (new_group then takes torch's default)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        timeout = group._get_backend(device).options._timeout
    except Exception:  # a private API: absent in some torch builds
        return None
    return timeout if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None


def exit_rank(code: int = 0, barrier: bool = True) -> NoReturn:
    """End this rank's process with exit status ``code``, skipping torch.distributed teardown.

    With ``code == 0`` and an initialized default group, first waits on a barrier, so no rank
    leaves while another still expects a message from it; a failing barrier (a peer already
    gone) turns the status into 1. ``barrier=False`` leaves at once: for a rank whose peers may be
    stuck in a collective, so that they get a connection error instead of waiting out its timeout. Then flushes stdout and stderr and calls ``os._exit``: no
    destroy_process_group, no atexit handlers, no C++ destructors (the gloo abort above).
    Flush or close anything else (files, multiprocessing queues) before calling this.
    """
    if code == 0 and barrier and dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except Exception as exc:  # a peer died after its work: report it, do not hang or abort
            print(f"exit_rank: final barrier failed ({exc}); exiting with status 1",
                  file=sys.stderr)
            code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass  # a closed pipe must not turn a finished run into a failure
    os._exit(code)
