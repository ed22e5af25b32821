"""Sparse attention benchmark: dense vs vertical-slash under zigzag, token-striped, block-striped
and hierarchical (double-ring) schedules: fwd+bwd time, bytes sent, imbalance degrees.

    python -m megatron_burst.bench sparse --world-size 4 --seq 8192 --heads 2

The pattern is MTraining-like: 4 sink tokens and ``--verticals`` random vertical lines, a local
band of ``--band`` slash offsets and ``--slashes`` random ones (the same for every head). Dense is
cp_attention (burst, zigzag). Times are medians of ``--repeats`` between barriers (the slowest rank
sets the time); on a shared 2-core machine the ranks share cores. The ranks run with glibc's
allocator told to keep freed memory (launch.STEADY_MALLOC; ``--malloc default`` turns that
off), for dense and sparse alike. Imbalance degrees come from
megatron_burst.sparse.imbalance (work = visible pairs; worker = sum over steps of the max over
ranks / sum of the mean; step = mean over ranks of max/mean over its steps).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.bench import plotting
from megatron_burst.bench.launch import STEADY_MALLOC, run_local
from megatron_burst.masks.imbalance import pattern_imbalance
from megatron_burst.masks.vertical_slash import VerticalSlash

SCHEDULES = {  # name: (layout, stripe, ring)
    "zigzag": ("zigzag", 1, "flat"),
    "token-striped": ("striped", 1, "flat"),
    "block-striped": ("striped", 64, "flat"),
    "hierarchical": ("striped", 64, "double"),
}


def make_pattern(seq: int, heads: int, verticals: int, band: int, slashes: int, seed: int = 0,
                 vertical_prefix: int = 0, pools: int = 0, pool: int = 64) -> VerticalSlash:
    """4 sinks + ``verticals`` random keys (in the first ``vertical_prefix`` tokens; 0: anywhere),
    slash offsets 0 .. band-1 + ``slashes`` random ones + ``pools`` random pools of ``pool``
    consecutive offsets starting on a multiple of ``pool`` past the band (MTraining selects slash
    offsets by pools of 64); the same lines for every head."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.cat([torch.arange(4), torch.randint(0, vertical_prefix or seq, (verticals,), generator=g)])
    vertical = vertical.expand(heads, -1)
    first, last = -(-band // pool), seq // pool
    starts = (first + torch.randperm(max(0, last - first), generator=g)[:pools]) * pool
    pooled = (starts[:, None] + torch.arange(pool)).reshape(-1)
    pooled = pooled[pooled < seq]
    slash = torch.cat([torch.arange(band), torch.randint(band, seq, (slashes,), generator=g), pooled])
    return VerticalSlash(vertical.contiguous(), slash.expand(heads, -1).contiguous())


def _run(args):
    W, r = dist.get_world_size(), dist.get_rank()
    pattern = make_pattern(args.seq, args.heads, args.verticals, args.band, args.slashes,
                           vertical_prefix=args.vertical_prefix)
    topo = mb.build_cp_topology(None, args.ranks_per_node) if "hierarchical" in args.schedules else None
    torch.manual_seed(1234)
    mk = lambda h: torch.randn(args.seq, 1, h, args.head_dim)  # noqa: E731
    full = [mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)]
    samples = {name: [] for name in ["dense"] + args.schedules}
    for i in range(args.warmup + args.repeats):
        for name in samples:
            layout, stripe, ring = SCHEDULES.get(name, ("zigzag", 1, "flat"))
            q, k, v, dout = (mb.shard(t, 0, r, W, layout, stripe) for t in full)
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            with mb.comm_counter() as c:
                dist.barrier()
                t0 = time.perf_counter()
                if name == "dense":
                    out = mb.cp_attention(ql, kl, vl, algo="burst", layout="zigzag")
                else:
                    out = mb.sparse_cp_attention(ql, kl, vl, pattern, layout=layout, stripe=stripe, algo="burst",
                                                 ring=ring, group=topo if ring == "double" else None)
                dist.barrier()
                t1 = time.perf_counter()
                out.backward(dout)
                dist.barrier()
                t2 = time.perf_counter()
            if i >= args.warmup:
                samples[name].append((t1 - t0, t2 - t1, c.bytes("sent")))
    return {name: (statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs), runs[-1][2])
            for name, runs in samples.items()}




def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench sparse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2, help="the hierarchical ring's emulated node size")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--verticals", type=int, default=12)
    p.add_argument("--vertical-prefix", type=int, default=0,
                   help="draw the vertical lines from the first N tokens (heavy hitters in a prefix); 0: anywhere")
    p.add_argument("--band", type=int, default=256, help="local slash offsets 0 .. band-1")
    p.add_argument("--slashes", type=int, default=32)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--malloc", choices=["steady", "default"], default="steady",
                   help="steady: glibc keeps freed memory (no page-fault churn); default: glibc's own settings")
    p.add_argument("--plot", default="docs/sparse.png", help="bar chart of the times ('' for none)")
    p.add_argument("--nodes", type=int, default=0,
                   help="run on this many emulated nodes (network namespaces, root; --ranks-per-node ranks each, "
                        "a slow inter-node link); 0: --world-size local ranks")
    p.add_argument("--inter-mbit", type=float, default=1000.0, help="emulated inter-node link per rank NIC, Mbit/s")
    p.add_argument("--ratio", type=float, default=10.0, help="emulated intra-node rate / inter-node rate")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--cpu-per-rank", type=float, default=None,
                   help="with --nodes: cap each rank at this many cores (a CPU cgroup per rank), so that a rank "
                        "waiting for a slower one does not lend it its core: a device of fixed speed per rank, "
                        "where imbalance costs time as on GPUs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nodes:
        args.world_size = args.nodes * args.ranks_per_node
    args.kv_heads = args.kv_heads or args.heads
    for name in args.schedules:
        layout, stripe, _ = SCHEDULES[name]
        try:
            mb.masks.layout.check_seq_len(args.seq, args.world_size, layout, stripe)
        except ValueError as exc:
            p.error(f"--seq {args.seq}, schedule {name}: {exc}")
    if args.worker:
        from megatron_burst.bench.emulated import run_rank

        return run_rank(args, _run, args.threads)
    pattern = make_pattern(args.seq, args.heads, args.verticals, args.band, args.slashes,
                           vertical_prefix=args.vertical_prefix)
    env = STEADY_MALLOC if args.malloc == "steady" else {}
    if args.nodes:
        from megatron_burst.bench.emulated import run_on_emulated_nodes

        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
        for k, v in env.items():
            os.environ.setdefault(k, v)  # the namespaces' ranks inherit this environment
        res = run_on_emulated_nodes("sparse", forwarded, args.nodes, args.ranks_per_node, args.inter_mbit,
                                    args.inter_mbit * args.ratio, args.timeout, args.cpu_per_rank)[0]
        res = {name: tuple(v) for name, v in res.items()}
    else:
        res = run_local(args.world_size, _run, args, threads=args.threads, env=env)[0]
    where = (f"{args.nodes} emulated nodes x {args.ranks_per_node} (inter {args.inter_mbit:g} Mbit/s per rank, "
             f"intra x{args.ratio:g}{f', {args.cpu_per_rank:g} core each' if args.cpu_per_rank else ''})"
             if args.nodes else "local")
    print(f"# sparse attention: W={args.world_size} gloo ranks ({where}), seq={args.seq}, heads={args.heads}/{args.kv_heads} kv, "
          f"head_dim={args.head_dim}, fp32, burst backward; pattern 4 sinks + {args.verticals} vertical"
          f"{f' in the first {args.vertical_prefix} tokens' if args.vertical_prefix else ''}, band "
          f"{args.band} + {args.slashes} slash; median of {args.repeats}")
    dense_total = res["dense"][0] + res["dense"][1]
    rows = []
    print("| schedule | fwd s | bwd s | total s | speedup vs dense | MB sent/rank | worker imbalance | step imbalance |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (fwd, bwd, sent) in res.items():
        rows.append((name, fwd, bwd))
        if name == "dense":
            cols = "- | -"
        else:
            layout, stripe, ring = SCHEDULES[name]
            imb = pattern_imbalance(pattern, args.seq, args.world_size, layout, stripe=stripe, ring=ring,
                                    ranks_per_node=args.ranks_per_node)
            cols = f"{imb['worker']:.2f} | {imb['step']:.2f}"
        print(f"| {name} | {fwd:.3f} | {bwd:.3f} | {fwd + bwd:.3f} | {dense_total / (fwd + bwd):.2f} | "
              f"{sent / 1e6:.2f} | {cols} |")
    work = sum(map(sum, pattern_imbalance(pattern, args.seq, args.world_size, "zigzag")["work"]))
    sparsity = 1 - work / (args.heads * args.seq * (args.seq + 1) / 2)
    print(f"# sparsity {sparsity:.3f} (of causal pairs)")
    if args.plot:
        _plot(rows, args, sparsity)


def _plot(rows: list, args, sparsity: float) -> None:
    """Stacked forward / backward bars per schedule, speedups over dense on top."""
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r[0] for r in rows]
    fwd = [r[1] for r in rows]
    bwd = [r[2] for r in rows]
    ax.bar(names, fwd, label="forward", color="#4c72b0")
    ax.bar(names, bwd, bottom=fwd, label="backward", color="#dd8452")
    dense = fwd[0] + bwd[0]
    for i, (f, b) in enumerate(zip(fwd, bwd)):
        ax.text(i, f + b, f"{dense / (f + b):.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("fwd + bwd seconds (median)")
    ax.set_title(f"vertical-slash sparse vs dense: W={args.world_size} gloo ranks, {args.seq} tokens, "
                 f"{sparsity:.1%} sparse", fontsize=9)
    ax.legend(fontsize=8)
    plotting.save(fig, args.plot)


if __name__ == "__main__":
    main()
