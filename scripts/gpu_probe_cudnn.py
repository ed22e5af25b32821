"""Which blocks crash torch's private cuDNN attention op, and does torch's public eligibility test
(``can_use_cudnn_attention``, the gate of kernels/cudnn_sdpa.py) refuse each of them?

    python scripts/gpu_probe_cudnn.py            (GPU machine; ~10 s, cases run in parallel)

Each case runs the raw op forward + backward (the gate bypassed) in a process of its own, so a
segfault is a result, not the end of the probe. Prints one line per case: shape, torch's verdict,
and ok / the exception / the signal that killed it. The shapes are the GPU suite's blocks (b = 2,
sbhd views, GQA 8/2, the documents of tests/gpu/common.doc_bounds, one-token documents included).
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

CASE = r'''
import json, sys, torch
from megatron_burst.kernels import cudnn_sdpa
b, s, sk, hq, hkv, d, causal = json.loads(sys.argv[1])
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda n, h: torch.randn(n, b, h, d, device="cuda", dtype=torch.bfloat16, generator=g).permute(1, 2, 0, 3)
q, k, v, do = mk(s, hq), mk(sk, hkv), mk(sk, hkv), mk(s, hq)
kk, vv = cudnn_sdpa._kv(k, hq), cudnn_sdpa._kv(v, hq)
print("VERDICT", cudnn_sdpa._torch_would_run_cudnn(q, kk, vv, causal), flush=True)
cudnn_sdpa._TAKES.clear()
cudnn_sdpa.takes_block = lambda *a: True  # the raw op, as before the gate
kind = "causal" if causal else "full"
out, lse = cudnn_sdpa.forward(q, k, v, kind, 1, d ** -0.5)
dq, dk, dv = cudnn_sdpa.backward(do, q, k, v, None, lse, kind, 1, d ** -0.5, out=out)
torch.cuda.synchronize()
print("OK", bool(torch.isfinite(dq.float()).all()), flush=True)
'''

CASES = [  # (b, sq, sk, hq, hkv, d, causal)
    (2, 1600, 1600, 8, 2, 128, True), (2, 1000, 1000, 8, 2, 64, True), (2, 1600, 1600, 8, 2, 128, False),
    (2, 1, 1, 8, 2, 128, True), (2, 322, 322, 8, 2, 128, True), (2, 476, 476, 8, 2, 128, True),
    (2, 407, 407, 8, 2, 128, True), (2, 202, 202, 8, 2, 64, True), (2, 800, 800, 8, 2, 128, True),
    (2, 193, 400, 8, 2, 128, False), (1, 1, 1, 8, 2, 128, True), (1, 512, 512, 32, 8, 128, True),
    (2, 64, 64, 8, 2, 128, True), (2, 128, 192, 8, 2, 128, False),
]


def run(case: tuple) -> str:
    try:
        p = subprocess.run([sys.executable, "-c", CASE, json.dumps(case)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return f"{case}: timed out"
    verdict = next((l.split()[1] for l in p.stdout.splitlines() if l.startswith("VERDICT")), "?")
    if p.returncode == 0:
        res = "ok" if "OK True" in p.stdout else "non-finite gradients"
    elif p.returncode < 0:
        res = f"killed by signal {-p.returncode}"
    else:
        res = "raised: " + (p.stderr.strip().splitlines() or ["?"])[-1][:200]
    return f"b={case[0]} sq={case[1]} sk={case[2]} heads {case[3]}/{case[4]} d={case[5]} causal={case[6]}: " \
           f"torch would run cuDNN: {verdict}; raw op: {res}"


if __name__ == "__main__":
    with ThreadPoolExecutor(8) as pool:
        for line in pool.map(run, CASES):
            print(line, flush=True)
