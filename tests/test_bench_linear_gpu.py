"""``python -m megatron_burst.bench linear --gpu --smoke``: the one-GPU linear benchmark's plumbing on
CPU in seconds (W = 1 and W = 2 gloo ranks with the host-staged transport staging CPU tensors), and
its fla variants (ours with kernel='fla', fla's own kernel) against the stand-in fla of
tests/fla_standin.py on the CUDA decision path."""
from __future__ import annotations

import json

import pytest

import fla_standin
from megatron_burst.bench import linear_gpu
from megatron_burst.bench import verdict as vd
from megatron_burst.kernels import choice as attention_choice
from megatron_burst.linear import kernel_choice


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_smoke_runs_every_section_and_records_errors_vs_fp32(tmp_path, capsys):
    out = tmp_path / "bench_linear.jsonl"  # the name scripts/gpu_session.sh gives it (the verdict reads it)
    linear_gpu.main(["--gpu", "--smoke", "--out", str(out)])
    lines = _lines(out)
    assert not [l for l in lines if "error" in l], [l["error"] for l in lines if "error" in l]
    local = {(l["name"], l["variant"]) for l in lines if l["section"] == "local" and "ms" in l}
    assert local == {(f"lasp2_{f}", "torch") for f in linear_gpu.FORMS} | {("gdn", "torch")}
    for l in lines:
        if l["section"] == "local" and "ms" in l:
            assert max(l["errors"].values()) <= 1e-6, l  # the torch path is the fp32 reference here
    multi = [l for l in lines if l["section"] == "multi_rank" and "ms" in l]
    assert {l["variant"] for l in multi} == {"lasp2:token:torch", "gdn:token:torch"}
    for l in multi:
        assert l["sent_bytes_per_rank"] > 0 and max(l["rel_diff_vs_w1"].values()) <= 1e-5, l
    assert "| local | gdn | torch |" in capsys.readouterr().out
    rows, _ = vd.verdict(str(tmp_path))  # every I3 bar found; CPU torch figures: "missing"
    local = [r for r in rows if r.issue == "I3"]
    assert {r.bar.split(",")[0] for r in local} == {"lasp2_none", "lasp2_head", "lasp2_token", "lasp2_channel", "gdn"}
    assert {r.status for r in rows} == {vd.MISSING}


def _local_with_stand_in(tmp_path, monkeypatch) -> list[dict]:
    """The W = 1 section with ours (torch, fla) and fla's own kernel on the stand-in fla, on the CUDA
    decision path: its JSON lines but the closing one."""
    fla_standin.install(monkeypatch)
    monkeypatch.setattr(attention_choice, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    kernel_choice.reset()
    out = tmp_path / "linear.jsonl"
    try:
        linear_gpu.main(["--gpu", "--smoke", "--sections", "local", "--kernels", "torch", "fla", "--seq", "96",
                         "--forms", "head", "channel", "--out", str(out)])
    finally:
        kernel_choice.reset()
    return [l for l in _lines(out) if l["variant"] != "done"]


def test_fla_variants_against_the_stand_in(tmp_path, monkeypatch):
    lines = _local_with_stand_in(tmp_path, monkeypatch)
    assert not [l for l in lines if "error" in l], [l["error"] for l in lines if "error" in l]
    got = {(l["name"], l["variant"]) for l in lines}
    assert got == {(n, v) for n in ("lasp2_head", "lasp2_channel", "gdn") for v in ("torch", "fla", "fla_direct")}
    for l in lines:
        assert max(l["errors"].values()) <= 1e-5, l
    fla_lines = [l for l in lines if l["variant"] == "fla"]
    assert all(any("self-checked" in k for k in l["linear_kernels"]) for l in fla_lines)


def test_forms_fla_refuses_are_skipped_with_the_reason(tmp_path, monkeypatch):
    """On Hopper with 3.4 <= Triton < 3.7.1 fla refuses its gated backward kernels (fla issue #640):
    the bench records those variants (ours through fla, fla's own) as skipped, naming the refusal and
    the carried-Triton fix, instead of compiling fla's forward and failing in its backward; the
    ungated form (channel) and our torch path still run."""
    monkeypatch.setattr(kernel_choice, "_fla_flags", lambda: (True, True, False))  # Hopper, Triton 3.6
    lines = {(l["name"], l["variant"]): l for l in _local_with_stand_in(tmp_path, monkeypatch)}
    assert not [l for l in lines.values() if "error" in l]
    for name in ("lasp2_head", "gdn"):
        for variant in ("fla", "fla_direct"):
            assert "fla issue #640" in lines[name, variant]["skipped"], lines[name, variant]
            assert "scripts/triton_bundle.sh" in lines[name, variant]["skipped"]
        assert "skipped" not in lines[name, "torch"]
    assert all("skipped" not in lines["lasp2_channel", v] for v in ("torch", "fla", "fla_direct"))


def test_limit_autotune_keeps_the_fewest_stage_configs():
    """bench linear --gpu --autotune-configs N and tests/gpu (N = 2): every Triton autotuner tries at
    most N configs, those with the fewest pipeline stages then warps; N <= 0 restores the full search."""
    triton = pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner
    from megatron_burst.bench.autotune_limit import limit_autotune

    original = getattr(Autotuner.prune_configs, "uncapped", Autotuner.prune_configs)
    tuner = Autotuner.__new__(Autotuner)
    tuner.configs = [triton.Config({"B": b}, num_warps=w, num_stages=s) for b in (32, 64) for w in (8, 4)
                     for s in (3, 1, 2)]
    tuner.early_config_prune, tuner.perf_model, tuner.nargs = None, None, {}
    try:
        assert limit_autotune(2)
        assert [(c.num_stages, c.num_warps) for c in tuner.prune_configs({})] == [(1, 4), (1, 4)]
        limit_autotune(3)  # a later call replaces the cap, not stacks on it
        assert len(tuner.prune_configs({})) == 3
        limit_autotune(0)
        assert len(tuner.prune_configs({})) == 12
    finally:
        Autotuner.prune_configs = original
