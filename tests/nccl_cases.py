"""Rank-side bodies of the NCCL-semantics tests: record real schedules on gloo, replay them."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.comm import RingComm, record_schedule
from megatron_burst.nccl_check import check_on_all_ranks
from attention_cases import run_case
from topology_cases import topology


def _replays(trace) -> dict:
    """Both NCCL models over every rank's trace: per-communicator FIFO, and one FIFO per rank."""
    out = {}
    for serialize in (False, True):
        report = check_on_all_ranks(trace, serialize_communicators=serialize)
        out["serialized" if serialize else "per_comm"] = (report.ok, str(report), report.total)
    return out


def attention_schedule(algo: str, ring: str, ranks_per_node: int, layout: str = "zigzag", heads="gqa4"):
    """One cp_attention forward + backward (errors checked too), recorded and replayed."""
    group = topology(ranks_per_node) if ring == "double" else None
    with record_schedule() as trace:
        errs = run_case(algo, layout, True, heads, group=group, ring=ring)
    result = _replays(trace)
    result["max_err"] = max(errs[n] for n in ("out", "dq", "dk", "dv"))
    result["posted"] = sum(1 for kind, _ in trace.events if kind == "post")
    return result


def lone_send_ring(nbytes: int = 1 << 12):
    """The schedule the review found in the old ring_pass: every rank posts its send to the next
    rank as a batch of its own and the matching receive in a later batch. gloo buffers the send,
    so this completes here; under NCCL every send waits for a receive queued behind a send."""
    comm = RingComm(None)
    block = torch.full((nbytes // 4,), float(dist.get_rank()))
    with record_schedule() as trace:
        sent = comm.exchange([block], [], "backward", label="lone send")
        got = comm.exchange([], [torch.empty_like(block)], "backward", label="its receive").wait()[0]
        sent.wait()
    ok_here = bool((got == float((dist.get_rank() - 1) % dist.get_world_size())).all())
    return ok_here, _replays(trace)


def collectives_schedule():
    """all_gather and all_to_all through megatron_burst.comm: counted, traced, replayable."""
    W = dist.get_world_size()
    x = torch.arange(6, dtype=torch.float32) + 10 * dist.get_rank()
    gathered = torch.empty(6 * W)
    a2a_in = torch.arange(2 * W, dtype=torch.float32) + 100 * dist.get_rank()
    a2a_out = torch.empty_like(a2a_in)
    with mb.comm_counter() as counter, record_schedule() as trace:
        mb.comm.all_gather(gathered, x, None, "forward").wait()
        mb.comm.all_to_all(a2a_out, a2a_in, None, "backward").wait()
    expect_gather = torch.cat([torch.arange(6, dtype=torch.float32) + 10 * r for r in range(W)])
    expect_a2a = torch.tensor([100.0 * r + 2 * dist.get_rank() + i for r in range(W) for i in range(2)])
    return {"values_ok": bool(torch.equal(gathered, expect_gather) and torch.equal(a2a_out, expect_a2a)),
            "bytes": {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")},
            **_replays(trace)}


def selective_recompute_schedule(ring: str, ranks_per_node: int, algo: str = "burst"):
    """Sequence-level selective checkpointing's passes: the first (no-grad) forward, the recompute
    (only the K,V prefix the early rows see travels) and the backward, recorded and replayed."""
    from megatron_burst.activation_store import SelectiveAttentionCache, selective_cp_attention
    from attention_cases import full_inputs

    W, r = dist.get_world_size(), dist.get_rank()
    group = topology(ranks_per_node) if ring == "double" else None
    q, k, v, dout = full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=5)
    sh = lambda t: mb.shard(t, 0, r, W, "striped").clone()  # noqa: E731
    kw = dict(algo=algo, layout="striped", group=group, ring=ring)
    cache = SelectiveAttentionCache()
    with record_schedule() as trace:
        with torch.no_grad():
            selective_cp_attention(sh(q), sh(k), sh(v), cache=cache, stored_fraction=0.5, **kw)
        leaves = [sh(t).requires_grad_() for t in (q, k, v)]
        selective_cp_attention(*leaves, cache=cache, stored_fraction=0.5, **kw).backward(sh(dout))
    result = _replays(trace)
    result["hits"] = cache.hits
    return result


def linear_schedule(algo: str, layout: str, causal: bool):
    """linear_attention forward + backward (errors checked too), recorded and replayed."""
    from linear_cases import run_case as linear_case

    stripe = 64 if layout == "striped" else 1
    with record_schedule() as trace:
        errs = linear_case(algo, layout, causal, "channel" if causal else None, 128 if stripe > 1 else 70,
                           stripe=stripe)
    result = _replays(trace)
    result["max_err"] = max(v for key, v in errs.items() if key not in ("bytes", "dtype"))
    return result


def document_schedule(algo: str, ring: str, ranks_per_node: int, layout: str = "zigzag"):
    """cp_attention with packed documents (some block pairs skip compute), recorded and replayed:
    the schedule must not depend on the mask, or ranks skipping a pair would unbalance the batches."""
    from document_cases import run_doc_case

    W = dist.get_world_size()
    seq = 8 * W
    with record_schedule() as trace:
        errs = run_doc_case(algo, layout, (8, 2), [0, 3, 4, seq // 2 + 3, seq], 8,
                            ranks_per_node=ranks_per_node if ring == "double" else None, ring=ring)
    result = _replays(trace)
    result["max_err"] = max(errs[n] for n in ("out", "dq", "dk", "dv"))
    return result


def direct_document_schedule(algo: str, ring: str, ranks_per_node: int, layout: str = "zigzag"):
    """A document-masked call with direct traffic (schedule.direct_pass: blocks only where the mask
    needs them, straight from their owner), forward + backward, recorded and replayed."""
    from direct_traffic_cases import run_direct_case

    W = dist.get_world_size()
    bounds = [0, 3, 4, 8 + 4, 8 + 6, 8 * W]
    res = run_direct_case(algo, layout, (8, 2), bounds, 8, ranks_per_node=ranks_per_node if ring == "double" else None,
                          ring=ring, replay=True)
    (per_comm, serialized) = res["replay"]
    return {"per_comm": per_comm, "serialized": serialized,
            "max_err": max(res["direct"][n] for n in ("out", "dq", "dk", "dv")),
            "sent": sum(res["direct"]["bytes"].values()), "ring_sent": sum(res["ring"]["bytes"].values())}


def gdn_schedule(layout: str, kernel: str = "torch"):
    """gated_delta_rule forward + backward (errors checked too), recorded and replayed; ``kernel``
    "fla": the local work by the CPU stand-in for fla (its one wide call), as on CUDA."""
    from gdn_cases import run_gdn_case

    stripe = 64 if layout == "striped" else 1
    with record_schedule() as trace:
        errs = run_gdn_case(layout, 128 if stripe > 1 else 70, stripe=stripe, kernel=kernel)
    result = _replays(trace)
    result["max_err"] = max(v for key, v in errs.items() if key not in ("bytes", "dtype"))
    return result


def sparse_dynamic_schedule(algo: str):
    """sparse_cp_attention with MTraining's dynamic pattern (its mass all-reduce, then the ring) forward
    + backward, recorded and replayed; every rank must get the same output shape and finite grads."""
    W, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(11)
    full = [torch.randn(128 * W, 1, 2, 8, generator=gen) for _ in range(4)]
    q, k, v, dout = (mb.shard(t, 0, r, W, "striped", 64).clone() for t in full)
    for t in (q, k, v):
        t.requires_grad_()
    with record_schedule() as trace:
        out = mb.sparse_cp_attention(q, k, v, "dynamic", layout="striped", stripe=64, algo=algo)
        out.backward(dout)
    result = _replays(trace)
    result["finite"] = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    result["kinds"] = sorted({op.kind for kind, batch in trace.events if kind == "post" for op in batch.ops})
    return result


def previous_tokens_schedule(layout: str):
    """The Gated DeltaNet conv halo (previous_tokens' all-gathers, forward and backward), replayed."""
    from gdn_cases import previous_tokens_case

    stripe = 64 if layout == "striped" else 1
    with record_schedule() as trace:
        errs = previous_tokens_case(layout, 128 if stripe > 1 else 70, 3, stripe=stripe)
    result = _replays(trace)
    result["max_err"] = max(errs["halo"], errs["grad"])
    return result


def balanced_nodes_schedule(algo: str, ranks_per_node: int):
    """layout "balanced" on a node topology: the plan placed for the nodes, the direct pass over the CP
    group in the plan's member order (not the identity here), forward + backward recorded and
    replayed; errors vs the dense reference and the inter-node bytes (documents at levels dividing
    the node size stay inside a node)."""
    from balanced_cases import LEVEL_TWO_BOUNDS, run_case
    from megatron_burst.bench.document_mixes import lognormal_mix

    W = dist.get_world_size()
    local_len = 12 if W == 4 else 128  # 2 x 2: documents at level 2; 2 x 4: the lognormal mix at levels 1, 4
    bounds = LEVEL_TWO_BOUNDS if W == 4 else lognormal_mix(local_len * W)
    group = topology(ranks_per_node)
    with record_schedule() as trace, mb.comm_counter() as counter:
        errs = run_case(algo, (8, 2), local_len, bounds=bounds, group=group)
    result = _replays(trace)
    result["max_err"] = max(errs[n] for n in ("out", "dq", "dk", "dv"))
    result["inter"] = counter.bytes("sent", link="inter")
    result["sent"] = counter.bytes("sent")
    return result


def run_layouts_schedule():
    """The data-derived layouts (THD, balanced) of the linear family: LASP-2 and the gated delta rule
    over runs (padded all-gathers), and the conv halo over runs, recorded and replayed."""
    from linear_run_cases import run_halo_case, run_layout_cases

    with record_schedule() as trace:
        cases = run_layout_cases()
        halo = run_halo_case()
    result = _replays(trace)
    cases.pop("runs")
    result["max_err"] = max([v for errs in cases.values() for k, v in errs.items() if k != "sent"]
                            + [halo["halo"], halo["grad"]])
    return result
