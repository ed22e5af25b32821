"""Time the balanced dispatch planner at the issue's size (issue L: <= 5 ms for 1M tokens, 1000 lognormal
documents, W = 64, one CPU core) against the frozen pre-speed-up copy (tests/dispatch_reference.py),
interleaved in one process so that a busy machine slows both alike; ``--profile`` adds cProfile.

    PYTHONPATH=. python scripts/plan_dispatch_timing.py [--runs 21] [--seeds 3 0 1 2] [--profile]

Reports process CPU time (median and min over the runs): wall time on a shared machine mostly
measures the neighbours. Prints only; nothing here gates CI.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from dispatch_reference import reference_plan_dispatch  # noqa: E402
from megatron_burst.bench.document_mixes import lognormal_mix  # noqa: E402
from megatron_burst.masks.dispatch import plan_dispatch  # noqa: E402


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--seeds", type=int, nargs="+", default=[3, 0, 1, 2], help="lognormal_mix seeds (3: the test's)")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for seed in args.seeds:
        bounds = lognormal_mix(1 << 20, 1000, 1.0, seed)
        plan = plan_dispatch(bounds, args.world)  # warm (imports, caches)
        new, old = [], []
        for _ in range(args.runs):
            t0 = time.process_time()
            plan_dispatch(bounds, args.world)
            new.append(time.process_time() - t0)
            t0 = time.process_time()
            reference_plan_dispatch(bounds, args.world)
            old.append(time.process_time() - t0)
        print(f"seed {seed}: plan_dispatch median {statistics.median(new) * 1e3:.2f} ms (min {min(new) * 1e3:.2f}); "
              f"reference median {statistics.median(old) * 1e3:.2f} ms (min {min(old) * 1e3:.2f}); "
              f"attempt {plan.attempt}")
    if args.profile:
        bounds = lognormal_mix(1 << 20, 1000, 1.0, args.seeds[0])
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            plan_dispatch(bounds, args.world)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
