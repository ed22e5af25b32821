"""Emulated multi-node benchmark: flat vs double ring, ring vs burst backward, all-gather, Ulysses and USP
(Ulysses inside a node, burst double ring across), over a slow inter-node link.

    sudo python -m megatron_burst.bench multinode --nodes 2 --ranks-per-node 2 --inter-mbit 100 --ratio 10

One network namespace per node (megatron_burst.bench.netns), R gloo ranks per node, each with its
own NIC limited to --inter-mbit (rail-optimized, like one NIC per GPU); intra-node traffic crosses
the namespace's loopback limited to ratio x that. For each variant it times forward + backward (median of --repeats, after a warm-up)
and reports how much of the inter-node transfer time was hidden behind other work:

    hidden = 1 - (time blocked waiting on inter-node transfers) / (inter-node transfer time)

where the transfer time is the inter-node bytes divided by the link rate measured in the same run
(an isolated exchange over the inter-node ring). Variants are interleaved within each repeat.
Writes a markdown table and a plot.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import textwrap
import time

from megatron_burst.bench import plotting

VARIANTS = [("ring", "flat"), ("burst", "flat"), ("ring", "double"), ("burst", "double"), ("allgather", "flat"),
            ("ulysses", "flat"), ("usp", "double")]


def _variant_name(algo: str, ring: str, ranks_per_node: int) -> str:
    if algo == "usp":  # Ulysses over the node's ranks, burst's double ring across nodes
        return f"usp{ranks_per_node}/burst/{ring}"
    return algo if algo in ("allgather", "ulysses") else f"{algo}/{ring}"


# ---------------------------------------------------------------- worker (runs inside a namespace)
def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    import megatron_burst as mb
    from megatron_burst.world import exit_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    topo = mb.build_cp_topology(None, args.ranks_per_node)
    R = args.ranks_per_node
    usp = mb.build_usp_topology(None, R, R) if 1 < R < args.world_size else None
    variants = [(a, ring) for a, ring in VARIANTS if a != "usp" or usp is not None]
    W, r = args.world_size, args.rank
    n = args.seq // W
    torch.manual_seed(r)
    mk = lambda h: torch.randn(n, 1, h, args.head_dim)  # noqa: E731
    q, k, v, dout = mk(args.heads), mk(args.heads), mk(args.heads), mk(args.heads)

    # the inter-node link rate, measured with the same transfers the rings make
    rate = None
    if topo.outer is not None:
        block = torch.stack([k, v])
        dist.barrier()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            topo.outer.act.exchange([block], [torch.empty_like(block)], "forward").wait()
            times.append(time.perf_counter() - t0)
            dist.barrier()
        rate = block.numel() * block.element_size() / statistics.median(times)

    # variants interleaved within every repeat, so machine noise falls on all of them alike
    results = {_variant_name(algo, ring, R): [] for algo, ring in variants}
    for i in range(args.warmup + args.repeats):
        for algo, ring in variants:
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            kw = dict(group=usp, ulysses_size=R, ring_backward="burst") if algo == "usp" else dict(group=topo)
            dist.barrier()
            with mb.comm_counter() as c:
                t0 = time.perf_counter()
                out = mb.cp_attention(ql, kl, vl, algo=algo, ring=ring, layout=args.layout, **kw)
                t1 = time.perf_counter()
                out.backward(dout)
                t2 = time.perf_counter()
            dist.barrier()
            if i >= args.warmup:
                inter_bytes = c.bytes("sent", link="inter")
                results[_variant_name(algo, ring, R)].append(dict(
                    fwd=t1 - t0, bwd=t2 - t1, inter_bytes=inter_bytes, intra_bytes=c.bytes("sent", link="intra"),
                    inter_wait=c.wait_seconds(link="inter"), inter_transfer=inter_bytes / rate if rate else 0.0))
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump({"rank": r, "rate": rate, "results": results}, f)
    exit_rank(0)  # barrier, then end without gloo's teardown (it can abort a finished rank)


# ---------------------------------------------------------------- driver
def _summarize(per_rank: list[dict], repeats: int) -> dict[str, dict[str, float]]:
    summary = {}
    for variant in per_rank[0]["results"]:
        # an iteration takes as long as its slowest rank
        totals = [max(pr["results"][variant][i]["fwd"] + pr["results"][variant][i]["bwd"] for pr in per_rank)
                  for i in range(repeats)]
        fwd = [max(pr["results"][variant][i]["fwd"] for pr in per_rank) for i in range(repeats)]
        inter_transfer = sum(statistics.median(x["inter_transfer"] for x in pr["results"][variant]) for pr in per_rank)
        inter_wait = sum(statistics.median(x["inter_wait"] for x in pr["results"][variant]) for pr in per_rank)
        hidden = 1 - inter_wait / inter_transfer if inter_transfer > 0 else float("nan")
        summary[variant] = dict(
            total=statistics.median(totals), fwd=statistics.median(fwd),
            inter_mb=max(statistics.median(x["inter_bytes"] for x in pr["results"][variant]) for pr in per_rank) / 1e6,
            intra_mb=max(statistics.median(x["intra_bytes"] for x in pr["results"][variant]) for pr in per_rank) / 1e6,
            hidden=max(0.0, hidden))
    return summary


def _plot(summary, path, title) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    names = list(summary)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    fwd = [summary[n]["fwd"] for n in names]
    bwd = [summary[n]["total"] - summary[n]["fwd"] for n in names]
    ax.bar(names, fwd, label="forward")
    ax.bar(names, bwd, bottom=fwd, label="backward")
    for i, n in enumerate(names):
        ax.text(i, summary[n]["total"], f"{summary[names[0]]['total'] / summary[n]['total']:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("seconds per fwd+bwd (median)")
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=8)
    ax.set_ylim(0, max(summary[n]["total"] for n in names) * 1.15)
    ax.legend()
    plotting.save(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench multinode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-mbit", type=float, default=100.0, help="inter-node link rate per rank NIC, Mbit/s")
    p.add_argument("--ratio", type=float, default=10.0, help="intra-node rate / inter-node rate")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--plot", default="docs/multinode.png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)

    from megatron_burst.bench.emulated import run_on_emulated_nodes

    intra = args.inter_mbit * args.ratio
    per_rank = run_on_emulated_nodes("multinode", _forwarded(args), args.nodes, args.ranks_per_node,
                                     args.inter_mbit, intra, args.timeout)
    summary = _summarize(per_rank, args.repeats)
    base = summary["ring/flat"]["total"]
    rate = statistics.median(pr["rate"] for pr in per_rank if pr["rate"])
    title = (f"{args.nodes} nodes x {args.ranks_per_node} ranks (gloo), inter {args.inter_mbit:g} Mbit/s per rank NIC, "
             f"intra {intra:g} Mbit/s; seq {args.seq}, {args.heads}x{args.head_dim}, {args.layout}, fp32")
    print(f"# {title}; measured inter-node rate {rate * 8 / 1e6:.0f} Mbit/s; median of {args.repeats}")
    print("| backward / ring | fwd s | fwd+bwd s | speedup vs ring/flat | inter MB sent (max rank) | "
          "intra MB sent (max rank) | inter-node time hidden |")
    print("|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['fwd']:.2f} | {s['total']:.2f} | {base / s['total']:.2f}x | {s['inter_mb']:.1f} | "
              f"{s['intra_mb']:.1f} | {s['hidden'] * 100:.0f}% |")
    if args.plot:
        _plot(summary, args.plot, title)


def _forwarded(args) -> list[str]:
    out = []
    for name in ("nodes", "ranks_per_node", "seq", "heads", "head_dim", "layout", "repeats", "warmup"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


if __name__ == "__main__":
    main()
