"""The fused loss's memory and precision properties (I2): ``weight_grad="backward"`` keeps no fp32
[V/tp, d] weight-gradient accumulator (nothing weight-sized but the gradient itself), and the bf16
gradients of both modes are at least as accurate as the unfused bf16 path's on the same inputs.

Memory is asserted on CPU from the tensors themselves, not from an allocator: every tensor an op
creates during the forward and the backward is recorded (a TorchDispatchMode sees every output),
and so is every tensor saved for the backward (saved_tensors_hooks).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fused_loss_cases as cases
from harness import run_ranks
from megatron_burst.loss import fused_linear_cross_entropy, reference_linear_cross_entropy
from megatron_burst.loss import vocab_pass

FP32_TOL = 1e-5


def _run_recorded(weight_grad: str, main_grad: bool, N=64, d=40, V=96, dtype=torch.bfloat16):
    """One fwd + bwd of the fused op (TP = 1, torch impl); returns (tensors created, tensors saved,
    d weight) -- (dtype, numel) pairs, saved ones beyond hidden and weight."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, d, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    mask = (torch.rand(N, generator=g) > 0.2).float()
    if main_grad:
        w.main_grad = torch.zeros(V, d)
        w.grad_added_to_main_grad = False
    saved = []

    def pack(t):
        if t.data_ptr() not in (h.data_ptr(), w.data_ptr()):
            saved.append((t.dtype, t.numel()))
        return t

    rec = cases.CreatedTensors()
    with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fused_linear_cross_entropy(h, w, labels, loss_mask=mask, token_chunk=16, vocab_chunk=32,
                                          impl="torch", weight_grad=weight_grad,
                                          accumulate_into_main_grad=main_grad)
        ((loss * mask).sum() / mask.sum()).backward()
    return rec.made, saved, (w.main_grad if main_grad else w.grad)


@pytest.mark.parametrize("main_grad", [False, True])
def test_backward_weight_grad_keeps_no_weight_sized_buffer(main_grad, monkeypatch):
    """weight_grad="backward": no fp32 tensor of V x d elements (or more) is ever created -- the only
    weight-sized tensor is the bf16 gradient (with main_grad: Megatron's bf16 placeholder; the fp32
    sums go into main_grad in place); nothing weight-sized is saved. The pass is forced to split the
    tokens (tile accumulator [vt, d] fp32 = 32 x 40). The default mode does create the fp32 [V, d]
    accumulator: the difference this option makes."""
    monkeypatch.setattr(vocab_pass, "TILE_BYTES", 6 * 32 * 24)  # vt = 32 rows, tn = 24 of 64 tokens
    N, d, V = 64, 40, 96
    made, saved, dw = _run_recorded("backward", main_grad)
    weight_sized = [(dt, n) for dt, n in made if n >= V * d]
    assert all(dt == torch.bfloat16 and n == V * d for dt, n in weight_sized), weight_sized
    assert len(weight_sized) <= 1, weight_sized  # the gradient (or the placeholder), at most once
    assert max(n for dt, n in made if dt == torch.float32) <= max(N * 32, 32 * d, N * d), made
    assert all(n < V * d for _, n in saved), saved
    made_fwd, saved_fwd, dw_fwd = _run_recorded("forward", main_grad)
    assert (torch.float32, V * d) in made_fwd and (torch.float32, V * d) in saved_fwd
    # Same gradient either way (bf16 rounding apart; into main_grad both add fp32 sums).
    assert (dw.float() - dw_fwd.float()).abs().max() <= 2 ** -7 * dw_fwd.float().abs().max()


@pytest.mark.parametrize("kind", ["binary", "mismatch"])
def test_backward_weight_grad_tp_sequence_parallel(kind):
    """weight_grad="backward" at TP = 2 with sequence parallelism, scaled and recompute paths, fp32:
    loss, d hidden, d weight equal the reference."""
    for res in run_ranks(2, cases.run_case, kind=kind, sequence_parallel=True, weight_grad="backward",
                         with_megatron=False):
        for q in cases.QUANTITIES:
            assert res[f"ref_{q}"] <= FP32_TOL * res[f"scale_{q}"], (q, res)


def test_backward_weight_grad_main_grad_tp_and_bf16():
    """weight_grad="backward" with Megatron's main_grad at TP = 2 (fp32) and TP = 1 (bf16 weight: the
    fp32 sums are added into main_grad unrounded, so at least as accurate as Megatron's bf16)."""
    for res in run_ranks(2, cases.main_grad_case, weight_grad="backward"):
        assert res["err_vs_ref"] <= FP32_TOL * res["scale"], res
        assert res["grad_added_to_main_grad"]
    res = run_ranks(1, cases.main_grad_case, dtype=torch.bfloat16, weight_grad="backward")[0]
    assert res["err_vs_ref"] <= res["megatron_err_vs_ref"], res


def test_ignore_index_and_empty_weight_grad_backward():
    """All labels ignored: zero gradients in both modes (the vocabulary pass writes zeros, not garbage)."""
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    labels = torch.full((6,), -100)
    loss = fused_linear_cross_entropy(h, w, labels, impl="torch", weight_grad="backward")
    loss.sum().backward()
    assert loss.abs().max() == 0 and w.grad.abs().max() == 0 and h.grad.abs().max() == 0
    with pytest.raises(ValueError, match="weight_grad must be 'forward'.*got 'later'"):
        fused_linear_cross_entropy(h, w, labels, impl="torch", weight_grad="later")


PRECISION_SCRIPT = r"""
import json, sys, torch
from megatron_burst.loss import fused_linear_cross_entropy
IGN = -100
def unfused(h, W, y):  # Megatron's rounding: bf16 logits, fp32 cross-entropy, bf16 gradient GEMMs
    return torch.nn.functional.cross_entropy((h @ W.t()).float(), y, ignore_index=IGN, reduction="none")
def ref(h, W, y):
    return torch.nn.functional.cross_entropy(h @ W.t(), y, ignore_index=IGN, reduction="none")
N, d, V = 128, 64, 128
g = torch.Generator().manual_seed(1)
h = torch.randn(N, d, generator=g).bfloat16()
W = (torch.randn(V, d, generator=g) * 3 * d ** -0.5).bfloat16()
y = torch.randint(0, V, (N,), generator=g)
y[::11] = IGN
mask = (torch.rand(N, generator=g) > 0.1).float()
def run(fn, dtype=None, **kw):
    hh = h.to(dtype or h.dtype).clone().requires_grad_()
    ww = W.to(dtype or W.dtype).clone().requires_grad_()
    loss = fn(hh, ww, y, **kw)
    ((loss * mask).sum() / mask.sum()).backward()
    return hh.grad.double(), ww.grad.double()
R = run(ref, torch.float64)
out = {}
for name, kw in (("unfused", None), ("forward", "forward"), ("backward", "backward")):
    got = run(unfused) if kw is None else run(fused_linear_cross_entropy, loss_mask=mask, token_chunk=32,
                                              vocab_chunk=48, impl="triton", weight_grad=kw)
    out[name] = [((a - b).norm() / b.norm()).item() for a, b in zip(got, R)]
print(json.dumps(out))
"""


def test_bf16_gradients_no_less_accurate_than_unfused():
    """bf16 on the fast path (Triton interpreted, a fresh process): relative Frobenius errors of
    d hidden and d weight against an fp64 reference are <= the unfused bf16 path's on the same
    inputs, in both weight_grad modes (here: d hidden 4.0e-3, d weight 3.8e-3 / 3.9e-3, unfused
    4.5e-3 / 4.6e-3). The scale c is applied to the bf16 d hidden in fp32 (see autograd._scale_in_place)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", PRECISION_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("forward", "backward"):
        for i, q in enumerate(("dh", "dw")):
            assert errs[mode][i] <= errs["unfused"][i], (mode, q, errs)
