"""Run W ranks on ONE GPU (tests and benchmarks) with the host-staged transport.

NCCL refuses two ranks on the same device, so on a single-GPU machine a multi-rank CUDA run of
CP attention needs another way to move data: the ranks join a gloo group and
:mod:`megatron_burst.comm`'s ``host_staged`` transport copies every CUDA tensor through (pinned)
host memory. The kernels are the real CUDA ones; only the transfers are slower than NCCL's.

From a script or a benchmark (spawns the ranks, returns their results in rank order)::

    from megatron_burst.launch import run_on_one_gpu

    def body(n):                              # module-level: the ranks import it by name
        x = torch.randn(n, device="cuda")     # every rank's "cuda" is cuda:0
        ...
        return result                         # picklable

    results = run_on_one_gpu(body, 4, 1024)   # 4 ranks, body(1024) on each

Under an existing launcher (torchrun, tests/harness.py), each rank calls
:func:`setup_one_gpu_rank` after ``dist.init_process_group("gloo")``, or the launcher runs the
function through :func:`call_on_one_gpu` (tests/harness.py: ``run_ranks_on_one_gpu``). Setting
``MEGATRON_BURST_TRANSPORT=host_staged`` in the ranks' environment enables the transport too.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_burst import comm

__all__ = ["run_on_one_gpu", "setup_one_gpu_rank", "call_on_one_gpu", "require_cuda"]


def require_cuda(device: int = 0) -> None:
    """Raise (naming what to do instead) unless ``cuda:device`` exists on this machine."""
    if not torch.cuda.is_available():
        raise RuntimeError("W ranks on one GPU need CUDA, and torch.cuda.is_available() is False here: run on a "
                           "machine with a GPU (on CPU, test the staging path with "
                           "megatron_burst.comm.set_transport('host_staged', stage_cpu=True))")
    if not 0 <= device < torch.cuda.device_count():
        raise ValueError(f"device={device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _use_shared_gpu(device: int) -> torch.device:
    """Checks, then make ``cuda:device`` this process's current device."""
    require_cuda(device)
    if not dist.is_initialized():
        raise RuntimeError("ranks sharing a GPU: initialize the process group first, with "
                           "dist.init_process_group('gloo') (NCCL refuses two ranks on one GPU)")
    backend = str(dist.get_backend())
    if "gloo" not in backend:
        raise RuntimeError(f"ranks sharing a GPU need a gloo process group, and the default one uses {backend!r}: "
                           "dist.init_process_group('gloo')")
    torch.cuda.set_device(device)
    return torch.device("cuda", device)


def setup_one_gpu_rank(device: int = 0) -> torch.device:
    """Prepare this rank (of an initialized gloo world) to share ``cuda:device`` with the others.

    Makes ``cuda:device`` the current device and selects the host-staged transport for this
    process (:func:`megatron_burst.comm.set_transport`). Returns the device to put tensors on.
    """
    dev = _use_shared_gpu(device)
    comm.set_transport("host_staged")
    return dev


def call_on_one_gpu(fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None,
                    device: int = 0) -> Any:
    """``fn(*args, **kwargs)`` on this rank, on ``cuda:device`` with the host-staged transport (the
    transport chosen before is restored afterwards). For launchers that run one function on every
    rank of a gloo world; module-level, so it pickles by reference."""
    _use_shared_gpu(device)
    with comm.transport("host_staged"):
        return fn(*args, **(kwargs or {}))


def run_on_one_gpu(fn: Callable[..., Any], world_size: int, *args: Any, device: int = 0, threads: int = 1,
                   env: Optional[dict[str, str]] = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned processes that all use ``cuda:device``; returns
    the per-rank results in rank order.

    The ranks form a gloo world (:func:`megatron_burst.bench.launch.run_local`) and communicate
    through the host-staged transport; ``fn`` and ``args`` must pickle (a module-level function).
    A rank that raises prints its traceback and the call raises RuntimeError. ``threads``: torch
    CPU threads per rank; ``env``: extra environment variables for the ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    require_cuda(device)
    from megatron_burst.bench.launch import run_local

    return run_local(world_size, call_on_one_gpu, fn, args, None, device, threads=threads, env=env)
