"""python -m megatron_burst.bench loss on CPU: peers that cannot run are explicit "skipped" lines, --quick
is refused on a CPU, and a tiny run prints a row per variant with errors against fp32."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_burst.bench import loss as bench
from megatron_burst.bench import verdict as vd


def test_peers_are_skipped_lines_on_cpu(capsys, tmp_path):
    bench.main(["--device", "cpu", "--tokens", "64", "--vocab", "128", "--hidden", "16", "--variants", "liger", "cce",
                "--plot", "", "--out", str(tmp_path / "loss.jsonl")])
    out = capsys.readouterr().out
    assert "- skipped liger at N=64 V=128 d=16 TP=1: needs CUDA (this run is on cpu)" in out
    assert "- skipped cce at N=64 V=128 d=16 TP=1: needs CUDA (this run is on cpu)" in out
    lines = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["skipped"]) for r in lines] == [("liger", "needs CUDA (this run is on cpu)"),
                                                             ("cce", "needs CUDA (this run is on cpu)")]


def test_skip_reasons():
    assert bench.skip_reason("liger", "cuda", 2) == "takes no tensor-parallel group (TP = 1 only)"
    assert bench.skip_reason("unfused_torch", "cuda", 2) == "plain torch, TP = 1 only"
    assert bench.skip_reason("fused@2048", "cpu", 2) is None
    assert bench.skip_reason("fused_recompute", "cpu", 1).startswith("Triton kernels, needs CUDA")
    assert bench.skip_reason("fused_recompute", "cuda", 2) is None
    assert "fused_recompute" in bench.QUICK_VARIANTS and "fused_recompute" in bench.TP_VARIANTS
    assert bench.base_variant("fused@2048") == "fused"


def test_quick_is_for_a_gpu():
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--device", "cpu"])
    assert exc.value.code == 2


def test_tiny_run_prints_rows_with_errors(capsys, tmp_path):
    bench.main(["--device", "cpu", "--tokens", "96", "--vocab", "256", "--hidden", "16", "--variants", "unfused",
                "fused", "--fast-chunks", "32", "--repeats", "1", "--errors", "--plot", "",
                "--out", str(tmp_path / "bench_loss.jsonl")])  # as scripts/gpu_session.sh names it
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 96 |")]
    assert [r[4].strip() for r in rows] == ["unfused", "fused", "fused@32"], out
    by = {r[4].strip(): r for r in rows}
    assert by["fused"][5].strip() == "torch" and by["fused@32"][6].strip() == "32"
    for r in rows:  # fp32 on CPU: every error tiny
        assert all(float(x) < 1e-5 for x in (r[13], r[14], r[15])), r
    assert float(by["fused@32"][12]) < 1.0 and float(by["unfused"][12]) >= 1.0  # largest / NxV
    # the JSON lines carry what the table shows (the verdict reads them: megatron_burst.bench.verdict)
    lines = {r["variant"]: r for r in map(json.loads, (tmp_path / "bench_loss.jsonl").read_text().splitlines())}
    assert list(lines) == ["unfused", "fused", "fused@32"]
    for name, r in lines.items():
        assert (r["tokens"], r["vocab"], r["hidden"], r["tp"], r["dtype"]) == (96, 256, 16, 1, "float32")
        assert f"{r['time_s'] * 1e3:.1f}" == by[name][7].strip()
        assert f"{r['peak_bytes'] / 2 ** 20:.0f}" == by[name][9].strip()
        assert f"{r['errors']['dh']:.1e}" == by[name][14].strip()
    rows, _ = vd.verdict(str(tmp_path))  # the verdict reads it: no CCE (and a tiny shape) here
    loss = [r for r in rows if r.bar.startswith("fused loss")]
    assert "lacks" in loss[0].figure and {r.status for r in rows} == {vd.MISSING}, loss


def test_reference_errors_of_an_exact_gradient_are_zero():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 4, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(7, 4, generator=g).requires_grad_()
    y = torch.randint(0, 7, (10,), generator=g)
    mask = (torch.rand(10, generator=g) > 0.3).float()
    n = mask.sum()
    obj = (torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="none") * mask).sum() / n
    obj.backward()
    errs = bench.reference_errors(h, w, y, mask, n, obj.item(), h.grad, w.grad, chunk=3)
    assert max(errs.values()) < 1e-6, errs


def test_quick_takes_the_repeats_asked_for(monkeypatch, capsys):
    """--quick keeps its one configuration but not a fixed repeat count: --repeats reaches every
    variant's worker (a close comparison, such as the lean loss against unfused, asks for more), and
    so does --logit-std (the weight's scale)."""
    specs = []
    monkeypatch.setattr(bench, "_run", lambda spec, timeout: specs.append(spec) or {"error": "not run"})
    bench.main(["--quick", "--device", "cpu", "--variants", "fused", "--repeats", "7", "--logit-std", "3",
                "--plot", ""])
    bench.main(["--quick", "--device", "cpu", "--variants", "fused", "--plot", ""])
    assert [(s["tokens"], s["dtype"], s["repeats"], s["logit_std"]) for s in specs] == [
        (16384, "bfloat16", 7, 3.0), (16384, "bfloat16", 3, 1.0)]


def test_knob_variants_set_module_constants_in_their_process():
    """``fused_bwdw:VOCAB_TILE=4096,G_IN_LOGITS=0``: one of ours with fast-path constants set (one
    process per variant); a bad knob, value or base is refused naming it."""
    import argparse

    from megatron_burst.bench import loss as bl
    from megatron_burst.loss import vocab_pass

    v = "fused_bwdw@2048:VOCAB_TILE=4096,G_IN_LOGITS=0"
    assert bl.base_variant(v) == "fused_bwdw" and bl._variant_arg(v) == v
    assert bl.variant_knobs(v) == {"VOCAB_TILE": 4096, "G_IN_LOGITS": 0}
    old = (vocab_pass.VOCAB_TILE, vocab_pass.G_IN_LOGITS)
    try:
        bl.apply_knobs(v)
        assert vocab_pass.VOCAB_TILE == 4096 and vocab_pass.G_IN_LOGITS is False
    finally:
        vocab_pass.VOCAB_TILE, vocab_pass.G_IN_LOGITS = old
    for bad, says in (("fused_bwdw:TILE=4", "'TILE=4' is not KNOB=INT"), ("fused_bwdw:VOCAB_TILE=big", "is not KNOB=INT"),
                      ("cce:VOCAB_TILE=4096", "tune our fused loss only"), ("fused_bwd", "unknown variant")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            bl._variant_arg(bad)


def test_replot_reads_an_earlier_runs_lines(tmp_path, capsys):
    """``--replot FILE.jsonl``: the table (and plot) of a GPU session's bench_loss.jsonl, here run 6's
    (H100), without measuring: one row per timed variant, skipped lines left out."""
    import os

    lines = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "data",
                         "loss_h100_run6.jsonl")
    table = bench.replot(lines, "")
    (key, res), = table
    assert key == (16384, 131072, 4096, 1) and list(res) == ["fused_bwdw", "unfused", "cce", "fused_bwdw_2read"]
    out = capsys.readouterr().out
    assert "| fused_bwdw | triton, d weight in-GEMM | 1024 | 117.0 |" in out and "| cce | - | - | 175.3 | 1.52 |" in out
    skipped = tmp_path / "s.jsonl"
    skipped.write_text(open(lines).readline() + json.dumps({"tokens": 1, "variant": "liger", "skipped": "x"}) + "\n")
    assert [list(r) for _, r in bench.replot(str(skipped), "")] == [["fused_bwdw"]]
    assert [list(r) for _, r in bench.replot(lines, "", ["cce", "unfused"])] == [["unfused", "cce"]]
