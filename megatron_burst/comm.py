"""Communication primitives for context parallelism, with byte accounting and schedule tracing.

Every byte an algorithm moves goes through this module, so :func:`comm_counter` sees it all:

    with megatron_burst.comm_counter() as c:
        out = cp_attention(q, k, v, group=g)
        out.backward(dout)
    c.bytes("sent", phase="backward")

Bytes are recorded by direction (sent/received), phase (forward/backward) and link class
(intra/inter node). The link class of a peer comes from a ``link_of`` callable given by the caller
(a topology); without one every link is "intra".

Counters (and schedule traces, :func:`record_schedule`) are process-wide, not per thread: autograd
runs the backward of GPU tensors on a per-device worker thread, and a counter opened around
``loss.backward()`` must still see those bytes. Nested counters all receive every record.

Waits are timed where the wait happens: on the host for CPU tensors (gloo blocks there), and with
CUDA events on the current stream for GPU tensors (an NCCL ``wait()`` only makes the stream wait,
so host time would measure nothing); :meth:`CommCounter.wait_seconds` resolves the events lazily.

Transports (how tensors reach torch.distributed): ``"direct"`` (the default) hands every tensor
to the process group as is. ``"host_staged"`` lets several ranks share ONE GPU for tests and
benchmarks, where NCCL refuses two ranks on a device: the ranks form a gloo group and every CUDA
tensor is copied to a host buffer (pinned, reused), moved by gloo, and the result copied back into
the CUDA destination when the request is waited on -- ``wait()`` still makes the data valid, on
the current stream. Choose it in one of two ways (code wins over the environment)::

    megatron_burst.comm.set_transport("host_staged")      # or: with comm.transport("host_staged"):
    MEGATRON_BURST_TRANSPORT=host_staged python bench.py  # read by active_transport() only

Staging is invisible to :func:`comm_counter` (logical bytes of the exchange, never the copies) and
to :func:`record_schedule` (the same trace as the direct transport, so the NCCL replay checker
still guards the ordering). ``stage_cpu=True`` (``MEGATRON_BURST_TRANSPORT=host_staged_cpu``)
stages CPU tensors too, so the staging path runs, and is tested, on machines without a GPU.
CUDA tensors on a gloo group under the direct transport raise :class:`TransportError` naming the
fix. :mod:`megatron_burst.launch` starts W ranks on one GPU with this transport.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_burst import env

PHASES = ("forward", "backward")
LINKS = ("intra", "inter")
DIRECTIONS = ("sent", "received")


class CommCounter:
    """Bytes moved by this rank, keyed by (direction, phase, link), and time spent waiting on them."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        self._wait: dict[tuple[str, str], float] = defaultdict(float)
        # (phase, link, start event, end event) of GPU waits, read when wait_seconds() asks
        self._pending_events: list[tuple[str, str, object, object]] = []
        self._lock = threading.Lock()

    def record(self, direction: str, phase: str, link: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[(direction, phase, link)] += int(nbytes)

    def record_wait(self, phase: str, link: str, seconds: float) -> None:
        with self._lock:
            self._wait[(phase, link)] += seconds

    def record_wait_events(self, phase: str, link: str, start, end) -> None:
        """A GPU wait: ``start``/``end`` are CUDA events around the stream's wait (timed later)."""
        with self._lock:
            self._pending_events.append((phase, link, start, end))

    def _resolve_events(self) -> None:
        with self._lock:
            pending, self._pending_events = self._pending_events, []
        for phase, link, start, end in pending:
            end.synchronize()
            self.record_wait(phase, link, start.elapsed_time(end) / 1e3)  # elapsed_time is in ms

    def wait_seconds(self, phase: Optional[str] = None, link: Optional[str] = None) -> float:
        """Seconds this rank was blocked waiting for transfers (the part compute did not hide).

        On GPU this is the time the compute stream stood still at the waits (CUDA events); reading
        it synchronizes with those events once.
        """
        self._resolve_events()
        with self._lock:
            return sum(v for (p, l), v in self._wait.items()
                       if (phase is None or p == phase) and (link is None or l == link))

    def bytes(self, direction: str = "sent", phase: Optional[str] = None, link: Optional[str] = None) -> int:
        """Total bytes for ``direction`` in {"sent", "received"}; ``phase``/``link`` None = all."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r}: choose one of {DIRECTIONS}")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase={phase!r}: choose one of {PHASES} or None")
        if link is not None and link not in LINKS:
            raise ValueError(f"link={link!r}: choose one of {LINKS} or None")
        with self._lock:
            return sum(v for (d, p, l), v in self._bytes.items()
                       if d == direction and (phase is None or p == phase) and (link is None or l == link))

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._wait.clear()
            self._pending_events.clear()

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f"{d}/{p}/{l}": v for (d, p, l), v in sorted(self._bytes.items())}


# ------------------------------------------------------------------------- schedule traces


@dataclass(frozen=True)
class TracedOp:
    """One operation of a posted batch, as the NCCL replay checker sees it.

    kind: "send" / "recv" (``peer`` is the peer's global rank) or a collective name ("all_gather",
    "all_to_all", ...; ``peer`` is -1). ``nbytes`` is the buffer size on this rank.
    """

    kind: str
    peer: int
    nbytes: int


@dataclass(frozen=True)
class TracedBatch:
    """One ``batch_isend_irecv`` group (or one collective) posted on communicator ``comm``."""

    id: int
    comm: str  # the process group's name: equal on every member
    members: tuple[int, ...]  # global ranks of the communicator
    ops: tuple[TracedOp, ...]
    label: str = ""


@dataclass
class ScheduleTrace:
    """This process's posted batches and waits, in program order (see :func:`record_schedule`).

    ``events`` holds ("post", TracedBatch) and ("wait", batch id) tuples.
    """

    rank: int
    events: list = field(default_factory=list)


class _Registry:
    """Process-wide active counters and traces (see module docstring for why not thread-local)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters: list[CommCounter] = []
        self.traces: list[ScheduleTrace] = []
        self.next_batch_id = 0

    def snapshot(self) -> tuple[list[CommCounter], list[ScheduleTrace]]:
        with self.lock:
            return list(self.counters), list(self.traces)

    @contextlib.contextmanager
    def active(self, registered: list, item):
        """``item`` is in ``registered`` (counters or traces) while the block runs."""
        with self.lock:
            registered.append(item)
        try:
            yield item
        finally:
            with self.lock:
                registered.remove(item)


_registry = _Registry()


@contextlib.contextmanager
def comm_counter() -> Iterator[CommCounter]:
    """Count the bytes this rank sends and receives in CP attention while the block runs (nestable).

    Process-wide: work on other threads (autograd's device threads) is counted too.
    """
    with _registry.active(_registry.counters, CommCounter()) as counter:
        yield counter


@contextlib.contextmanager
def record_schedule() -> Iterator[ScheduleTrace]:
    """Record every batch this process posts through this module, and every wait on one.

    The traces of all ranks, replayed by :func:`megatron_burst.nccl_check.replay`, tell whether
    the schedule completes under NCCL's rules (no buffering, FIFO per communicator).
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    with _registry.active(_registry.traces, ScheduleTrace(rank)) as trace:
        yield trace


def record(direction: str, phase: str, link: str, nbytes: int) -> None:
    for c in _registry.snapshot()[0]:
        c.record(direction, phase, link, nbytes)


def record_wait(phase: str, link: str, seconds: float) -> None:
    for c in _registry.snapshot()[0]:
        c.record_wait(phase, link, seconds)


def _group_identity(group: Optional[dist.ProcessGroup]) -> tuple[str, tuple[int, ...]]:
    g = group if group is not None else dist.group.WORLD
    return g.group_name, tuple(dist.get_process_group_ranks(g))


def _trace_post(group: Optional[dist.ProcessGroup], ops: Sequence[TracedOp], label: str) -> Optional[int]:
    traces = _registry.snapshot()[1]
    if not traces:
        return None
    name, members = _group_identity(group)
    with _registry.lock:
        batch_id = _registry.next_batch_id
        _registry.next_batch_id += 1
    batch = TracedBatch(batch_id, name, members, tuple(ops), label)
    for t in traces:
        t.events.append(("post", batch))
    return batch_id


def _trace_wait(batch_id: Optional[int]) -> None:
    if batch_id is None:
        return
    for t in _registry.snapshot()[1]:
        t.events.append(("wait", batch_id))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------- transports

TRANSPORT_ENV = "MEGATRON_BURST_TRANSPORT"
TRANSPORTS = ("direct", "host_staged")
# values of TRANSPORT_ENV: a transport name, or host_staged_cpu (host_staged that stages CPU tensors too)
_ENV_VALUES = {"direct": ("direct", False), "host_staged": ("host_staged", False),
               "host_staged_cpu": ("host_staged", True)}


class TransportError(RuntimeError):
    """A tensor cannot travel over this process group with the active transport (the message names the fix)."""


@dataclass(frozen=True)
class Transport:
    """The active transport: ``name`` in :data:`TRANSPORTS`; ``stage_cpu`` (host_staged only) stages
    CPU tensors through host buffers too, so the staging path runs without a GPU (tests)."""

    name: str = "direct"
    stage_cpu: bool = False


_transport_override: Optional[Transport] = None  # set by set_transport / transport(); None: environment


def _transport_from_env() -> Transport:
    """The transport :data:`TRANSPORT_ENV` names (megatron_burst.env reads it; unset or empty: direct)."""
    value = env.transport()
    if not value:
        return Transport()
    if value not in _ENV_VALUES:
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: choose one of {sorted(_ENV_VALUES)} (or leave it unset)")
    name, stage_cpu = _ENV_VALUES[value]
    return Transport(name, stage_cpu)


def active_transport() -> Transport:
    """The transport the next operation uses: :func:`set_transport`'s choice if one was made,
    else :data:`TRANSPORT_ENV` (read on every call, so a change of the variable takes effect), else direct."""
    override = _transport_override
    return override if override is not None else _transport_from_env()


def set_transport(name: Optional[str], *, stage_cpu: bool = False) -> None:
    """Choose the transport for this process (all threads: autograd's device threads communicate too).

    ``name``: ``"direct"`` (hand tensors to torch.distributed as they are) or ``"host_staged"``
    (CUDA tensors travel through host buffers over a gloo group: several ranks on one GPU);
    ``None`` drops the choice, so :data:`TRANSPORT_ENV` (or the direct default) applies again.
    ``stage_cpu`` (host_staged only): stage CPU tensors as well, to exercise staging on CPU.
    Set it between operations, not while requests are pending (a pending request finishes with
    the transport it was posted with).
    """
    global _transport_override
    if name is None:
        if stage_cpu:
            raise ValueError("set_transport(None, stage_cpu=True): stage_cpu needs name='host_staged'")
        _transport_override = None
        return
    if name not in TRANSPORTS:
        raise ValueError(f"set_transport({name!r}): choose one of {TRANSPORTS}, or None for the environment's "
                         f"{TRANSPORT_ENV}")
    if stage_cpu and name != "host_staged":
        raise ValueError(f"set_transport({name!r}, stage_cpu=True): stage_cpu applies to 'host_staged' only")
    _transport_override = Transport(name, stage_cpu)


@contextlib.contextmanager
def transport(name: Optional[str], *, stage_cpu: bool = False) -> Iterator[Transport]:
    """:func:`set_transport` for the block, then restore the previous choice. Process-wide (not per
    thread), like :func:`comm_counter`; do not nest it concurrently from several threads."""
    global _transport_override
    previous = _transport_override
    set_transport(name, stage_cpu=stage_cpu)
    try:
        yield active_transport()
    finally:
        _transport_override = previous


def needs_staging(t: torch.Tensor) -> bool:
    """Whether ``t`` lives where gloo cannot read it (device memory): such tensors need the
    host-staged transport on a gloo group. The single place that decides it (tests patch it)."""
    return t.is_cuda


@dataclass
class StagingStats:
    """Counts of the host-staged transport in this process (:func:`staging_stats`)."""

    staged_ops: int = 0  # operations (batches, collectives) that staged at least one tensor
    copies_in: int = 0  # tensor -> host buffer copies (sends, collective inputs, in-place all_reduce)
    copies_out: int = 0  # host buffer -> tensor copies at wait() (receives, collective outputs)
    staged_bytes: int = 0  # bytes of those copies, both ways (never counted by comm_counter)
    buffers_allocated: int = 0
    buffers_reused: int = 0


class _StagingPool:
    """Host buffers, free ones kept per (dtype, numel, pinned) for reuse.

    A buffer is in use from :meth:`take` until its operation's ``wait()`` has copied it out; a
    buffer copied into a CUDA tensor asynchronously is reused only once that copy's event is done.
    At most ``max_free_per_key`` free buffers are kept per key (the rest are freed).
    """

    def __init__(self, max_free_per_key: int = 8) -> None:
        self.max_free_per_key = max_free_per_key
        self._free: dict[tuple, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.stats = StagingStats()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor with ``like``'s shape and dtype (contents undefined)."""
        pinned = like.is_cuda  # pinned host memory for fast, async copies to and from the GPU
        key = (like.dtype, like.numel(), pinned)
        with self._lock:
            free = self._free.get(key, [])
            for i, (flat, ready) in enumerate(free):
                if ready is None or ready.query():
                    del free[i]
                    self.stats.buffers_reused += 1
                    return flat.view(like.shape)
            self.stats.buffers_allocated += 1
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)

    def give_back(self, buf: torch.Tensor, pinned: bool, ready: object = None) -> None:
        """Return ``buf`` (from :meth:`take`); ``ready`` (a CUDA event, or None) completes once nothing
        reads the buffer any more."""
        with self._lock:
            free = self._free[(buf.dtype, buf.numel(), pinned)]
            if len(free) < self.max_free_per_key:
                free.append((buf.view(-1), ready))

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_pool = _StagingPool()


def staging_stats() -> StagingStats:
    """A copy of this process's staging counts (all zero until the host-staged transport stages)."""
    with _pool._lock:
        return StagingStats(**vars(_pool.stats))


def clear_staging_buffers() -> None:
    """Free the cached (pinned) host buffers of the host-staged transport; counts are kept."""
    _pool.clear()


def _backend(group: Optional[dist.ProcessGroup]) -> str:
    return str(dist.get_backend(group))


class _Staging:
    """One operation's staging: tensors swapped for host buffers at post, results copied back at wait.

    Inactive (every method returns its tensor unchanged) under the direct transport, or when none
    of the operation's tensors needs staging.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], tensors: Sequence[torch.Tensor], what: str) -> None:
        setting = active_transport()
        on_device = [t for t in tensors if needs_staging(t)]
        self.active = False
        self._stage_cpu = setting.stage_cpu
        self._held: list[tuple[torch.Tensor, bool]] = []  # (buffer, pinned)
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        if setting.name == "direct":
            if on_device and _backend(group) == "gloo":
                t = on_device[0]
                raise TransportError(
                    f"{what}: a {t.device} tensor {tuple(t.shape)} {t.dtype} cannot travel over a gloo process "
                    f"group with the direct transport. To run several ranks on one GPU, enable host staging: "
                    f"megatron_burst.comm.set_transport('host_staged') (or the environment variable "
                    f"{TRANSPORT_ENV}=host_staged; megatron_burst.launch.run_on_one_gpu does both); otherwise "
                    f"use an NCCL process group for CUDA tensors.")
            return
        if not on_device and not setting.stage_cpu:
            return
        backend = _backend(group)
        if backend == "nccl":
            raise TransportError(
                f"{what}: the host_staged transport moves host buffers, which an NCCL-only process group cannot: "
                f"create the group with backend='gloo' (or 'cpu:gloo,cuda:nccl'), or set_transport('direct').")
        self.active = True
        with _pool._lock:
            _pool.stats.staged_ops += 1

    def _wanted(self, t: torch.Tensor) -> bool:
        return self.active and (self._stage_cpu or needs_staging(t))

    def source(self, t: torch.Tensor) -> torch.Tensor:
        """What to hand to gloo for ``t`` read by the operation (a send, a collective's input)."""
        if not self._wanted(t):
            return t
        buf = _pool.take(t)
        buf.copy_(t)  # device -> pinned host is synchronous: the data is on the host before gloo reads it
        self._held.append((buf, t.is_cuda))
        with _pool._lock:
            _pool.stats.copies_in += 1
            _pool.stats.staged_bytes += nbytes(t)
        return buf

    def sink(self, t: torch.Tensor, read_first: bool = False) -> torch.Tensor:
        """What to hand to gloo for ``t`` written by the operation (a receive, a collective's output);
        ``read_first``: the operation also reads it (in-place all_reduce). Copied back at wait()."""
        if not self._wanted(t):
            return t
        if read_first:
            buf = self.source(t)
        else:
            buf = _pool.take(t)
            self._held.append((buf, t.is_cuda))
        self._copy_back.append((t, buf))
        return buf

    def finish(self) -> None:
        """After the requests completed: copy results into their tensors, return the buffers.

        Copies into CUDA tensors are queued on the current stream (as NCCL's wait() orders the
        current stream after the transfer); their buffers are reused once those copies are done.
        """
        for dst, buf in self._copy_back:
            dst.copy_(buf, non_blocking=dst.is_cuda)  # from pinned memory: queued on the current stream
        ready = None
        if any(dst.is_cuda for dst, _ in self._copy_back):
            ready = torch.cuda.Event()
            ready.record()
        with _pool._lock:
            _pool.stats.copies_out += len(self._copy_back)
            _pool.stats.staged_bytes += sum(nbytes(dst) for dst, _ in self._copy_back)
        for buf, pinned in self._held:
            _pool.give_back(buf, pinned, ready if pinned else None)
        self._held, self._copy_back = [], []


# ------------------------------------------------------------------------- waiting


def _wait_all(reqs: Sequence, device: torch.device, phase: str, link: str) -> None:
    """Wait for ``reqs`` and charge the time to (phase, link): host time on CPU, stream time on GPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for r in reqs:
            r.wait()  # NCCL: the current stream waits; the host does not
        end.record()
        for c in _registry.snapshot()[0]:
            c.record_wait_events(phase, link, start, end)
        return
    t0 = time.perf_counter()
    for r in reqs:
        r.wait()
    record_wait(phase, link, time.perf_counter() - t0)


class PendingExchange:
    """Handle of a posted batch; ``wait()`` returns the receive buffers once filled.

    ``device``: where the wait is timed (CUDA: events on the current stream; else host time).
    ``finish``: run once after the requests completed (the host-staged transport copies received
    data from its host buffers into the receive tensors there).
    """

    def __init__(self, reqs: list, recv: list[torch.Tensor], phase: str = "forward", link: str = "intra",
                 device: Optional[torch.device] = None, trace_id: Optional[int] = None,
                 finish: Optional[Callable[[], None]] = None) -> None:
        self._reqs = reqs
        self._recv = recv
        self._phase, self._link = phase, link
        self._device = device or torch.device("cpu")
        self._trace_id = trace_id
        self._finish = finish

    def wait(self) -> list[torch.Tensor]:
        """Block until the batch completed (CUDA with NCCL: order the current stream after it) and
        return the receive tensors, valid from here on. Waiting again returns them at once."""
        if self._reqs:
            _wait_all(self._reqs, self._device, self._phase, self._link)
            _trace_wait(self._trace_id)
        self._reqs = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._recv


def _timing_device(staging: _Staging, device: torch.device) -> torch.device:
    """Staged waits block the host in gloo: time them on the host, whatever the tensors' device."""
    return torch.device("cpu") if staging.active else device


def _finisher(staging: _Staging) -> Optional[Callable[[], None]]:
    return staging.finish if staging.active else None


# ------------------------------------------------------------------------- ring exchange


# groups whose communicator RingComm.ensure_communicator has created: id(group) -> group
_READY_COMMUNICATORS: dict[int, object] = {}


def forget_communicators() -> None:
    """Forget which groups :meth:`RingComm.ensure_communicator` has set up (tests that replay a
    schedule from a process's first use of a group call this before recording)."""
    _READY_COMMUNICATORS.clear()


class RingComm:
    """Point-to-point neighbour exchange over a process group, as used by ring algorithms.

    :meth:`exchange` posts one batch of sends and receives; every rank of a ring posts its batches
    in the same order with the same shapes, which is what NCCL needs (it matches the k-th send
    from a to b with the k-th receive on b from a, runs one batch at a time per communicator, and
    completes a large send only together with its receive).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], link_of: Optional[Callable[[int], str]] = None,
                 ranks: Optional[Sequence[int]] = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # ``ranks`` optionally restricts the ring to a sub-sequence of group ranks (a ring inside a node).
        self.ring = list(ranks) if ranks is not None else list(range(self.world_size))
        self.pos = self.ring.index(self.rank)
        self.next = self.ring[(self.pos + 1) % len(self.ring)]
        self.prev = self.ring[(self.pos - 1) % len(self.ring)]
        self._link_of = link_of or (lambda peer: "intra")

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def ensure_communicator(self) -> None:
        """Make sure the group's communicator exists, with every member present; once per group.

        NCCL creates a communicator at the group's first operation and needs every member in that
        operation. A schedule in which some member posts nothing (direct traffic: a rank whose
        documents are all local) would leave the others waiting on a fresh group. Every member
        calls this at the same point (before the pass), so one 4-byte all-reduce creates it with
        everyone present. Done on every backend, so traces (and their NCCL replay) are the same on
        CPU and GPU; not counted as traffic (``comm_counter``); traced as a collective.
        """
        g = self.group if self.group is not None else dist.group.WORLD
        if id(g) in _READY_COMMUNICATORS:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in _backend(g) else torch.device("cpu")
        trace_id = _trace_post(g, [TracedOp("all_reduce", -1, 4)], "communicator init")
        dist.all_reduce(torch.zeros(1, device=device), group=g)
        _trace_wait(trace_id)
        _READY_COMMUNICATORS[id(g)] = g  # the value keeps the group alive, so its id is not reused

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], phase: str,
                 send_to: Optional[int | Sequence[int]] = None, recv_from: Optional[int | Sequence[int]] = None,
                 stream: int = 0, label: str = "") -> PendingExchange:
        """Post one batch: sends of ``send`` to ``send_to`` (default next), receives into ``recv``
        from ``recv_from`` (default previous). A peer is a group rank, or a list of them (one per
        tensor; e.g. a gradient going home past its neighbours).

        ``stream`` tags the messages for gloo, which matches by tag; NCCL ignores tags, so callers
        keep the order of messages between two ranks the same on both ends.
        """
        send_to = self.next if send_to is None else send_to
        recv_from = self.prev if recv_from is None else recv_from
        send_peers = [send_to] * len(send) if isinstance(send_to, int) else list(send_to)
        recv_peers = [recv_from] * len(recv) if isinstance(recv_from, int) else list(recv_from)
        if len(send_peers) != len(send) or len(recv_peers) != len(recv):
            raise ValueError(f"exchange: {len(send)} sends / {len(recv)} receives but {len(send_peers)} / "
                             f"{len(recv_peers)} peers")
        if not send and not recv:
            return PendingExchange([], [], phase)
        staging = _Staging(self.group, list(send) + list(recv), f"RingComm.exchange [{label or phase}]")
        ops, traced, links = [], [], set()
        for t, to in zip(send, send_peers):
            peer = self._global(to)
            ops.append(dist.P2POp(dist.isend, staging.source(t), peer, self.group, tag=stream))
            traced.append(TracedOp("send", peer, nbytes(t)))
            record("sent", phase, self._link_of(to), nbytes(t))
            links.add(self._link_of(to))
        for t, frm in zip(recv, recv_peers):
            peer = self._global(frm)
            ops.append(dist.P2POp(dist.irecv, staging.sink(t), peer, self.group, tag=stream))
            traced.append(TracedOp("recv", peer, nbytes(t)))
            record("received", phase, self._link_of(frm), nbytes(t))
            links.add(self._link_of(frm))
        trace_id = _trace_post(self.group, traced, label or phase)
        reqs = dist.batch_isend_irecv(ops)
        device = _timing_device(staging, (list(send) + list(recv))[0].device)
        # a wait is charged to the slower link class involved
        return PendingExchange(reqs, list(recv), phase, "inter" if "inter" in links else "intra", device, trace_id,
                               _finisher(staging))


# ------------------------------------------------------------------------- collectives


def _collective(kind: str, group: Optional[dist.ProcessGroup], phase: str, moved: dict[str, int],
                in_bytes: int, post: Callable[[], object], device: torch.device, label: str,
                staging: _Staging) -> PendingExchange:
    """Count ``moved`` ({link: bytes}, sent and as many received), trace and post one collective
    (``post`` hands ``staging``'s tensors to torch.distributed; its wait() copies results back)."""
    for link, n in moved.items():
        record("sent", phase, link, n)
        record("received", phase, link, n)
    trace_id = _trace_post(group, [TracedOp(kind, -1, in_bytes)], label or f"{phase} {kind}")
    work = post()
    # a wait is charged to the slower link class involved
    return PendingExchange([work], [], phase, "inter" if moved.get("inter") else "intra",
                           _timing_device(staging, device), trace_id, _finisher(staging))


# torch >= 2.13 names them *_single (the *_tensor spellings warn as deprecated); older torch has only those
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup], phase: str,
               link: str = "intra", label: str = "") -> PendingExchange:
    """Post ``all_gather_into_tensor(out, inp)``: out [W * n, ...] rank-major from every inp [n, ...].

    Counted as a ring all-gather: each rank sends (and receives) (W - 1) x inp's bytes.
    """
    W = dist.get_world_size(group)
    if out.numel() != W * inp.numel() or out.dtype != inp.dtype:
        raise ValueError(f"all_gather: out {tuple(out.shape)} {out.dtype} must hold {W} x inp "
                         f"{tuple(inp.shape)} {inp.dtype}")
    moved = {link: (W - 1) * nbytes(inp)}
    staging = _Staging(group, [out, inp], f"all_gather [{label or phase}]")
    src, dst = staging.source(inp.contiguous()), staging.sink(out)
    return _collective("all_gather", group, phase, moved, nbytes(inp),
                       lambda: _all_gather_single(dst, src, group=group, async_op=True),
                       inp.device, label, staging)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup], phase: str,
               link: str | Callable[[int], str] = "intra", label: str = "") -> PendingExchange:
    """Post ``all_to_all_single(out, inp)`` with equal splits along dim 0 (W chunks each).

    Counted as what leaves the rank: (W - 1) / W of inp's bytes (the own chunk stays), classed by
    ``link``: one class, or a function of the peer's group rank (a group spanning nodes).
    """
    W = dist.get_world_size(group)
    if inp.shape[0] % W or out.shape != inp.shape or out.dtype != inp.dtype:
        raise ValueError(f"all_to_all: inp {tuple(inp.shape)} must split into {W} equal chunks along dim 0 "
                         f"and out {tuple(out.shape)} {out.dtype} must match it")
    chunk, me = nbytes(inp) // W, dist.get_rank(group)
    moved: dict[str, int] = {}
    for peer in range(W):
        if peer != me:
            cls = link(peer) if callable(link) else link
            moved[cls] = moved.get(cls, 0) + chunk
    staging = _Staging(group, [out, inp], f"all_to_all [{label or phase}]")
    src, dst = staging.source(inp.contiguous()), staging.sink(out)
    return _collective("all_to_all", group, phase, moved, nbytes(inp),
                       lambda: dist.all_to_all_single(dst, src, group=group, async_op=True),
                       inp.device, label, staging)


def all_reduce(t: torch.Tensor, group: Optional[dist.ProcessGroup], phase: str, op: str = "sum",
               link: str = "intra", label: str = "") -> PendingExchange:
    """Post an in-place ``all_reduce(t)`` (``op`` "sum" or "max").

    Counted as a ring all-reduce: each rank sends (and receives) 2 (W - 1) / W x t's bytes.
    """
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op={op!r}, choose 'sum' or 'max'")
    W = dist.get_world_size(group)
    moved = {link: 2 * (W - 1) * nbytes(t) // W}
    red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    staging = _Staging(group, [t], f"all_reduce [{label or phase}]")
    buf = staging.sink(t, read_first=True)
    return _collective("all_reduce", group, phase, moved, nbytes(t),
                       lambda: dist.all_reduce(buf, op=red, group=group, async_op=True), t.device, label, staging)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup], phase: str,
                   link: str = "intra", label: str = "") -> PendingExchange:
    """Post ``reduce_scatter_tensor(out, inp)`` (sum): inp [W * n, ...] rank-major, out [n, ...] this
    rank's part of the sum over ranks.

    Counted as a ring reduce-scatter: each rank sends (and receives) (W - 1) x out's bytes.
    """
    W = dist.get_world_size(group)
    if inp.numel() != W * out.numel() or out.dtype != inp.dtype:
        raise ValueError(f"reduce_scatter: inp {tuple(inp.shape)} {inp.dtype} must hold {W} x out "
                         f"{tuple(out.shape)} {out.dtype}")
    moved = {link: (W - 1) * nbytes(out)}
    staging = _Staging(group, [out, inp], f"reduce_scatter [{label or phase}]")
    src, dst = staging.source(inp.contiguous()), staging.sink(out)
    return _collective("reduce_scatter", group, phase, moved, nbytes(inp),
                       lambda: _reduce_scatter_single(dst, src, group=group, async_op=True),
                       inp.device, label, staging)
