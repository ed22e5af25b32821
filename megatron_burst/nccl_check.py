"""Replay recorded communication schedules under NCCL's rules, to find deadlocks a CPU run hides.

gloo buffers sends and matches messages by tag, so a schedule can pass every CPU test and still
hang on a GPU cluster. NCCL (as torch.distributed drives it) differs in four ways this module models:

* A ``batch_isend_irecv`` call is one NCCL group: its operations progress together, and the group
  finishes when all of them have.
* Groups (and collectives) of one communicator run one after another, in the order they were posted
  (one stream per communicator). With ``serialize_communicators=True`` a rank runs ALL its groups
  in posting order, whatever the communicator -- what happens when NCCL kernels of different
  communicators cannot run side by side on a GPU; a schedule safe under both is safe either way.
* Nothing is buffered: a send completes only together with its matching receive. The k-th send
  from rank a to rank b on a communicator matches the k-th receive posted on b from a; tags are
  ignored. Sizes must agree.
* A collective matches the same-numbered collective of every member of its communicator.

The host posts without blocking; ``wait()`` on a request orders everything posted after it behind
the waited group (on GPU the stream waits; either way no later group starts first). Optionally
(``lazy_init``) the first use of a communicator is a collective over all its members, as NCCL's
lazy communicator creation is.

Use :func:`megatron_burst.comm.record_schedule` on every rank around the code under test, gather
the traces, and call :func:`replay`; or call :func:`check_on_all_ranks` from every rank. Traces are
recorded above the transport: a run with the host-staged one (several ranks on one GPU, over gloo;
see megatron_burst.comm) records the same trace as a direct run, so it is checked the same way.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megatron_burst.comm import ScheduleTrace, TracedBatch, TracedOp

__all__ = ["ReplayReport", "replay", "check_on_all_ranks"]


@dataclass
class ReplayReport:
    """Outcome of a replay: ``ok``, the number of groups that ran, and what went wrong."""

    ok: bool
    completed: int
    total: int
    problems: list[str]

    def __str__(self) -> str:
        if self.ok:
            return f"NCCL replay: all {self.total} groups complete"
        return (f"NCCL replay: stuck after {self.completed} of {self.total} groups\n  "
                + "\n  ".join(self.problems))


@dataclass
class _Op:
    rank: int
    batch: TracedBatch
    index: int  # position in batch.ops
    kind: str
    peer: int
    nbytes: int
    partners: tuple = ()  # the _Op(s) this one completes together with
    done: bool = False

    def describe(self) -> str:
        if self.kind == "send":
            return f"send of {self.nbytes} B to rank {self.peer}"
        if self.kind == "recv":
            return f"receive of {self.nbytes} B from rank {self.peer}"
        return f"{self.kind} ({self.nbytes} B in)"


def _where(batch: TracedBatch, rank: int) -> str:
    return f"rank {rank} group #{batch.id} [{batch.label or '?'}] on communicator {batch.comm}"


def replay(traces: Mapping[int, Sequence] | Sequence[ScheduleTrace], serialize_communicators: bool = False,
           lazy_init: bool = True) -> ReplayReport:
    """Replay every rank's recorded events under NCCL's rules (module docstring).

    ``traces``: {global rank: events} or a list of :class:`ScheduleTrace`; events are ("post",
    TracedBatch) and ("wait", batch id), in program order. Returns a :class:`ReplayReport`; its
    problems name the first group that cannot complete and why, or the operations without a match.
    """
    if not isinstance(traces, Mapping):
        traces = {t.rank: t.events for t in traces}
    events = {r: list(ev) for r, ev in traces.items()}
    if lazy_init:
        events = {r: _with_lazy_init(r, ev) for r, ev in events.items()}
    problems: list[str] = []
    ops_of: dict[tuple[int, int], list[_Op]] = {}
    total = 0
    for r, evs in events.items():
        for kind, payload in evs:
            if kind == "post":
                ops_of[(r, payload.id)] = [_Op(r, payload, i, o.kind, o.peer, o.nbytes)
                                          for i, o in enumerate(payload.ops)]
                total += 1
    problems += _match(events, ops_of)
    if problems:
        return ReplayReport(False, 0, total, problems)

    pc = {r: 0 for r in events}
    queues: dict[tuple, deque] = defaultdict(deque)  # (rank, communicator or "*") -> posted groups
    finished: set[tuple[int, int]] = set()
    while True:
        progressed = False
        for r, evs in events.items():  # hosts run until they wait on an unfinished group
            while pc[r] < len(evs):
                kind, payload = evs[pc[r]]
                if kind == "post":
                    lane = "*" if serialize_communicators else payload.comm
                    queues[(r, lane)].append(payload)
                elif (r, payload) not in finished:
                    break
                pc[r] += 1
                progressed = True
        running = {(r, q[0].id) for (r, _), q in queues.items() if q}
        for (r, bid) in running:  # an op completes when all its partners are in running groups
            for op in ops_of[(r, bid)]:
                if not op.done and all((p.rank, p.batch.id) in running for p in op.partners):
                    for o in (op,) + op.partners:
                        o.done = True
        for key, q in queues.items():
            while q and all(o.done for o in ops_of[(key[0], q[0].id)]):
                finished.add((key[0], q.popleft().id))
                progressed = True
        if not progressed:
            break
    if all(pc[r] == len(evs) for r, evs in events.items()) and not any(queues.values()):
        return ReplayReport(True, len(finished), total, [])
    return ReplayReport(False, len(finished), total, _explain_stuck(events, pc, queues, ops_of, finished))


def _with_lazy_init(rank: int, evs: list) -> list:
    """Insert an init collective before the first group each communicator sees on this rank."""
    seen: set[str] = set()
    out = []
    for kind, payload in evs:
        if kind == "post" and payload.comm not in seen:
            seen.add(payload.comm)
            init = TracedBatch(-len(seen), payload.comm, payload.members, (TracedOp("communicator init", -1, 0),),
                               "lazy communicator init")
            out.append(("post", init))
        out.append((kind, payload))
    return out


def _match(events: Mapping[int, list], ops_of: dict) -> list[str]:
    """Pair sends with receives and collectives across members; return what cannot be paired."""
    problems: list[str] = []
    sends: dict[tuple, list[_Op]] = defaultdict(list)  # (comm, src, dst) -> sends in program order
    recvs: dict[tuple, list[_Op]] = defaultdict(list)
    colls: dict[tuple, list[_Op]] = defaultdict(list)  # (comm, rank) -> collectives in order
    members: dict[str, tuple] = {}
    for r, evs in events.items():
        for kind, payload in evs:
            if kind != "post":
                continue
            members[payload.comm] = payload.members
            for op in ops_of[(r, payload.id)]:
                if op.kind == "send":
                    sends[(payload.comm, r, op.peer)].append(op)
                elif op.kind == "recv":
                    recvs[(payload.comm, op.peer, r)].append(op)
                else:
                    colls[(payload.comm, r)].append(op)
    for key in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get(key, []), recvs.get(key, [])
        for s, rv in zip(s_list, r_list):
            if s.nbytes != rv.nbytes:
                problems.append(f"size mismatch: {_where(s.batch, s.rank)} sends {s.nbytes} B but the matching "
                                f"receive in {_where(rv.batch, rv.rank)} expects {rv.nbytes} B")
            s.partners, rv.partners = (rv,), (s,)
        comm, src, dst = key
        for s in s_list[len(r_list):]:
            problems.append(f"unmatched: {_where(s.batch, src)}: {s.describe()} has no matching receive on "
                            f"rank {dst}")
        for rv in r_list[len(s_list):]:
            problems.append(f"unmatched: {_where(rv.batch, dst)}: {rv.describe()} has no matching send")
    for comm, ranks in members.items():
        lists = {r: colls.get((comm, r), []) for r in ranks if r in events}
        counts = {r: len(v) for r, v in lists.items()}
        if len(set(counts.values())) > 1:
            problems.append(f"collective count differs on communicator {comm}: {counts}")
            continue
        for i in range(min(counts.values(), default=0)):
            group = [lists[r][i] for r in lists]
            if len({o.kind for o in group}) > 1:
                problems.append(f"collective #{i} on communicator {comm} differs: "
                                + ", ".join(f"rank {o.rank} {o.kind}" for o in group))
            for o in group:
                o.partners = tuple(p for p in group if p is not o)
    return problems


def _explain_stuck(events, pc, queues, ops_of, finished) -> list[str]:
    """Name the first stuck group (lowest rank, then oldest) and every rank's position."""
    lines = []
    heads = sorted((r, q[0]) for (r, _), q in queues.items() if q)
    for r, batch in heads[:1]:
        waiting = [o for o in ops_of[(r, batch.id)] if not o.done]
        lines.append(f"first stuck: {_where(batch, r)}")
        for op in waiting:
            for p in op.partners:
                lines.append(f"    its {op.describe()} needs {_state_of(p, pc, events, queues, finished)}")
    for r in sorted(events):
        evs = events[r]
        if pc[r] < len(evs):
            kind, payload = evs[pc[r]]
            blocked = [b for (rr, _), q in queues.items() if rr == r for b in list(q)[:1]]
            lines.append(f"rank {r}: host waits for group #{payload}; running: "
                         + (", ".join(f"#{b.id} [{b.label}]" for b in blocked) or "nothing"))
    return lines


def _state_of(op: _Op, pc, events, queues, finished) -> str:
    r, batch = op.rank, op.batch
    posted = any(k == "post" and p.id == batch.id for k, p in events[r][:pc[r]])
    what = f"rank {r}'s {op.describe()} in group #{batch.id} [{batch.label}]"
    if not posted:
        return f"{what}, not posted yet (rank {r}'s host is still waiting)"
    for (rr, _), q in queues.items():
        if rr == r and batch in q:
            pos = list(q).index(batch)
            if pos:
                return f"{what}, queued behind group #{q[0].id} [{q[0].label}]"
    return f"{what}"


def check_on_all_ranks(trace: ScheduleTrace, group=None, **kwargs) -> ReplayReport:
    """Gather every rank's ``trace`` (all_gather_object over ``group``) and replay them all.

    Collective: every rank of ``group`` must call it. Every rank gets the same report.
    """
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (trace.rank, trace.events), group=group)
    return replay(dict(everyone), **kwargs)
