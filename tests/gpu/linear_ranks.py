"""Rank-side body of tests/gpu/test_gpu_linear.py: W processes sharing cuda:0 (CPU gloo ranks in the
dry run), each running linear_attention / gated_delta_rule with kernel "auto" on its contiguous shard (or its
part of a packed THD batch)."""
from __future__ import annotations

import traceback
import warnings
from typing import Optional

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.bench.linear_gpu import leaves_of, make_inputs, run_ours
from megatron_burst.kernels.choice import SlowKernelWarning
from megatron_burst.linear import kernel_choice
from megatron_burst.masks.documents import check_thd, rank_positions

from gpu.common import DTYPE, cpu_tensors, rank_device, slow_kernel_keys


def linear_cases(cases: list, seq: int, heads: int, d: int, seed: int = 0, thd: Optional[tuple] = None) -> dict:
    """Forward + backward of every (op, form) case on this rank's contiguous shard of the full
    inputs (built from ``seed`` on every rank); ``thd`` = (cu_seqlens, cu_seqlens_padded): a packed
    THD batch in TransformerEngine's partitioning instead. Returns {"results": {case: [out, grads...]
    CPU}, "errors": {case: traceback}, "kernels": linear kernel report, "slow": SlowKernelWarning keys,
    "positions": this rank's global token positions}."""
    W, r = dist.get_world_size(), dist.get_rank()
    dev = rank_device()
    out: dict = {"results": {}, "errors": {}}
    kw: dict = {"layout": "contiguous"}
    pos = mb.layout_indices(seq, r, W, "contiguous")
    if thd is not None:
        docs = check_thd(list(thd[0]), list(thd[1]), seq // W, W, 1)
        kw = {"layout": "thd", "cu_seqlens": docs}
        pos = rank_positions("thd", r, W, seq // W, partition=docs.partition)
    out["positions"] = pos
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)
        for op, form in cases:
            try:
                full = make_inputs(op, form, seq, heads, d, DTYPE, torch.device("cpu"), seed)
                x = {n: None if t is None else (t if t.dim() == 1 else t[pos]).to(dev) for n, t in full.items()}
                leaves = leaves_of(op, form, x)
                o = run_ours(op, form, "auto", x, leaves, **kw)
                o.backward(x["dout"])
                out["results"][(op, form)] = cpu_tensors([o] + [t.grad for t in leaves])
            except Exception:  # noqa: BLE001  reported by the test with its traceback
                out["errors"][(op, form)] = traceback.format_exc()[-3000:]
    out["kernels"] = kernel_choice.report()
    out["slow"] = slow_kernel_keys()
    return out
