"""LM head + cross-entropy benchmark: fused vs Megatron's unfused path vs a recompute (CCE-style) variant.

    python -m megatron_burst.bench loss --threads 2      # 3 points of the issue's grid (~16 min, 2 cores)
    python -m megatron_burst.bench loss --full           # the issue's grid: N 4K/16K, V 32K/128K, d 1K/4K
    python -m megatron_burst.bench loss --tokens 2048 --vocab 16384 --hidden 512 --dtype bfloat16

The default runs the points of the issue's grid at d = 1024 whose GEMMs a 2-core CPU finishes in
minutes: (N, V) = (4K, 32K), (4K, 128K), (16K, 32K). ``--full`` adds d = 4096 and (16K, 128K),
which take hours there (meant for a GPU). The chunked variants process ``--tile-elems / V`` tokens
per chunk (a chunk's fp32 logits tile holds at most --tile-elems values; the op's default, 2^26).

Tensor / sequence parallelism (``--tp 2 --sequence-parallel``): each run is ``--tp`` gloo ranks
(processes) holding V/tp vocabulary rows each and, with --sequence-parallel, N/tp tokens of the
hidden states (labels: all N); memory figures are the largest over the ranks. On CPU, Megatron's
unfused path cannot run under sequence parallelism (its backward allocates on CUDA): use
``--variants fused recompute`` there. E.g. the fused loss's memory under TP = 2 with SP:

    MALLOC_MMAP_THRESHOLD_=1048576 python -m megatron_burst.bench loss --tp 2 --sequence-parallel \
        --variants fused recompute --tokens 4096 --vocab 32768 --hidden 1024 --repeats 1 --plot ''

(On CPU the peak is the RSS's: glibc keeps some freed blocks in its heap unless large blocks are
mmapped, which the fixed MALLOC_MMAP_THRESHOLD_ forces; then the RSS follows the live tensors.)

Variants, each on hidden [N, 1, d], weight [V, d], objective sum(loss * mask) / sum(mask):
  unfused    Megatron: ColumnParallelLinear output layer -> logits [N, V] -> vocab_parallel_cross_entropy
  fused      megatron_burst.loss.fused_linear_cross_entropy(loss_mask=mask)
  recompute  megatron_burst.loss.recompute_linear_cross_entropy (backward recomputes the logits)
Every (configuration, variant) runs in fresh subprocesses (``--tp`` gloo ranks). Time: median of
``--repeats`` forward + backward after one warm-up. Peak memory: on CPU the process's peak RSS
(VmHWM, reset once the inputs exist) minus its RSS then; on CUDA max_memory_allocated minus the
allocated bytes once the inputs exist. "saved": the bytes of the tensors the variant keeps from
forward to backward (torch.autograd.graph.saved_tensors_hooks), beyond the inputs hidden and weight
themselves (alive anyway: an activation and a parameter); "backward peak": the peak of one more
backward above the memory in use when it starts (in a model, saved + backward peak is what the loss
adds to the step's peak, which comes at the start of the backward). "largest / NxV": the largest
tensor any op produced during one more (untimed) step, in elements, over N x V -- 1.00 or more
means an N x V tensor was allocated.
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
import tempfile
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


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(spec: dict) -> dict:
    """Run one variant on one configuration on this rank (a fresh process); returns time and memory."""
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    tp, rank = spec.get("tp", 1), spec.get("rank", 0)
    sp = spec.get("sequence_parallel", False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    from megatron_burst.loss import fused_linear_cross_entropy, recompute_linear_cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    N, V, d = spec["tokens"], spec["vocab"], spec["hidden"]
    if V % tp or (sp and N % tp):
        raise SystemExit(f"V={V} (and N={N} under sequence parallelism) must be divisible by --tp {tp}")
    dtype = getattr(torch, spec["dtype"])

    def gen(seed: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed)

    # Each rank generates only its own pieces (a full [V, d] weight would raise the peak RSS).
    n_local = N // tp if sp else N
    hidden = torch.randn(n_local, 1, d, generator=gen(1 + rank)).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(V // tp, d, generator=gen(1001 + rank)) * d ** -0.5).to(device=device, dtype=dtype)
    weight.requires_grad_()
    labels = torch.randint(0, V, (N, 1), generator=gen(2001)).to(device)  # all N tokens, the same on every rank
    mask = (torch.rand(N, 1, generator=gen(2002)) > 0.1).float().to(device)
    n_tokens = mask.sum()
    chunk = max(1, spec["tile_elems"] // (V // tp))
    layer = None
    if spec["variant"] == "unfused":
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                                  perform_initialization=False, params_dtype=dtype)
        layer = ColumnParallelLinear(d, V, config=cfg, init_method=lambda w: None, bias=False, gather_output=False,
                                     skip_weight_param_allocation=True)

    def forward() -> torch.Tensor:
        if spec["variant"] == "unfused":
            logits, _ = layer(hidden, weight=weight)
            loss = vocab_parallel_cross_entropy(logits, labels)
        elif spec["variant"] == "fused":
            loss = fused_linear_cross_entropy(hidden, weight, labels, tp_group=group, loss_mask=mask,
                                              sequence_parallel=sp, token_chunk=chunk)
        else:
            loss = recompute_linear_cross_entropy(hidden, weight, labels, tp_group=group, sequence_parallel=sp,
                                                  token_chunk=chunk)
        return (loss * mask).sum() / n_tokens

    def step() -> None:
        hidden.grad, weight.grad = None, None
        forward().backward()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()
        base = _rss_bytes()
    step()  # warm-up
    times = []
    for _ in range(spec["repeats"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()) - base
    saved = {}  # storage -> bytes of every tensor kept for backward, beyond the inputs themselves

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in (hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()):
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def memory_mark() -> int:  # reset the peak; the memory in use now
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        _reset_peak_rss()
        return _rss_bytes()

    hidden.grad, weight.grad = None, None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective = forward()
    mark = memory_mark()
    objective.backward()  # what the backward allocates on top of what the forward left
    sync()
    backward_peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()) - mark
    del objective
    with LargestTensor() as probe:  # after the memory reading: the probe keeps nothing alive
        step()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {"time_s": statistics.median(times), "peak_bytes": peak, "largest_numel": probe.numel,
            "saved_bytes": sum(saved.values()), "backward_peak_bytes": backward_peak}


def _run(spec: dict, timeout: float, attempts: int = 3) -> dict:
    """Run ``spec`` on spec["tp"] fresh rank processes; time of rank 0, memory: the largest rank's.

    The rendezvous port is free when picked but may be taken before rank 0 listens on it (other
    jobs on the machine): then the run is repeated on a new port, up to ``attempts`` times.
    """
    for _ in range(attempts):
        res = _run_once(dict(spec, port=free_port()), timeout)
        if "EADDRINUSE" not in res.get("error", ""):
            break
    return res


def _run_once(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), PYTHONWARNINGS="ignore")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    # Files, not pipes: the ranks are polled, not read, while they run (a full pipe would block one).
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(spec.get("tp", 1))]
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_burst.bench.loss", "--worker",
                               json.dumps(dict(spec, rank=rank))], env=env, stdout=out, stderr=err, text=True)
             for rank, (out, err) in enumerate(logs)]
    deadline = time.monotonic() + timeout
    try:
        # Poll all ranks: one that fails (e.g. its rendezvous port was taken) leaves the others
        # waiting in a collective, so stop at the first failure instead of waiting for them.
        while any(proc.poll() is None for proc in procs):
            if any(proc.returncode not in (None, 0) for proc in procs):
                break
            if time.monotonic() > deadline:
                return {"error": f"timed out after {timeout:.0f} s"}
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        outputs = []
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            outputs.append((out.read(), err.read()))
            out.close()
            err.close()
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        if proc.returncode > 0:  # the cause; ranks killed here (< 0) were waiting for it
            return {"error": f"rank {rank}: " + (err.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]}
    if any(proc.returncode != 0 for proc in procs):
        return {"error": "a rank was killed by a signal"}
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    merged = dict(results[0])
    for key in ("peak_bytes", "saved_bytes", "backward_peak_bytes", "largest_numel"):
        merged[key] = max(r[key] for r in results)
    return merged


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
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes) per run; V is split")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="hidden states sequence-sharded over the TP ranks (Megatron's --sequence-parallel)")
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
    if args.tp < 1 or (args.sequence_parallel and args.tp == 1):
        p.error("--tp must be >= 1, and --sequence-parallel needs --tp > 1")
    print(f"# LM head + cross-entropy, TP={args.tp}{' with SP' if args.sequence_parallel else ''}, {args.dtype}, "
          f"{args.device}, {args.threads} thread(s) per rank, median of {args.repeats} fwd+bwd; peak = memory above "
          f"the inputs, saved = kept for backward beyond the inputs (largest rank); tile {tile} fp32 logits")
    print("| N | V | d | chunk | N x V fp32 GiB | unfused s | fused s | recompute s | fused/unfused | fused/recompute "
          "| unfused peak GiB | fused peak GiB | recompute peak GiB | saved MiB: unfused, fused, recompute "
          "| backward peak MiB: unfused, fused, recompute | largest / NxV: unfused, fused, recompute |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    skipped, errors, rows = [], [], []
    for N, V, d in configs:
        need = N * V * UNFUSED_BYTES_PER_LOGIT[args.dtype] + 2 * (N + V) * d * 4
        if "unfused" in args.variants and avail is not None and need > 0.8 * avail:
            skipped.append(f"N={N} V={V} d={d}: the unfused path needs ~{_gib(need)} GiB, "
                           f"{_gib(avail)} GiB available")
            continue
        res = {}
        for variant in args.variants:
            spec = dict(variant=variant, tokens=N, vocab=V, hidden=d, dtype=args.dtype, device=args.device,
                        repeats=args.repeats, threads=args.threads, tile_elems=tile, tp=args.tp,
                        sequence_parallel=args.sequence_parallel)
            res[variant] = _run(spec, args.timeout)
            if "error" in res[variant]:
                errors.append(f"N={N} V={V} d={d} {variant}: {res[variant]['error']}")
        print(_row(N, V, d, max(1, tile // (V // args.tp)), res), flush=True)
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
        return f"{res[v]['peak_bytes'] / 2 ** 30:.3f}" if "peak_bytes" in res.get(v, {}) else "-"

    def ratio(a, b):
        ok = all("time_s" in res.get(v, {}) for v in (a, b))
        return f"{res[a]['time_s'] / res[b]['time_s']:.2f}" if ok else "-"

    nv = N * V * 4

    def big(v):
        return f"{res[v]['largest_numel'] / (N * V):.2f}" if "largest_numel" in res.get(v, {}) else "-"

    def mib(v, key):
        return f"{res[v][key] / 2 ** 20:.0f}" if key in res.get(v, {}) else "-"

    below = ", ".join(big(v) for v in VARIANTS)
    saved = ", ".join(mib(v, "saved_bytes") for v in VARIANTS)
    bwd = ", ".join(mib(v, "backward_peak_bytes") for v in VARIANTS)
    return (f"| {N} | {V} | {d} | {min(chunk, N)} | {_gib(nv)} | {t('unfused')} | {t('fused')} | {t('recompute')} | "
            f"{ratio('fused', 'unfused')} | {ratio('fused', 'recompute')} | {m('unfused')} | {m('fused')} | "
            f"{m('recompute')} | {saved} | {bwd} | {below} |")


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
