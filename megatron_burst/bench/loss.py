"""LM head + cross-entropy benchmark: fused vs Megatron's unfused path vs a recompute (CCE-style) variant.

    python -m megatron_burst.bench loss --threads 2      # 3 points of the issue's grid (~16 min, 2 cores)
    python -m megatron_burst.bench loss --full           # the issue's grid: N 4K/16K, V 32K/128K, d 1K/4K
    python -m megatron_burst.bench loss --tokens 2048 --vocab 16384 --hidden 512 --dtype bfloat16

The default runs the points of the issue's grid at d = 1024 whose GEMMs a 2-core CPU finishes in
minutes: (N, V) = (4K, 32K), (4K, 128K), (16K, 32K). ``--full`` adds d = 4096 and (16K, 128K),
which take hours there (meant for a GPU). The chunked variants process ``--tile-elems / V`` tokens
per chunk (a chunk's fp32 logits tile holds at most --tile-elems values; the op's default, 2^26).

Variants, each on hidden [N, 1, d], weight [V, d], objective sum(loss * mask) / sum(mask):
  unfused    Megatron: ColumnParallelLinear output layer -> logits [N, V] -> vocab_parallel_cross_entropy
  fused      megatron_burst.loss.fused_linear_cross_entropy(loss_mask=mask)
  recompute  megatron_burst.loss.recompute_linear_cross_entropy (backward recomputes the logits)
Every (configuration, variant) runs in a fresh subprocess (TP = 1, one gloo rank). Time: median of
``--repeats`` forward + backward after one warm-up. Peak memory: on CPU the process's peak RSS
(getrusage) minus its RSS once the inputs exist; on CUDA max_memory_allocated minus the allocated
bytes once the inputs exist. "largest / NxV": the largest tensor any op produced during one more
(untimed) step, in elements, over N x V -- 1.00 or more means an N x V tensor was allocated.
Configurations whose unfused path cannot fit in this machine's memory are skipped and listed.
The --full grid is meant for a GPU (or a large CPU box): on a small CPU machine its GEMMs take
hours; each run is cut at --timeout seconds and reported as an error line.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_burst.bench import plotting
from megatron_burst.world import free_port

VARIANTS = ("unfused", "fused", "recompute")
DEFAULT_CONFIGS = [(4096, 32768, 1024), (4096, 131072, 1024), (16384, 32768, 1024)]  # (N, V, d)
FULL_GRID = dict(tokens=[4096, 16384], vocab=[32768, 131072], hidden=[1024, 4096])
DEFAULT_TILE_ELEMS = 1 << 26
# Megatron's unfused path holds about this many bytes per logit at its peak -- fp32: the logits,
# turned into softmax and gradient in place (4, measured 4.4 with temporaries); bf16: the bf16
# logits plus their fp32 copy, later the fp32 gradient plus its bf16 cast (6) -- with headroom.
# Used only to skip configurations that cannot fit.
UNFUSED_BYTES_PER_LOGIT = {"float32": 6, "bfloat16": 8}


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op produces while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(spec: dict) -> dict:
    """Run one variant on one configuration in this (fresh) process; returns time and peak memory."""
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    from megatron_burst.loss import fused_linear_cross_entropy, recompute_linear_cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    N, V, d = spec["tokens"], spec["vocab"], spec["hidden"]
    dtype = getattr(torch, spec["dtype"])
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(N, 1, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, d, generator=g) * d ** -0.5).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (N, 1), generator=g).to(device)
    mask = (torch.rand(N, 1, generator=g) > 0.1).float().to(device)
    n_tokens = mask.sum()
    chunk = max(1, spec["tile_elems"] // V)
    layer = None
    if spec["variant"] == "unfused":
        cfg = ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True,
                                  perform_initialization=False, params_dtype=dtype)
        layer = ColumnParallelLinear(d, V, config=cfg, init_method=lambda w: None, bias=False, gather_output=False,
                                     skip_weight_param_allocation=True)

    def step() -> None:
        hidden.grad, weight.grad = None, None
        if spec["variant"] == "unfused":
            logits, _ = layer(hidden, weight=weight)
            loss = vocab_parallel_cross_entropy(logits, labels)
        elif spec["variant"] == "fused":
            loss = fused_linear_cross_entropy(hidden, weight, labels, loss_mask=mask, token_chunk=chunk)
        else:
            loss = recompute_linear_cross_entropy(hidden, weight, labels, token_chunk=chunk)
        ((loss * mask).sum() / n_tokens).backward()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else _rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up
    times = []
    for _ in range(spec["repeats"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    with LargestTensor() as probe:  # after the memory reading: the probe keeps nothing alive
        step()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {"time_s": statistics.median(times), "peak_bytes": peak, "largest_numel": probe.numel}


def _run(spec: dict, timeout: float) -> dict:
    spec = dict(spec, port=free_port())
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), PYTHONWARNINGS="ignore")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_burst.bench.loss", "--worker", json.dumps(spec)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench loss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the issue's grid (needs a large machine or a GPU)")
    p.add_argument("--tokens", type=int, nargs="+", help="N values (with --vocab and --hidden: their product)")
    p.add_argument("--vocab", type=int, nargs="+", help="V values")
    p.add_argument("--hidden", type=int, nargs="+", help="d values")
    p.add_argument("--tile-elems", type=int, default=DEFAULT_TILE_ELEMS,
                   help="fp32 logits per chunk (default 2^26, the op's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per (configuration, variant)")
    p.add_argument("--plot", default="docs/loss.png", help="peak memory and time per configuration; '' to skip")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.tokens or args.vocab or args.hidden or args.full:
        grid = FULL_GRID
        configs = list(itertools.product(args.tokens or grid["tokens"], args.vocab or grid["vocab"],
                                         args.hidden or grid["hidden"]))
    else:
        configs = DEFAULT_CONFIGS
    tile = args.tile_elems
    avail = _available_bytes() if args.device == "cpu" else None
    print(f"# LM head + cross-entropy, TP=1, {args.dtype}, {args.device}, {args.threads} thread(s), "
          f"median of {args.repeats} fwd+bwd; peak = memory above the inputs; tile {tile} fp32 logits")
    print("| N | V | d | chunk | N x V fp32 GiB | unfused s | fused s | recompute s | fused/unfused | fused/recompute "
          "| unfused peak GiB | fused peak GiB | recompute peak GiB | largest / NxV: unfused, fused, recompute |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    skipped, errors, rows = [], [], []
    for N, V, d in configs:
        need = N * V * UNFUSED_BYTES_PER_LOGIT[args.dtype] + 2 * (N + V) * d * 4
        if avail is not None and need > 0.8 * avail:
            skipped.append(f"N={N} V={V} d={d}: the unfused path needs ~{_gib(need)} GiB, "
                           f"{_gib(avail)} GiB available")
            continue
        res = {}
        for variant in args.variants:
            spec = dict(variant=variant, tokens=N, vocab=V, hidden=d, dtype=args.dtype, device=args.device,
                        repeats=args.repeats, threads=args.threads, tile_elems=tile)
            res[variant] = _run(spec, args.timeout)
            if "error" in res[variant]:
                errors.append(f"N={N} V={V} d={d} {variant}: {res[variant]['error']}")
        print(_row(N, V, d, max(1, tile // V), res), flush=True)
        rows.append(((N, V, d), res))
    for line in skipped:
        print(f"- skipped {line}")
    for e in errors:
        print(f"- error {e}")
    if args.plot and rows:
        _plot(rows, args.plot, f"{args.dtype}, {args.device}")


def _row(N: int, V: int, d: int, chunk: int, res: dict) -> str:
    def t(v):
        return f"{res[v]['time_s']:.3f}" if "time_s" in res.get(v, {}) else "-"

    def m(v):
        return _gib(res[v]["peak_bytes"]) if "peak_bytes" in res.get(v, {}) else "-"

    def ratio(a, b):
        ok = all("time_s" in res.get(v, {}) for v in (a, b))
        return f"{res[a]['time_s'] / res[b]['time_s']:.2f}" if ok else "-"

    nv = N * V * 4

    def big(v):
        return f"{res[v]['largest_numel'] / (N * V):.2f}" if "largest_numel" in res.get(v, {}) else "-"

    below = ", ".join(big(v) for v in VARIANTS)
    return (f"| {N} | {V} | {d} | {min(chunk, N)} | {_gib(nv)} | {t('unfused')} | {t('fused')} | {t('recompute')} | "
            f"{ratio('fused', 'unfused')} | {ratio('fused', 'recompute')} | {m('unfused')} | {m('fused')} | "
            f"{m('recompute')} | {below} |")


def _plot(rows: list, path: str, where: str) -> None:
    """Two panels, one group of bars per configuration: peak memory above the inputs, and time."""
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(VARIANTS)
    labels = [f"N={N // 1024}K\nV={V // 1024}K\nd={d}" for (N, V, d), _ in rows]
    for ax, key, scale, ylabel in ((axes[0], "peak_bytes", 2 ** -30, "peak memory above inputs, GiB"),
                                   (axes[1], "time_s", 1.0, "fwd + bwd, s (median)")):
        for i, variant in enumerate(VARIANTS):
            vals = [res.get(variant, {}).get(key, float("nan")) * scale for _, res in rows]
            ax.bar([x + (i - 1) * width for x in range(len(rows))], vals, width, label=variant)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"LM head + cross-entropy: fused vs unfused vs recompute ({where})", fontsize=9)
    plotting.save(fig, path)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


if __name__ == "__main__":
    main(sys.argv[1:])
