"""End to end on one GPU: a ~1.2B-parameter GPT at 16K tokens, bf16, trained by Megatron-LM's own
``pretrain_gpt.py`` (core_v0.16.1 + patches/pretrain_gpt.patch, bundled in .mlm/ by
scripts/mlm_bundle.sh) and by ``python -m megatron_burst.train``, with our attention and the fused
LM loss, measured per variant.

    bash scripts/e2e_gpu.sh                 # on the GPU machine (installs megatron-core from .whl/)
    python examples/e2e_gpt_1b.py --out DIR [--variants ...] [--smoke]

The model (Llama-style GQA, one flag set for every variant):
  24 layers, hidden h = 2048, a = 16 query heads of d = 128, g = 8 KV groups, SwiGLU MLP of
  f = 5440 (Megatron-LM's int(8h/3 / 64) * 64), RMSNorm, no linear biases, RoPE, vocabulary
  V = 32128 (NullTokenizer 32000 + EOD, padded to a multiple of 128), tied embedding/output,
  sequence s = 16384, micro and global batch 1 (16384 tokens per iteration), megatron.core's
  MockGPTDataset (synthetic tokens: the GPU machine has no network).
Parameters N = L * (h*d*(2a + 2g) + 3*h*f + 2h) + V*h + h
             = 24 * (2048*128*48 + 3*2048*5440 + 4096) + 32128*2048 + 2048 = 1,170,049,024
  (QKV + output projection, the three SwiGLU matrices, two RMSNorm weights per layer; the tied
  embedding; the final norm). The trainer prints its own count, recorded beside it.

FLOPs per iteration (MFU's numerator): Megatron-LM's ``num_floating_point_operations`` for a dense
GPT (training.py; GEMMs x 3 for forward, wgrad, dgrad; causal attention counts half the s^2 matrix):
    12 * B * s * L * h^2 * [ (1 + g/a + s/(2h)) * (a*d/h) + (f/h) * 3/2 + V / (2*L*h) ]
The JSON also gives the textbook 6*N*tokens + 6*L*a*d*s^2*B (= 12*L*h*s^2/2 per sequence). MFU =
FLOPs / (iteration time x peak dense bf16 FLOP/s: 989.4e12 on H100/H200 SXM, or --peak-tflops);
recompute is not counted (model FLOPs, not hardware FLOPs). Iteration time: the mean of the
iterations after --warmup (the first builds the kernels' self-checks and the allocator's pool).
Peak memory: torch.cuda.max_memory_allocated at the end (the trainer logs it on CUDA).

Variants (each a fresh process, so peaks and OOMs stay apart). Through Megatron-LM's pretrain_gpt.py
(what a Megatron-LM user runs; its own training loop, optimizer and logging; iteration time, its
own TFLOP/s and ``max allocated`` parsed from its log; TE- and apex-free flags, ``mlm_flags``):
  mlm_burst         --cp-algo burst --fused-lm-loss --te-free-fusions: our attention and fused loss, and
                    fused RoPE / Adam / gradient-norm kernels in place of the TE/apex ones megatron.core
                    lacks here (megatron_burst.megatron.te_free; Megatron-LM's default --rope-fusion)
  mlm_burst_unfused the same without --te-free-fusions (--no-rope-fusion; torch's foreach AdamW and
                    megatron.core's per-tensor norm / copy loops: what a TE-free install runs by default)
  mlm_megatron_local  --cp-algo none (Megatron's own local attention and unfused loss) with
                    --te-free-fusions, full recompute
Through ``python -m megatron_burst.train``:
  burst             our engine (--cp-algo burst; at CP = 1 one fused kernel call per direction)
  burst_recompute   + Megatron's full recompute (uniform, 1 layer)
  burst_recompute_selckpt  + --seq-selective-ckpt-ratio 0.5: the first forward keeps (out, lse) of
                    the later half of the sequence, the recompute runs only the earlier half
                    (1/4 of the causal attention FLOPs)
  sdpa              torch.nn.functional.scaled_dot_product_attention (flash) as core attention in
                    the same model: the plain-spec reference for our engine at CP = 1
  megatron_local    megatron.core 0.16.1's own core attention without TransformerEngine: the local
                    spec's DotProductAttention, which materializes the [a, s, s] scores (bf16 +
                    an fp32 softmax: ~50 GB per layer at 16K), so it runs under full recompute and
                    may still run out of memory on an 80 GB H100 (recorded as such). Needs CUDA.
  (Megatron-core 0.16.1 has no torch-SDPA core attention of its own; its fused attention is
  TransformerEngine's, which is not installed there.)

Results go to OUT/e2e_results.json after every variant (a time-out keeps the finished ones), the
trainers' output to OUT/e2e.log. ``--smoke``: the same runs at a tiny size, on CPU if no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL = dict(layers=24, hidden=2048, heads=16, groups=8, kv_channels=128, ffn=5440, vocab=32000, seq=16384,
            iters=10, warmup=2)  # 7 timed iterations (one may be profiled): MFU is their mean
SMOKE = dict(layers=2, hidden=64, heads=4, groups=2, kv_channels=16, ffn=192, vocab=1000, seq=256,
             iters=3, warmup=1)
VARIANTS = {
    "burst": [],
    "burst_recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"],
    "burst_recompute_selckpt": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1", "--seq-selective-ckpt-ratio", "0.5"],
    "sdpa": [],
    "megatron_local": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"],
}
CORE_ATTENTION = {"sdpa": "sdpa", "megatron_local": "megatron_local"}  # the others keep our spec
# Megatron-LM's own training loop: the patched pretrain_gpt.py of .mlm/ (scripts/mlm_bundle.sh), same model
# (--te-free-fusions: megatron_burst.megatron.te_free; without it a TE-free run needs --no-rope-fusion)
MLM_VARIANTS = {
    "mlm_burst": ["--cp-algo", "burst", "--fused-lm-loss", "--te-free-fusions"],
    "mlm_burst_unfused": ["--cp-algo", "burst", "--fused-lm-loss", "--no-rope-fusion"],
    "mlm_megatron_local": ["--cp-algo", "none", "--te-free-fusions", "--recompute-granularity", "full",
                           "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
ALL_VARIANTS = list(VARIANTS) + list(MLM_VARIANTS)
MLM_DIR = os.path.join(REPO, ".mlm")
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12, "A100": 312e12}


def padded_vocab(vocab: int) -> int:
    return -(-(vocab + 1) // 128) * 128  # NullTokenizer: ids < vocab, EOD = vocab


def param_count(c: dict) -> int:
    h, a, g, d, f, L = c["hidden"], c["heads"], c["groups"], c["kv_channels"], c["ffn"], c["layers"]
    return L * (h * d * (2 * a + 2 * g) + 3 * h * f + 2 * h) + padded_vocab(c["vocab"]) * h + h


def flops_megatron(c: dict, batch: int = 1) -> float:
    """Megatron-LM's num_floating_point_operations (dense GPT, SwiGLU, GQA, causal)."""
    h, a, g, d, f, L, s = c["hidden"], c["heads"], c["groups"], c["kv_channels"], c["ffn"], c["layers"], c["seq"]
    V = padded_vocab(c["vocab"])
    return 12 * batch * s * L * h * h * ((1 + g / a + s / h / 2) * (a * d / h) + (f / h) * 1.5 + V / (2 * L * h))


def flops_6n(c: dict, batch: int = 1) -> float:
    """6 N T plus the causal attention matmuls, 6 L a d s^2 B (= 12 L h s^2 / 2 per sequence when a d = h)."""
    s = c["seq"]
    return 6 * param_count(c) * s * batch + 6 * c["layers"] * c["heads"] * c["kv_channels"] * s * s * batch


def train_flags(c: dict, data_dir: str) -> List[str]:
    return ["--num-layers", str(c["layers"]), "--hidden-size", str(c["hidden"]),
            "--num-attention-heads", str(c["heads"]), "--num-query-groups", str(c["groups"]),
            "--kv-channels", str(c["kv_channels"]), "--ffn-hidden-size", str(c["ffn"]), "--swiglu",
            "--normalization", "RMSNorm", "--disable-bias-linear", "--seq-length", str(c["seq"]),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(c["iters"]),
            "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(c["vocab"]), "--data-cache-path", data_dir, "--bf16", "--fused-lm-loss",
            "--cp-algo", "burst", "--te-free-fusions", "--log-interval", "1"]


def mlm_flags(c: dict, data_dir: str) -> List[str]:
    """The same model for Megatron-LM's pretrain_gpt.py (TransformerEngine- and apex-free: local
    layers, no fusions that need them; RoPE fusion is each variant's choice), logging every
    iteration's time, throughput and memory."""
    return ["--num-layers", str(c["layers"]), "--hidden-size", str(c["hidden"]),
            "--num-attention-heads", str(c["heads"]), "--group-query-attention", "--num-query-groups", str(c["groups"]),
            "--kv-channels", str(c["kv_channels"]), "--ffn-hidden-size", str(c["ffn"]), "--swiglu",
            "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
            "--seq-length", str(c["seq"]), "--max-position-embeddings", str(c["seq"]),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(c["iters"]),
            "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(c["vocab"]), "--data-cache-path", data_dir, "--bf16", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-persist-layer-norm", "--no-masked-softmax-fusion",
            "--eval-iters", "0", "--eval-interval", str(10 ** 6), "--log-interval", "1", "--log-throughput",
            "--log-memory-interval", "1"]


_MLM_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                       r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|)?.*?lm loss: ([\d.eE+-]+) \|")
_MLM_MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: ([\d.]+)")


def parse_mlm_log(text: str) -> Dict:
    """Per-iteration seconds, Megatron-LM's own TFLOP/s per GPU and lm loss, and the largest
    ``max allocated`` (bytes), from pretrain_gpt.py's log (training_log / report_memory lines)."""
    rows = [(int(i), float(ms) / 1e3, float(tf) if tf else None, float(loss))
            for i, ms, tf, loss in _MLM_ITER.findall(text)]
    peaks = [float(mb) * 2 ** 20 for _, mb in _MLM_MEMORY.findall(text)]
    return {"iterations": [r[0] for r in rows], "elapsed_s": [r[1] for r in rows],
            "megatron_tflops": [r[2] for r in rows], "lm_loss": [r[3] for r in rows],
            "max_memory_allocated_bytes": max(peaks) if peaks else None}


# ------------------------------------------------------------------ worker: another core attention

def _sdpa_core_attention():
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        """DotProductAttention's interface over torch's scaled_dot_product_attention (causal, GQA,
        no dropout): q, k, v [s, b, heads, d] -> [s, b, heads * d]."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            assert config.context_parallel_size == 1, "SDPACoreAttention runs at CP = 1 only"
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is None and attention_bias is None
            groups = query.shape[2] // key.shape[2]
            if groups > 1:  # GQA: KV heads repeated locally (as Megatron's DotProductAttention does)
                key, value = (t.repeat_interleave(groups, dim=2) for t in (key, value))
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            with _fused_sdpa_only(q.device):  # never torch's math fallback (it builds the s x s matrix)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _fused_sdpa_only(device):
        import contextlib

        if device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])

    return SDPACoreAttention


def _worker(kind: str, argv: List[str]) -> None:
    """``python -m megatron_burst.train argv`` with the layer spec's core attention replaced by
    ``kind`` (the rest of the model -- RoPE, projections, MLP, fused loss -- is the same)."""
    import copy

    import megatron_burst.specs as specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    core = _sdpa_core_attention() if kind == "sdpa" else DotProductAttention
    build = specs.get_gpt_layer_spec

    def spec_with_other_attention(*args, **kwargs):
        spec = copy.deepcopy(build(*args, **kwargs))
        spec.submodules.self_attention.submodules.core_attention = core
        return spec

    specs.get_gpt_layer_spec = spec_with_other_attention
    from megatron_burst.train.__main__ import main

    main(argv)


# Kernel-name patterns of a profiled step's categories, first match wins (the rest: elementwise
# kernels -- norms, unfused RoPE, SwiGLU, residual adds, casts -- and anything unnamed here).
PROFILE_CATEGORIES = (("gemm", r"gemm|nvjet|cutlass|xmma|cublas"), ("attention", r"flash|fmha|cudnn|attn"),
                      ("fused loss", r"ce_rows"), ("rope", r"rope"), ("optimizer", r"multi_tensor|adam"),
                      ("copies", r"memcpy|memset|copy"), ("elementwise and other", r""))


def profile_train_step(at: int, path: str) -> None:
    """Run Megatron-LM's ``at``-th train_step (1-based) under torch's profiler and write where its
    time went: ``path`` (the kernel table, top 40 by own time) and ``path + '.json'`` ({category:
    ms} over PROFILE_CATEGORIES, the step's wall ms; device time on CUDA, else CPU time). Wraps
    ``megatron.training.training.train_step``, which ``train`` looks up per call."""
    import megatron.training.training as training
    import torch
    from torch.profiler import ProfilerActivity, profile

    real, calls = training.train_step, {"n": 0}
    cuda = torch.cuda.is_available()

    def train_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != at:
            return real(*args, **kwargs)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            out = real(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
        events = prof.key_averages()
        own = "self_device_time_total" if cuda else "self_cpu_time_total"
        kernels = [e for e in events if not cuda or str(getattr(e, "device_type", "")).endswith("CUDA")]
        sums = {name: 0.0 for name, _ in PROFILE_CATEGORIES}
        for e in kernels:
            name = next(n for n, pattern in PROFILE_CATEGORIES if re.search(pattern, e.key, re.IGNORECASE))
            sums[name] += getattr(e, own, 0.0) / 1e3
        with open(path, "w") as f:
            f.write(events.table(sort_by=own.replace("device", "cuda") if cuda else own, row_limit=40,
                                 max_name_column_width=80))
        with open(path + ".json", "w") as f:
            json.dump({"iteration": at, "wall_ms": round(wall_ms, 2), "time": "device" if cuda else "cpu",
                       "ms": {k: round(v, 2) for k, v in sums.items()}}, f)
        print(f"> profiled iteration {at}: {wall_ms:.1f} ms; " + ", ".join(f"{k} {v:.1f} ms" for k, v in sums.items()))
        return out

    training.train_step = train_step


def _mlm_worker(argv: List[str]) -> None:
    """Run .mlm/pretrain_gpt.py as ``python pretrain_gpt.py argv`` would, with Megatron-LM's two
    start-up build steps fitted to a pip-installed megatron-core (the GPU machine's): the dataset
    index helpers are not recompiled when the wheel ships them compiled (``helpers_cpp``; Megatron-LM
    runs ``make`` in megatron/core/datasets, which a wheel has no Makefile for), and the legacy
    fused-kernel loader, which in core_v0.16.1 builds no kernel but asks ``nvcc -V`` for the CUDA
    version, is skipped where no nvcc is found. Neither changes what is computed."""
    import runpy

    import megatron.core.datasets.utils as dataset_utils
    from megatron.legacy import fused_kernels

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        dataset_utils.compile_helpers = lambda: print("> dataset index helpers: compiled in the megatron-core wheel")
    except ImportError:
        pass
    real_load = fused_kernels.load

    def load(args):
        try:
            real_load(args)
        except (TypeError, OSError, subprocess.CalledProcessError) as exc:
            print(f"> legacy fused kernels: none to build; nvcc not usable here ({type(exc).__name__}: {exc})")

    fused_kernels.load = load
    if int(os.environ.get("E2E_PROFILE_ITER", "0") or 0) > 0:
        profile_train_step(int(os.environ["E2E_PROFILE_ITER"]), os.environ.get("E2E_PROFILE_OUT", "e2e_profile.txt"))
    script = os.path.join(MLM_DIR, "pretrain_gpt.py")
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


# ------------------------------------------------------------------ driver

_ENV_PROBE = """
import json, sys
info = {"python": sys.version.split()[0]}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
except Exception as exc:
    info["torch_error"] = repr(exc)
try:
    import megatron.core
    info["megatron_core"] = megatron.core.__version__
except Exception as exc:
    info["megatron_core_error"] = repr(exc)
print(json.dumps(info))
"""


def _environment() -> dict:
    """Versions and the device, probed in a child process (the driver never opens a CUDA context,
    which would hold GPU memory through every variant's run)."""
    proc = subprocess.run([sys.executable, "-c", _ENV_PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"probe_error": proc.stderr[-2000:]}


def _peak_flops(override: Optional[float], device: str) -> Optional[float]:
    if override:
        return override * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in device), None)


def _run_logged(name: str, cmd: List[str], cwd: str, env: dict, timeout: float, log) -> tuple:
    """Run one variant's process: (returncode or "timeout", stdout, stderr, wall seconds). Its
    command and stdout go into ``log`` (opened for appending) and its stderr into
    ``<log>.<name>.stderr`` as they are written, so a driver killed from outside (the GPU session's
    time limit) still leaves them."""
    log.write(f"\n=== {name}\n$ {' '.join(cmd)}\n")
    log.flush()
    start = os.path.getsize(log.name)
    t0 = time.perf_counter()
    with open(f"{log.name}.{name}.stderr", "w+") as err_file:
        try:
            rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=err_file, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        err_file.seek(0)
        err = err_file.read()
    with open(log.name, "rb") as f:
        f.seek(start)
        out = f.read().decode(errors="replace")
    if rc != 0:
        log.write("\n--- stderr (tail)\n" + err[-6000:])
        log.flush()
    return rc, out, err, round(time.perf_counter() - t0, 1)


def _failure(err: str, fallback: str) -> str:
    """What a failed variant reports: out of memory, or the last line of its stderr."""
    if "OutOfMemoryError" in err or "out of memory" in err.lower():
        return "out of GPU memory"
    return (err.strip().splitlines() or [fallback])[-1][-500:]


def _rates(c: dict, times: List[float], args) -> Dict:
    """Step time (mean after the warm-up iterations), tokens/s, TFLOP/s and MFU (both FLOP counts)
    from the per-iteration seconds of one variant (global batch 1: c["seq"] tokens per iteration)."""
    steady = times[c["warmup"]:] or times[-1:]
    step_s = sum(steady) / len(steady)
    return {"iteration_s": [round(t, 4) for t in times], "step_s": round(step_s, 4),
            "tokens_per_s": round(c["seq"] / step_s, 1), "tflops_per_s": round(flops_megatron(c) / step_s / 1e12, 1),
            "mfu": round(flops_megatron(c) / step_s / args.peak, 4) if args.peak else None,
            "mfu_6n": round(flops_6n(c) / step_s / args.peak, 4) if args.peak else None}


# megatron_burst.world.LAUNCHER_VARIABLES (this orchestrator imports neither torch nor megatron_burst;
# tests/test_e2e_smoke.py holds the two equal)
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_mlm_variant(name: str, c: dict, args, log) -> Dict:
    """One Megatron-LM variant: .mlm/pretrain_gpt.py in a fresh single-rank process (env:// rendezvous)."""
    if name == "mlm_megatron_local":
        c = {**c, "iters": min(c["iters"], c["warmup"] + 2)}
    flags = mlm_flags(c, os.path.join(args.work, "data")) + MLM_VARIANTS[name]
    result: Dict = {"variant": name, "flags": flags, "trainer": "Megatron-LM pretrain_gpt.py"}
    script = os.path.join(MLM_DIR, "pretrain_gpt.py")
    if not os.path.exists(script):
        result.update(returncode="no .mlm", error=f"{script} missing: run `bash scripts/mlm_bundle.sh` here and carry .mlm")
        return result
    with open(os.path.join(MLM_DIR, "SOURCE")) as f:
        result["megatron_lm"] = f.read().strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--mlm-worker", "--"] + flags
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV},
           "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join([MLM_DIR, REPO, os.environ.get("PYTHONPATH", "")])}
    profile_path = None
    if getattr(args, "profile_iter", 0) > 0:
        profile_path = os.path.join(os.path.abspath(args.out), f"{name}_profile.txt")
        env.update(E2E_PROFILE_ITER=str(args.profile_iter), E2E_PROFILE_OUT=profile_path)
    rc, out, err, wall = _run_logged(name, cmd, MLM_DIR, env, args.per_run_timeout, log)
    result.update(returncode=rc, wall_s=wall)
    if profile_path and os.path.exists(profile_path + ".json"):
        with open(profile_path + ".json") as f:
            result["profile"] = json.load(f)
    parsed = parse_mlm_log(out)
    if rc != 0 or not parsed["elapsed_s"]:
        result["error"] = _failure(err, "no iteration logged")
        if not parsed["elapsed_s"]:
            return result
    peak = parsed["max_memory_allocated_bytes"]
    elapsed = list(parsed["elapsed_s"])
    if profile_path and len(elapsed) >= args.profile_iter:
        elapsed.pop(args.profile_iter - 1)  # the profiled iteration (the profiler slows it) is not timed
        result["timed_without_iteration"] = args.profile_iter
    result.update(_rates(c, elapsed, args))
    result.update(lm_loss=[round(x, 4) for x in parsed["lm_loss"]], megatron_tflops_per_gpu=parsed["megatron_tflops"],
                  peak_memory_gib=round(peak / 2 ** 30, 2) if peak else None)
    return result


def run_variant(name: str, c: dict, args, log) -> Dict:
    """One variant in a fresh process; its metrics, time and memory figures."""
    if name in MLM_VARIANTS:
        return run_mlm_variant(name, c, args, log)
    metrics_file = os.path.join(args.work, f"{name}.metrics.json")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    if name == "megatron_local":  # seconds per iteration at 16K (the s x s scores, recomputed): fewer of them
        c = {**c, "iters": min(c["iters"], c["warmup"] + 2)}
    flags = train_flags(c, os.path.join(args.work, "data")) + VARIANTS[name] + ["--metrics-file", metrics_file]
    kind = CORE_ATTENTION.get(name)
    cmd = ([sys.executable, os.path.abspath(__file__), "--worker", kind, "--"] if kind
           else [sys.executable, "-m", "megatron_burst.train"]) + flags
    # each variant is a world of one that the trainer makes itself: no launcher variables from this process
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update({"PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    rc, out, err, wall = _run_logged(name, cmd, REPO, env, args.per_run_timeout, log)
    result: Dict = {"variant": name, "flags": flags[:-2], "returncode": rc, "wall_s": wall}
    if rc != 0:
        result["error"] = _failure(err, "?")
        return result
    data = json.load(open(metrics_file))
    rows = data["metrics"]
    banner = re.search(r"(\d+) parameters per TP rank", out)
    result.update(_rates(c, [r["elapsed_s"] for r in rows], args))
    result.update({
        "lm_loss": [round(r["lm_loss"], 4) for r in rows],
        "peak_memory_gib": (round(rows[-1]["max_memory_allocated_bytes"] / 2**30, 2)
                            if "max_memory_allocated_bytes" in rows[-1] else None),
        "parameters_trainer": int(banner.group(1)) if banner else None,
        "kernels": data.get("kernels"),
        "precision": data.get("precision"),
    })
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "runs/e2e"), help="where results go (default $OUT)")
    p.add_argument("--work", default=None, help="metrics files and mock-data cache (default /tmp/e2e_work)")
    p.add_argument("--smoke", action="store_true", help="tiny model (runs on CPU): proves the pipeline end to end")
    p.add_argument("--variants", nargs="+", default=None, choices=ALL_VARIANTS,
                   help="default: mlm_burst first and mlm_megatron_local last when .mlm/ exists (Megatron-LM's "
                        "pretrain_gpt.py: scripts/mlm_bundle.sh; CUDA only), the trainer's variants between")
    p.add_argument("--seq-length", type=int, default=None, help="override the sequence length")
    p.add_argument("--iters", type=int, default=None, help="iterations per variant")
    p.add_argument("--per-run-timeout", type=float, default=None, help="seconds per variant (default 120)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s for MFU")
    p.add_argument("--profile-iter", type=int, default=0,
                   help="Megatron-LM variants: run this iteration (1-based; after the warm-up) under torch's "
                        "profiler; its kernel table goes to OUT/<variant>_profile.txt and the time per category "
                        "(GEMMs, attention, loss, optimizer, elementwise) into the results")
    p.add_argument("--worker", choices=["sdpa", "megatron_local"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--mlm-worker", action="store_true", help=argparse.SUPPRESS)
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--mlm-worker"]:  # everything after "--" is pretrain_gpt.py's
        _mlm_worker([a for a in argv[1:] if a != "--"])
        return 0
    args, rest = p.parse_known_args(argv)
    if args.worker:
        _worker(args.worker, [a for a in rest if a != "--"])
        return 0
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.variants is None:
        have_mlm = os.path.exists(os.path.join(MLM_DIR, "pretrain_gpt.py"))
        args.variants = (["mlm_burst"] if have_mlm else []) + list(VARIANTS) + (["mlm_megatron_local"] if have_mlm else [])
    c = dict(SMOKE if args.smoke else FULL)
    if args.seq_length:
        c["seq"] = args.seq_length
    if args.iters:
        c["iters"] = args.iters
    args.per_run_timeout = args.per_run_timeout or 120
    os.makedirs(args.out, exist_ok=True)
    args.work = args.work or "/tmp/e2e_work"  # not under OUT: only a few files may come back from there
    os.makedirs(args.work, exist_ok=True)
    env = _environment()
    args.peak = _peak_flops(args.peak_tflops, env.get("device", "cpu"))
    cuda = env.get("device", "cpu") != "cpu"
    summary = {"model": {**c, "padded_vocab": padded_vocab(c["vocab"]), "parameters": param_count(c),
                         "flops_per_iteration_megatron": flops_megatron(c), "flops_per_iteration_6n": flops_6n(c),
                         "tokens_per_iteration": c["seq"]},
               "peak_flops": args.peak, "env": env, "smoke": args.smoke, "results": []}
    path = os.path.join(args.out, "e2e_results.json")
    with open(os.path.join(args.out, "e2e.log"), "a") as log:
        for name in args.variants:
            if name == "megatron_local" and not cuda:
                summary["results"].append({"variant": name, "skipped": "needs CUDA: megatron.core's DotProductAttention "
                                           "allocates its score buffer on the current CUDA device"})
            elif name in MLM_VARIANTS and not cuda:
                summary["results"].append({"variant": name, "skipped": "needs CUDA: Megatron-LM's training loop"})
            else:
                result = run_variant(name, c, args, log)
                summary["results"].append(result)
                print(json.dumps({k: result.get(k) for k in ("variant", "returncode", "step_s", "tokens_per_s",
                                                             "mfu", "peak_memory_gib", "error", "wall_s")}), flush=True)
            with open(path + ".tmp", "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(path + ".tmp", path)
    failed = [r["variant"] for r in summary["results"] if r.get("returncode") not in (0, None)
              and r["variant"] not in ("megatron_local", "mlm_megatron_local")]
    print(f"results: {path}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
