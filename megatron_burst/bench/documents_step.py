"""Measured step time and bytes of packed documents: zigzag vs balanced (issue L, deliverable 5).

    python -m megatron_burst.bench documents --emulate [--nodes 2 --ranks-per-node 4 --inter-mbit 150
                                                        --ratio 9 --cpu-per-rank 0.2]
    python -m megatron_burst.bench documents --local [--world-size 8 ...]   # one machine, plain gloo
    python -m megatron_burst.bench documents --quick                        # tiny, seconds (CI smoke)

Every rank runs forward + backward of ``cp_attention`` on the same lognormal packed-document batch
(megatron_burst.bench.document_mixes.lognormal_mix scaled to ``--seq``: 47 documents, sigma 1.0), once
per (algorithm, layout), the variants interleaved within each repeat so machine noise falls on all
of them alike. Per variant it reports:

* ``step s``: median over repeats of the slowest rank's forward + backward (ranks start together
  after a barrier: a synchronous step lasts as long as its slowest rank);
* ``compute s``: the busiest / the mean rank's time not blocked on transfers (forward + backward
  minus comm_counter's wait time): the work imbalance as the ranks felt it;
* ``MB sent``: bytes the busiest rank sent, forward + backward, from comm_counter, and the most
  any rank sent over inter- and over intra-node links (the busiest rank of each can differ);
* ``max err``: the largest absolute difference of the gathered output and of dq, dk, dv from a
  per-document torch SDPA reference over the full sequence (computed by the driver, off the
  clock), so a fast but wrong variant shows;
* ``speedup``: zigzag's step time / this one's, same algorithm.

Layouts: ``zigzag`` (Megatron's; the engine's default ring, i.e. the double ring when the
topology spans nodes), ``zigzag/flat`` (one flat ring), ``block-striped`` (stripes of 64 tokens),
``balanced`` (megatron_burst.balanced_documents placed for the emulated nodes' ranks per node, as
cp_attention plans on a multi-node topology: documents split over k ranks with k dividing the ranks
per node stay inside a node; it picks the direct traffic schedule), ``balanced/one-node-plan`` (the
same documents planned as for one node, ``ranks_per_node=None``: cosets of ranks W/k apart span
both nodes; run on a one-node view of the same CP group, :func:`one_node_view`, whose links keep
the emulated nodes' intra/inter classes).

Emulation (``--emulate``; root and iproute2, see megatron_burst.bench.emulated): one network
namespace per node, each rank with its own NIC limited to ``--inter-mbit`` (rail-optimized, one
NIC per GPU) and the node's loopback limited to ``--ratio`` x ``--inter-mbit`` x
``--ranks-per-node``: NVLink gives every GPU its own bandwidth, but the namespace's loopback is one
link its ranks share. ``--cpu-per-rank`` caps each rank's CPU (a cgroup each), so a waiting rank
cannot lend its core to a busy one: every rank is a device of fixed speed, and imbalance costs time
as it does on GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

VARIANTS = {  # name: (layout, stripe, ring: None = the engine's default for the topology)
    "zigzag": ("zigzag", 1, None),
    "zigzag/flat": ("zigzag", 1, "flat"),
    "block-striped": ("striped", 64, None),
    "balanced": ("balanced", 1, None),  # placed for the topology's nodes (the engine's default)
    "balanced/one-node-plan": ("balanced", 1, None),  # placed as for one node, to show the difference
}
BASELINE = "zigzag"
# fp32 everywhere: a correct variant differs from the reference by summation order only
EXACT_TOLERANCE = 1e-4

QUICK = dict(world_size=4, ranks_per_node=2, seq=1024, heads=2, kv_heads=1, head_dim=16, repeats=1, warmup=1,
             algos=["ring", "burst"])


# ---------------------------------------------------------------- shared by driver and ranks
def batch(args) -> tuple[list, list[torch.Tensor]]:
    """The lognormal mix's boundaries at ``args.seq`` and the full q, k, v, dout [S, 1, h, d] (fp32,
    seeded: every rank and the driver build the same tensors)."""
    from megatron_burst.bench.document_mixes import lognormal_mix

    bounds = lognormal_mix(args.seq)
    g = torch.Generator().manual_seed(args.seed)
    shapes = [(args.heads, "q"), (args.kv_heads, "k"), (args.kv_heads, "v"), (args.heads, "dout")]
    full = [torch.randn(args.seq, 1, h, args.head_dim, generator=g) for h, _ in shapes]
    return bounds, full


def reference(bounds: list, full: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Output and dq, dk, dv of causal attention within each document, one torch SDPA per document
    (independent of the engine's block masks and merges)."""
    q, k, v, dout = (t.clone().requires_grad_(t is not full[3]) for t in full)
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        # [L, 1, h, d] -> [1, h, L, d]
        qd, kd, vd = (t[a:b].permute(1, 2, 0, 3) for t in (q, k, v))
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        outs.append(od.permute(2, 0, 1, 3))
    out = torch.cat(outs)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def plans_of(bounds: list, seq: int, world_size: int, ranks_per_node: int) -> dict:
    """Documents per balanced variant: placed for nodes of ``ranks_per_node`` ranks (what cp_attention
    plans on that topology), and placed as for one node."""
    import megatron_burst as mb

    cu = torch.tensor(bounds)
    return {"balanced": mb.balanced_documents(cu, seq, 1, world_size, ranks_per_node=ranks_per_node),
            "balanced/one-node-plan": mb.balanced_documents(cu, seq, 1, world_size, ranks_per_node=None)}


def one_node_view(topo):
    """The CP group of ``topo`` as one node (ranks_per_node = W, its flat ring, no double ring), for
    the one-node plan: cp_attention refuses a plan placed for other nodes than its topology's. The
    flat ring's links are still classed by ``topo`` (bytes counted intra/inter as they travel)."""
    from megatron_burst.topology import CPTopology

    return CPTopology(topo.group, topo.rank, topo.world_size, topo.world_size, topo.flat)


def variant_key(algo: str, name: str) -> str:
    return f"{algo}|{name}"


# ---------------------------------------------------------------- ranks
def measure(args) -> dict:
    """One rank's part: every (algorithm, variant) forward + backward, ``warmup + repeats`` times,
    interleaved. Returns per-repeat timings and bytes; writes the last repeat's output and input
    gradients to ``args.tensors`` for the driver's exactness check."""
    import megatron_burst as mb
    from megatron_burst.masks.documents import check_cu_seqlens

    W, r = dist.get_world_size(), dist.get_rank()
    topo = mb.build_cp_topology(None, args.ranks_per_node)
    bounds, full = batch(args)
    cu = torch.tensor(bounds, dtype=torch.int32)
    documents = plans_of(bounds, args.seq, W, args.ranks_per_node)
    groups = {name: one_node_view(topo) if name == "balanced/one-node-plan" else topo for name in args.variants}
    plain = check_cu_seqlens(cu, args.seq, 1)  # validated once, as Megatron's layers pass them
    locals_ = {}
    for name in args.variants:
        layout, stripe, _ = VARIANTS[name]
        plan = documents[name].plan if layout == "balanced" else None
        locals_[name] = [mb.shard(t, 0, r, W, layout, stripe, plan=plan).contiguous() for t in full]

    rate = _inter_node_rate(topo, locals_[args.variants[0]][1:3]) if topo.outer is not None else None
    samples: dict[str, list] = {variant_key(a, n): [] for a in args.algos for n in args.variants}
    for i in range(args.warmup + args.repeats):
        for algo in args.algos:
            for name in args.variants:
                layout, stripe, ring = VARIANTS[name]
                q, k, v, dout = locals_[name]
                ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
                docs = documents[name] if layout == "balanced" else plain
                dist.barrier()
                with mb.comm_counter() as c:
                    t0 = time.perf_counter()
                    out = mb.cp_attention(ql, kl, vl, group=groups[name], algo=algo, layout=layout, stripe=stripe,
                                          ring=ring, cu_seqlens=docs)
                    t1 = time.perf_counter()
                    out.backward(dout)
                    t2 = time.perf_counter()
                dist.barrier()
                if i >= args.warmup:
                    samples[variant_key(algo, name)].append(dict(
                        fwd=t1 - t0, bwd=t2 - t1, wait=c.wait_seconds(), fwd_wait=c.wait_seconds(phase="forward"),
                        inter=c.bytes("sent", link="inter"), intra=c.bytes("sent", link="intra"),
                        fwd_bytes=c.bytes("sent", phase="forward")))
                if i == args.warmup + args.repeats - 1:
                    torch.save({"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad},
                               os.path.join(args.tensors, f"rank{r}_{algo}_{name.replace('/', '-')}.pt"))
    return {"rank": r, "rate": rate, "samples": samples}


def _inter_node_rate(topo, kv: list[torch.Tensor]) -> float:
    """Bytes/s over the inter-node ring, measured with the transfer the rings make (one K,V block)."""
    block = torch.stack(kv)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        topo.outer.act.exchange([block], [torch.empty_like(block)], "forward").wait()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return block.numel() * block.element_size() / statistics.median(times)




# ---------------------------------------------------------------- driver
def summarize(per_rank: list[dict], args, ref: dict[str, torch.Tensor], bounds: list) -> dict:
    """Per variant: step / compute times, bytes, max error against the reference (see module docstring)."""
    import megatron_burst as mb

    W = len(per_rank)
    plans = {name: docs.plan for name, docs in plans_of(bounds, args.seq, W, args.ranks_per_node).items()}
    summary = {}
    for key in per_rank[0]["samples"]:
        algo, name = key.split("|")
        runs = [pr["samples"][key] for pr in per_rank]
        n = len(runs[0])
        steps = [max(run[i]["fwd"] + run[i]["bwd"] for run in runs) for i in range(n)]
        fwds = [max(run[i]["fwd"] for run in runs) for i in range(n)]
        computes = [[run[i]["fwd"] + run[i]["bwd"] - run[i]["wait"] for run in runs] for i in range(n)]
        fwd_computes = [[run[i]["fwd"] - run[i]["fwd_wait"] for run in runs] for i in range(n)]
        median_of = lambda field: [statistics.median(x[field] for x in run) for run in runs]  # noqa: E731
        inter, intra = median_of("inter"), median_of("intra")
        sent = [a + b for a, b in zip(inter, intra)]
        layout, stripe, _ = VARIANTS[name]
        shards = [torch.load(os.path.join(args.tensors, f"rank{r}_{algo}_{name.replace('/', '-')}.pt"))
                  for r in range(W)]
        err = {}
        for field in ("out", "dq", "dk", "dv"):
            got = mb.unshard([s[field] for s in shards], 0, layout, stripe,
                             plan=plans.get(name))
            err[field] = float((got - ref[field]).abs().max())
        summary[key] = dict(
            algo=algo, variant=name, step=statistics.median(steps), step_min=min(steps), step_max=max(steps),
            fwd=statistics.median(fwds),
            compute_max=statistics.median(max(c) for c in computes),
            compute_mean=statistics.median(statistics.fmean(c) for c in computes),
            fwd_compute_mean=statistics.median(statistics.fmean(c) for c in fwd_computes),
            sent_max=max(sent), sent_mean=statistics.fmean(sent), inter_max=max(inter), intra_max=max(intra),
            max_err=max(err.values()), errors=err, exact=max(err.values()) <= EXACT_TOLERANCE)
    for key, s in summary.items():
        base = summary.get(variant_key(s["algo"], BASELINE))
        s["speedup"] = base["step"] / s["step"] if base else None
        s["bytes_vs_zigzag"] = s["sent_max"] / base["sent_max"] if base and base["sent_max"] else None
    return summary


def _print_table(summary: dict, header: str) -> None:
    print(header)
    print("| algo | layout | step s (median, min-max) | speedup vs zigzag | compute s max / mean rank | "
          "MB sent/rank: max total / max inter / max intra | bytes vs zigzag | max err | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summary.values():
        speed = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        ratio = f"{s['bytes_vs_zigzag']:.2f}" if s["bytes_vs_zigzag"] is not None else "-"
        print(f"| {s['algo']} | {s['variant']} | {s['step']:.3f} ({s['step_min']:.3f}-{s['step_max']:.3f}) | {speed} | "
              f"{s['compute_max']:.3f} / {s['compute_mean']:.3f} | {s['sent_max'] / 1e6:.2f} / "
              f"{s['inter_max'] / 1e6:.2f} / {s['intra_max'] / 1e6:.2f} | {ratio} | {s['max_err']:.1e} | "
              f"{'yes' if s['exact'] else 'NO'} |")


def _comm_compute_ratio(summary: dict, per_rank: list[dict], args) -> Optional[float]:
    """Seconds to move one rank's K,V block over the inter-node link / the mean rank's forward compute
    per ring step (zigzag, first algorithm): the ratio the emulation is chosen to match (docs/benchmarks.md)."""
    rates = [pr["rate"] for pr in per_rank if pr["rate"]]
    base = summary.get(variant_key(args.algos[0], BASELINE))
    if not rates or base is None:
        return None
    W = len(per_rank)
    block_bytes = 2 * (args.seq // W) * args.kv_heads * args.head_dim * 4
    return (block_bytes / statistics.median(rates)) / (base["fwd_compute_mean"] / W)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench documents --emulate|--local|--quick",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--emulate", action="store_true", help="ranks on emulated nodes (network namespaces; root)")
    mode.add_argument("--local", action="store_true", help="--world-size local gloo ranks, no link limits")
    mode.add_argument("--quick", action="store_true",
                      help=f"--local with tiny sizes, seconds (CI smoke): {QUICK}")
    mode.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--world-size", type=int, default=None, help="--local: ranks (default nodes x ranks-per-node)")
    p.add_argument("--inter-mbit", type=float, default=150.0, help="emulated inter-node rate per rank NIC, Mbit/s")
    p.add_argument("--ratio", type=float, default=9.0,
                   help="intra-node rate per rank / inter-node rate (NVLink 4 ~450 GB/s vs NDR 50 GB/s: 9)")
    p.add_argument("--cpu-per-rank", type=float, default=0.2,
                   help="--emulate: cap each rank at this many cores (0: no cap)")
    p.add_argument("--seq", type=int, default=16384, help="packed tokens S (divisible by 2 x world size)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--algos", nargs="+", default=["ring", "burst"], choices=["ring", "burst", "auto"])
    p.add_argument("--variants", nargs="+", default=["zigzag", "balanced", "balanced/one-node-plan"],
                   choices=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="also write the summary here (JSON)")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--tensors", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.worker:
        from megatron_burst.bench.emulated import run_rank

        return run_rank(args, measure, args.threads)
    if args.quick:
        for k, val in QUICK.items():
            setattr(args, k, val)
    if args.world_size is None or args.emulate:
        args.world_size = args.nodes * args.ranks_per_node
    if BASELINE not in args.variants:
        args.variants = [BASELINE] + args.variants  # speedups and byte ratios are against it
    if args.world_size % args.ranks_per_node:
        p.error(f"--world-size {args.world_size} is not a multiple of --ranks-per-node {args.ranks_per_node}")
    if args.seq % (2 * args.world_size) or ("block-striped" in args.variants and args.seq % (64 * args.world_size)):
        p.error(f"--seq {args.seq} must be divisible by 2 x {args.world_size} ranks (zigzag) and, with "
                f"block-striped, by 64 x {args.world_size}: try --seq {64 * args.world_size * 32}")

    from megatron_burst.bench.launch import STEADY_MALLOC, run_local

    bounds, full = batch(args)
    ref = reference(bounds, full)
    args.tensors = tempfile.mkdtemp(prefix="mb_documents_step_")
    try:
        if args.emulate:
            from megatron_burst.bench.emulated import run_on_emulated_nodes

            for k, val in STEADY_MALLOC.items():
                os.environ.setdefault(k, val)  # the namespaces' ranks inherit this environment
            forwarded = _forwarded(args)
            per_rank = run_on_emulated_nodes(
                "documents", forwarded, args.nodes, args.ranks_per_node, args.inter_mbit,
                args.inter_mbit * args.ratio * args.ranks_per_node, args.timeout, args.cpu_per_rank or None)
        else:
            per_rank = run_local(args.world_size, measure, args, threads=args.threads, env=STEADY_MALLOC)
        summary = summarize(per_rank, args, ref, bounds)
    finally:
        shutil.rmtree(args.tensors, ignore_errors=True)

    import numpy as np

    lengths = np.diff(bounds)
    if args.emulate:
        where = (f"{args.nodes} emulated nodes x {args.ranks_per_node} ranks, inter {args.inter_mbit:g} Mbit/s per "
                 f"rank NIC, intra {args.ratio:g}x that per rank, "
                 f"{f'{args.cpu_per_rank:g} core per rank' if args.cpu_per_rank else 'no CPU cap'}")
    else:
        where = f"{args.world_size} local ranks ({args.ranks_per_node} per node for the topology), no link limits"
    header = (f"# packed documents, measured: W={args.world_size} gloo ranks on CPU ({where}); S={args.seq}, "
              f"lognormal mix ({len(lengths)} documents, median {np.median(lengths):.0f}, max {lengths.max()}), "
              f"heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, fp32, causal; "
              f"median of {args.repeats} after {args.warmup} warm-up")
    ratio = _comm_compute_ratio(summary, per_rank, args)
    if ratio is not None:
        rate = statistics.median(pr["rate"] for pr in per_rank if pr["rate"])
        header += (f"\n# measured inter-node rate {rate * 8 / 1e6:.0f} Mbit/s per rank; one K,V block across / "
                   f"mean forward compute per ring step (zigzag): {ratio:.1f}")
    _print_table(summary, header)
    print("# summary " + json.dumps({k: {f: v for f, v in s.items() if f != "errors"} for k, s in summary.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "tensors"}, "bounds": bounds,
                       "summary": summary, "comm_compute_ratio": ratio}, f, indent=1)
    bad = [k for k, s in summary.items() if not s["exact"]]
    if bad:
        raise SystemExit(f"inexact variants (max err > {EXACT_TOLERANCE}): {bad}")


def _forwarded(args) -> list[str]:
    """The flags a rank needs (run_on_emulated_nodes adds --worker --rank --world-size --out)."""
    out = ["--tensors", args.tensors]
    for name in ("nodes", "ranks_per_node", "seq", "heads", "kv_heads", "head_dim", "repeats", "warmup", "threads",
                 "seed"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out + ["--algos", *args.algos, "--variants", *args.variants]
