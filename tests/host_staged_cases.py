"""Rank-side bodies of the host-staged transport tests (run on gloo ranks by harness.run_ranks).

Without a GPU the staging path runs with ``stage_cpu=True`` (CPU tensors travel through separate
host buffers), or with comm.needs_staging patched so that CPU tensors pass for CUDA ones.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst import comm
from megatron_burst.nccl_check import check_on_all_ranks
from attention_cases import full_inputs
from cp_family_cases import usp_group


def normalized_trace(events) -> list:
    """Trace events with batch ids renumbered by first appearance (ids are process-wide counters)."""
    ids: dict[int, int] = {}
    out = []
    for kind, payload in events:
        if kind == "post":
            ids.setdefault(payload.id, len(ids))
            out.append(("post", ids[payload.id], payload.comm, payload.members, payload.ops, payload.label))
        else:
            out.append(("wait", ids.get(payload, ("unknown", payload))))
    return out


def _stats_delta(before: comm.StagingStats) -> dict:
    after = comm.staging_stats()
    return {k: getattr(after, k) - v for k, v in vars(before).items()}


def _attention(algo: str, group, heads: tuple[int, int], **cp_kw) -> dict:
    """One cp_attention forward + backward with counting and tracing; the replay report too."""
    pg = group.cp_group if isinstance(group, mb.topology.USPTopology) else group
    W, r = dist.get_world_size(pg), dist.get_rank(pg)
    q, k, v, dout = full_inputs(6 * W, 2, *heads, 8, torch.float32, seed=3)
    sh = lambda t: mb.shard(t, 0, r, W, "zigzag").clone()  # noqa: E731
    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    with comm.comm_counter() as counter, comm.record_schedule() as trace:
        out = mb.cp_attention(*leaves, group=group, algo=algo, layout="zigzag", causal=True, **cp_kw)
        out.backward(sh(dout))
    replays = {}
    for serialize in (False, True):
        report = check_on_all_ranks(trace, serialize_communicators=serialize)
        replays["serialized" if serialize else "per_comm"] = (report.ok, str(report), report.total)
    return {"tensors": [out.detach()] + [t.grad for t in leaves], "bytes": counter.as_dict(),
            "trace": normalized_trace(trace.events), "replays": replays}


def staged_matches_direct(algo: str, ulysses_size=None) -> dict:
    """cp_attention under the direct transport, then again with every tensor staged (stage_cpu):
    what differs between the two runs, and the staged run's replay reports and staging counts."""
    W = dist.get_world_size()
    heads = (6, 3) if W % 3 == 0 else (8, 2)
    group = usp_group(ulysses_size) if algo == "usp" else None
    kw = {"ulysses_size": ulysses_size} if algo == "usp" else {}
    with comm.transport("direct"):
        direct = _attention(algo, group, heads, **kw)
    before = comm.staging_stats()
    with comm.transport("host_staged", stage_cpu=True):
        staged = _attention(algo, group, heads, **kw)
    names = ("out", "dq", "dk", "dv")
    return {
        "unequal_tensors": [n for n, a, b in zip(names, direct["tensors"], staged["tensors"]) if not torch.equal(a, b)],
        "bytes": (direct["bytes"], staged["bytes"]),
        "trace_equal": direct["trace"] == staged["trace"],
        "posted": sum(1 for e in staged["trace"] if e[0] == "post"),
        "replays": staged["replays"],
        "stats": _stats_delta(before),
    }


def _comm_ops(ring: comm.RingComm) -> dict:
    """Every operation of megatron_burst.comm once (values depend on the rank); results and the
    receive tensor of the ring exchange as it was before wait()."""
    W, r = dist.get_world_size(), dist.get_rank()
    base = torch.arange(6 * W, dtype=torch.float32) + 100 * r
    res = {}
    recv = torch.full((4,), float("nan"))
    sent = torch.full((4,), float(r))
    pending = ring.exchange([sent], [recv], "forward", label="ring")
    res["recv_before_wait_untouched"] = bool(torch.isnan(recv).all())  # copied out only by wait()
    res["exchange"] = pending.wait()[0].clone()
    assert pending.wait()[0] is recv  # a second wait returns the same tensors at once
    gathered = torch.empty(6 * W * W)
    comm.all_gather(gathered, base, None, "forward", label="gather").wait()
    res["all_gather"] = gathered
    a2a = torch.empty_like(base)
    comm.all_to_all(a2a, base, None, "backward", label="a2a").wait()
    res["all_to_all"] = a2a
    summed = base.clone()
    comm.all_reduce(summed, None, "backward", label="sum").wait()
    res["all_reduce_sum"] = summed
    biggest = base.flip(0).clone()
    comm.all_reduce(biggest, None, "forward", op="max", label="max").wait()
    res["all_reduce_max"] = biggest
    part = torch.empty(6)
    comm.reduce_scatter(part, base, None, "backward", label="rs").wait()
    res["reduce_scatter"] = part
    return res


def _recorded_ops(ring: comm.RingComm) -> tuple[dict, dict, list]:
    with comm.comm_counter() as counter, comm.record_schedule() as trace:
        res = _comm_ops(ring)
    return res, counter.as_dict(), normalized_trace(trace.events)


def comm_ops_staged(mode: str) -> dict:
    """Every comm operation direct, then staged by ``mode``: "stage_cpu" (set_transport), "env"
    (MEGATRON_BURST_TRANSPORT=host_staged_cpu) or "pretend_cuda" (host_staged with needs_staging
    patched to say yes, as it would for CUDA tensors). Staged twice, so buffers get reused."""
    ring = comm.RingComm(None)
    with comm.transport("direct"):
        direct, direct_bytes, direct_trace = _recorded_ops(ring)
    before = comm.staging_stats()
    if mode == "stage_cpu":
        ctx = comm.transport("host_staged", stage_cpu=True)
    elif mode == "env":
        os.environ[comm.TRANSPORT_ENV] = "host_staged_cpu"  # the harness restores the environment
        ctx = contextlib.nullcontext()
    else:
        ctx = _pretend_cuda("host_staged")
    with ctx:
        runs = [_recorded_ops(ring) for _ in range(2)]
    out = {"stats": _stats_delta(before)}
    values = [k for k in direct if k != "recv_before_wait_untouched"]
    for i, (staged, staged_bytes, staged_trace) in enumerate(runs):
        out[f"run{i}"] = {
            "unequal": [k for k in values if not torch.equal(direct[k], staged[k])],
            "recv_before_wait_untouched": staged["recv_before_wait_untouched"],
            "bytes_equal": staged_bytes == direct_bytes and sum(direct_bytes.values()) > 0,
            "trace_equal": staged_trace == direct_trace and len(direct_trace) > 0,
        }
    return out


@contextlib.contextmanager
def _pretend_cuda(transport: str):
    """Every tensor "needs staging" (as CUDA tensors do) while the block runs, under ``transport``."""
    original = comm.needs_staging
    comm.needs_staging = lambda t: True
    try:
        with comm.transport(transport):
            yield
    finally:
        comm.needs_staging = original


def refusals() -> dict:
    """Each operation with "CUDA" tensors on the gloo group under the direct transport: the error
    (type, message), and whether anything was counted or traced before it."""
    W = dist.get_world_size()
    x, y = torch.ones(2 * W), torch.ones(2 * W)
    ring = comm.RingComm(None)
    calls = {
        "exchange": lambda: ring.exchange([x], [y], "forward"),
        "all_gather": lambda: comm.all_gather(torch.empty(2 * W * W), x, None, "forward"),
        "all_to_all": lambda: comm.all_to_all(y, x, None, "forward"),
        "all_reduce": lambda: comm.all_reduce(x, None, "forward"),
        "reduce_scatter": lambda: comm.reduce_scatter(torch.empty(2), x, None, "forward"),
    }
    out = {}
    for name, call in calls.items():
        with comm.comm_counter() as counter, comm.record_schedule() as trace, _pretend_cuda("direct"):
            try:
                call()
                out[name] = ("no error", "", 0, 0)
            except Exception as exc:  # noqa: BLE001  (the test checks the type)
                out[name] = (type(exc).__name__, str(exc), sum(counter.as_dict().values()), len(trace.events))
    dist.barrier()  # nothing was posted: every rank gets here
    return out


def _seen_on_rank() -> tuple:
    return comm.active_transport(), dist.get_world_size()


def one_gpu_call_pretending_cuda() -> dict:
    """launch.call_on_one_gpu on a CPU box with torch.cuda patched to claim one device: the function
    runs under host_staged on cuda:0, and the transport chosen before comes back afterwards."""
    from megatron_burst import launch

    patched = {"is_available": lambda: True, "device_count": lambda: 1, "set_device": lambda d: chosen.append(d)}
    chosen: list = []
    saved = {name: getattr(torch.cuda, name) for name in patched}
    try:
        for name, fake in patched.items():
            setattr(torch.cuda, name, fake)
        with comm.transport("direct"):
            inside = launch.call_on_one_gpu(_seen_on_rank)
            after = comm.active_transport()
        device = launch.setup_one_gpu_rank()
        kept = comm.active_transport()
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
    return {"inside": inside, "after": after, "chosen": chosen, "device": str(device), "kept": kept}
