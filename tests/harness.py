"""Multi-rank test harness: run a function on N CPU processes with a gloo process group.

    from harness import run_ranks

    def _body(base, scale=1):         # module-level, so workers can unpickle it by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return base + t.item() * scale

    def test_sum():
        assert run_ranks(3, _body, 1.0, scale=2) == [7.0, 7.0, 7.0]

One pool of `world_size` worker processes per world size lives for the whole pytest session;
starting a process that imports torch and megatron costs seconds on a small CPU box. Workers are
forked from a forkserver that has torch (and megatron.core, when installed) pre-imported, so a
pool restart costs well under a second. Any failure (a rank raising, dying or hanging) kills the
pool, and the next call starts a fresh one, so one test's wreckage never leaks into the next.

`run_ranks_on_one_gpu(W, fn, ...)` runs fn the same way with every rank on cuda:0 and
megatron_burst.comm's host-staged transport (CUDA tensors travel through host memory over gloo).
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.resource_tracker as mp_resource_tracker
import multiprocessing.util as mp_util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional

__all__ = ["run_ranks", "run_ranks_on_one_gpu", "shutdown_pools", "worker_pids", "RankFailure", "ERROR_GRACE_S"]

# Imported once in the forkserver and inherited by every worker it forks. A module that fails
# to import here is skipped silently by multiprocessing (workers then import it on demand).
# megatron.core is left out on a CUDA machine: importing it there initializes CUDA in the
# forkserver, and every forked rank then fails with "Cannot re-initialize CUDA in forked
# subprocess" (seen on an H100: every multi-rank GPU test). Ranks import it on demand instead.
PRELOAD_MODULES = ["torch", "torch.distributed", "megatron.core", "pytest"]
CUDA_SAFE_PRELOAD = ["torch", "torch.distributed", "pytest"]

# Once a rank has failed, wait at most this long for the other ranks (None: the whole
# `timeout`). They are usually blocked in a collective the failed rank never joined.
ERROR_GRACE_S: float | None = None

_START_TIMEOUT_S = 120.0  # pool start (fork + gloo rendezvous); not charged to the test's timeout
# A port free when picked can be taken before rank 0 listens on it (another xdist worker's ranks,
# a test's own subprocesses): a pool whose rendezvous fails that way starts again on a new port.
_START_ATTEMPTS = 3
# once a rank fails to start, the others cannot finish the rendezvous: stop waiting for them soon
_START_ERROR_GRACE_S = 5.0
_STACK_DUMP_WAIT_S = 2.0  # how long to wait for hung ranks to write their faulthandler dumps
_JOIN_TIMEOUT_S = 5.0

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)


class RankFailure(RuntimeError):
    """Raised by run_ranks when a rank raised, died or did not finish in time."""

    def __init__(self, message: str, errors: dict[int, str], hung: list[int]):
        super().__init__(message)
        self.errors = errors  # rank -> traceback text (or the reason it died)
        self.hung = hung  # ranks that did not finish within the timeout


# ----------------------------------------------------------------------------- worker side


def _start_orphan_watchdog() -> None:
    """Exit if the pytest process dies: a worker stuck in a collective would otherwise live on."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="run_ranks-orphan-watchdog", daemon=True).start()


@dataclass
class _Baseline:
    """Per-process state restored before every task, so tests cannot leak settings."""

    env: dict[str, str]
    cwd: str
    default_dtype: Any
    rng_state: Any


def _reset_state(base: _Baseline) -> None:
    import torch

    if os.environ != base.env:
        os.environ.clear()
        os.environ.update(base.env)
    os.chdir(base.cwd)
    torch.set_default_dtype(base.default_dtype)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    torch.set_rng_state(base.rng_state)
    # Megatron keeps its process groups in module globals; a test that calls
    # initialize_model_parallel would otherwise make the next one fail with "already initialized".
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    _destroy_task_process_groups()
    # megatron-burst's per-process caches: registered CP topologies (a test must build its own) and
    # the GPU kernels' self-check verdicts
    topology = sys.modules.get("megatron_burst.topology")
    if topology is not None:
        topology.clear_registered_cp_topologies()
    kernel_choice = sys.modules.get("megatron_burst.kernels.choice")
    if kernel_choice is not None:
        kernel_choice.reset()
    comm = sys.modules.get("megatron_burst.comm")
    if comm is not None:  # a task's set_transport must not outlive it
        comm.set_transport(None)


def _destroy_task_process_groups() -> None:
    """Destroy every process group but the default one (the tasks' subgroups).

    initialize_model_parallel makes ~25 gloo groups per call and destroy_model_parallel only drops
    Megatron's references: each group keeps its gloo threads and sockets. Over a few hundred tests a
    long-lived worker piles up thousands of threads whose loops then burn the CPU. Every rank
    resets before every task, so all ranks destroy the same groups.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)


def _worker_main(rank: int, world_size: int, port: int, conn: mp_connection.Connection,
                 stack_path: str, extra_sys_path: list[str]) -> None:
    """Worker loop: init gloo once, then run pickled tasks from `conn` until told to stop."""
    for path in reversed(extra_sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    # Ctrl-C reaches the whole process group; let the pytest process handle it and kill us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _start_orphan_watchdog()
    # The parent sends SIGUSR1 to a hung worker to get its Python stacks for the error message.
    stack_file = open(stack_path, "w")  # stays open: faulthandler writes to it on SIGUSR1
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    })
    # Gloo otherwise picks the interface the hostname resolves to, which may not be loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        base = _Baseline(dict(os.environ), os.getcwd(), torch.get_default_dtype(), torch.get_rng_state())
    except BaseException:
        conn.send_bytes(pickle.dumps((0, "error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps((0, "ok", os.getpid())))  # task 0: "ready"

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not data:  # b"": orderly shutdown
            break
        task_id, blob = pickle.loads(data)
        try:
            _reset_state(base)
            fn, args, kwargs = pickle.loads(blob)
            payload = pickle.dumps(fn(*args, **kwargs))
            if not dist.is_initialized():  # the pool is unusable now; fail so it gets replaced
                raise RuntimeError("the task destroyed the default process group")
            reply = (task_id, "ok", payload)
        except BaseException:
            reply = (task_id, "error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))
    try:
        dist.destroy_process_group()
    except Exception:
        pass  # exiting anyway; gloo needs no teardown to release anything


# ----------------------------------------------------------------------------- parent side

_used_ports: set[int] = set()


def _free_port() -> int:
    """megatron_burst.world.free_port, but never the same port twice in this session."""
    from megatron_burst.world import free_port

    while True:
        port = free_port()
        if port not in _used_ports:
            _used_ports.add(port)
            return port


_tracker_stop_registered = False


def _preload_modules() -> list[str]:
    """What the forkserver imports: never a module that initializes CUDA (see PRELOAD_MODULES)."""
    import torch

    return CUDA_SAFE_PRELOAD if torch.cuda.is_available() else PRELOAD_MODULES


def _context() -> mp.context.BaseContext:
    global _tracker_stop_registered
    ctx = mp.get_context("forkserver")
    # Only effective before the forkserver starts (the first pool of the session).
    ctx.set_forkserver_preload(_preload_modules())
    tracker = getattr(mp_resource_tracker, "_resource_tracker", None)
    if not _tracker_stop_registered and getattr(tracker, "_pid", 0) is None:
        # Starting the forkserver also starts multiprocessing's resource tracker, which otherwise
        # outlives us as an unreaped orphan for a moment. Stop it after every other multiprocessing
        # exit finalizer (those may still talk to it): exitpriority -100 runs last.
        mp_util.Finalize(None, tracker._stop, exitpriority=-100)
        _tracker_stop_registered = True
    return ctx


@dataclass
class _Worker:
    rank: int
    process: mp.process.BaseProcess
    conn: mp_connection.Connection
    stack_path: str


class _Pool:
    """`world_size` workers sharing one gloo world, fed tasks over one pipe each."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.workers: list[_Worker] = []
        self.tmpdir = tempfile.mkdtemp(prefix=f"run_ranks_w{world_size}_")
        self._task_id = 0

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def start(self) -> None:
        ctx = _context()
        port = _free_port()
        extra_path = [_TESTS_DIR, _REPO_ROOT]
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            stack_path = os.path.join(self.tmpdir, f"rank{rank}.stack")
            proc = ctx.Process(
                target=_worker_main, name=f"run_ranks-w{self.world_size}-r{rank}",
                args=(rank, self.world_size, port, child_conn, stack_path, extra_path))
            proc.start()
            child_conn.close()
            self.workers.append(_Worker(rank, proc, parent_conn, stack_path))
        replies, errors, hung = self._collect(time.monotonic() + _START_TIMEOUT_S, _START_ERROR_GRACE_S)
        errors.update({rank: tb for rank, (_, status, tb) in replies.items() if status == "error"})
        if errors or hung:
            self.kill()
            raise RankFailure(_format_failure(f"starting a pool of {self.world_size} ranks", errors,
                                              hung, {}, _START_TIMEOUT_S), errors, hung)

    def run(self, name: str, blob: bytes, timeout: float) -> list:
        """Run the pickled (fn, args, kwargs) on every rank; on any failure kill the pool and raise."""
        self._task_id += 1
        message = pickle.dumps((self._task_id, blob))
        start = time.monotonic()
        deadline = start + timeout
        errors: dict[int, str] = {}
        for w in self.workers:
            try:
                w.conn.send_bytes(message)
            except OSError as exc:
                errors[w.rank] = f"could not send the task: worker is gone ({exc!r})"
        replies, died, hung = self._collect(deadline, ERROR_GRACE_S, skip=set(errors))
        errors.update(died)
        results: dict[int, Any] = {}
        for rank, (task_id, status, payload) in sorted(replies.items()):
            assert task_id == self._task_id, f"rank {rank}: stale reply {task_id} != {self._task_id}"
            if status == "error":
                errors[rank] = payload
                continue
            try:
                results[rank] = pickle.loads(payload)
            except Exception:
                errors[rank] = ("returned a value that cannot be unpickled in the pytest process:\n"
                                + traceback.format_exc())
        if not errors and not hung:
            return [results[r] for r in range(self.world_size)]
        waited = min(timeout, time.monotonic() - start)  # less than timeout if ERROR_GRACE_S cut it
        stacks = self._dump_stacks(hung)
        # Ranks may sit in a half-finished collective or hold unmatched messages: start afresh.
        self.kill()
        raise RankFailure(_format_failure(name, errors, hung, stacks, waited), errors, hung)

    def _collect(self, deadline: float, grace: float | None, skip: Collection[int] = ()
                 ) -> tuple[dict[int, tuple], dict[int, str], list[int]]:
        """Wait for one message per worker. Returns (replies, deaths, ranks still pending)."""
        pending = {w.rank: w for w in self.workers if w.rank not in skip}
        replies: dict[int, Any] = {}
        died: dict[int, str] = {}
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            by_handle: dict[Any, _Worker] = {}
            for w in pending.values():
                by_handle[w.conn] = w
                by_handle[w.process.sentinel] = w
            for handle in mp_connection.wait(list(by_handle), timeout=deadline - now):
                w = by_handle[handle]
                if w.rank not in pending:
                    continue  # both its pipe and its sentinel fired
                # A worker that died may still have left a message in the pipe.
                try:
                    if w.conn.poll():
                        replies[w.rank] = pickle.loads(w.conn.recv_bytes())
                        del pending[w.rank]
                        continue
                except (EOFError, OSError):
                    pass
                if handle is w.conn or not w.process.is_alive():
                    w.process.join(_JOIN_TIMEOUT_S)
                    died[w.rank] = f"worker process died (exit code {w.process.exitcode})"
                    del pending[w.rank]
            failed = died or any(status == "error" for _, status, _ in replies.values())
            if failed and grace is not None:
                deadline = min(deadline, time.monotonic() + grace)
                grace = None  # the grace period counts from the first failure only
        return replies, died, sorted(pending)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask hung workers for their Python stacks (faulthandler on SIGUSR1)."""
        targets = [self.workers[r] for r in ranks if self.workers[r].process.is_alive()]
        for w in targets:
            try:
                os.kill(w.process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        for w in targets:
            last_size = -1
            while time.monotonic() < deadline:
                size = os.path.getsize(w.stack_path)
                if size and size == last_size:  # written and no longer growing
                    break
                last_size = size
                time.sleep(0.05)
            with open(w.stack_path, errors="replace") as f:
                stacks[w.rank] = f.read().strip() or "(no stack dump received)"
        return stacks

    def kill(self) -> None:
        """SIGKILL every worker and reap it."""
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
        self._reap()

    def close(self) -> None:
        """Ask workers to exit; kill those that do not within a few seconds."""
        for w in self.workers:
            try:
                w.conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _reap(self) -> None:
        for w in self.workers:
            w.process.join(_JOIN_TIMEOUT_S)
            w.conn.close()
        self.workers = []
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _format_failure(what: str, errors: dict[int, str], hung: list[int], stacks: dict[int, str],
                    waited: float) -> str:
    """One message with every failing rank's traceback and every hung rank's stacks."""
    problems = []
    if errors:
        problems.append(f"rank(s) {sorted(errors)} failed")
    if hung:
        problems.append(f"rank(s) {hung} did not finish within {waited:.3g} s")
    lines = [f"{what}: {'; '.join(problems)} (pool killed; the next call starts a fresh one)"]
    for rank in sorted(errors):
        lines.append(f"\n----- rank {rank} failed -----\n{errors[rank].rstrip()}")
    for rank in hung:
        lines.append(f"\n----- rank {rank} hung; its Python stacks -----\n"
                     f"{stacks.get(rank, '(not collected)')}")
    return "\n".join(lines)


_pools: dict[int, _Pool] = {}


def _get_pool(world_size: int) -> _Pool:
    pool = _pools.get(world_size)
    if pool is None or not pool.workers:
        from megatron_burst.world import port_taken
        for attempt in range(_START_ATTEMPTS):
            pool = _Pool(world_size)
            try:
                pool.start()
                break
            except BaseException as exc:
                pool.kill()
                if not port_taken(exc) or attempt == _START_ATTEMPTS - 1:
                    raise
        _pools[world_size] = pool
    return pool


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results.

    fn, args and results cross process boundaries by pickle, so fn must be a module-level function
    (tests under tests/ are importable in the workers as plain modules). If any rank raises or dies,
    or not all ranks finish within `timeout` seconds, the pool is killed and RankFailure (a
    RuntimeError) is raised with every failing rank's traceback and the hung ranks' stacks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        blob = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"run_ranks: cannot pickle {fn!r} or its arguments ({exc}); fn must be a "
                        "module-level function of an importable module") from exc
    pool = _get_pool(world_size)
    name = f"run_ranks({world_size}, {getattr(fn, '__qualname__', repr(fn))})"
    try:
        return pool.run(name, blob, timeout)
    except BaseException:
        # Also reached on KeyboardInterrupt mid-wait: the workers' state is unknown. (Idempotent.)
        pool.kill()
        raise


def run_ranks_on_one_gpu(world_size: int, fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
    """run_ranks, with every rank on cuda:0 and the host-staged transport (several ranks, one GPU).

    Each rank runs megatron_burst.launch.call_on_one_gpu(fn, args, kwargs): cuda:0 is the current
    device and CUDA tensors travel through host buffers over the gloo group. Raises RuntimeError
    at once (no pool started) when this machine has no CUDA device.
    """
    from megatron_burst.launch import require_cuda, call_on_one_gpu

    require_cuda(0)
    return run_ranks(world_size, call_on_one_gpu, fn, args, kwargs, 0, timeout=timeout)


def worker_pids(world_size: int) -> list[int]:
    """PIDs of the live pool for `world_size` (empty if none); for tests of the harness itself."""
    pool = _pools.get(world_size)
    return pool.pids() if pool is not None else []


def shutdown_pools(stop_forkserver: bool = False) -> None:
    """Stop every pool; pools restart on next use. Safe to call repeatedly.

    stop_forkserver (session end): also stop and reap the forkserver now instead of leaving it to
    notice our exit, which would leave it briefly orphaned.
    """
    while _pools:
        _, pool = _pools.popitem()
        pool.close()
    if stop_forkserver:
        stop = getattr(getattr(mp_forkserver, "_forkserver", None), "_stop", None)  # private, 3.8+
        if stop is not None:
            stop()


atexit.register(shutdown_pools, stop_forkserver=True)


def pythonpath(*first: str) -> str:
    """A PYTHONPATH for a process this one starts: ``first``, then this process's PYTHONPATH (which
    carries tests/startup, tests/conftest.py), empty entries dropped (one would put the cwd on sys.path)."""
    rest = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(p for p in (*first, *rest) if p)


def load_test_startup():
    """tests/startup/sitecustomize.py as a module of this process (the processes started with tests/startup
    on PYTHONPATH run it as their ``sitecustomize``); loaded once."""
    import importlib.util

    name = "megatron_burst_test_startup"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup", "sitecustomize.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class RunBytecode:
    """The bytecode of this checkout's Python (the package, tests/, examples/) for one test run whose
    Python writes none itself (``PYTHONDONTWRITEBYTECODE``, ``-B``): without it each fresh process the
    run starts -- ~130 a run, 90 of them import the package (trainer ranks, CLIs, interpreter runs) --
    compiles what it imports again, 0.75 s of CPU a process (the package is ~30k lines). :meth:`write`
    compiles what is missing or stale, once, before any worker starts; :meth:`remove` deletes exactly
    the files it wrote (and the ``__pycache__`` folders it made), so the checkout is left as the
    variable asks. A Python that writes bytecode itself needs neither."""

    def __init__(self, root: str, dirs: Collection[str] = ("megatron_burst", "tests", "examples")):
        self.folders = [os.path.join(root, d) for d in dirs if os.path.isdir(os.path.join(root, d))]
        self.written: list[str] = []
        self.made_folders: list[str] = []

    def _files(self) -> tuple[set, set]:
        files, folders = set(), set()
        for top in self.folders:
            for here, subdirs, names in os.walk(top):
                subdirs[:] = [d for d in subdirs if not d.startswith(".")]
                if os.path.basename(here) == "__pycache__":
                    folders.add(here)
                    files.update(os.path.join(here, n) for n in names if n.endswith(".pyc"))
        return files, folders

    def write(self) -> int:
        """Compile; returns how many files were written."""
        import compileall

        files, folders = self._files()
        for top in self.folders:
            compileall.compile_dir(top, quiet=2)  # a file that does not compile is the test run's to report
        now, now_folders = self._files()
        self.written = sorted(now - files)
        self.made_folders = sorted(now_folders - folders, reverse=True)  # deepest first
        return len(self.written)

    def remove(self) -> None:
        for path in self.written:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        for folder in self.made_folders:
            with contextlib.suppress(OSError):  # not empty: something else wrote there too
                os.rmdir(folder)
        self.written, self.made_folders = [], []


def run_interpreted(script: str, *args: str, code: Optional[str] = None, drop_env: tuple = (),
                    timeout: float = 600) -> dict:
    """Run ``tests/<script> args`` (or ``python -c code``) in a fresh python with TRITON_INTERPRET=1
    (Triton reads it when first imported, so a test process that already imported triton cannot
    set it), tests/ and the repository on PYTHONPATH, ``drop_env`` variables removed, started by
    tests/interpreted.py (the interpreter without its redundant re-patching); the run must
    exit 0. Returns the JSON of its last stdout line (the *_cases.py scripts print their results so)."""
    import json
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=pythonpath(here, os.path.dirname(here)))
    for name in drop_env:
        env.pop(name, None)
    launcher = [sys.executable, os.path.join(here, "interpreted.py")]
    cmd = launcher + (["-c", code, *args] if code is not None else [os.path.join(here, script), *args])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
