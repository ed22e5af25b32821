"""Launch configs of the Triton masked attention kernel (kernels/triton_masked.py GPU_CONFIG), timed
per kernel (forward, dq, dk/dv) on the GPU, bf16, head dim 128, GQA 32/8:

    python scripts/gpu_tune_masked.py [--seq 32768] [--out FILE.jsonl]

Cases: a causal sliding window of 1024 keys over --seq tokens (kind "positions", keys loaded) and
block-causal blocks of 64 (one rank's block-striped diagonal, --seq / 4 rows). Phase 1 compiles every
candidate in parallel processes (Triton caches compiled kernels on disk); phase 2 times them one
after another in this process (median of 5 after 2 warm-ups, CUDA events). One JSON line per
(case, kernel, config): ms, or the error (a config that does not compile, e.g. out of shared memory).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_burst.kernels import triton_masked as tm

CANDIDATES = {  # (BLOCK_M, BLOCK_N, warps, stages); the first is today's
    "forward": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (128, 32, 4, 3)],
    "dkdv": [(16, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (32, 128, 8, 2)],
}


def inputs(seq: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(seq, 1, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).permute(1, 2, 0, 3)  # noqa: E731
    return mk(32), mk(8), mk(8), mk(32)


def cases(seq: int) -> dict:
    pos = torch.arange(seq)
    return {"window1024": dict(kind="positions", block=1, positions=(pos, pos, None, None, (1024, 0)), seq=seq),
            "block_causal64": dict(kind="block_causal", block=64, positions=None, seq=seq // 4)}


def time_one(case: dict, kernel: str, cfg: tuple, repeats: int = 5) -> float:
    tm.GPU_CONFIG[(kernel, 128, 16)] = cfg
    q, k, v, do = inputs(case["seq"])
    kw = dict(kind=case["kind"], block=case["block"], scale=128 ** -0.5)
    if case["positions"] is not None:
        kw["positions"] = case["positions"]
    out, lse = tm.forward(q, k, v, **kw)
    D = (do.float() * out).sum(-1)
    fn = (lambda: tm.forward(q, k, v, **kw)) if kernel == "forward" else (lambda: tm.backward(do, q, k, v, D, lse, **kw))
    times = []
    for i in range(repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--out", default=None)
    p.add_argument("--one", help=argparse.SUPPRESS)  # phase 1: compile one (case, kernel, config)
    a = p.parse_args()
    if a.one:
        name, kernel, cfg = json.loads(a.one)
        time_one(cases(a.seq)[name], kernel, tuple(cfg), repeats=0)
        return
    jobs = [(name, kernel, cfg) for name in cases(a.seq) for kernel, cfgs in CANDIDATES.items() for cfg in cfgs]
    with ThreadPoolExecutor(12) as pool:  # compiles are CPU-bound: fill the cores
        list(pool.map(lambda j: subprocess.run([sys.executable, __file__, "--seq", str(a.seq), "--one", json.dumps(j)],
                                               capture_output=True, timeout=240), jobs))
    all_cases = cases(a.seq)
    for name, kernel, cfg in jobs:
        saved = dict(tm.GPU_CONFIG)
        try:
            row = {"case": name, "kernel": kernel, "config": cfg, "ms": round(time_one(all_cases[name], kernel, cfg), 3)}
        except Exception as e:  # noqa: BLE001  a config that does not compile is a result
            row = {"case": name, "kernel": kernel, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        finally:
            tm.GPU_CONFIG.clear()
            tm.GPU_CONFIG.update(saved)
        line = json.dumps(row)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
