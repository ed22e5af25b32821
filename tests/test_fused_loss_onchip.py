"""The opt-in on-chip recompute variant of the fused loss (impl="triton_recompute",
megatron_burst/loss/onchip.py) under Triton's CPU interpreter, one fresh process
(tests/onchip_loss_cases.py: TRITON_INTERPRET must be set before triton is imported).

Asserted: loss, d hidden and d weight against the fp32 reference -- fp32 within 1e-5 x max|ref|,
bf16 within the fast path's bound (1.5 x the unfused bf16 path's own error + one bf16 rounding),
for objectives proportional to the loss mask and not (exact for any incoming gradient), with
ignored labels; d weight through fp32 slices (a bf16 weight) and into Megatron's main_grad; TP = 2
with sequence parallelism (the statistics' all-reduces) and main_grad; the self-check of
megatron_burst.loss.choice run on it. Memory: nothing of N x V elements is created, no fp32
tensor of V x d elements for a bf16 weight (only the fp32 slice), and only [N]-sized tensors are
saved for the backward beyond hidden and weight. "auto" never picks it (not yet run on a GPU).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import fused_loss_cases as cases
from harness import run_interpreted
from megatron_burst.loss import fused_linear_cross_entropy

FP32_TOL = 1e-5
N, V, D = 37, 70, 24  # as tests/onchip_loss_cases.py


def _bf16_within_unfused(r):
    for q in ("dh", "dw"):
        bound = 1.5 * r[f"megref_{q}"] + 2.0 ** -8 * r[f"scale_{q}"]
        assert r[f"reference_{q}"] <= bound, (q, r)
        assert r[f"reference_rms_{q}"] <= 1.5 * r[f"megref_rms_{q}"] + 1e-6 * r[f"scale_rms_{q}"], (q, r)
    # fp32 logits: the loss is as accurate as an fp32 computation (the unfused bf16 one is not)
    assert r["reference_loss"] <= FP32_TOL * r["scale_loss"], r


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_onchip_variant_under_interpreter():
    res = run_interpreted("onchip_loss_cases.py")
    assert res["launch"] == {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_D": 16, "UPCAST": True}
    r = res["fp32"]
    for q in cases.QUANTITIES:
        assert r[f"reference_{q}"] <= FP32_TOL * r[f"scale_{q}"], (q, r)
    for key in ("bf16", "bf16_slices", "bf16_main_grad"):
        _bf16_within_unfused(res[key])
    for key in ("fp32", "bf16", "bf16_slices", "bf16_main_grad"):
        r = res[key]
        assert r["ignored_loss"] == 0.0
        # saved beyond hidden and weight: labels, lse, the label check -- nothing of size d
        assert all(n <= N for _, n in r["saved"]), (key, r["saved"])
        assert sorted(r["saved"]) == sorted([["torch.int64", N], ["torch.float32", N], ["torch.bool", 1],
                                             ["torch.float32", N]]), (key, r["saved"])  # + the objective's weights
        assert all(n < N * V for _, n in r["made"]), (key, r["made"])
    # fp32 weight: the gradient itself is the only [V, d] tensor; the fp32 d hidden buffer is d hidden.
    assert [m for m in res["fp32"]["made"] if m[1] >= V * D] == [["torch.float32", V * D]]
    # bf16, slices of 32 rows: fp32 at most 32 x d; the bf16 gradients once each.
    made = res["bf16_slices"]["made"]
    assert max(n for dt, n in made if dt == "torch.float32") <= max(32 * D, N * D), made
    assert [m for m in made if m[0] == "torch.bfloat16" and m[1] > 0] == [["torch.bfloat16", N * D],
                                                                          ["torch.bfloat16", V * D]]
    # main_grad: nothing weight-sized is created at all (the fp32 sums go into main_grad in place).
    made = res["bf16_main_grad"]["made"]
    assert all(n < V * D for _, n in made), made
    assert res["bf16_main_grad"]["grad_added_to_main_grad"] is False  # no DDP placeholder asked for
    assert res["all_ignored"] == 0.0
    assert res["self_check"] == "passed", res["self_check"]
    for rank in res["tp2"]:
        r = rank["sp_mismatch"]
        assert r["paths"] == {"scaled": 0, "recompute": 0}  # no proportionality decision at all
        for q in cases.QUANTITIES:
            assert r[f"ref_{q}"] <= FP32_TOL * r[f"scale_{q}"], (q, r)
        r = rank["main_grad"]
        assert r["err_vs_ref"] <= FP32_TOL * r["scale"] and r["grad_added_to_main_grad"], r


def test_onchip_variant_is_opt_in():
    """"auto" on CPU is the torch path; the new impl is accepted by name and refused on CPU without
    the interpreter (when that is how this process runs)."""
    from megatron_burst.loss.choice import resolve_impl
    h = torch.randn(4, 8)
    assert resolve_impl("auto", h, fused_linear_cross_entropy) == "torch"
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            fused_linear_cross_entropy(h, torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                                       impl="triton_recompute")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (pip install triton): the Triton kernels are untested")
def test_onchip_kernels_compile_for_hopper():
    """No GPU here: the three kernels compiled for sm_90 down to a cubin with their GPU blocks and
    launch options on bf16 inputs (tensor-core code, shared memory within an H100's 227 KiB), so a
    kernel that only the interpreter accepts fails here, not on the GPU."""
    from megatron_burst.loss import onchip
    from triton_masked_cases import aot_compile

    src = onchip._kernels()
    pointers = {"H": "bf16", "W": "bf16", "TGT": "i64", "MAX": "fp32", "SUMEXP": "fp32", "ZTGT": "fp32", "LSE": "fp32",
                "GW": "fp32", "DH": "fp32", "DW": "fp32"}
    for name, extra in (("lse_stats_kernel", {}), ("hidden_grad_kernel", {}),
                        ("weight_grad_kernel", {"ACCUMULATE": True}), ("weight_grad_kernel", {"ACCUMULATE": False})):
        fn = getattr(src, name)
        opts = dict(onchip.GPU_BLOCKS, UPCAST=False, PREC="tf32", **extra)
        compiled = aot_compile(fn, opts, pointers, onchip.GPU_LAUNCH)
        assert "cubin" in compiled.asm and compiled.metadata.shared <= 227 * 1024, name
        assert "wgmma.mma_async" in compiled.asm["ptx"], name
