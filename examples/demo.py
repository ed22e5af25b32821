"""`make demo`: train one small GPT twice from the same weights and batches -- with context
parallelism (4 CPU ranks, BurstAttention, striped layout) and without (CP = 1) -- and show that
the loss curves agree to float rounding.

    python examples/demo.py [--steps 30] [--nproc 4] [--algo burst] [--layout striped]

Both runs are `python -m megatron_burst.train` (Megatron-Core GPTModel + megatron-burst spec,
GPTDataset over the built-in stdlib byte corpus); this script only launches and compares them.
Exit status 1 if the largest relative loss difference exceeds --tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_flags(steps: int) -> list[str]:
    """A small GPT that still has something to learn in a few dozen steps on 2 CPU cores."""
    return ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
            "--num-query-groups", "4", "--seq-length", "512", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr", "2e-3", "--lr-warmup-iters", "2",
            "--lr-decay-style", "cosine", "--min-lr", "2e-4", "--train-iters", str(steps),
            "--seed", "1234", "--log-interval", "5", "--data-cache-path", "data_cache"]


def run(cmd: list[str], title: str) -> float:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return time.perf_counter() - t0


def summarize(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    m = data["metrics"]
    steady = [r["tokens_per_s"] for r in m[1:]] or [m[0]["tokens_per_s"]]  # step 1 warms caches
    return {"data": data, "losses": [r["lm_loss"] for r in m], "tokens_per_s": statistics.median(steady),
            "comm": m[-1]["cp_comm_bytes_per_rank"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=4, help="ranks (= CP size) of the CP run")
    p.add_argument("--algo", default="burst")
    p.add_argument("--layout", default="striped")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--out", default=os.path.join("runs", "demo"))
    args = p.parse_args()
    t_start = time.perf_counter()
    os.makedirs(os.path.join(REPO, args.out), exist_ok=True)

    sys.path.insert(0, REPO)
    warnings.filterwarnings("ignore")  # megatron.core's "TE/Apex not installed" notes on CPU
    from megatron_burst import data  # noqa: E402  (after sys.path, so a fresh clone works too)

    t0 = time.perf_counter()
    prefix = data.default_corpus(os.path.join(REPO, "data_cache"))
    stats = data.corpus_stats(prefix)
    print(f"corpus: Python {sys.version.split()[0]} standard library sources as bytes, "
          f"{stats['documents']} files, {stats['tokens']} tokens -> {os.path.relpath(prefix, REPO)}.bin/.idx "
          f"({time.perf_counter() - t0:.1f} s)")

    flags = model_flags(args.steps)
    cp_json = os.path.join(args.out, f"cp{args.nproc}.json")
    ref_json = os.path.join(args.out, "cp1.json")
    wall_cp = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(args.nproc), "-m", "megatron_burst.train", *flags,
                   "--context-parallel-size", str(args.nproc), "--cp-algo", args.algo,
                   "--cp-layout", args.layout, "--metrics-file", cp_json],
                  f"CP = {args.nproc}: {args.nproc} gloo ranks, --cp-algo {args.algo} --cp-layout {args.layout}")
    wall_ref = run([sys.executable, "-m", "megatron_burst.train", *flags, "--metrics-file", ref_json],
                   "CP = 1: one rank, same initial weights and batches")

    cp, ref = summarize(os.path.join(REPO, cp_json)), summarize(os.path.join(REPO, ref_json))
    rel = [abs(a - b) / abs(b) for a, b in zip(cp["losses"], ref["losses"])]
    worst = max(range(len(rel)), key=rel.__getitem__)
    print("\n=== result")
    print(f"final lm loss   CP={args.nproc} ({args.algo}, {args.layout}): {cp['losses'][-1]:.6f}   "
          f"CP=1: {ref['losses'][-1]:.6f}   (first step: {ref['losses'][0]:.6f})")
    print(f"max relative loss difference over {len(rel)} steps: {rel[worst]:.2e} (step {worst + 1}; "
          f"tolerance {args.tolerance:.0e})")
    print(f"tokens/s (median, steps 2-{len(rel)})   CP={args.nproc}: {cp['tokens_per_s']:.0f}   "
          f"CP=1: {ref['tokens_per_s']:.0f}   (2 CPU cores shared by all ranks: CP here shows "
          "correctness, not speed)")
    print(f"CP attention traffic per rank per iteration: {cp['comm'] / 2**20:.2f} MiB sent")
    print(f"wall time: CP={args.nproc} run {wall_cp:.0f} s, CP=1 run {wall_ref:.0f} s, "
          f"demo total {time.perf_counter() - t_start:.0f} s")
    if len(rel) != args.steps or rel[worst] > args.tolerance:
        print("FAILED: the CP run does not follow the CP=1 trajectory", file=sys.stderr)
        return 1
    print("OK: context-parallel training follows the single-rank trajectory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
