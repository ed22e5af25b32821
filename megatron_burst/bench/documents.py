"""Packed-document load balance: imbalance and K,V traffic of zigzag, contiguous, block-striped, THD
and the balanced dispatch planner on realistic document mixes (issue L).

    python -m megatron_burst.bench documents [--worlds 8 32] [--seq 131072] [--plot docs/documents.png]
    python -m megatron_burst.bench documents --emulate | --local | --quick [...]   # measured, see below

Work is visible query-key pairs, causal within each document, counted exactly from token
ownership (megatron_burst.documents.imbalance); nothing runs on a device. Columns:

* ``worker``: max / mean over ranks of a pass's work (the issue's worker-level imbalance);
* ``step``: per ring step, sum over steps of the slowest rank's work / sum of the mean (what a
  synchronous ring waits for; at step t rank r computes against rank (r - t) mod W's keys);
* ``KV blocks``: K,V blocks the busiest rank sends, in local blocks: W - 1 for the ring layouts,
  and for ``balanced`` one per rank whose queries see one of its keys (traffic follows documents);
  ``KV tokens``: the K,V tokens other ranks' queries actually see (the finest traffic), in local
  blocks;
* ``pad``: tokens THD adds (each document padded to a multiple of 2W).

Mixes (S = ``--seq``): ``lognormal`` (47 documents, mean S/47 = 2.8K at 128K, lognormal sigma 1.0,
seed 46), ``64K+short`` (one 64K document first, then lognormal short documents, median 1K),
``16x8K`` (S/16 each), ``corpus`` (lengths drawn from the default training corpus: the Python
standard library's files as byte tokens + EOD, seed 0, the last one cut to fit).

With ``--emulate`` (2 emulated nodes), ``--local`` or ``--quick`` (tiny, for CI) the ranks run
forward + backward of cp_attention instead and report measured step times and bytes
(megatron_burst.bench.documents_step; ``--emulate --help`` lists its options).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from megatron_burst.bench import plotting
from megatron_burst.bench.document_mixes import (LOGNORMAL, corpus_lengths, corpus_mix, cu,  # noqa: F401 (public here)
                                                 long_plus_short, lognormal_mix, mixes, uniform_mix)
from megatron_burst.masks.dispatch import plan_dispatch
from megatron_burst.masks.imbalance import document_imbalance as imbalance

LAYOUTS = (  # name: (layout, stripe)
    ("zigzag", "zigzag", 1),
    ("contiguous", "contiguous", 1),
    ("block-striped(64)", "striped", 64),
    ("thd", "thd", 1),
    ("balanced", "balanced", 1),
)

def measure(bounds: list, world_size: int) -> list:
    """One row per layout: (name, imbalance dict, seconds to plan or lay out)."""
    rows = []
    for name, layout, stripe in LAYOUTS:
        if layout == "balanced":
            t0 = time.perf_counter()
            plan = plan_dispatch(bounds, world_size)
            planned = time.perf_counter() - t0
            rows.append((name, imbalance(bounds, world_size, plan), planned, plan))
        else:
            rows.append((name, imbalance(bounds, world_size, layout, stripe=stripe), None, None))
    return rows


MEASURED_MODES = ("--emulate", "--local", "--quick", "--worker")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(flag in argv for flag in MEASURED_MODES):  # ranks run the engine: a different benchmark
        from megatron_burst.bench import documents_step

        return documents_step.main(argv)
    ap = argparse.ArgumentParser(prog="python -m megatron_burst.bench documents", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 32], help="CP sizes W")
    ap.add_argument("--seq", type=int, default=131072, help="packed tokens S (divisible by 2W for zigzag)")
    ap.add_argument("--mixes", nargs="+", default=None, help="subset of: lognormal 64K+short 16x8K corpus")
    ap.add_argument("--plot", default=None, help="write a bar chart of worker / step imbalance here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    all_mixes = mixes(args.seq)
    chosen = {k: v for k, v in all_mixes.items() if args.mixes is None or k in args.mixes}
    print(f"# packed documents: S={args.seq} tokens, causal within each document; work = visible query-key "
          "pairs (exact)")
    print("# worker = max/mean over ranks; step = sum over ring steps of the slowest rank / sum of the mean; "
          "KV = blocks / tokens (in local blocks) the busiest rank sends")
    results = {}
    for mix, bounds in chosen.items():
        lengths = np.diff(bounds)
        print(f"\n## {mix}: {len(lengths)} documents, mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
              f"max {lengths.max()} tokens")
        print("| W | layout | worker | step | KV blocks | KV tokens | pad | plan |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for W in args.worlds:
            rows = measure(bounds, W)
            results[(mix, W)] = rows
            for name, m, planned, plan in rows:
                extra = (f"{planned * 1e3:.1f} ms, groups of {plan.group_size}" if plan is not None else "")
                print(f"| {W} | {name} | {m['worker_total']:.2f} | {m['worker']:.2f} | {max(m['kv_sent'])} | "
                      f"{max(m['kv_tokens_needed']):.2f} | {m['padding']} | {extra} |")
    print(f"\n# {time.perf_counter() - t0:.1f} s")
    if args.plot:
        _plot(results, args.plot)


def _plot(results: dict, path: str) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    keys = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(keys)), 4), sharey=True)
    names = [name for name, _, _ in LAYOUTS]
    x = np.arange(len(keys))
    width = 0.8 / len(names)
    for ax, metric, title in ((axes[0], "worker_total", "worker (max/mean over ranks)"),
                              (axes[1], "worker", "per ring step")):
        for i, name in enumerate(names):
            vals = [next(m[metric] for n, m, _, _ in results[k] if n == name) for k in keys]
            ax.bar(x + i * width, vals, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks(x + 0.4 - width / 2)
        ax.set_xticklabels([f"{mix}\nW={W}" for mix, W in keys], fontsize=8)
        ax.set_title(title)
    axes[0].set_ylabel("imbalance")
    axes[0].legend(fontsize=7)
    plotting.save(fig, path)


if __name__ == "__main__":
    main()
