"""LASP-2 vs LASP-1, the gated delta rule (and softmax ring / burst attention of the same size) on
emulated nodes. (``--gpu``: the one-GPU benchmark against flash-linear-attention instead, see
:mod:`megatron_burst.bench.linear_gpu`.)

    sudo python -m megatron_burst.bench linear --nodes 2 --ranks-per-node 2 --inter-mbit 100 \\
        --seqs 4096 16384 65536 --softmax-max-seq 16384

One network namespace per node (megatron_burst.bench.netns), each rank with its own NIC limited to
--inter-mbit; ranks of one node share a loopback --ratio times faster. Every rank holds seq / W
tokens (contiguous layout, LASP's natural one) of one sequence with --heads heads of --head-dim,
a Lightning-Attention-style constant decay per head, fp32; the gated delta rule (``gdn``:
megatron_burst.gated_delta_rule, one all-gather of per-segment (A, B) maps) gets l2-normalized keys,
a per-token decay and beta, as Gated DeltaNet feeds it. For each sequence length it times one
forward + backward of each variant (median of --repeats after --warmup, the variants interleaved
in every repeat so machine noise falls on all alike; an iteration takes as long as its slowest
rank) and records the bytes each rank sent. Softmax attention (quadratic) runs only up to
--softmax-max-seq. Writes a markdown table and a plot of time against sequence length.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from megatron_burst.bench import plotting

LINEAR = ("lasp2", "lasp1")
DELTA = "gdn"
SOFTMAX = ("ring", "burst")


# ---------------------------------------------------------------- worker (runs inside a namespace)
def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    import megatron_burst as mb
    from megatron_burst.world import exit_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    W, r = args.world_size, args.rank
    h, d = args.heads, args.head_dim
    decay = -torch.tensor([2.0 ** -(1 + 8 * i / h) for i in range(h)])  # a per-head schedule, Lightning-style
    results = {}
    for seq in args.seqs:
        n = seq // W
        torch.manual_seed(1234 + r)
        q, k, v, dout = (torch.randn(n, 1, h, d) * 0.5 for _ in range(4))
        g_tok = -torch.rand(n, 1, h) * 0.1  # the gated delta rule's per-token log-decay and beta
        beta = torch.rand(n, 1, h)
        variants = list(LINEAR) + [DELTA] + (list(SOFTMAX) if seq <= args.softmax_max_seq else [])
        runs = {name: [] for name in variants}
        for i in range(args.warmup + args.repeats):
            for name in variants:
                ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
                dist.barrier()
                with mb.comm_counter() as c:
                    t0 = time.perf_counter()
                    if name in LINEAR:
                        out = mb.linear_attention(ql, kl, vl, g=decay, layout="contiguous", algo=name)
                    elif name == DELTA:
                        out = mb.gated_delta_rule(ql, torch.nn.functional.normalize(kl, dim=-1), vl, g_tok, beta,
                                                  layout="contiguous")
                    else:
                        out = mb.cp_attention(ql, kl, vl, algo=name, layout="zigzag")
                    out.backward(dout)
                    elapsed = time.perf_counter() - t0
                dist.barrier()
                if i >= args.warmup:
                    runs[name].append({"s": elapsed, "sent": c.bytes("sent")})
        results[str(seq)] = runs
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump({"rank": r, "results": results}, f)
    exit_rank(0)  # barrier, then end without gloo's teardown (it can abort a finished rank)


# ---------------------------------------------------------------- driver
def summarize(per_rank: list[dict], repeats: int) -> dict[int, dict[str, dict[str, float]]]:
    """{seq: {variant: {"s": median over repeats of the slowest rank, "sent_mb": max rank's bytes}}}."""
    out = {}
    for seq in per_rank[0]["results"]:
        out[int(seq)] = {}
        for name in per_rank[0]["results"][seq]:
            slowest = [max(pr["results"][seq][name][i]["s"] for pr in per_rank) for i in range(repeats)]
            sent = max(pr["results"][seq][name][-1]["sent"] for pr in per_rank)
            out[int(seq)][name] = {"s": statistics.median(slowest), "sent_mb": sent / 1e6}
    return out


def _plot(summary, path, title) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    seqs = sorted(summary)
    for name in LINEAR + (DELTA,) + SOFTMAX:
        pts = [(s, summary[s][name]["s"]) for s in seqs if name in summary[s]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("seconds per fwd+bwd (median)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    plotting.save(fig, path)


def main(argv=None) -> None:
    if "--gpu" in (argv if argv is not None else []):  # one GPU, fla side by side: megatron_burst.bench.linear_gpu
        from megatron_burst.bench import linear_gpu
        return linear_gpu.main(argv)
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-mbit", type=float, default=100.0, help="inter-node link rate per rank NIC, Mbit/s")
    p.add_argument("--ratio", type=float, default=10.0, help="intra-node rate / inter-node rate")
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--softmax-max-seq", type=int, default=16384, help="longest sequence softmax attention runs at")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--cpu-per-rank", type=float, default=None,
                   help="cap each rank at this many cores (a CPU cgroup per rank), so that a rank waiting in "
                        "LASP-1's chain does not lend its core to the others: a device of fixed speed per rank. "
                        "Default: cores / ranks when there are more ranks than cores, else no cap; 0: no cap")
    p.add_argument("--plot", default="docs/linear.png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    W = args.nodes * args.ranks_per_node
    for seq in args.seqs:
        if seq % (2 * W):
            p.error(f"--seqs {seq} is not divisible by 2 x {W} ranks (softmax attention runs zigzag)")
    if args.worker:
        return _worker(args)

    from megatron_burst.bench.emulated import run_on_emulated_nodes

    forwarded = ["--seqs", *map(str, args.seqs)]
    for name in ("softmax_max_seq", "heads", "head_dim", "repeats", "warmup"):
        forwarded += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cpu_per_rank = args.cpu_per_rank
    if cpu_per_rank is None:
        cores = len(os.sched_getaffinity(0))
        cpu_per_rank = cores / W if W > cores else 0
    per_rank = run_on_emulated_nodes("linear", forwarded, args.nodes, args.ranks_per_node, args.inter_mbit,
                                     args.inter_mbit * args.ratio, args.timeout, cpu_per_rank or None)
    summary = summarize(per_rank, args.repeats)
    title = (f"{args.nodes} nodes x {args.ranks_per_node} ranks (gloo"
             f"{f', {cpu_per_rank:g} core each' if cpu_per_rank else ''}), inter {args.inter_mbit:g} Mbit/s per rank, "
             f"{args.heads} heads x {args.head_dim}, fp32, fwd+bwd, median of {args.repeats}")
    print(f"# {title}")
    print("| seq | lasp2 s | lasp1 s | lasp1 / lasp2 | gdn s | ring s | burst s | lasp2 MB sent/rank | lasp1 MB | "
          "gdn MB | ring MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for seq in sorted(summary):
        row = summary[seq]
        cell = lambda name, key: f"{row[name][key]:.3f}" if name in row else "—"  # noqa: E731
        print(f"| {seq} | {cell('lasp2', 's')} | {cell('lasp1', 's')} | "
              f"{row['lasp1']['s'] / row['lasp2']['s']:.2f}x | {cell(DELTA, 's')} | {cell('ring', 's')} | "
              f"{cell('burst', 's')} | {cell('lasp2', 'sent_mb')} | {cell('lasp1', 'sent_mb')} | "
              f"{cell(DELTA, 'sent_mb')} | {cell('ring', 'sent_mb')} |")
    if args.plot:
        _plot(summary, args.plot, title)


if __name__ == "__main__":
    main()
