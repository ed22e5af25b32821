"""LM head + cross-entropy benchmark: ours (fast path and torch path) vs unfused and peer libraries.

    python -m megatron_burst.bench loss --quick              # GPU: (16K, 128K, 4096) bf16, 3 repeats, peers
    python -m megatron_burst.bench loss --threads 2          # CPU: 3 points of the issue's grid (~16 min, 2 cores)
    python -m megatron_burst.bench loss --full               # the issue's grid: N 4K/16K, V 32K/128K, d 1K/4K
    python -m megatron_burst.bench loss --tokens 2048 --vocab 16384 --hidden 512 --dtype bfloat16

``--quick`` measures only N = 16384 tokens, V = 131072, d = 4096 in bf16, median of 3 repeats (or --repeats),
each variant in a fresh process (a few minutes on one H100 / H200, most of it process start-up
and the fp32 reference); with two or more GPUs it adds TP = 2 for the variants that take a
tensor-parallel group. ``--fast-chunks 2048 4096`` adds our fast path at those token chunks
(variants ``fused@2048`` ...) next to its default chunk. Without ``--quick``: the points of the
issue's grid at d = 1024 whose GEMMs a 2-core CPU finishes in minutes, (N, V) = (4K, 32K), (4K,
128K), (16K, 32K); ``--full`` adds d = 4096 and (16K, 128K) (hours on a CPU; meant for a GPU).

Variants, all on the same inputs (hidden [N, 1, d], weight [V, d], labels, a loss mask dropping
~10 % of the tokens) and the same objective, the mean loss over the kept tokens
``sum(loss * mask) / sum(mask)`` (for the libraries that take no mask: those labels set to -100
and their "mean" reduction -- the same number):
  unfused        Megatron: ColumnParallelLinear output layer -> bf16/fp32 logits [N, V] -> vocab_parallel_cross_entropy
  unfused_torch  torch: (h W^T) in the input dtype, .float(), F.cross_entropy (TP = 1; the issue's "unfused bf16")
  fused          megatron_burst.fused_linear_cross_entropy(loss_mask=mask), impl="auto", the op's default chunk
                 (on CUDA: the fast path after its self-check; on CPU: the torch path)
  fused_bwdw     fused, weight_grad="backward" (d weight per vocabulary tile in the backward: no fp32 [V, d] accumulator)
  fused_bwdw_2read  the same with the forward's two reads of each logit (loss.fast.ONE_READ_FORWARD = False):
                 the one-read forward's A/B
  BASE:KNOB=INT,...  one of ours with module constants of the fast path set in its process (KNOBS below:
                 the backward's tile plan, the kernels' block sizes, the one-read forward), e.g.
                 ``fused_bwdw:VOCAB_TILE=4096`` -- candidate settings compared in one device call
  fused_recompute  fused, impl="triton_recompute" (opt-in, not yet run on a GPU: logits recomputed tile by tile
                 in Triton kernels and never stored; d hidden and d weight in the backward; CUDA only)
  fused_torch    the same with impl="torch" (its default chunk: a 2^26-logit fp32 tile)
  recompute      megatron_burst.loss.recompute_linear_cross_entropy (backward recomputes the logits; impl auto)
  liger          Liger-Kernel's fused linear cross-entropy (CUDA, TP = 1, when importable)
  cce            Cut Cross-Entropy's linear_cross_entropy (CUDA, TP = 1, when importable)
A peer that cannot run here (no CUDA, not installed, TP > 1) is an explicit "skipped" line.

Measurements (each (configuration, variant) in fresh processes: ``--tp`` ranks, nccl on CUDA, gloo
on CPU). Time: median of ``--repeats`` forward + backward steps after one warm-up (self-checks,
Triton compiles and allocator growth stay out). Peak memory above the inputs: on CUDA
max_memory_allocated minus the allocated bytes once the inputs exist -- the same accounting for
every variant, gradients included; on CPU the peak RSS (VmHWM, reset once the inputs exist) minus
the RSS then. "saved": the bytes kept from forward to backward (saved_tensors_hooks) beyond hidden
and weight; "bwd peak": the peak of one more backward above the memory in use when it starts.
"largest / NxV": the largest tensor any op produced during one more step over N x V (>= 1.00: an
N x V tensor was allocated; a peer's own kernels allocate through torch, so they are seen too).
Errors (CUDA, TP = 1; on CPU with ``--errors``): relative Frobenius error ||x - ref|| / ||ref|| of the
objective, d hidden and d weight against an fp32 computation (fp32 GEMMs, TF32 off) of the same
objective on the same (rounded) inputs, done in token chunks on the device -- the reference is not
rounded to the input dtype, so a bf16 gradient shows at least its own rounding (~1e-3).
Configurations whose unfused path cannot fit in this machine's memory (CPU) are skipped and listed.

Tensor / sequence parallelism (``--tp 2 --sequence-parallel``): each rank holds V/tp vocabulary rows
and, with --sequence-parallel, N/tp tokens of the hidden states (labels: all N); memory figures
are the largest over the ranks, times rank 0's. On CPU, Megatron's unfused path cannot run under
sequence parallelism (its backward allocates on CUDA): use ``--variants fused recompute`` there, e.g.

    MALLOC_MMAP_THRESHOLD_=1048576 python -m megatron_burst.bench loss --tp 2 --sequence-parallel \\
        --variants fused recompute --tokens 4096 --vocab 32768 --hidden 1024 --repeats 1 --plot ''

(On CPU the peak is the RSS's: glibc keeps some freed blocks in its heap unless large blocks are
mmapped, which the fixed MALLOC_MMAP_THRESHOLD_ forces; then the RSS follows the live tensors.)
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_burst.bench import plotting
from megatron_burst.world import free_port, port_taken

VARIANTS = ("unfused", "unfused_torch", "fused", "fused_bwdw", "fused_bwdw_2read", "fused_recompute", "fused_torch",
            "recompute", "liger", "cce")
CPU_VARIANTS = ("unfused", "fused", "recompute", "liger", "cce")  # liger / cce: reported as skipped on CPU
# --quick's order: what the criteria read first (a GPU call may end before the last variant)
QUICK_VARIANTS = ("fused", "fused_bwdw", "cce", "unfused", "liger", "fused_recompute", "unfused_torch", "fused_torch")
# the ones that take a TP group
TP_VARIANTS = ("unfused", "fused", "fused_bwdw", "fused_bwdw_2read", "fused_recompute", "fused_torch", "recompute")
OURS_FUSED = ("fused", "fused_bwdw", "fused_bwdw_2read", "fused_recompute", "fused_torch")  # fused_linear_cross_entropy
LEAN = ("fused_bwdw", "fused_bwdw_2read")  # weight_grad="backward"
PEERS = {"liger": ("liger_kernel", "pip install liger-kernel"), "cce": ("cut_cross_entropy",
                                                                       "pip install cut-cross-entropy")}
DEFAULT_CONFIGS = [(4096, 32768, 1024), (4096, 131072, 1024), (16384, 32768, 1024)]  # (N, V, d)
QUICK_CONFIG = (16384, 131072, 4096)
FULL_GRID = dict(tokens=[4096, 16384], vocab=[32768, 131072], hidden=[1024, 4096])
DEFAULT_TILE_ELEMS = 1 << 26
# Megatron's unfused path holds about this many bytes per logit at its peak -- fp32: the logits,
# turned into softmax and gradient in place (4, measured 4.4 with temporaries); bf16: the bf16
# logits plus their fp32 copy, later the fp32 gradient plus its bf16 cast (6) -- with headroom.
# Used only to skip configurations that cannot fit.
UNFUSED_BYTES_PER_LOGIT = {"float32": 6, "bfloat16": 8}
IGNORE = -100


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


# Tuning knobs a variant may set, ``fused_bwdw:VOCAB_TILE=4096,PIECE_COST_BYTES=67108864`` (each variant
# runs in processes of its own): the module constants of the fast path's plan and kernels, so that one
# device call compares candidate settings on the same inputs (ints; 0 / 1 for the switches).
KNOBS = {name: "megatron_burst.loss.vocab_pass" for name in
         ("VOCAB_TILE", "TILE_BYTES", "MIN_TILE_ROWS", "TAIL_BYTES", "PIECE_COST_BYTES", "ROW_ALIGN", "G_IN_LOGITS",
          "SCRATCH_IN_RESULT", "GEMM_ROWS_FLOOR", "GEMM_FLOPS_PER_BYTE", "TRANSPOSED_TILES",
          "FUSED_TILE_GRAD")}
KNOBS.update(ONE_READ_FORWARD="megatron_burst.loss.fast", FUSED_EPILOGUE="megatron_burst.loss.fast",
             GPU_BLOCK_V="megatron_burst.loss.triton_kernels",
             GPU_NUM_WARPS="megatron_burst.loss.triton_kernels", FAST_CHUNK_BYTES="megatron_burst.loss.config")


def base_variant(variant: str) -> str:
    """``fused@2048`` -> ``fused`` (the fast path at a given token chunk); ``fused_bwdw:KNOB=V`` ->
    ``fused_bwdw``."""
    return variant.split(":")[0].split("@")[0]


def variant_knobs(variant: str) -> dict[str, int]:
    """The knob settings of ``BASE[@CHUNK][:KNOB=INT,...]`` (see KNOBS); raises naming a bad one."""
    if ":" not in variant:
        return {}
    base, _, spec = variant.partition(":")
    knobs = {}
    for item in spec.split(","):
        name, eq, value = item.partition("=")
        if name not in KNOBS or not eq or not value.lstrip("-").isdigit():
            raise ValueError(f"variant {variant!r}: {item!r} is not KNOB=INT with KNOB one of {sorted(KNOBS)}")
        knobs[name] = int(value)
    if base_variant(base) not in OURS_FUSED + ("recompute",):
        raise ValueError(f"variant {variant!r}: knobs tune our fused loss only (not {base_variant(base)!r})")
    return knobs


def apply_knobs(variant: str) -> None:
    """Set ``variant``'s knobs on their modules (in the variant's own process); a switch that was a
    bool stays a bool."""
    import importlib

    for name, value in variant_knobs(variant).items():
        module = importlib.import_module(KNOBS[name])
        old = getattr(module, name)
        setattr(module, name, bool(value) if isinstance(old, bool) else value)


def _variant_arg(text: str) -> str:
    """argparse type of --variants: a known variant, with an optional @CHUNK and :KNOBS."""
    if base_variant(text) not in VARIANTS:
        raise argparse.ArgumentTypeError(f"unknown variant {text!r} (choose from {', '.join(VARIANTS)}; "
                                         f"ours may add @CHUNK and :KNOB=INT,...)")
    try:
        variant_knobs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def skip_reason(variant: str, device: str, tp: int) -> str | None:
    """Why ``variant`` cannot run here (None: it can)."""
    base = base_variant(variant)
    if base in PEERS:
        module, fix = PEERS[base]
        if not device.startswith("cuda"):
            return f"needs CUDA (this run is on {device})"
        if tp > 1:
            return "takes no tensor-parallel group (TP = 1 only)"
        if importlib.util.find_spec(module) is None:
            return f"not installed ({fix})"
    if base == "fused_recompute" and not device.startswith("cuda"):
        return f"Triton kernels, needs CUDA (this run is on {device}; the tests run them under TRITON_INTERPRET=1)"
    if base == "unfused_torch" and tp > 1:
        return "plain torch, TP = 1 only"
    return None


def reference_errors(hidden, weight, labels, mask, n_tokens, loss, dh, dw, chunk=1024) -> dict:
    """Relative errors of (objective, d hidden, d weight) against an fp32 computation of
    sum(loss * mask) / n_tokens on the same inputs, in token chunks (TP = 1)."""
    h = hidden.detach().reshape(-1, hidden.shape[-1])
    w32 = weight.detach().float()
    N = h.shape[0]
    y, msk = labels.reshape(-1), mask.reshape(-1).float()
    dh_ref = torch.empty(N, h.shape[1], dtype=torch.float32, device=h.device)
    dw_ref = torch.zeros_like(w32)
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for a in range(0, N, chunk):
            r = slice(a, min(a + chunk, N))
            hc = h[r].float()
            z = hc @ w32.t()
            lse = torch.logsumexp(z, dim=1)
            zt = z.gather(1, y[r].clamp(min=0)[:, None])[:, 0]
            total += ((lse - zt) * msk[r]).sum().double()
            g = torch.softmax(z, dim=1)
            del z
            g[torch.arange(g.shape[0], device=g.device), y[r].clamp(min=0)] -= 1.0
            g *= (msk[r] / n_tokens)[:, None]
            dh_ref[r] = g @ w32
            dw_ref.addmm_(g.t(), hc)
            del g
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    def rel(got, ref):
        return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    obj = (total / n_tokens.double()).float()
    return {"loss": abs(loss - obj.item()) / abs(obj.item()), "dh": rel(dh.reshape(N, -1), dh_ref),
            "dw": rel(dw, dw_ref)}


def _worker(spec: dict) -> dict:
    """Run one variant on one configuration on this rank (a fresh process); returns time and memory."""
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    tp, rank = spec.get("tp", 1), spec.get("rank", 0)
    sp = spec.get("sequence_parallel", False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=tp)
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    from megatron_burst.loss import fused_linear_cross_entropy, recompute_linear_cross_entropy
    from megatron_burst.loss.choice import resolve_impl
    from megatron_burst.loss.config import make_loss_config

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    N, V, d = spec["tokens"], spec["vocab"], spec["hidden"]
    if V % tp or (sp and N % tp):
        raise SystemExit(f"V={V} (and N={N} under sequence parallelism) must be divisible by --tp {tp}")
    dtype = getattr(torch, spec["dtype"])
    variant, base = spec["variant"], base_variant(spec["variant"])

    # Each rank generates only its own pieces (a full [V, d] weight would raise the peak); on CUDA
    # with a device generator (seconds less per process than 0.5 G values drawn on the CPU).
    gen_device = device if device.type == "cuda" else torch.device("cpu")

    def randn(shape, seed, scale=1.0):
        g = torch.Generator(device=gen_device).manual_seed(seed)
        return (torch.randn(shape, generator=g, device=gen_device) * scale).to(device=device, dtype=dtype)

    n_local = N // tp if sp else N
    hidden = randn((n_local, 1, d), 1 + rank).requires_grad_()
    # logits of std logit_std (hidden ~ N(0, 1)): Cut Cross-Entropy skips gradient blocks whose softmax
    # values are all below its filter, so its time (and error) depends on this scale
    weight = randn((V // tp, d), 1001 + rank, spec.get("logit_std", 1.0) * d ** -0.5).requires_grad_()
    g = torch.Generator(device="cpu").manual_seed(2001)
    labels = torch.randint(0, V, (N, 1), generator=g).to(device)  # all N tokens, the same on every rank
    mask = (torch.rand(N, 1, generator=torch.Generator().manual_seed(2002)) > 0.1).float().to(device)
    labels_ign = torch.where(mask > 0, labels, IGNORE)  # the same objective for "mean over kept tokens" APIs
    n_tokens = mask.sum()
    chunk = spec.get("token_chunk")
    layer = None
    if base == "unfused":
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                                  perform_initialization=False, params_dtype=dtype)
        layer = ColumnParallelLinear(d, V, config=cfg, init_method=lambda w: None, bias=False, gather_output=False,
                                     skip_weight_param_allocation=True)
    elif base == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    elif base == "cce":
        from cut_cross_entropy import linear_cross_entropy
    impl = {"fused_torch": "torch", "fused_recompute": "triton_recompute"}.get(base, "auto")
    info = {}
    if base == "fused_bwdw_2read":  # (each variant runs in processes of its own)
        from megatron_burst.loss import fast
        fast.ONE_READ_FORWARD = False
    apply_knobs(variant)
    if base in OURS_FUSED + ("recompute",):
        lc = make_loss_config(hidden, weight, labels, mask, group, IGNORE, sp, chunk, None,
                              resolve_impl(impl, hidden, fused_linear_cross_entropy))
        info = {"impl": lc.impl, "chunk": lc.token_chunk}
        if lc.impl == "triton" and dtype != torch.float32:
            from megatron_burst.loss.fast import weight_grad_mode

            info["impl"] = f"triton, d weight {weight_grad_mode(device)}"

    def forward() -> torch.Tensor:
        if base == "unfused":
            logits, _ = layer(hidden, weight=weight)
            loss = vocab_parallel_cross_entropy(logits, labels)
        elif base == "unfused_torch":
            logits = hidden.view(N, d) @ weight.t()
            return torch.nn.functional.cross_entropy(logits.float(), labels_ign.view(N), ignore_index=IGNORE)
        elif base in OURS_FUSED:
            loss = fused_linear_cross_entropy(hidden, weight, labels, tp_group=group, loss_mask=mask,
                                              sequence_parallel=sp, token_chunk=chunk, impl=impl,
                                              weight_grad="backward" if base in LEAN else "forward")
        elif base == "recompute":
            loss = recompute_linear_cross_entropy(hidden, weight, labels, tp_group=group, sequence_parallel=sp,
                                                  token_chunk=chunk)
        elif base == "liger":
            return liger_fused_linear_cross_entropy(hidden.view(N, d), weight, labels_ign.view(N), ignore_index=IGNORE,
                                                    reduction="mean")
        else:
            return linear_cross_entropy(hidden.view(N, d), weight, labels_ign.view(N), ignore_index=IGNORE,
                                        reduction="mean")
        return (loss * mask).sum() / n_tokens

    def step() -> torch.Tensor:
        hidden.grad, weight.grad = None, None
        objective = forward()
        objective.backward()
        return objective.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        base_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()
        base_bytes = _rss_bytes()
    step()  # warm-up
    times = []
    for _ in range(spec["repeats"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()) - base_bytes
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
    result = {"time_s": statistics.median(times), "peak_bytes": peak, "largest_numel": probe.numel,
              "saved_bytes": sum(saved.values()), "backward_peak_bytes": backward_peak, **info}
    if tp == 1 and (device.type == "cuda" or spec.get("errors")):
        objective = step()
        dh, dw = hidden.grad, weight.grad
        hidden.grad, weight.grad = None, None
        result["errors"] = reference_errors(hidden, weight, labels, mask, n_tokens, objective.item(), dh, dw)
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def _run(spec: dict, timeout: float, attempts: int = 3) -> dict:
    """Run ``spec`` on spec["tp"] fresh rank processes; time of rank 0, memory: the largest rank's.

    The rendezvous port is free when picked but may be taken before rank 0 listens on it (other
    jobs on the machine): then the run is repeated on a new port, up to ``attempts`` times.
    """
    for _ in range(attempts):
        res = _run_once(dict(spec, port=free_port()), timeout)
        if not port_taken(res.get("error", "")):
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


def _variant_list(args, device: str) -> list[str]:
    if args.variants:
        variants = list(args.variants)
    elif args.quick:
        variants = list(QUICK_VARIANTS)
    else:
        variants = list(VARIANTS if device.startswith("cuda") else CPU_VARIANTS)
    return variants + [f"fused@{t}" for t in args.fast_chunks or ()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench loss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="only N=16384, V=131072, d=4096, bf16 (+ TP=2 with two GPUs): for a short "
                        "GPU session")
    p.add_argument("--full", action="store_true", help="the issue's grid (needs a large machine or a GPU)")
    p.add_argument("--tokens", type=int, nargs="+", help="N values (with --vocab and --hidden: their product)")
    p.add_argument("--vocab", type=int, nargs="+", help="V values")
    p.add_argument("--hidden", type=int, nargs="+", help="d values")
    p.add_argument("--tile-elems", type=int, default=None,
                   help="fp32 logits per chunk for our variants (default: each op's own default chunk)")
    p.add_argument("--fast-chunks", type=int, nargs="+", help="also run our default impl at these token chunks")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default float32 (--quick: bfloat16)")
    p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    p.add_argument("--variants", nargs="+", type=_variant_arg,
                   help="default: all that can run here; ours may add @CHUNK (token chunk) and :KNOB=INT,... "
                        f"(module constants of the fast path, one process each: {', '.join(sorted(KNOBS))})")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per variant, median taken (default 3, --quick too)")
    p.add_argument("--logit-std", type=float, default=1.0,
                   help="the logits' standard deviation (the weight's scale; hidden states are N(0, 1)); "
                        "a trained model's are larger. Cut Cross-Entropy's gradient filter makes its time "
                        "depend on it")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes) per run; V is split")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="hidden states sequence-sharded over the TP ranks (Megatron's --sequence-parallel)")
    p.add_argument("--errors", action="store_true", help="errors against fp32 on CPU too (always on CUDA at TP=1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per (configuration, variant)")
    p.add_argument("--plot", default="docs/loss.png", help="peak memory and time per configuration; '' to skip")
    p.add_argument("--out", default=None, help="also append one JSON line per (configuration, variant) to this file")
    p.add_argument("--replot", metavar="FILE.jsonl",
                   help="no measurement: redraw --plot (and print the table) from the JSON lines of an earlier --out, "
                        "e.g. a GPU session's bench_loss.jsonl (--variants: just those)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.replot:
        replot(args.replot, args.plot, args.variants)
        return
    if args.tp < 1 or (args.sequence_parallel and args.tp == 1):
        p.error("--tp must be >= 1, and --sequence-parallel needs --tp > 1")
    if args.quick and not args.device.startswith("cuda") and not args.variants:
        p.error("--quick measures N=16384, V=131072, d=4096 in bf16: hours of GEMMs on a CPU. Run it on a GPU, "
                "or pass --variants to run (or list as skipped) some variants anyway")
    dtype = args.dtype or ("bfloat16" if args.quick else "float32")
    if args.quick:
        configs = [QUICK_CONFIG]
        tps = [args.tp] + ([2] if args.tp == 1 and args.device.startswith("cuda")
                           and torch.cuda.device_count() >= 2 else [])
    elif args.tokens or args.vocab or args.hidden or args.full:
        grid = FULL_GRID
        configs = list(itertools.product(args.tokens or grid["tokens"], args.vocab or grid["vocab"],
                                         args.hidden or grid["hidden"]))
        tps = [args.tp]
    else:
        configs, tps = DEFAULT_CONFIGS, [args.tp]
    variants = _variant_list(args, args.device)
    avail = _available_bytes() if args.device == "cpu" else None
    if args.out:  # this run's lines only (each is appended as it is taken)
        open(args.out, "w").close()
    print(f"# LM head + cross-entropy, {dtype}, {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, "
          f"{'SP, ' if args.sequence_parallel else ''}median of {args.repeats or 3} fwd+bwd; objective sum(loss * mask) / "
          f"sum(mask); peak = memory above the inputs (gradients included), saved = kept for backward beyond the "
          f"inputs, largest rank; errors: relative Frobenius against fp32")
    print("| N | V | d | TP | variant | impl | chunk | ms | x unfused | peak MiB | saved MiB | bwd peak MiB "
          "| largest / NxV | loss err | dh err | dW err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    skipped, errors, rows = [], [], []
    for (N, V, d), tp in itertools.product(configs, tps):
        need = N * V * UNFUSED_BYTES_PER_LOGIT[dtype] // tp + 2 * (N + V) * d * 4
        if "unfused" in variants and avail is not None and need > 0.8 * avail:
            skipped.append(f"N={N} V={V} d={d}: the unfused path needs ~{_gib(need)} GiB, "
                           f"{_gib(avail)} GiB available")
            continue
        res = {}
        for variant in variants:
            why = skip_reason(variant, args.device, tp)
            if why is None and tp > 1 and base_variant(variant) not in TP_VARIANTS:
                why = "TP = 1 only"
            if why is not None:
                skipped.append(f"{variant} at N={N} V={V} d={d} TP={tp}: {why}")
                if args.out:
                    _append_line(args.out, dict(tokens=N, vocab=V, hidden=d, tp=tp, variant=variant, dtype=dtype,
                                                device=args.device, torch=torch.__version__, skipped=why))
                continue
            chunk = None
            if "@" in variant:
                chunk = int(variant.split(":")[0].split("@")[1])
            elif args.tile_elems and base_variant(variant) in ("fused", "fused_torch", "recompute"):
                chunk = max(1, args.tile_elems // (V // tp))
            spec = dict(variant=variant, tokens=N, vocab=V, hidden=d, dtype=dtype, device=args.device,
                        repeats=args.repeats or 3, threads=args.threads, token_chunk=chunk, tp=tp,
                        logit_std=args.logit_std,
                        sequence_parallel=args.sequence_parallel, errors=args.errors)
            res[variant] = _run(spec, args.timeout)
            if args.out:  # as it is taken: a run cut short keeps what finished
                _append_line(args.out, dict(tokens=N, vocab=V, hidden=d, tp=tp, variant=variant, dtype=dtype,
                                            device=args.device, torch=torch.__version__, logit_std=args.logit_std,
                                            **res[variant]))
            if "error" in res[variant]:
                errors.append(f"{variant} at N={N} V={V} d={d} TP={tp}: {res[variant]['error']}")
                continue
            print(_row(N, V, d, tp, variant, res), flush=True)
        rows.append(((N, V, d, tp), res))
    for line in skipped:
        print(f"- skipped {line}")
    for e in errors:
        print(f"- error {e}")
    if args.plot and rows:
        _plot(rows, variants, args.plot, f"{dtype}, {args.device}")


def _append_line(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _row(N: int, V: int, d: int, tp: int, variant: str, res: dict) -> str:
    r = res[variant]
    base = res.get("unfused") or res.get("unfused_torch") or {}
    ratio = f"{r['time_s'] / base['time_s']:.2f}" if "time_s" in base else "-"
    err = r.get("errors", {})

    def e(q):
        return f"{err[q]:.1e}" if q in err else "-"

    return (f"| {N} | {V} | {d} | {tp} | {variant} | {r.get('impl', '-')} | {r.get('chunk', '-')} | "
            f"{r['time_s'] * 1e3:.1f} | {ratio} | {r['peak_bytes'] / 2 ** 20:.0f} | {r['saved_bytes'] / 2 ** 20:.0f} | "
            f"{r['backward_peak_bytes'] / 2 ** 20:.0f} | {r['largest_numel'] / (N * V):.2f} | {e('loss')} | "
            f"{e('dh')} | {e('dw')} |")


def replot(jsonl: str, plot: str, only: Optional[list] = None) -> list:
    """The table and plot of an earlier run's JSON lines (``--out``): one group per (N, V, d, TP),
    variants in their order there (``only``: just these), skipped and failed ones left out. Returns
    the rows plotted."""
    rows: dict = {}
    variants, where = [], set()
    with open(jsonl) as f:
        for line in f:
            r = json.loads(line)
            if "time_s" not in r or (only and r["variant"] not in only):
                continue
            key = (r["tokens"], r["vocab"], r["hidden"], r["tp"])
            rows.setdefault(key, {})[r["variant"]] = r
            if r["variant"] not in variants:
                variants.append(r["variant"])
            where.add(f"{r.get('dtype')}, {r.get('device_name', r.get('device'))}, torch {r.get('torch')}")
    table = list(rows.items())
    for (N, V, d, tp), res in table:
        for v in res:
            print(_row(N, V, d, tp, v, res))
    if plot and table:
        _plot(table, variants, plot, "; ".join(sorted(where)))
    return table


def _plot(rows: list, variants: list, path: str, where: str) -> None:
    """Two panels, one group of bars per configuration: peak memory above the inputs, and time."""
    plt = plotting.pyplot()
    if plt is None:
        return
    shown = [v for v in variants if any("time_s" in res.get(v, {}) for _, res in rows)]
    if not shown:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(shown)
    labels = [f"N={N // 1024}K\nV={V // 1024}K\nd={d}" + (f"\nTP={tp}" if tp > 1 else "") for (N, V, d, tp), _ in rows]
    for ax, key, scale, ylabel in ((axes[0], "peak_bytes", 2 ** -30, "peak memory above inputs, GiB"),
                                   (axes[1], "time_s", 1e3, "fwd + bwd, ms (median)")):
        for i, variant in enumerate(shown):
            vals = [res.get(variant, {}).get(key, float("nan")) * scale for _, res in rows]
            ax.bar([x + (i - (len(shown) - 1) / 2) * width for x in range(len(rows))], vals, width, label=variant)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"LM head + cross-entropy: ours vs unfused vs peers ({where})", fontsize=9)
    plotting.save(fig, path)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


if __name__ == "__main__":
    main(sys.argv[1:])
