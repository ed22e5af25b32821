"""Rank-side bodies of the GPU suite, run on W processes sharing cuda:0 (harness.run_ranks_on_one_gpu).

Every rank builds the full inputs from a seed on the CPU (identical everywhere), takes its shard
with megatron_burst.shard, runs the engine on cuda:0 and returns its output and gradients as CPU
tensors; the test process reassembles them (megatron_burst.unshard) and compares against the
full-sequence fp32 reference. A case that raises is reported with its traceback (not the whole call),
and a SlowKernelWarning is an error here as in the test process.
"""
from __future__ import annotations

import traceback
import warnings

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.algorithms import prepare
from megatron_burst.kernels.choice import SlowKernelWarning
from megatron_burst.topology import build_usp_topology

from gpu.common import cpu_tensors, inputs, mask_kwargs, rank_device, slow_kernel_keys


def cp_cases(cases: list, seq: int, b: int, hq: int, hkv: int, d: int, seed: int = 0, ulysses_size: int = 2) -> dict:
    """cp_attention forward + backward of every (algo, layout, stripe, mask) case on this rank's shard.

    Returns {"results": {case: [out, dq, dk, dv] CPU}, "kernels": {case: KernelChoice rows},
    "errors": {case: traceback}, "slow": SlowKernelWarning keys}. usp runs over the 2-D groups of
    build_usp_topology(None, ulysses_size) (built once, collectively, before the cases).
    """
    W, r = dist.get_world_size(), dist.get_rank()
    dev = rank_device()
    full = inputs(seq, b, hq, hkv, d, seed=seed)
    usp = build_usp_topology(None, ulysses_size) if any(c[0] == "usp" for c in cases) else None
    out: dict = {"results": {}, "kernels": {}, "errors": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)
        for case in cases:
            algo, layout, stripe, mask = case
            try:
                kw = mask_kwargs(mask, seq, dev)
                if layout == "balanced":  # the placement comes from the documents (one document: [0, seq])
                    kw.setdefault("cu_seqlens", torch.tensor([0, seq], dtype=torch.int32, device=dev))
                place = {"cu_seqlens": kw["cu_seqlens"].tolist()} if layout == "balanced" else {}
                q, k, v, dout = (mb.shard(t, 0, r, W, layout, stripe, **place).to(dev) for t in full)
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                if algo == "usp":
                    kw.update(group=usp, ulysses_size=ulysses_size)
                call = prepare(*leaves, algo=algo, layout=layout, stripe=stripe, **kw)
                o = call.apply()
                o.backward(dout)
                out["results"][case] = cpu_tensors([o] + [t.grad for t in leaves])
                out["kernels"][case] = tuple(call.cfg.kernel.kernels)
            except Exception:  # noqa: BLE001  reported per case by the test
                out["errors"][case] = traceback.format_exc()
    out["slow"] = slow_kernel_keys()
    return out


class _Capture:
    """Records the patterns megatron_burst.masks.dynamic.estimate returns while active (the test
    compares against the very pattern the engine ran with; the engine calls through that module)."""

    def __init__(self):
        import megatron_burst.masks.dynamic as dp
        self.module, self.original, self.patterns = dp, dp.estimate, []

    def __enter__(self):
        def wrapped(*args, **kwargs):
            p = self.original(*args, **kwargs)
            self.patterns.append(p)
            return p
        self.module.estimate = wrapped
        return self

    def __exit__(self, *exc):
        self.module.estimate = self.original
        return False


def sparse_cases(cases: list, seq: int, b: int, hq: int, hkv: int, d: int, vertical: torch.Tensor,
                 slash: torch.Tensor, seed: int = 0) -> dict:
    """sparse_cp_attention forward + backward per (pattern, algo, layout, stripe) case on this rank's
    shard; pattern "static" (the given lines, as CUDA tensors), "dynamic" (estimated per call) or
    "dynamic_pools" (estimated, whole top pools of slash offsets: per-head dense blocks on CUDA).
    Returns like :func:`cp_cases`, plus {"patterns": {case: (vertical, slash) CPU}} for dynamic cases."""
    from megatron_burst.masks.dynamic import Dynamic

    W, r = dist.get_world_size(), dist.get_rank()
    dev = rank_device()
    full = inputs(seq, b, hq, hkv, d, seed=seed)
    static = mb.VerticalSlash(vertical.to(dev), slash.to(dev))
    out: dict = {"results": {}, "errors": {}, "patterns": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)
        for case in cases:
            kind, algo, layout, stripe = case
            try:
                q, k, v, dout = (mb.shard(t, 0, r, W, layout, stripe).to(dev) for t in full)
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                with _Capture() as cap:
                    pattern = {"static": static, "dynamic": "dynamic",
                               "dynamic_pools": Dynamic(slash_lines="pools")}[kind]
                    o = mb.sparse_cp_attention(*leaves, pattern, algo=algo, layout=layout, stripe=stripe)
                o.backward(dout)
                out["results"][case] = cpu_tensors([o] + [t.grad for t in leaves])
                if kind.startswith("dynamic"):
                    p = cap.patterns[-1]
                    out["patterns"][case] = (p.vertical.cpu(), p.slash.cpu())
            except Exception:  # noqa: BLE001
                out["errors"][case] = traceback.format_exc()
    out["slow"] = slow_kernel_keys()
    return out
