"""GPU benchmark of the engine against torch's fused attention and peer libraries (one GPU).

    python -m megatron_burst.bench gpu [--sections dense rank_block documents sparse multi_rank]
                                       [--out FILE.jsonl] [--plot FILE.png] [--smoke]

Every measurement is one JSON line, printed and flushed as it is taken (and appended to ``--out``);
a markdown table of all of them follows at the end. A line carries the device name, torch / triton /
CUDA versions, dtype, shapes, the kernel decisions made so far in the process
(``megatron_burst.kernels.choice.report()``), the median milliseconds, TFLOP/s and peak memory, or
``"error"`` (the exception text; the run goes on with the next measurement) or ``"skipped"`` (why
a baseline cannot run here: not installed, needs CUDA, too large). Nothing is silently omitted.

Timing: CUDA events around the forward and the backward of each iteration (wall clock on CPU);
``--warmup`` iterations first (kernel self-checks, Triton compiles, plan building and allocator
growth stay out of the numbers), then the median of ``--repeats`` (fewer when one iteration is so
slow that the repeats would pass ``--max-seconds``). ``ms`` is forward + backward unless the line
says otherwise; ``fwd_ms`` is the forward part of the same iterations. Peak memory is
``torch.cuda.max_memory_allocated`` over the measurement (``peak_mib``) and its excess over what was
allocated before it (``peak_extra_mib``: inputs excluded).

FLOPs (the FlashAttention convention): a forward over P visible (query, key) pairs costs
``4 * b * hq * d * P`` (two matmuls of 2 flops per multiply-add); the backward 2.5x that; ``tflops``
is (3.5 x forward FLOPs) / (fwd + bwd time). Plain causal attention counts P = s^2 / 2, i.e.
forward FLOPs = 2 * 2 * b * hq * s^2 * d / 2; full attention P = sq * sk; documents
P = sum(len_i^2 / 2); a causal sliding window of w keys P = sum_i min(i, w) + 1; sparse patterns
and one rank's CP blocks the exact visible pairs of their masks.

Sections (``--sections``):

* ``dense``: fwd+bwd causal at ``--seqs`` (8K ... 128K), GQA ``--heads``/``--kv-heads`` (32/8),
  d=128, bf16: cp_attention at W=1 (burst, contiguous) vs SDPA's flash and cuDNN backends (inputs
  Megatron's sbhd as [b, h, s, d] views, the way the engine gets them), flash-attn and
  TransformerEngine when importable. ``ratio`` = engine / best SDPA backend.
* ``rank_block``: one CP rank's local work at W=8 (``--rank-world``) without communication
  (zigzag, striped stripe 1, striped stripe 64): the forward and backward kernels of every block pair
  rank r computes (CPConfig.blocks, kernels.block_forward / block_backward with the call's
  KernelChoice, the fp32 merge), vs one non-causal SDPA call over the same FLOPs (q of the local
  length, keys = visible pairs / local length). ``ratio`` = engine block work / best one call.
* ``documents``: 1, 8, 64 documents per ``--doc-seqs`` sequence (equal lengths, and a lognormal
  mix) at W=1: cp_attention(cu_seqlens=...) vs torch's varlen flash
  (torch.nn.attention.varlen.varlen_attn), flex_attention with a document mask (compiled on CUDA)
  and dense SDPA with a boolean mask (only up to ``--mask-max-seq``); sliding windows ``--windows``
  vs varlen flash with window_size, flex_attention with a sliding-window mask, flash-attn when
  importable, and the causal dense SDPA time as an upper bound. ``ratio`` = engine / best baseline.
* ``sparse``: ``--sparse-seq`` (64K) tokens, static vertical-slash patterns (~95 % of causal pairs
  masked: sinks, ``--verticals`` lines, a ``--band`` and ``--pools`` pools of 64 offsets, run as
  dense blocks and again as sparse tiles; and with ``--slashes`` isolated offsets) and the dynamic pattern (estimated per call; inputs built with local and sink structure
  so that it is sparse), W=1, sparse_cp_attention vs dense causal cp_attention and SDPA cuDNN;
  ``speedup`` = dense time / sparse time.
* ``multi_rank``: W = 2 and 4 ranks on the one GPU (launch.run_on_one_gpu, the host-staged
  transport over gloo): per-step time (the slowest rank's median) and the relative difference of
  the gathered output and gradients from the W=1 engine (and from the fp32 reference at small
  sizes). Staged timings are NOT NCCL timings: every transfer goes through host memory.

``--smoke`` runs every section at tiny sizes (256 tokens, 4/2 heads, d=32; fp32 on CPU, bf16 on a
GPU) so the whole script runs end-to-end on a CPU in well under a minute; multi_rank then runs the
same rank bodies over CPU gloo ranks with the host-staged transport staging CPU tensors.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from megatron_burst.bench import apply_defaults

SECTIONS = ("dense", "rank_block", "documents", "sparse", "multi_rank")
NAMES = ("out", "dq", "dk", "dv")


# ------------------------------------------------------------------------------------------ environment
def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception as e:  # noqa: BLE001  (not installed, or broken: say which)
        return f"unavailable ({type(e).__name__})"


def environment(device: torch.device) -> dict:
    """What every line carries about the machine."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        name, cap = f"cpu ({platform.machine()}, {os.cpu_count()} cores)", None
    return {"device": name, "capability": cap, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _triton_version()}


def kernel_report() -> list[str]:
    from megatron_burst.kernels import choice
    return choice.report()


class Recorder:
    """Prints each measurement as one JSON line (flushed), appends it to ``path``, keeps it for the table."""

    def __init__(self, path: Optional[str], env: dict):
        self.env = env
        self.lines: list[dict] = []
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "w")

    def emit(self, section: str, name: str, variant: str, **fields: Any) -> dict:
        line = {"section": section, "name": name, "variant": variant, **self.env, "kernels": kernel_report(), **fields}
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()
        self.lines.append(line)
        return line

    def skip(self, section: str, name: str, variant: str, reason: str, **fields: Any) -> dict:
        return self.emit(section, name, variant, skipped=reason, **fields)

    def error(self, section: str, name: str, variant: str, exc: BaseException, **fields: Any) -> dict:
        tb = traceback.format_exc()
        return self.emit(section, name, variant, error=f"{type(exc).__name__}: {exc}"[:2000], traceback=tb[-3000:],
                         **fields)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# ------------------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_between_barriers(step: Callable[[], None], sync: Callable[[], None], cuda: bool) -> float:
    """Milliseconds of ``step()`` on this rank of a multi-rank body, started together with the other
    ranks (``sync``: a barrier) and timed to the end of its device work; ends at the next barrier."""
    if cuda:
        torch.cuda.synchronize()
    sync()
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) * 1e3


def time_fwd_bwd(fwd: Callable[[], Any], bwd: Callable[[Any], None], device: torch.device, warmup: int,
                 repeats: int, max_seconds: float, zero: Optional[Callable[[], None]] = None) -> dict:
    """Median fwd+bwd (and fwd) milliseconds of ``bwd(fwd())``; CUDA events on a GPU.

    ``zero`` runs before every iteration, outside the timed region (gradients reset). The first
    ``warmup`` iterations are not counted; the repeats are cut so they take about ``max_seconds``.
    """
    timing = time_interleaved({"": (fwd, bwd, zero)}, device, warmup, repeats, max_seconds)[""]
    if isinstance(timing, Exception):
        raise timing
    return timing


def time_interleaved(cases: dict[str, tuple[Callable[[], Any], Callable[[Any], None], Optional[Callable[[], None]]]],
                     device: torch.device, warmup: int, repeats: int, max_seconds: float) -> dict[str, dict]:
    """:func:`time_fwd_bwd` of several ``name -> (fwd, bwd, zero)`` cases compared with each other.
    With more than one case, every case first runs once untimed (first-use compiles, autotuning and
    self-checks, which may share work between the cases, land on none of them); then each case's
    warm-up runs on its own (its peak memory measured there), and the timed repeats go round-robin
    (a, b, a, b, ...), so that clock drift and other work on the device fall on every case alike.
    The repeats are cut so all cases together take about ``max_seconds``. A case that raises before
    its repeats maps to that exception (the others are still timed)."""
    cuda = device.type == "cuda"

    def once(fwd, bwd, zero) -> tuple[float, float]:
        if zero is not None:
            zero()
        if cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            state = fwd()
            e1.record()
            bwd(state)
            e2.record()
            del state
            e2.synchronize()
            return e0.elapsed_time(e1), e0.elapsed_time(e2)
        t0 = time.perf_counter()
        state = fwd()
        t1 = time.perf_counter()
        bwd(state)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    out: dict[str, Any] = {}
    if len(cases) > 1:
        for name, case in cases.items():
            try:
                once(*case)
            except Exception as e:  # noqa: BLE001  this case's result is its exception
                out[name] = e
    live, round_ms = [], 0.0
    for name, case in cases.items():
        if name in out:
            continue
        try:
            _sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if cuda else 0
            last = None
            for _ in range(max(warmup, 1)):
                last = once(*case)
        except Exception as e:  # noqa: BLE001  this case's result is its exception
            out[name] = e
            continue
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
            out[name] = {"peak_mib": peak / 2**20, "peak_extra_mib": (peak - base) / 2**20}
        else:
            out[name] = {"peak_mib": None, "peak_extra_mib": None}
        live.append(name)
        round_ms += last[1]
    n = max(1, min(repeats, int(max_seconds * 1e3 / max(round_ms, 1e-3))))
    samples: dict[str, list] = {name: [] for name in live}
    for _ in range(n):
        for name in live:
            samples[name].append(once(*cases[name]))
    for name in live:
        fwd_ms, tot_ms = [f for f, _ in samples[name]], [t for _, t in samples[name]]
        out[name] = {"ms": statistics.median(tot_ms), "fwd_ms": statistics.median(fwd_ms),
                     "bwd_ms": statistics.median(t - f for f, t in zip(fwd_ms, tot_ms)), "repeats": n,
                     "spread_ms": [min(tot_ms), max(tot_ms)], **out[name]}
    return out


def tflops(fwd_flops: float, timing: dict) -> dict:
    """TFLOP/s of fwd+bwd (3.5 x forward FLOPs) and of the forward alone."""
    return {"fwd_flops": fwd_flops, "tflops": 3.5 * fwd_flops / (timing["ms"] * 1e-3) / 1e12,
            "fwd_tflops": fwd_flops / (timing["fwd_ms"] * 1e-3) / 1e12 if timing["fwd_ms"] > 0 else None}


def attn_fwd_flops(b: int, hq: int, d: int, pairs: float) -> float:
    return 4.0 * b * hq * d * pairs


class Bench:
    """Shared state of one run: arguments, device, the recorder."""

    def __init__(self, args, rec: Recorder, device: torch.device, dtype: torch.dtype):
        self.args, self.rec, self.device, self.dtype = args, rec, device, dtype

    def measure(self, section: str, name: str, variant: str, fwd: Callable[[], Any], bwd: Callable[[Any], None],
                zero: Optional[Callable[[], None]], pairs: float, shape: dict, b: Optional[int] = None,
                hq: Optional[int] = None, d: Optional[int] = None, **fields: Any) -> Optional[dict]:
        """Time ``bwd(fwd())`` (``zero()`` before each iteration, untimed) over ``pairs`` visible
        (query, key) pairs per head; emit its line (or its error line). Returns the line, None on error."""
        a = self.args
        b, hq, d = b or shape.get("b", a.batch), hq or shape.get("hq", a.heads), d or shape.get("d", a.head_dim)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                timing = time_fwd_bwd(fwd, bwd, self.device, a.warmup, a.repeats, a.max_seconds, zero)
            seen = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught
                           if not issubclass(w.category, (DeprecationWarning, FutureWarning))})
            line = self.rec.emit(section, name, variant, dtype=str(self.dtype).replace("torch.", ""), shape=shape,
                                 **timing, **tflops(attn_fwd_flops(b, hq, d, pairs), timing), pairs=pairs,
                                 warnings=seen, **fields)
            return line
        except Exception as e:  # noqa: BLE001  recorded, and the run goes on
            self.rec.error(section, name, variant, e, dtype=str(self.dtype).replace("torch.", ""), shape=shape, **fields)
            return None
        finally:
            free_memory(self.device)


# ------------------------------------------------------------------------------------------ inputs & baselines
def sbhd_inputs(s: int, b: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """q, k, v [s, b, h, d] leaves requiring grad, and dout (Megatron's layout), random normal."""
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: torch.randn(s, b, h, d, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def bhsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [b, h, s, d] view (no copy)."""
    return t.permute(1, 2, 0, 3)


def autograd_pair(fn: Callable, q, k, v, dout, out_to_sbhd: Callable = lambda o: o):
    """(fwd, bwd, zero) closures timing ``fn(q, k, v)`` and its backward with ``dout`` (sbhd)."""
    def fwd():
        return fn(q, k, v)

    def bwd(out):
        out_to_sbhd(out).backward(dout)

    def zero():
        q.grad = k.grad = v.grad = None
    return fwd, bwd, zero


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_fn(backend: Optional[str], causal: bool = True, mask: Optional[torch.Tensor] = None, gqa: str = "native"):
    """SDPA on sbhd tensors (viewed [b, h, s, d]) restricted to ``backend``; returns sbhd output.
    ``gqa``: "native" (enable_gqa) or "expanded" (k, v repeated to the query heads, inside the call)."""
    from torch.nn.attention import sdpa_kernel

    def f(q, k, v):
        qb, kb, vb = bhsd(q), bhsd(k), bhsd(v)
        kw = {}
        if kb.shape[1] != qb.shape[1]:
            if gqa == "native":
                kw["enable_gqa"] = True
            else:
                r = qb.shape[1] // kb.shape[1]
                kb, vb = kb.repeat_interleave(r, 1), vb.repeat_interleave(r, 1)
        ctx = sdpa_kernel(sdpa_backend(backend)) if backend is not None else contextlib.nullcontext()
        with ctx:
            if mask is not None:
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, **kw)
            else:
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, **kw)
        return o.permute(2, 0, 1, 3)
    return f


def sdpa_probe(backend: Optional[str], q, k, v, causal=True, mask=None) -> tuple[Optional[Callable], str, Optional[str]]:
    """An SDPA callable that runs here: native GQA first, expanded k/v if the backend refuses GQA.
    Returns (fn, gqa mode, None) or (None, "", reason)."""
    reasons = []
    for gqa in ("native", "expanded"):
        fn = sdpa_fn(backend, causal, mask, gqa)
        try:
            with torch.no_grad():
                fn(q[:256].detach(), k[:256].detach(), v[:256].detach()) if mask is None else fn(q.detach(), k.detach(), v.detach())
            return fn, gqa, None
        except Exception as e:  # noqa: BLE001
            reasons.append(f"{gqa} GQA: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400])
            if bhsd(k).shape[1] == bhsd(q).shape[1]:
                break
    return None, "", "; ".join(reasons)


def peer_flash_attn():
    try:
        from flash_attn import flash_attn_func
        return flash_attn_func, None
    except Exception as e:  # noqa: BLE001
        return None, f"flash-attn not importable ({type(e).__name__}: {str(e)[:200]})"


def peer_transformer_engine():
    try:
        import transformer_engine.pytorch as te
        return te, None
    except Exception as e:  # noqa: BLE001
        return None, f"TransformerEngine not importable ({type(e).__name__}: {str(e)[:200]})"


def _need_cuda(device: torch.device, what: str) -> Optional[str]:
    return None if device.type == "cuda" else f"{what} needs a CUDA device (this run is on {device.type})"


def best(lines: list[Optional[dict]]) -> Optional[dict]:
    ok = [l for l in lines if l is not None and "ms" in l]
    return min(ok, key=lambda l: l["ms"]) if ok else None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ dense
def section_dense(B: Bench) -> None:
    import megatron_burst as mb

    a, dev, dt, S = B.args, B.device, B.dtype, "dense"
    fa, fa_why = peer_flash_attn()
    te, te_why = peer_transformer_engine()
    for s in a.seqs:
        name = f"causal_s{s}"
        shape = {"s": s, "b": a.batch, "hq": a.heads, "hkv": a.kv_heads, "d": a.head_dim, "format": "sbhd"}
        pairs = s * s / 2
        try:
            q, k, v, dout = sbhd_inputs(s, a.batch, a.heads, a.kv_heads, a.head_dim, dt, dev)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory at the largest size)
            B.rec.error(S, name, "inputs", e, shape=shape)
            free_memory(dev)
            continue
        baselines = []
        outs = {}
        for backend in ("flash", "cudnn"):
            variant = f"sdpa_{backend}"
            why = _need_cuda(dev, f"SDPA's {backend} backend") if backend == "cudnn" else None
            if why:
                B.rec.skip(S, name, variant, why, shape=shape)
                continue
            fn, gqa, why = sdpa_probe(backend, q, k, v)
            if fn is None:
                B.rec.skip(S, name, variant, f"SDPA {backend} backend refuses this call: {why}", shape=shape)
                continue
            baselines.append(B.measure(S, name, variant, *autograd_pair(fn, q, k, v, dout), pairs, shape, gqa=gqa))
            if baselines[-1] is not None:
                with torch.no_grad():
                    outs[variant] = fn(q, k, v).detach()
        # peer libraries
        why = fa_why or _need_cuda(dev, "flash-attn")
        if why:
            B.rec.skip(S, name, "flash_attn", why, shape=shape)
        else:
            f = lambda q_, k_, v_: fa(q_.transpose(0, 1), k_.transpose(0, 1), v_.transpose(0, 1),  # noqa: E731
                                      causal=True).transpose(0, 1)
            B.measure(S, name, "flash_attn", *autograd_pair(f, q, k, v, dout), pairs, shape)
        why = te_why or _need_cuda(dev, "TransformerEngine")
        if why:
            B.rec.skip(S, name, "transformer_engine", why, shape=shape)
        else:
            try:
                layer = te.DotProductAttention(a.heads, a.head_dim, num_gqa_groups=a.kv_heads, attention_dropout=0.0,
                                               qkv_format="sbhd", attn_mask_type="causal")
                f = lambda q_, k_, v_: layer(q_, k_, v_)  # noqa: E731  -> [s, b, h*d]
                B.measure(S, name, "transformer_engine", *autograd_pair(
                    f, q, k, v, dout, lambda o: o.view(s, a.batch, a.heads, a.head_dim)), pairs, shape)
            except Exception as e:  # noqa: BLE001
                B.rec.error(S, name, "transformer_engine", e, shape=shape)
        ref = best(baselines)
        eng = lambda q_, k_, v_: mb.cp_attention(q_, k_, v_, algo="burst", layout="contiguous")  # noqa: E731
        extra = {}
        if ref is not None:
            extra["ratio_to"] = ref["variant"]
            try:
                with torch.no_grad():
                    extra["out_rel_diff_vs_" + ref["variant"]] = rel(eng(q, k, v), outs[ref["variant"]])
            except Exception as e:  # noqa: BLE001
                extra["out_rel_diff_error"] = f"{type(e).__name__}: {e}"[:500]
        line = B.measure(S, name, "engine_w1_burst", *autograd_pair(eng, q, k, v, dout), pairs, shape, **extra)
        if line is not None and ref is not None:
            B.rec.emit(S, name, "ratio", engine_ms=line["ms"], baseline=ref["variant"], baseline_ms=ref["ms"],
                       ratio=line["ms"] / ref["ms"], shape=shape, note="engine W=1 fwd+bwd / best SDPA backend")
        del q, k, v, dout, outs
        free_memory(dev)


# ------------------------------------------------------------------------------------------ rank_block
def mask_pairs(m) -> int:
    """Visible (query, key) pairs of one BlockMask rectangle."""
    R, C = m.q_stop - m.q_start, m.kv_stop - m.kv_start
    if m.kind == "full":
        return R * C
    if m.kind == "causal":
        return R * (R + 1) // 2 if R <= C else C * (C + 1) // 2 + (R - C) * C
    if m.kind == "block_causal":
        total, blk = 0, m.block
        for rb in range(-(-R // blk)):
            total += min(blk, R - rb * blk) * min((rb + 1) * blk, C)
        return total
    if m.kind == "positions":
        from megatron_burst.masks.block import positions_visibility
        return int(positions_visibility(*m.mask_data, R, C).sum())
    raise ValueError(f"mask_pairs: {m.kind!r}")


def rank_block_work(layout: str, stripe: int, W: int, n: int, scale: float):
    """(per-rank visible pairs, cfg) of one causal CP call's blocks at W ranks of n local tokens."""
    from megatron_burst.algorithms.schedule import CPConfig
    from megatron_burst.topology import CPTopology

    cfg = CPConfig(CPTopology(None, 0, W, W, None), "flat", layout, stripe, True, scale, None)
    work = [sum(mask_pairs(m) for o in range(W) for _, m in cfg.blocks(r, o, n)) for r in range(W)]
    return work, cfg


def section_rank_block(B: Bench) -> None:
    from megatron_burst.algorithms.prepare import choose_kernels
    from megatron_burst.kernels import block_backward, block_forward, empty_accumulator, merge_into, row_dot

    a, dev, dt, S = B.args, B.device, B.dtype, "rank_block"
    W, s = a.rank_world, a.rank_seq
    n = s // W
    hq, hkv, d, b = a.heads, a.kv_heads, a.head_dim, a.batch
    scale = d ** -0.5
    for layout, stripe in (("zigzag", 1), ("striped", 1), ("striped", 64)):
        label = f"{layout}{'' if layout == 'zigzag' else f'_stripe{stripe}'}"
        name = f"W{W}_s{s}_{label}"
        try:
            from megatron_burst.masks.layout import check_seq_len
            check_seq_len(s, W, layout, stripe)
            work, cfg = rank_block_work(layout, stripe, W, n, scale)
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, name, "plan", e)
            continue
        r = a.rank if a.rank is not None else max(range(W), key=lambda i: work[i])
        pairs = work[r]
        shape = {"W": W, "rank": r, "s": s, "local": n, "b": b, "hq": hq, "hkv": hkv, "d": d,
                 "layout": layout, "stripe": stripe, "work_per_rank": work}
        try:
            g = torch.Generator(device=dev).manual_seed(1)
            mk = lambda h: torch.randn(b, h, n, d, generator=g, device=dev).to(dt)  # noqa: E731
            q, dout = mk(hq), mk(hq)
            choose_kernels(cfg, q, d, None, None)  # as cp_attention resolves them (one process: no agreement)
            choice = cfg.kernel
            kvs = [(mk(hkv), mk(hkv)) for _ in range(W)]
            blocks = [cfg.blocks(r, o, n) for o in range(W)]
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, name, "engine_blocks", e, shape=shape)
            continue

        def fwd():
            acc, lse = empty_accumulator(q, d)
            for o in range(W):
                for bs, m in blocks[o]:
                    ob, lb = block_forward(q[bs], kvs[o][0][bs], kvs[o][1][bs], m, scale, choice)
                    merge_into(acc[bs, :, m.q_slice], lse[bs, :, m.q_slice], ob, lb)
            return acc.to(dt), lse

        def bwd(state):
            out, lse = state
            D = row_dot(dout, out)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
            for o in range(W):
                dkv = torch.zeros((2,) + tuple(kvs[o][0].shape), dtype=torch.float32, device=dev)
                for bs, m in blocks[o]:
                    gq, gk, gv = block_backward(dout[bs], q[bs], kvs[o][0][bs], kvs[o][1][bs], D[bs], lse[bs], m, scale,
                                                choice, out[bs])
                    dq[bs, :, m.q_slice] += gq
                    m.add_kv_grad(dkv[0][bs], gk)
                    m.add_kv_grad(dkv[1][bs], gv)

        n_blocks = sum(len(x) for x in blocks)
        eng = B.measure(S, name, "engine_blocks", fwd, bwd, None, pairs, shape, blocks=n_blocks,
                        kinds=sorted({m.kind for x in blocks for _, m in x}), choice=choice.describe())
        # one SDPA call over the same visible pairs: q of n rows, L = pairs / n keys, no mask
        L = max(64, int(round(pairs / n / 64)) * 64)
        one_shape = {"sq": n, "sk": L, "b": b, "hq": hq, "hkv": hkv, "d": d, "mask": "none"}
        one = []
        for backend in ("flash", "cudnn"):
            variant = f"one_call_sdpa_{backend}"
            why = _need_cuda(dev, f"SDPA's {backend} backend") if backend == "cudnn" else None
            if why:
                B.rec.skip(S, name, variant, why, shape=one_shape)
                continue
            try:
                g2 = torch.Generator(device=dev).manual_seed(2)
                mk2 = lambda h, m_: torch.randn(m_, b, h, d, generator=g2, device=dev).to(dt).requires_grad_()  # noqa: E731
                q1, k1, v1 = mk2(hq, n), mk2(hkv, L), mk2(hkv, L)
                do1 = torch.randn(n, b, hq, d, generator=g2, device=dev).to(dt)
                fn, gqa, why = sdpa_probe(backend, q1, k1, v1, causal=False)
            except Exception as e:  # noqa: BLE001
                B.rec.error(S, name, variant, e, shape=one_shape)
                continue
            if fn is None:
                B.rec.skip(S, name, variant, f"SDPA {backend} backend refuses this call: {why}", shape=one_shape)
                continue
            one.append(B.measure(S, name, variant, *autograd_pair(fn, q1, k1, v1, do1), n * L, one_shape, gqa=gqa))
            del q1, k1, v1, do1
        ref = best(one)
        if eng is not None and ref is not None:
            B.rec.emit(S, name, "ratio", engine_ms=eng["ms"], baseline=ref["variant"], baseline_ms=ref["ms"],
                       ratio=eng["ms"] / ref["ms"], shape=shape,
                       note="engine block work (no communication) / one SDPA call of the same FLOPs")
        del q, dout, kvs
        free_memory(dev)


# ------------------------------------------------------------------------------------------ documents
def doc_lengths(s: int, count: int, mix: str, seed: int = 0) -> list[int]:
    """``count`` document lengths summing to s: equal (the remainder spread over the first ones), or
    lognormal (sigma 1) rounded, each >= 1."""
    if mix == "equal":
        base, extra = divmod(s, count)
        return [base + (1 if i < extra else 0) for i in range(count)]
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(count, generator=g, dtype=torch.float64))
    lens = (w / w.sum() * (s - count)).floor().long() + 1
    lens[int(torch.argmax(lens))] += s - int(lens.sum())
    return [int(x) for x in lens]


def cu_from_lengths(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


_FLEX: dict = {}  # tensors the flex mask_mods read (swapped per configuration: no recompiles for same shapes)


def _flex_doc_causal(b, h, q_idx, kv_idx):
    doc = _FLEX["doc"]
    return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)


def _flex_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= _FLEX["w"])


def flex_runner(device: torch.device):
    """(flex_attention callable, create_block_mask, compiled?) or raises ImportError."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if device.type == "cuda":
        if "compiled" not in _FLEX:
            _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
        return _FLEX["compiled"], create_block_mask, True
    return flex_attention, create_block_mask, False


def varlen_runner():
    """(varlen_attn, its parameter names) or raises ImportError."""
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def varlen_fn(varlen_attn, params: set, cu: torch.Tensor, max_len: int, window: Optional[int], hq: int):
    """varlen flash on sbhd tensors with b = 1 ([s, 1, h, d] -> [s, h, d] views), causal (and a
    left window). Argument names follow this torch's signature."""
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (window if window is not None else -1, 0)
    elif window is not None:
        raise TypeError("this torch's varlen_attn has no window_size argument")
    else:
        kw["is_causal"] = True
    native_gqa = "enable_gqa" in params

    def f(q, k, v):
        qt, kt, vt = q[:, 0], k[:, 0], v[:, 0]
        if kt.shape[1] != hq:
            if native_gqa:
                kw["enable_gqa"] = True
            else:
                kt, vt = kt.repeat_interleave(hq // kt.shape[1], 1), vt.repeat_interleave(hq // vt.shape[1], 1)
        o = varlen_attn(qt, kt, vt, cu, cu, max_len, max_len, **kw)
        return o.unsqueeze(1)
    return f, ("native" if native_gqa else "expanded")


def section_documents(B: Bench) -> None:
    import megatron_burst as mb
    from megatron_burst.masks.documents import dense_document_mask

    a, dev, dt, S = B.args, B.device, B.dtype, "documents"
    b, hq, hkv, d = 1, a.heads, a.kv_heads, a.head_dim
    try:
        varlen_attn, vparams = varlen_runner()
        v_why = _need_cuda(dev, "varlen flash attention (torch.nn.attention.varlen)")
    except Exception as e:  # noqa: BLE001
        varlen_attn, vparams, v_why = None, set(), f"torch.nn.attention.varlen not available ({type(e).__name__}: {e})"
    if a.no_flex:
        flex, f_why = None, "flex_attention disabled (--no-flex)"
    elif dev.type != "cuda":  # torch: "FlexAttention does not support backward on CPU"
        flex, f_why = None, f"flex_attention's backward needs a CUDA device (this run is on {dev.type})"
    else:
        try:
            flex = flex_runner(dev)
            f_why = None
        except Exception as e:  # noqa: BLE001
            flex, f_why = None, f"flex_attention not available ({type(e).__name__}: {e})"
    fa, fa_why = peer_flash_attn()

    def run_flex(name, shape, mask_mod, pairs, q, k, v, dout):
        if flex is None:
            B.rec.skip(S, name, "flex_attention", f_why, shape=shape)
            return None
        fx, create, compiled = flex
        s = q.shape[0]
        try:
            bm = create(mask_mod, None, None, s, s, device=str(dev), _compile=compiled)
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, name, "flex_attention", e, shape=shape)
            return None
        f = lambda q_, k_, v_: fx(bhsd(q_), bhsd(k_), bhsd(v_), block_mask=bm,  # noqa: E731
                                  enable_gqa=hq != hkv).permute(2, 0, 1, 3)
        return B.measure(S, name, "flex_attention", *autograd_pair(f, q, k, v, dout), pairs, shape, compiled=compiled)

    def run_varlen(name, shape, cu_list, window, pairs, q, k, v, dout):
        if v_why:
            B.rec.skip(S, name, "varlen_flash", v_why, shape=shape)
            return None
        try:
            cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
            f, gqa = varlen_fn(varlen_attn, vparams, cu, max(x - y for x, y in zip(cu_list[1:], cu_list)), window, hq)
        except Exception as e:  # noqa: BLE001
            B.rec.skip(S, name, "varlen_flash", f"{type(e).__name__}: {e}", shape=shape)
            return None
        return B.measure(S, name, "varlen_flash", *autograd_pair(f, q, k, v, dout), pairs, shape, gqa=gqa)

    def report_ratio(name, shape, eng, baselines, note=""):
        ref = best(baselines)
        if eng is not None and ref is not None:
            B.rec.emit(S, name, "ratio", engine_ms=eng["ms"], baseline=ref["variant"], baseline_ms=ref["ms"],
                       ratio=eng["ms"] / ref["ms"], shape=shape, note=note,
                       **{f"ratio_vs_{l['variant']}": eng["ms"] / l["ms"] for l in baselines if l is not None})

    for s in a.doc_seqs:
        try:
            q, k, v, dout = sbhd_inputs(s, b, hq, hkv, d, dt, dev)
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, f"docs_s{s}", "inputs", e)
            continue
        for count in a.doc_counts:
            for mix in (("equal",) if count == 1 else ("equal", "lognormal")):
                if count > s:
                    continue
                lens = doc_lengths(s, count, mix, seed=count)
                cu = cu_from_lengths(lens)
                name = f"docs{count}_{mix}_s{s}"
                shape = {"s": s, "b": b, "hq": hq, "hkv": hkv, "d": d, "docs": count, "mix": mix,
                         "min_len": min(lens), "max_len": max(lens)}
                pairs = sum(x * x / 2 for x in lens)
                baselines = [run_varlen(name, shape, cu, None, pairs, q, k, v, dout)]
                try:
                    pos = torch.arange(s, device=dev)
                    _FLEX["doc"] = torch.searchsorted(torch.tensor(cu, device=dev), pos, right=True) - 1
                except Exception as e:  # noqa: BLE001
                    B.rec.error(S, name, "flex_attention", e, shape=shape)
                else:
                    baselines.append(run_flex(name, shape, _flex_doc_causal, pairs, q, k, v, dout))
                if s <= a.mask_max_seq:
                    try:
                        mask = dense_document_mask(cu, s, causal=True).to(dev)
                        fn, gqa, why = sdpa_probe(None, q, k, v, mask=mask)
                        if fn is None:
                            B.rec.skip(S, name, "sdpa_bool_mask", why, shape=shape)
                        else:
                            baselines.append(B.measure(S, name, "sdpa_bool_mask", *autograd_pair(fn, q, k, v, dout),
                                                       pairs, shape, gqa=gqa))
                        del mask
                    except Exception as e:  # noqa: BLE001
                        B.rec.error(S, name, "sdpa_bool_mask", e, shape=shape)
                else:
                    B.rec.skip(S, name, "sdpa_bool_mask", f"dense boolean-mask SDPA only up to --mask-max-seq "
                               f"{a.mask_max_seq} tokens (an [s, s] mask here)", shape=shape)
                cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
                eng = B.measure(S, name, "engine_w1_burst", *autograd_pair(
                    lambda q_, k_, v_: mb.cp_attention(q_, k_, v_, algo="burst", layout="contiguous", cu_seqlens=cu_t),
                    q, k, v, dout), pairs, shape)
                report_ratio(name, shape, eng, baselines)
        del q, k, v, dout
        free_memory(dev)

    # sliding windows
    s = a.window_seq
    try:
        q, k, v, dout = sbhd_inputs(s, b, hq, hkv, d, dt, dev)
    except Exception as e:  # noqa: BLE001
        B.rec.error(S, f"window_s{s}", "inputs", e)
        return
    causal_shape = {"s": s, "b": b, "hq": hq, "hkv": hkv, "d": d, "mask": "causal"}
    dense = []
    for backend in ("flash", "cudnn"):
        variant = f"causal_dense_sdpa_{backend}"
        why = _need_cuda(dev, f"SDPA's {backend} backend") if backend == "cudnn" else None
        fn, gqa, why = (None, "", why) if why else sdpa_probe(backend, q, k, v)
        if fn is None:
            B.rec.skip(S, f"window_s{s}", variant, why, shape=causal_shape)
            continue
        dense.append(B.measure(S, f"window_s{s}", variant, *autograd_pair(fn, q, k, v, dout), s * s / 2,
                               causal_shape, gqa=gqa, note="upper bound: no window"))
    for w in a.windows:
        name = f"window{w}_s{s}"
        shape = {"s": s, "b": b, "hq": hq, "hkv": hkv, "d": d, "window": [w, 0]}
        pairs = s * (s + 1) // 2 if s <= w + 1 else (w + 1) * (w + 2) // 2 + (s - w - 1) * (w + 1)
        baselines = [run_varlen(name, shape, [0, s], w, pairs, q, k, v, dout)]
        try:
            _FLEX["w"] = torch.tensor(w, device=dev)
            baselines.append(run_flex(name, shape, _flex_window, pairs, q, k, v, dout))
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, name, "flex_attention", e, shape=shape)
        why = fa_why or _need_cuda(dev, "flash-attn")
        if why:
            B.rec.skip(S, name, "flash_attn", why, shape=shape)
        else:
            f = lambda q_, k_, v_: fa(q_.transpose(0, 1), k_.transpose(0, 1), v_.transpose(0, 1), causal=True,  # noqa: E731
                                      window_size=(w, 0)).transpose(0, 1)
            baselines.append(B.measure(S, name, "flash_attn", *autograd_pair(f, q, k, v, dout), pairs, shape))
        eng = B.measure(S, name, "engine_w1_burst", *autograd_pair(
            lambda q_, k_, v_: mb.cp_attention(q_, k_, v_, algo="burst", layout="contiguous", window=(w, 0)),
            q, k, v, dout), pairs, shape)
        report_ratio(name, shape, eng, baselines)
        ref = best(dense)
        if eng is not None and ref is not None:
            B.rec.emit(S, name, "ratio_vs_causal_dense", engine_ms=eng["ms"], baseline=ref["variant"],
                       baseline_ms=ref["ms"], ratio=eng["ms"] / ref["ms"], shape=shape,
                       note="windowed engine / dense causal SDPA (an upper bound any window kernel should beat)")
    del q, k, v, dout
    free_memory(dev)


# ------------------------------------------------------------------------------------------ sparse
def structured_qkv(s: int, b: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device,
                   seed: int = 0, corr: float = 256.0, sinks: int = 16):
    """q, k, v (sbhd leaves) and dout whose attention has MTraining's shape: each key is a slowly
    varying random trajectory (correlation exp(-|i-j| / corr)) shared by its query (a local band:
    slash lines near offset 0), and ``sinks`` keys at spread positions share a direction every
    query carries (vertical lines). The dynamic pattern estimated from them is sparse."""
    g = torch.Generator(device=device).manual_seed(seed)
    taps = int(4 * corr) | 1
    kernel = torch.exp(-torch.arange(taps, device=device, dtype=torch.float32) / corr)
    kernel = (kernel / kernel.norm()).view(1, 1, -1)
    noise = torch.randn(hkv * d * b, 1, s + taps - 1, generator=g, device=device)
    x = F.conv1d(noise, kernel).view(b, hkv, d, s).permute(3, 0, 1, 2)  # [s, b, hkv, d], unit variance
    c = torch.randn(d, generator=g, device=device)
    c = c / c.norm() * math.sqrt(d)
    alpha = math.sqrt(2.0)
    k = alpha * x
    sink_pos = torch.linspace(0, s - 1, sinks, device=device).long()
    k[sink_pos] += 2.0 * c
    r = hq // hkv
    q = alpha * x.repeat_interleave(r, 2) + 0.3 * torch.randn(s, b, hq, d, generator=g, device=device) + c
    v = torch.randn(s, b, hkv, d, generator=g, device=device)
    dout = torch.randn(s, b, hq, d, generator=g, device=device)
    return (q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_(), v.to(dtype).requires_grad_(),
            dout.to(dtype))


def pattern_pairs(pattern, s: int) -> tuple[int, float]:
    """(visible pairs over all heads, sparsity of causal pairs) of a VerticalSlash, counted per line."""
    from megatron_burst.masks.imbalance import pair_work
    pos = torch.arange(s, device=pattern.device)
    pairs = pair_work(pattern, s, pos, pos)
    heads = pattern.vertical.shape[0]
    return pairs, 1 - pairs / (heads * s * (s + 1) / 2)


def section_sparse(B: Bench) -> None:
    import megatron_burst as mb
    from megatron_burst.bench.sparse import make_pattern
    from megatron_burst.masks.dynamic import Dynamic, estimate
    from megatron_burst.masks.vertical_slash import VerticalSlash

    a, dev, dt, S = B.args, B.device, B.dtype, "sparse"
    s, b, hq, hkv, d = a.sparse_seq, 1, a.heads, a.kv_heads, a.head_dim
    base_shape = {"s": s, "b": b, "hq": hq, "hkv": hkv, "d": d}
    try:
        q, k, v, dout = structured_qkv(s, b, hq, hkv, d, dt, dev)
    except Exception as e:  # noqa: BLE001
        B.rec.error(S, f"s{s}", "inputs", e, shape=base_shape)
        return
    dense_lines = []
    name = f"s{s}"
    dense_lines.append(B.measure(S, name, "dense_engine_w1_burst", *autograd_pair(
        lambda q_, k_, v_: mb.cp_attention(q_, k_, v_, algo="burst", layout="contiguous"), q, k, v, dout),
        s * s / 2, {**base_shape, "mask": "causal"}))
    why = _need_cuda(dev, "SDPA's cudnn backend")
    fn, gqa, why = (None, "", why) if why else sdpa_probe("cudnn", q, k, v)
    if fn is None:
        B.rec.skip(S, name, "dense_sdpa_cudnn", why, shape=base_shape)
    else:
        dense_lines.append(B.measure(S, name, "dense_sdpa_cudnn", *autograd_pair(fn, q, k, v, dout), s * s / 2,
                                     {**base_shape, "mask": "causal"}, gqa=gqa))

    def speedups(line):
        if line is None:
            return
        for ref in dense_lines:
            if ref is not None:
                B.rec.emit(S, line["name"], f"speedup_vs_{ref['variant']}", sparse_ms=line["ms"],
                           baseline=ref["variant"], baseline_ms=ref["ms"], speedup=ref["ms"] / line["ms"],
                           sparsity=line.get("sparsity"), shape=line["shape"])

    # static: 4 sinks + verticals anywhere, a band of slash offsets, and either pools of 64 offsets
    # (MTraining's selection: the engine runs the band, the pools and the vertical keys as dense
    # positions blocks; again with that split off, the sparse tiles) or isolated random offsets
    from megatron_burst.masks import vertical_slash

    statics = [("sparse_static", dict(pools=a.pools), None), ("sparse_static_tiles", dict(pools=a.pools), False)]
    if a.slashes:
        statics.append(("sparse_static_isolated", dict(slashes=a.slashes), None))
    for variant, lines, runs_apart in statics:
        try:
            pat = make_pattern(s, hq, a.verticals, a.band, lines.get("slashes", 0), pools=lines.get("pools", 0))
            pat = VerticalSlash(pat.vertical.to(dev), pat.slash.to(dev))
            one = VerticalSlash(pat.vertical[:1], pat.slash[:1])
            pairs, sparsity = pattern_pairs(one, s)  # every head has the same lines: pairs per head
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, f"static_s{s}", variant, e, shape=base_shape)
            continue
        shape = {**base_shape, "verticals": a.verticals + 4, "band": a.band, **lines,
                 "dense_runs": vertical_slash.runs_apart_for(dev) if runs_apart is None else runs_apart}
        saved = vertical_slash._RUNS_OVERRIDE
        vertical_slash._RUNS_OVERRIDE = runs_apart if runs_apart is not None else saved
        try:
            line = B.measure(S, f"static_s{s}", variant, *autograd_pair(
                lambda q_, k_, v_: mb.sparse_cp_attention(q_, k_, v_, pat, algo="burst"), q, k, v, dout),
                pairs, shape, sparsity=sparsity)
        finally:
            vertical_slash._RUNS_OVERRIDE = saved
        speedups(line)
    # dynamic: estimated from this call's q and k (every call: its cost is part of the time), with the
    # top slash offsets (Algorithm 1) and with whole top pools (runs: dense blocks on CUDA)
    for variant, lines in (("sparse_dynamic", "offsets"), ("sparse_dynamic_pools", "pools")):
        budgets = Dynamic(p_v=a.p_v, p_s=a.p_s, slash_lines=lines)
        try:
            with torch.no_grad():
                est = estimate(bhsd(q), bhsd(k), budgets, layout="striped", stripe=64)
            pairs_all, sparsity = pattern_pairs(est, s)
            shape = {**base_shape, "p_v": a.p_v, "p_s": a.p_s, "slash_lines": lines,
                     "max_verticals": int(est.vertical.shape[1]), "max_slashes": int(est.slash.shape[1]),
                     "layout": "striped", "stripe": 64}
            del est
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, f"dynamic_s{s}", variant, e, shape=base_shape)
            continue
        if 1 - sparsity > a.dynamic_max_density:
            B.rec.skip(S, f"dynamic_s{s}", variant, f"the estimated dynamic pattern keeps {1 - sparsity:.1%} "
                       f"of causal pairs (> --dynamic-max-density {a.dynamic_max_density})", shape=shape,
                       sparsity=sparsity)
            continue
        line = B.measure(S, f"dynamic_s{s}", variant, *autograd_pair(
            lambda q_, k_, v_: mb.sparse_cp_attention(q_, k_, v_, budgets, algo="burst"), q, k, v, dout),
            pairs_all / hq, shape, sparsity=sparsity)
        speedups(line)
    del q, k, v, dout
    free_memory(dev)


# ------------------------------------------------------------------------------------------ multi_rank
def tensors_to_bytes(tensors: list[torch.Tensor]) -> bytes:
    """Tensors as plain bytes (torch.save). run_local's torch.multiprocessing queue would send CPU
    tensors as shared-memory handles that die with the rank process, which exits right after
    putting its result (the parent then cannot rebuild them, and run_local keeps polling)."""
    import io
    buf = io.BytesIO()
    torch.save([t.detach().cpu().clone() for t in tensors], buf)
    return buf.getvalue()


def tensors_from_bytes(data: bytes) -> list[torch.Tensor]:
    import io
    return torch.load(io.BytesIO(data), weights_only=True)


def multi_rank_body(cfg: dict) -> dict:
    """One rank (of W on one GPU, or CPU gloo ranks in the smoke run): cp_attention on this rank's
    zigzag shard of the full inputs (built from a seed on every rank), timed between barriers;
    returns the medians and the last iteration's output and gradients (CPU) for the sanity check."""
    import torch.distributed as dist

    import megatron_burst as mb
    from megatron_burst.bench.launch import in_step

    W, r = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if cfg["cuda"] else torch.device("cpu")
    dt = getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(cfg["seed"])
    s, b, hq, hkv, d = cfg["s"], cfg["b"], cfg["hq"], cfg["hkv"], cfg["d"]
    full = [torch.randn(s, b, h, d, generator=g).to(dt) for h in (hq, hkv, hkv, hq)]
    sh = lambda t: mb.shard(t, 0, r, W, "zigzag").to(dev)  # noqa: E731
    q, k, v, dout = (sh(t) for t in full)
    del full
    out = {"rank": r, "times": {}}

    def run(algo: str, sync) -> None:
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        samples, last = [], {}

        def step() -> None:
            last["o"] = o = mb.cp_attention(ql, kl, vl, algo=algo, layout="zigzag")
            o.backward(dout)

        for i in range(cfg["warmup"] + cfg["repeats"]):
            ql.grad = kl.grad = vl.grad = None
            ms = time_between_barriers(step, sync, cfg["cuda"])
            if i >= cfg["warmup"]:
                samples.append(ms)
        o = last["o"]
        out["times"][algo] = statistics.median(samples)
        if algo == cfg["algos"][0]:
            out["tensors"] = tensors_to_bytes([o, ql.grad, kl.grad, vl.grad])

    out["errors"] = in_step(list(cfg["algos"]), run)  # a failure on one rank never strands the others
    from megatron_burst.kernels import choice
    out["kernels"] = choice.report()
    return out


def chunked_reference(q, k, v, dout, causal: bool = True, heads_per_chunk: int = 0):
    """fp32 attention (sbhd in, sbhd out) with autograd, one kv head group at a time: out, dq, dk, dv."""
    s, b, hq, d = q.shape
    hkv = k.shape[2]
    r = hq // hkv
    scale = d ** -0.5
    outs = [torch.empty(t.shape, dtype=torch.float32, device=q.device) for t in (q, q, k, v)]
    pos = torch.arange(s, device=q.device)
    vis = (pos[None, :] <= pos[:, None]) if causal else None
    for g in range(hkv):
        qs = q[:, :, g * r:(g + 1) * r].detach().float().permute(1, 2, 0, 3).requires_grad_()
        ks = k[:, :, g:g + 1].detach().float().permute(1, 2, 0, 3).requires_grad_()
        vs = v[:, :, g:g + 1].detach().float().permute(1, 2, 0, 3).requires_grad_()
        sc = (qs @ ks.transpose(-1, -2)) * scale
        if vis is not None:
            sc = sc.masked_fill(~vis, float("-inf"))
        o = torch.softmax(sc, -1) @ vs
        gq, gk, gv = torch.autograd.grad(o, (qs, ks, vs), dout[:, :, g * r:(g + 1) * r].float().permute(1, 2, 0, 3))
        outs[0][:, :, g * r:(g + 1) * r] = o.detach().permute(2, 0, 1, 3)
        outs[1][:, :, g * r:(g + 1) * r] = gq.permute(2, 0, 1, 3)
        outs[2][:, :, g:g + 1] = gk.permute(2, 0, 1, 3)
        outs[3][:, :, g:g + 1] = gv.permute(2, 0, 1, 3)
        del sc, o
    return outs


def section_multi_rank(B: Bench) -> None:
    import megatron_burst as mb

    a, dev, dt, S = B.args, B.device, B.dtype, "multi_rank"
    s, b, hq, hkv, d = a.multi_seq, 1, a.heads, a.kv_heads, a.head_dim
    cuda = dev.type == "cuda"
    transport = "host_staged (CUDA tensors through pinned host memory over gloo)" if cuda else \
        "host_staged_cpu (CPU gloo ranks staging CPU tensors: the smoke path)"
    cfg = {"s": s, "b": b, "hq": hq, "hkv": hkv, "d": d, "dtype": str(dt).replace("torch.", ""), "seed": 7,
           "algos": list(a.multi_algos), "warmup": a.warmup, "repeats": a.repeats, "cuda": cuda}
    # the single-rank engine result on the full sequence (and the fp32 reference at small sizes)
    g = torch.Generator().manual_seed(cfg["seed"])
    full = [torch.randn(s, b, h, d, generator=g).to(dt).to(dev) for h in (hq, hkv, hkv, hq)]
    single = ref = None
    try:
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        o = mb.cp_attention(*leaves, algo=a.multi_algos[0], layout="zigzag")
        o.backward(full[3])
        single = [o.detach()] + [t.grad for t in leaves]
        del leaves, o
        if s <= a.ref_max_seq:
            ref = chunked_reference(*full)
    except Exception as e:  # noqa: BLE001
        B.rec.error(S, f"s{s}", "single_rank_reference", e)
    for W in a.multi_worlds:
        name = f"W{W}_s{s}"
        shape = {"W": W, "s": s, "b": b, "hq": hq, "hkv": hkv, "d": d, "layout": "zigzag"}
        try:
            from megatron_burst.masks.layout import check_seq_len
            check_seq_len(s, W, "zigzag")
            if cuda:
                from megatron_burst.launch import run_on_one_gpu
                results = run_on_one_gpu(multi_rank_body, W, cfg)
            else:
                from megatron_burst.bench.launch import run_local
                results = run_local(W, multi_rank_body, cfg, env={"MEGATRON_BURST_TRANSPORT": "host_staged_cpu"})
        except Exception as e:  # noqa: BLE001
            B.rec.error(S, name, "run", e, shape=shape, transport=transport)
            continue
        sanity = {}
        if "tensors" in results[0] and single is not None:
            shards = [tensors_from_bytes(res["tensors"]) for res in results]
            gathered = [mb.unshard([sh[i] for sh in shards], 0, "zigzag").to(dev) for i in range(4)]
            sanity["rel_diff_vs_w1_engine"] = {n: rel(x, y) for n, x, y in zip(NAMES, gathered, single)}
            if ref is not None:
                sanity["rel_err_vs_fp32_reference"] = {n: rel(x, y) for n, x, y in zip(NAMES, gathered, ref)}
                sanity["w1_rel_err_vs_fp32_reference"] = {n: rel(x, y) for n, x, y in zip(NAMES, single, ref)}
        for algo in a.multi_algos:
            errs = {res["rank"]: res["errors"][algo] for res in results if algo in res["errors"]}
            if errs:
                B.rec.emit(S, name, algo, error=next(iter(errs.values()))[:2000], shape=shape, transport=transport,
                           failed_ranks=sorted(errs))
                continue
            per_rank = [res["times"][algo] for res in results]
            ms = max(per_rank)
            B.rec.emit(S, name, algo, dtype=cfg["dtype"], shape=shape, ms=ms, per_rank_ms=per_rank,
                       tflops=3.5 * attn_fwd_flops(b, hq, d, s * s / 2) / (ms * 1e-3) / 1e12,
                       rank_kernels=results[0].get("kernels"), transport=transport,
                       note="per-step fwd+bwd time of the slowest rank; staged timings are not NCCL timings",
                       **(sanity if algo == a.multi_algos[0] else {}))
    del full, single, ref
    free_memory(dev)


# ------------------------------------------------------------------------------------------ report
def _fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def _shape_text(shape) -> str:
    if not isinstance(shape, dict):
        return "-"
    keys = ("s", "sq", "sk", "W", "rank", "local", "hq", "hkv", "d", "docs", "mix", "window", "layout", "stripe")
    return " ".join(f"{k}={shape[k]}" for k in keys if k in shape).replace(", ", ",") or "-"


def table(lines: list[dict]) -> str:
    rows = ["| section | name | variant | shape | ms | fwd ms | TFLOP/s | peak MiB | ratio / speedup | note |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for l in lines:
        note = ""
        if "skipped" in l:
            note = "skipped: " + l["skipped"]
        elif "error" in l:
            note = "ERROR: " + l["error"].splitlines()[0]
        elif l.get("sparsity") is not None:
            note = f"sparsity {l['sparsity']:.3f}"
        elif l.get("rel_diff_vs_w1_engine"):
            note = "rel diff vs W=1: " + " ".join(f"{k} {v:.1e}" for k, v in l["rel_diff_vs_w1_engine"].items())
        elif l.get("baseline"):
            note = f"vs {l['baseline']}"
        note = note.replace("|", "/")[:140]
        ratio = l.get("ratio", l.get("speedup"))
        rows.append(f"| {l['section']} | {l['name']} | {l['variant']} | {_shape_text(l.get('shape'))} | "
                    f"{_fmt(l.get('ms', l.get('engine_ms', l.get('sparse_ms'))))} | {_fmt(l.get('fwd_ms'))} | "
                    f"{_fmt(l.get('tflops'))} | {_fmt(l.get('peak_mib'), 5)} | {_fmt(ratio)} | {note} |")
    return "\n".join(rows)


def plot(lines: list[dict], path: str) -> None:
    from megatron_burst.bench import plotting

    plt = plotting.pyplot()
    if plt is None:
        return
    timed = [l for l in lines if isinstance(l.get("ms"), (int, float)) and "skipped" not in l and "error" not in l
             and l["variant"] not in ("ratio",)]
    sections = [s for s in SECTIONS if any(l["section"] == s for l in timed)]
    if not sections:
        print("plot skipped: no timed measurements")
        return
    fig, axes = plt.subplots(len(sections), 1, figsize=(9, 2.2 + 0.22 * len(timed)), squeeze=False)
    for ax, sec in zip(axes[:, 0], sections):
        mine = [l for l in timed if l["section"] == sec]
        labels = [f"{l['name']} / {l['variant']}" for l in mine]
        ax.barh(range(len(mine)), [l["ms"] for l in mine], color="#4c72b0")
        ax.set_yticks(range(len(mine)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("fwd+bwd ms (median)", fontsize=7)
        ax.set_title(sec, fontsize=8)
    plotting.save(fig, path)


# ------------------------------------------------------------------------------------------ main
SMOKE = dict(seqs=[256], heads=4, kv_heads=2, head_dim=32, rank_seq=1024, doc_seqs=[256], doc_counts=[1, 8, 64],
             mask_max_seq=256, windows=[16, 64], window_seq=256, sparse_seq=512, verticals=8, band=32, slashes=8, pools=2,
             multi_seq=256, repeats=2, warmup=1, max_seconds=2.0, dynamic_max_density=1.0, ref_max_seq=4096)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--smoke", action="store_true", help="tiny sizes of every section (CPU: fp32, < 60 s)")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    p.add_argument("--plot", default=None, help="bar chart PNG of every timing (needs matplotlib)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=10.0, help="cut repeats of one measurement to about this")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072], help="dense")
    p.add_argument("--rank-world", type=int, default=8, help="rank_block: the CP size emulated")
    p.add_argument("--rank-seq", type=int, default=65536, help="rank_block: global sequence length")
    p.add_argument("--rank", type=int, default=None, help="rank_block: the rank timed (default: the busiest)")
    p.add_argument("--doc-seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--doc-counts", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--mask-max-seq", type=int, default=8192, help="dense boolean-mask SDPA baseline up to this")
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--window-seq", type=int, default=32768)
    p.add_argument("--no-flex", action="store_true", help="skip the flex_attention baselines (torch.compile time)")
    p.add_argument("--sparse-seq", type=int, default=65536)
    p.add_argument("--verticals", type=int, default=1000, help="static pattern: random vertical lines (+4 sinks)")
    p.add_argument("--band", type=int, default=1024, help="static pattern: slash offsets 0 .. band-1")
    p.add_argument("--pools", type=int, default=4, help="static pattern: random pools of 64 slash offsets")
    p.add_argument("--slashes", type=int, default=228,
                   help="a second static pattern with this many isolated random slash offsets instead (0: none)")
    p.add_argument("--p-v", type=float, default=0.9, help="dynamic pattern: vertical top-p")
    p.add_argument("--p-s", type=float, default=0.9, help="dynamic pattern: slash top-p")
    p.add_argument("--dynamic-max-density", type=float, default=0.25,
                   help="skip the dynamic run (with its density) when the estimate keeps more of the causal pairs")
    p.add_argument("--multi-worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--multi-seq", type=int, default=16384)
    p.add_argument("--multi-algos", nargs="+", default=["burst", "ring"])
    p.add_argument("--ref-max-seq", type=int, default=8192, help="multi_rank: fp32 reference up to this length")
    args = p.parse_args(argv)
    if args.smoke:
        given = apply_defaults(args, argv, SMOKE)
    return args


def main(argv=None) -> None:
    args = parse(argv if argv is not None else sys.argv[1:])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is not None:  # torch 2.11's set_device refuses a device without an index
            torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    env = environment(device)
    rec = Recorder(args.out, env)
    B = Bench(args, rec, device, dtype)
    t0 = time.perf_counter()
    print(f"# bench gpu: {env['device']}, torch {env['torch']}, triton {env['triton']}, {dtype}, "
          f"sections {' '.join(args.sections)}{' (smoke sizes)' if args.smoke else ''}", flush=True)
    runners = {"dense": section_dense, "rank_block": section_rank_block, "documents": section_documents,
               "sparse": section_sparse, "multi_rank": section_multi_rank}
    for sec in args.sections:
        t = time.perf_counter()
        try:
            runners[sec](B)
        except Exception as e:  # noqa: BLE001  a section's own failure is recorded too
            rec.error(sec, "section", "-", e)
        rec.emit(sec, "section", "done", seconds=time.perf_counter() - t)
    rec.close()
    print(f"\n## bench gpu results ({env['device']}, torch {env['torch']}, triton {env['triton']}, "
          f"{str(dtype).replace('torch.', '')}; {time.perf_counter() - t0:.1f} s)\n")
    print(table([l for l in rec.lines if l["variant"] != "done"]))
    if args.plot:
        plot(rec.lines, args.plot)


if __name__ == "__main__":
    main()
