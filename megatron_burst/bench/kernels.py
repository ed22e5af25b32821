"""Local kernel benchmark: which backend is faster on this machine, per dtype and direction.

    python -m megatron_burst.bench kernels --seq 2048 --heads 8 --head-dim 64

The measured winner is the default in megatron_burst.kernels.select.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_burst.kernels import cpu_flash, tiled


def _median(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# local kernels: [1, {args.heads}, {args.seq}, {args.head_dim}], {args.threads} thread(s), median of {args.repeats}")
    print("| dtype | mask | tiled fwd s | cpu_flash fwd s | tiled bwd s | cpu_flash bwd s | fwd winner | bwd winner |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("causal", "full"):
            mk = lambda: torch.randn(1, args.heads, args.seq, args.head_dim, dtype=dtype)  # noqa: E731
            q, k, v, do = mk(), mk(), mk(), mk()
            row = {}
            for name, impl in (("tiled", tiled), ("cpu_flash", cpu_flash)):
                out, lse = impl.forward(q, k, v, kind, 1, 0.125)
                D = (do.float() * out.float()).sum(-1)
                row[name] = (_median(lambda: impl.forward(q, k, v, kind, 1, 0.125), args.repeats),
                             _median(lambda: impl.backward(do, q, k, v, D, lse, kind, 1, 0.125), args.repeats))
            fw = min(row, key=lambda n: row[n][0])
            bw = min(row, key=lambda n: row[n][1])
            print(f"| {str(dtype)[6:]} | {kind} | {row['tiled'][0]:.3f} | {row['cpu_flash'][0]:.3f} | "
                  f"{row['tiled'][1]:.3f} | {row['cpu_flash'][1]:.3f} | {fw} | {bw} |")


if __name__ == "__main__":
    main()
