"""Cases of the on-chip recompute variant (impl="triton_recompute", megatron_burst/loss/onchip.py)
under Triton's CPU interpreter. Run as a script with TRITON_INTERPRET=1 set before triton is
imported (``TRITON_INTERPRET=1 python tests/onchip_loss_cases.py``); prints one JSON line.
test_fused_loss_onchip.py starts it in a fresh process and asserts on the result.

Shapes are tiny and ragged against the interpreter's 16-wide tiles: 37 tokens (3 token tiles, the
last of 5), 70 vocabulary rows (5 tiles, the last of 6; 3 forward splits of 2, 2, 1 tiles), d = 24
(2 slices, the last of 8).
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch

import fused_loss_cases as cases
from megatron_burst.loss import (FusedLossRecomputeWarning, fused_linear_cross_entropy, onchip,
                                 reference_linear_cross_entropy)

IMPL = "triton_recompute"
IGNORE = -100
N, V, D = 37, 70, 24


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * D ** -0.5 * 2).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    y[torch.randperm(N, generator=g)[:4]] = IGNORE
    mask = (torch.rand(N, generator=g) > 0.25).float() * (y != IGNORE)
    r = torch.randn(N, generator=g)  # per-token objective weights, not proportional to the mask
    return h, w, y, mask, r


def tp1_case(dtype, objective, main_grad=False, record=False):
    """Loss, d hidden, d weight of the variant vs the fp32 reference and vs the unfused path in the
    input dtype (its own error against the reference: megref_*), TP = 1."""
    h0, w0, y, mask, r = inputs(dtype)
    weights = mask / mask.sum() if objective == "masked_mean" else r
    valid = y != IGNORE
    res, out = {}, {}
    for impl in (IMPL, "reference", "unfused"):
        h = cases.leaf(h0, torch.float32 if impl == "reference" else None)
        w = cases.leaf(w0, torch.float32 if impl == "reference" else None)
        if impl == IMPL and main_grad:
            prefill = torch.randn(V, D, generator=torch.Generator().manual_seed(9))
            w.main_grad, w.grad_added_to_main_grad = prefill.clone(), False
        saved = []
        rec = cases.CreatedTensors()

        def pack(t):
            if t.untyped_storage().data_ptr() not in (h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()):
                saved.append((str(t.dtype), t.numel()))
            return t

        with rec if (record and impl == IMPL) else _null(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if impl == IMPL:
                loss = fused_linear_cross_entropy(h, w, y, loss_mask=mask, impl=IMPL,
                                                  accumulate_into_main_grad=main_grad)
            elif impl == "reference":
                loss = reference_linear_cross_entropy(h, w, y)
            else:
                loss = cases.unfused_linear_cross_entropy(h, w, y)
            (loss * weights).sum().backward()
        dw = (w.main_grad - prefill) if (impl == IMPL and main_grad) else w.grad
        res[impl] = (loss[valid], h.grad, dw)
        if impl == IMPL:
            out.update(made=[(str(dt), n) for dt, n in rec.made], saved=saved, ignored_loss=loss[~valid].abs().max().item(),
                       grad_added_to_main_grad=getattr(w, "grad_added_to_main_grad", None))
    for prefix, got, ref in (("reference", IMPL, "reference"), ("megref", "unfused", "reference")):
        out.update(cases._errs(prefix, res[got], res[ref], cases.QUANTITIES))
    for q, t in zip(cases.QUANTITIES, res["reference"]):
        out[f"scale_{q}"] = t.abs().max().item()
        out[f"scale_rms_{q}"] = t.square().mean().sqrt().item()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def all_ignored():
    h, w = torch.randn(6, 16, requires_grad=True), torch.randn(20, 16, requires_grad=True)
    loss = fused_linear_cross_entropy(h, w, torch.full((6,), IGNORE), impl=IMPL)
    loss.sum().backward()
    return max(loss.abs().max().item(), h.grad.abs().max().item(), w.grad.abs().max().item())


def tp2_case():
    """TP = 2 (gloo ranks), fp32, each rank: an objective not proportional to the mask with sequence
    parallelism, and main_grad accumulation without it -- both against the fp32 reference."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedLossRecomputeWarning)  # the variant never takes a warned path
        return {"sp_mismatch": cases.run_case(impl=IMPL, with_megatron=False, kind="mismatch",
                                              sequence_parallel=True),
                "main_grad": cases.main_grad_case(impl=IMPL, kind="mismatch")}


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    start = time.perf_counter()
    torch.set_num_threads(1)
    from megatron_burst.loss import choice
    results = {}
    results["launch"] = onchip.launch_config()[0]
    results["fp32"] = tp1_case(torch.float32, "weights", record=True)
    results["bf16"] = tp1_case(torch.bfloat16, "masked_mean")
    # d weight in fp32 slices of 32 rows (3 launches over 70 rows), each rounded once to bf16.
    onchip.DW_SCRATCH_BYTES = 32 * D * 4
    results["bf16_slices"] = tp1_case(torch.bfloat16, "weights", record=True)
    results["bf16_main_grad"] = tp1_case(torch.bfloat16, "weights", main_grad=True, record=True)
    results["all_ignored"] = all_ignored()
    try:
        # bf16 only: the fp32 path is the "fp32" case above (the interpreter's time is the suite's)
        choice.self_check(torch.device("cpu"), torch.bfloat16, fused_linear_cross_entropy, impl=IMPL)
        results["self_check"] = "passed"
    except Exception as e:  # reported, the other assertions still run
        results["self_check"] = f"{type(e).__name__}: {e}"
    import onchip_loss_cases  # not __main__: the ranks unpickle the function by its module name
    from harness import run_ranks, shutdown_pools
    t0 = time.perf_counter()
    try:
        results["tp2"] = run_ranks(2, onchip_loss_cases.tp2_case, timeout=300)
    finally:
        shutdown_pools(stop_forkserver=True)
    print(f"tp2: {time.perf_counter() - t0:.1f} s; all: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
