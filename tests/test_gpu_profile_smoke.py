"""scripts/gpu_profile.py's ``fusions`` section on CPU at a tiny size (64 tokens, three small parameters): every
comparison it makes on a GPU runs and reports, so a device call does not spend its time on a broken
script. Timings here mean nothing."""
from __future__ import annotations

import os
import sys

import torch

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def test_fusions_section_runs_every_comparison():
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_profile
    finally:
        sys.path.remove(SCRIPTS)
    lines = []
    gpu_profile.section_fusions(lines.append, dev=torch.device("cpu"), S=64, layers=1,
                                shapes=[(64, 32), (32,), (100, 32)])
    text = "\n".join(lines)
    assert "RoPE q+k fwd+bwd" in text and "megatron.core unfused" in text
    assert "torch AdamW (foreach" in text and "FusedTorchAdam" in text
    assert "megatron.core local loops" in text and "torch _foreach (ours)" in text
    assert len(lines) == 5, lines
    # the model's parameter count, as examples/e2e_gpt_1b.py states it
    assert sum(torch.Size(s).numel() for s in gpu_profile.e2e_param_shapes()) == 1_170_049_024


def test_kernel_table_lists_gemms_by_shape(monkeypatch):
    """The lean loss's table adds its GEMMs grouped by input shape (the vocabulary tiles by height):
    on CPU (no CUDA sync, no device time) the grouping and its lines still form."""
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_profile
    finally:
        sys.path.remove(SCRIPTS)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    a, b = torch.randn(48, 16), torch.randn(16, 24)

    def step():
        torch.mm(a, b)
        torch.mm(a[:8], b)
        torch.addmm(torch.zeros(48, 24), a, b)

    text = gpu_profile._kernels(step, rows=5, gemm_shapes=True)
    lines = text.split("GEMMs by input shapes")[1].strip().splitlines()[1:]
    assert any(line.startswith("aten::mm") and "[[48, 16], [16, 24]]" in line for line in lines), text
    assert any(line.startswith("aten::mm") and "[[8, 16], [16, 24]]" in line for line in lines), text
    assert any(line.startswith("aten::addmm") for line in lines), text
