"""Communication primitives for context parallelism, with byte accounting.

Every byte an algorithm moves goes through this module, so :func:`comm_counter` sees it all:

    with megatron_burst.comm_counter() as c:
        out = cp_attention(q, k, v, group=g)
        out.backward(dout)
    c.bytes("sent", phase="backward")

Bytes are recorded by direction (sent/received), phase (forward/backward) and link class
(intra/inter node). The link class of a peer comes from a ``link_of`` callable given by the caller
(a topology); without one every link is "intra".
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

PHASES = ("forward", "backward")
LINKS = ("intra", "inter")
DIRECTIONS = ("sent", "received")


class CommCounter:
    """Bytes moved by this rank, keyed by (direction, phase, link), and seconds spent waiting on them."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        self._wait: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, direction: str, phase: str, link: str, nbytes: int) -> None:
        self._bytes[(direction, phase, link)] += int(nbytes)

    def record_wait(self, phase: str, link: str, seconds: float) -> None:
        self._wait[(phase, link)] += seconds

    def wait_seconds(self, phase: Optional[str] = None, link: Optional[str] = None) -> float:
        """Seconds this rank was blocked waiting for transfers (the part compute did not hide)."""
        return sum(v for (p, l), v in self._wait.items() if (phase is None or p == phase) and (link is None or l == link))

    def bytes(self, direction: str = "sent", phase: Optional[str] = None, link: Optional[str] = None) -> int:
        """Total bytes for ``direction`` in {"sent", "received"}; ``phase``/``link`` None = all."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r}: choose one of {DIRECTIONS}")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase={phase!r}: choose one of {PHASES} or None")
        if link is not None and link not in LINKS:
            raise ValueError(f"link={link!r}: choose one of {LINKS} or None")
        return sum(v for (d, p, l), v in self._bytes.items()
                   if d == direction and (phase is None or p == phase) and (link is None or l == link))

    def reset(self) -> None:
        self._bytes.clear()
        self._wait.clear()

    def as_dict(self) -> dict[str, int]:
        return {f"{d}/{p}/{l}": v for (d, p, l), v in sorted(self._bytes.items())}


_active = threading.local()


def _counters() -> list[CommCounter]:
    if not hasattr(_active, "stack"):
        _active.stack = []
    return _active.stack


@contextlib.contextmanager
def comm_counter() -> Iterator[CommCounter]:
    """Count the bytes this rank sends and receives in CP attention while the block runs (nestable)."""
    counter = CommCounter()
    _counters().append(counter)
    try:
        yield counter
    finally:
        _counters().remove(counter)


def record(direction: str, phase: str, link: str, nbytes: int) -> None:
    for c in _counters():
        c.record(direction, phase, link, nbytes)


def record_wait(phase: str, link: str, seconds: float) -> None:
    for c in _counters():
        c.record_wait(phase, link, seconds)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RingComm:
    """Point-to-point neighbour exchange over a process group, as used by ring algorithms.

    ``send_to_next(tensors)`` posts async sends of ``tensors`` to the next rank and async receives of
    same-shaped buffers from the previous rank; the returned handle's ``wait()`` gives the received
    tensors. Posting the next block's exchange before computing on the current one is what overlaps
    transfers with compute (double buffering).
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

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], phase: str,
                 send_to: Optional[int] = None, recv_from: Optional[int] = None,
                 stream: int = 0) -> "PendingExchange":
        """Post async sends of ``send`` to ``send_to`` (default next) and receives into ``recv``.

        ``stream`` tags the messages: an activation ring (stream 0) and a gradient ring (stream 1)
        between the same two ranks can then be in flight together without being matched to each
        other's buffers. Algorithms also post both streams in the same order on every rank, which is
        what backends without tag matching (NCCL) rely on.
        """
        send_to = self.next if send_to is None else send_to
        recv_from = self.prev if recv_from is None else recv_from
        ops = []
        links = set()
        for t in send:
            ops.append(dist.P2POp(dist.isend, t, self._global(send_to), self.group, tag=stream))
            record("sent", phase, self._link_of(send_to), nbytes(t))
            links.add(self._link_of(send_to))
        for t in recv:
            ops.append(dist.P2POp(dist.irecv, t, self._global(recv_from), self.group, tag=stream))
            record("received", phase, self._link_of(recv_from), nbytes(t))
            links.add(self._link_of(recv_from))
        reqs = dist.batch_isend_irecv(ops) if ops else []
        # a wait is charged to the slower link class involved
        return PendingExchange(reqs, list(recv), phase, "inter" if "inter" in links else "intra")

    def send_to_next(self, tensors: Sequence[torch.Tensor], phase: str, stream: int = 0) -> "PendingExchange":
        """Send ``tensors`` to the next rank and receive same-shaped buffers from the previous one."""
        recv = [torch.empty_like(t) for t in tensors]
        return self.exchange(tensors, recv, phase, stream=stream)

    def send(self, tensors: Sequence[torch.Tensor], phase: str, to: Optional[int] = None,
             stream: int = 0) -> "PendingExchange":
        return self.exchange(tensors, [], phase, send_to=to, stream=stream)

    def recv(self, like: Sequence[torch.Tensor], phase: str, frm: Optional[int] = None,
             stream: int = 0) -> "PendingExchange":
        return self.exchange([], [torch.empty_like(t) for t in like], phase, recv_from=frm, stream=stream)


class PendingExchange:
    """Handle of posted P2P operations; ``wait()`` returns the receive buffers once filled."""

    def __init__(self, reqs: list, recv: list[torch.Tensor], phase: str = "forward", link: str = "intra") -> None:
        self._reqs = reqs
        self._recv = recv
        self._phase, self._link = phase, link

    def wait(self) -> list[torch.Tensor]:
        if self._reqs:
            start = time.perf_counter()
            for r in self._reqs:
                r.wait()
            record_wait(self._phase, self._link, time.perf_counter() - start)
        self._reqs = []
        return self._recv
