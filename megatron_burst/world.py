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
from typing import NoReturn

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it), for MASTER_PORT.

    Another process may take it before the rendezvous binds it; callers that start many worlds
    in one process and must never reuse a port (tests/harness.py) keep their own record.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_rank(code: int = 0) -> NoReturn:
    """End this rank's process with exit status ``code``, skipping torch.distributed teardown.

    With ``code == 0`` and an initialized default group, first waits on a barrier, so no rank
    leaves while another still expects a message from it; a failing barrier (a peer already
    gone) turns the status into 1. Then flushes stdout and stderr and calls ``os._exit``: no
    destroy_process_group, no atexit handlers, no C++ destructors (the gloo abort above).
    Flush or close anything else (files, multiprocessing queues) before calling this.
    """
    if code == 0 and dist.is_available() and dist.is_initialized():
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
