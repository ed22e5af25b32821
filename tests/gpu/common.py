"""Shared pieces of the GPU suite: inputs, masks, the fp32 reference, torch's own SDPA error as the bar.

The bar (bf16 on the GPU): for out, dq, dk and dv, the engine's relative Frobenius error against an
fp32 reference computed on the GPU from the same bf16 inputs is at most ``BOUND`` (1.5) x the error of
torch's bf16 ``scaled_dot_product_attention`` on those inputs (flash / cuDNN / whichever SDPA picks;
with a mask, SDPA with a boolean attn_mask on a fused backend), and never above ``SANITY``.

Dry run on CPU: ``MEGATRON_BURST_GPU_TESTS_ON_CPU=1 pytest tests/gpu`` runs every test's plumbing
(inputs, sharding, the W ranks, reassembly, references) at tiny sizes in fp32 on CPU gloo ranks with
the host-staged transport staging CPU tensors; errors are then held to an absolute fp32 bound and the
kernel-choice / self-check assertions (CUDA kernels) are skipped. It proves the suite runs, not the GPU.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from megatron_burst import env
from megatron_burst.bench.autotune_limit import limit_autotune

ON_CPU = env.gpu_tests_on_cpu()


# The suite checks numbers, not speed: Triton's autotuner tries at most two launch configs per kernel
# (fla's kernels time dozens each on first use: 240 s were not enough for one LASP-2 backward beside
# the rest of the suite, H100, 2026-11-27). Any config computes the same function. Here, so that the
# test process and every rank process (both import this module) are capped; GPU_TEST_FULL_AUTOTUNE=1
# keeps the full search.
if os.environ.get("GPU_TEST_FULL_AUTOTUNE") != "1":
    limit_autotune(2)

DEV = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
DTYPE = torch.float32 if ON_CPU else torch.bfloat16
NAMES = ("out", "dq", "dk", "dv")
BOUND = 1.5  # engine error <= BOUND x torch's bf16 SDPA error on the same inputs
ABS_FLOOR = 1e-6  # added to the bar (matters only if SDPA's error were ~0)
SANITY = 2e-2  # and never above this (bf16)
CPU_FP32_BOUND = 1e-5  # the dry run's absolute bound (fp32)

# which kernel the choice must pick per mask kind (bf16 / fp16 on CUDA)
EXPECTED_KERNELS = {"full": {"cudnn", "cuda_flash"}, "causal": {"cudnn", "cuda_flash"},
                    "block_causal": {"triton_masked"}, "positions": {"varlen_or_triton"},
                    "sparse": {"triton_block_sparse"}}


def L(n: int) -> int:
    """A length of the GPU suite, scaled down 16x for the CPU dry run."""
    return n if not ON_CPU else max(2, n // 16)


STRIPE_WIDE = 64 if not ON_CPU else 4  # the block-striped layout's stripe
WINDOW = L(193)  # a left window that aligns with nothing


# ------------------------------------------------------------------------------------------ inputs, masks
def inputs(seq: int, b: int, hq: int, hkv: int, d: int, dtype: torch.dtype = DTYPE, seed: int = 0):
    """q, k, v, dout [seq, b, h, d] (Megatron's sbhd) on the CPU, the same on every rank for a seed."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(seq, b, h, d, generator=g).to(dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def doc_bounds(seq: int) -> list[int]:
    """Document boundaries over ``seq`` tokens: odd lengths, two one-token documents."""
    cuts = {0, 1, seq // 5 + 3, seq // 2 - 1, seq // 2, (3 * seq) // 4 + 7, seq}
    return sorted(c for c in cuts if 0 <= c <= seq)


MASKS = ("causal", "full", "documents", "window", "documents_window")


def mask_kwargs(name: str, seq: int, device: torch.device) -> dict:
    """cp_attention keyword arguments of a named mask over a global sequence of ``seq`` tokens."""
    kw: dict = {"causal": name != "full"}
    if "documents" in name:
        kw["cu_seqlens"] = torch.tensor(doc_bounds(seq), dtype=torch.int32, device=device)
    if "window" in name:
        kw["window"] = (WINDOW, 0)
    return kw


def visibility(name: str, seq: int) -> Optional[torch.Tensor]:
    """Boolean [seq, seq] (True = visible) of a named mask; None for plain causal / full (SDPA's flags)."""
    if name in ("causal", "full"):
        return None
    pos = torch.arange(seq)
    vis = pos[None, :] <= pos[:, None]
    if "documents" in name:
        doc = torch.searchsorted(torch.tensor(doc_bounds(seq)), pos, right=True) - 1
        vis &= doc[:, None] == doc[None, :]
    if "window" in name:
        vis &= pos[:, None] - pos[None, :] <= WINDOW
    return vis


# ------------------------------------------------------------------------------------------ reference & bar
def reference(q, k, v, dout, causal: bool = True, mask: Optional[torch.Tensor] = None, scale: Optional[float] = None):
    """fp32 attention with autograd on q's device, one kv-head group at a time (sbhd in and out):
    out, dq, dk, dv. ``mask`` (True = visible): [sq, sk], [h, sq, sk] or [b, h, sq, sk]; None: causal
    (top-left: row i sees j <= i) or full. A row that sees nothing gets output 0 and no gradient."""
    sq, b, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[2]
    r = hq // hkv
    scale = scale if scale is not None else d ** -0.5
    dev = q.device
    if mask is None and causal:
        mask = torch.arange(sk, device=dev)[None, :] <= torch.arange(sq, device=dev)[:, None]
    if mask is not None:
        mask = mask.to(dev)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    res = [torch.empty(sq, b, hq, d, device=dev), torch.empty(sq, b, hq, d, device=dev),
           torch.empty(sk, b, hkv, d, device=dev), torch.empty(sk, b, hkv, d, device=dev)]
    to_bh = lambda t: t.detach().float().permute(1, 2, 0, 3)  # noqa: E731  [b, h, s, d]
    for g in range(hkv):
        hs = slice(g * r, (g + 1) * r)
        qg = to_bh(q[:, :, hs]).requires_grad_()
        kg = to_bh(k[:, :, g:g + 1]).requires_grad_()
        vg = to_bh(v[:, :, g:g + 1]).requires_grad_()
        sc = (qg @ kg.transpose(-1, -2)) * scale  # [b, r, sq, sk]
        if mask is not None:
            m = mask[:, hs] if mask.shape[1] > 1 else mask
            seen = m.any(-1, keepdim=True)
            p = torch.softmax(sc.masked_fill(~(m | ~seen), float("-inf")), -1) * seen
        else:
            p = torch.softmax(sc, -1)
        o = p @ vg
        gq, gk, gv = torch.autograd.grad(o, (qg, kg, vg), to_bh(dout[:, :, hs]))
        back = lambda t: t.detach().permute(2, 0, 1, 3)  # noqa: E731
        res[0][:, :, hs], res[1][:, :, hs] = back(o), back(gq)
        res[2][:, :, g:g + 1], res[3][:, :, g:g + 1] = back(gk), back(gv)
        del sc, p, o
    return res


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ||a - b|| / ||b|| (in fp32, on b's device)."""
    a, b = a.to(b.device).float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> dict:
    return {n: rel(g, r) for n, g, r in zip(NAMES, got, ref)}


def sdpa_errors(q, k, v, dout, causal: bool, mask: Optional[torch.Tensor], ref) -> dict:
    """Errors of torch's own SDPA in q's dtype (autograd; kv heads expanded) on the same inputs.
    Without a mask: is_causal, the backend SDPA picks. With one: a boolean attn_mask on the fused
    backends (flash / efficient / cuDNN), the math backend only if none takes it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().clone().to(DEV).requires_grad_() for t in (q, k, v)]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in leaves)
    r = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(r, 1), vb.repeat_interleave(r, 1)
    if mask is None:
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
    else:
        m = mask.to(DEV)
        if m.dim() == 3:
            m = m.unsqueeze(0)
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                              SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m)
        except RuntimeError:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m)
    o.permute(2, 0, 1, 3).backward(dout.to(DEV))
    return errors([o.permute(2, 0, 1, 3)] + [t.grad for t in leaves], ref)


def check(engine: dict, sdpa: dict, what: str) -> list[str]:
    """Failures (empty: passed) of the engine's errors against the bar."""
    fails = []
    for n in NAMES:
        if ON_CPU:
            if not engine[n] <= CPU_FP32_BOUND:
                fails.append(f"{what}: {n} error {engine[n]:.2e} > {CPU_FP32_BOUND:.0e} (fp32 dry run)")
            continue
        bar = BOUND * sdpa[n] + ABS_FLOOR
        if not (engine[n] <= bar and engine[n] <= SANITY):
            fails.append(f"{what}: {n} error {engine[n]:.3e} > {BOUND} x SDPA's {sdpa[n]:.3e} (or > {SANITY})")
    return fails


def kernel_failures(kernels: Sequence[tuple], what: str) -> list[str]:
    """Failures of a KernelChoice's (kind, forward, backward) rows against EXPECTED_KERNELS (CUDA only)."""
    if ON_CPU:
        return []
    fails = []
    for kind, fwd, bwd in kernels:
        want = EXPECTED_KERNELS.get(kind)
        if want is not None and (fwd not in want or bwd not in want):
            fails.append(f"{what}: {kind} blocks run {fwd}/{bwd}, expected one of {sorted(want)}")
    return fails


def slow_kernel_keys() -> list:
    """SlowKernelWarning keys this process has warned about (plain-torch kernels on CUDA)."""
    from megatron_burst.kernels import choice
    return sorted(str(k) for k in choice._WARNED if k[0] == "slow")


def static_pattern(seq: int, hq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(vertical [hq, nv], slash [hq, ns]) int64 on the CPU: per head 4 sinks + random verticals, slash
    offsets 0 .. band-1 (so every query sees itself) + random ones; different lines per head."""
    g = torch.Generator().manual_seed(seed)
    nv, band, ns = L(640), L(1024), L(320)
    vertical = torch.cat([torch.arange(4).expand(hq, 4), torch.randint(0, seq, (hq, nv), generator=g)], 1)
    slash = torch.cat([torch.arange(band).expand(hq, band), torch.randint(0, seq, (hq, ns), generator=g)], 1)
    return vertical.contiguous(), slash.contiguous()


def shared_runs_pattern(seq: int, hq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(vertical, slash) as :func:`static_pattern` but the same lines for every head, the slash
    offsets a band and two pools of 64 (MTraining's selection): on CUDA the engine runs it as dense
    positions blocks (megatron_burst.masks.vertical_slash.MAX_RUN_BLOCKS), not sparse tiles."""
    g = torch.Generator().manual_seed(seed)
    nv, band = L(640), L(512)
    vertical = torch.cat([torch.arange(4), torch.randint(0, seq, (nv,), generator=g)])
    starts = (band // 64 + 1 + torch.randperm(seq // 64 - band // 64 - 1, generator=g)[:2]) * 64
    slash = torch.cat([torch.arange(band), (starts[:, None] + torch.arange(64)).reshape(-1)])
    return vertical.expand(hq, -1).contiguous(), slash.expand(hq, -1).contiguous()


def pattern_visibility(vertical: torch.Tensor, slash: torch.Tensor, seq: int) -> torch.Tensor:
    """Boolean [h, seq, seq]: query i of head h sees key j <= i iff j is a vertical line of h or
    i - j a slash offset of h (computed here from the definition, not by the engine)."""
    h = vertical.shape[0]
    pos = torch.arange(seq)
    diff = pos[:, None] - pos[None, :]
    is_v = torch.zeros(h, seq, dtype=torch.bool)
    is_v.scatter_(1, vertical.long().cpu(), True)
    is_s = torch.zeros(h, seq, dtype=torch.bool)
    is_s.scatter_(1, slash.long().cpu(), True)
    vis = is_v[:, None, :] | is_s[:, diff.clamp_min(0)]
    return vis & (diff >= 0)


# ------------------------------------------------------------------------------------------ ranks
def _cpu_staged(fn, args, kwargs):
    """The dry run's stand-in for launch.call_on_one_gpu: CPU ranks staging through host buffers."""
    from megatron_burst import comm
    with comm.transport("host_staged", stage_cpu=True):
        return fn(*args, **kwargs)


def run_on_ranks(world_size: int, fn, *args, timeout: float = 240.0, **kwargs) -> list:
    """``fn(*args, **kwargs)`` on W processes sharing cuda:0 (harness.run_ranks_on_one_gpu), or on
    CPU gloo ranks with staged CPU tensors in the dry run. ``timeout`` per call (the first call of a
    pool includes CUDA start-up and Triton compiles): a hung rank fails the test instead of the lease."""
    from harness import run_ranks, run_ranks_on_one_gpu

    if ON_CPU:
        return run_ranks(world_size, _cpu_staged, fn, args, kwargs, timeout=timeout)
    return run_ranks_on_one_gpu(world_size, fn, *args, timeout=timeout, **kwargs)


def rank_failures(per_rank: Sequence[dict], what: str) -> list[str]:
    """The failures each rank reported: plain-torch kernels it ran ("slow") and the cases that raised
    ("errors": case -> traceback), labelled ``what``."""
    fails = []
    for rank, res in enumerate(per_rank):
        if res["slow"]:
            fails.append(f"rank {rank} ran plain-torch kernels: {res['slow']}")
        fails += [f"{what} {case} raised on rank {rank}:\n{tb}" for case, tb in res["errors"].items()]
    return fails


def rank_device() -> torch.device:
    """This rank's device inside a rank body (cuda:0 set current by call_on_one_gpu)."""
    return torch.device("cpu") if ON_CPU else torch.device("cuda", torch.cuda.current_device())


def cpu_tensors(tensors: Sequence[torch.Tensor]) -> list:
    """Rank results as CPU tensors (the harness pickles them whole, plain pickle)."""
    return [t.detach().cpu() for t in tensors]
