"""CP attention benchmark: per algo x layout, forward/backward time and bytes per rank.

    python -m megatron_burst.bench attention --world-size 4 --seq 8192 --heads 8 --head-dim 64

Algorithms: ring, burst, auto, allgather, ulysses and usp (Ulysses groups of --ulysses-size, a ring
across them; its 2-D groups are built once before timing).

Times are medians over ``--repeats`` after a warm-up, taken between barriers; the algorithms are
interleaved within each repeat and ratios are to ring (same layout) in the same run. On a 2-core machine the ranks share cores, so absolute
times are compute-bound; the byte columns are exact.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.bench.launch import run_local


def _inputs(args):
    W, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1234 + r)
    n = args.seq // W
    dtype = getattr(torch, args.dtype)
    mk = lambda h: torch.randn(n, args.batch, h, args.head_dim, dtype=dtype)  # noqa: E731
    return mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)


def _once(algo, layout, tensors, args, usp=None):
    """One timed forward + backward (between barriers, so the slowest rank sets the time)."""
    q, k, v, dout = tensors
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    kw = dict(group=usp, ulysses_size=args.ulysses_size) if algo == "usp" else {}
    with mb.comm_counter() as c:
        dist.barrier()
        t0 = time.perf_counter()
        out = mb.cp_attention(ql, kl, vl, algo=algo, layout=layout, causal=not args.full, **kw)
        dist.barrier()
        t1 = time.perf_counter()
        out.backward(dout)
        dist.barrier()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, c.bytes("sent", "forward"), c.bytes("sent", "backward")


def _all(args):
    """Algorithms interleaved within every repeat, so machine noise falls on all of them alike."""
    tensors = _inputs(args)
    usp = mb.build_usp_topology(None, args.ulysses_size) if "usp" in args.algos else None
    samples = {(a, l): [] for l in args.layouts for a in args.algos}
    for i in range(args.warmup + args.repeats):
        for layout in args.layouts:
            for algo in args.algos:
                res = _once(algo, layout, tensors, args, usp)
                if i >= args.warmup:
                    samples[(algo, layout)].append(res)
    out = {}
    for key, runs in samples.items():
        out[key] = dict(fwd=statistics.median(r[0] for r in runs), bwd=statistics.median(r[1] for r in runs),
                        total=statistics.median(r[0] + r[1] for r in runs),
                        fwd_bytes=runs[-1][2], bwd_bytes=runs[-1][3])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--full", action="store_true", help="no causal mask")
    p.add_argument("--algos", nargs="+", default=None, choices=list(mb.CP_ALGOS),
                   help="default: ring burst auto allgather, and ulysses / usp where the heads and sizes allow")
    p.add_argument("--ulysses-size", type=int, default=2, help="usp's Ulysses group size (default 2)")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "striped"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not divisible by --kv-heads {args.kv_heads}")
    for layout in args.layouts:  # run exactly --seq, or say why not (never a silently shorter one)
        try:
            mb.masks.layout.check_seq_len(args.seq, args.world_size, layout)
        except ValueError as exc:
            p.error(f"--seq {args.seq} at --world-size {args.world_size}, layout {layout}: {exc}")
    from megatron_burst.algorithms.ulysses import check_heads
    from megatron_burst.topology import check_ulysses_size

    asked = args.algos is not None
    args.algos = args.algos or ["ring", "burst", "auto", "allgather", "ulysses", "usp"]
    for algo, U in (("ulysses", args.world_size), ("usp", args.ulysses_size)):
        if algo in args.algos:
            try:
                check_ulysses_size(args.world_size, U)
                check_heads(args.heads, args.kv_heads, U, algo)
            except ValueError as exc:
                if asked:
                    p.error(f"{exc} (drop {algo} from --algos or change the sizes)")
                args.algos.remove(algo)  # a default that does not fit this shape is left out
    res = run_local(args.world_size, _all, args, threads=args.threads)[0]
    mask = "full" if args.full else "causal"
    print(f"# cp attention: W={args.world_size} gloo ranks, seq={args.seq}, batch={args.batch}, "
          f"heads={args.heads}/{args.kv_heads} kv, head_dim={args.head_dim}, {args.dtype}, {mask}, "
          f"median of {args.repeats}" + (f"; usp = {args.ulysses_size} x {args.world_size // args.ulysses_size}"
                                         if "usp" in args.algos else ""))
    print("| layout | algo | fwd s | bwd s | total s | total vs ring | fwd MB sent/rank | bwd MB sent/rank | bwd bytes vs ring |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (algo, layout), m in res.items():
        base = res.get(("ring", layout), m)
        tot, base_tot = m["total"], base["total"]
        print(f"| {layout} | {algo} | {m['fwd']:.3f} | {m['bwd']:.3f} | {tot:.3f} | {tot / base_tot:.2f} | "
              f"{m['fwd_bytes'] / 1e6:.2f} | {m['bwd_bytes'] / 1e6:.2f} | {m['bwd_bytes'] / base['bwd_bytes']:.3f} |")


if __name__ == "__main__":
    main()
