"""python -m megatron_burst.bench verdict: a GPU session's files against the issues' bars. Each bar's
arithmetic at its edge, "missing" (never met) for absent, skipped, CPU or wrong-size figures. The CPU
smoke runs of the benches that write those files check the verdict reads them (test_gpu_bench_smoke.py,
test_bench_loss.py, test_bench_linear_gpu.py)."""
from __future__ import annotations

import json

import pytest

from megatron_burst.bench import verdict as vd

GPU = {"device": "NVIDIA H100 80GB HBM3", "capability": "9.0", "torch": "2.11.0+cu130", "cuda": "13.0",
       "triton": "3.6.0"}
CPU = {"device": "cpu (x86_64, 2 cores)", "capability": None, "torch": "2.13.0+cpu", "cuda": None}


def line(section, name, variant, ms, env=GPU, **extra):
    return {"section": section, "name": name, "variant": variant, "ms": ms, **env, **extra}


def write(tmp_path, name, records):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def rows_of(tmp_path, issue=None, bar=None):
    rows, _ = vd.verdict(str(tmp_path))
    return [r for r in rows if (issue is None or r.issue == issue) and (bar is None or bar in r.bar)]


@pytest.mark.parametrize("engine_ms, status", [(105.0, vd.MET), (105.2, vd.NOT_MET)])
def test_dense_bar_is_105_percent_of_the_fastest_sdpa_backend(tmp_path, engine_ms, status):
    write(tmp_path, "bench_gpu.jsonl", [line("dense", "causal_s32768", "sdpa_flash", 180.0),
                                        line("dense", "causal_s32768", "sdpa_cudnn", 100.0),
                                        line("dense", "causal_s32768", "engine_w1_burst", engine_ms)])
    [row] = rows_of(tmp_path, bar="dense causal 32K")
    assert row.status == status and "sdpa_cudnn 100.00 ms" in row.figure, row


def test_dense_bar_needs_both_sides_on_a_gpu(tmp_path):
    write(tmp_path, "bench_gpu.jsonl", [line("dense", "causal_s32768", "sdpa_flash", 100.0, env=CPU),
                                        line("dense", "causal_s32768", "engine_w1_burst", 50.0, env=CPU)])
    [row] = rows_of(tmp_path, bar="dense causal 32K")
    assert row.status == vd.MISSING and "not on a GPU" in row.figure
    write(tmp_path, "bench_gpu.jsonl", [line("dense", "causal_s32768", "engine_w1_burst", 50.0),
                                        {**line("dense", "causal_s32768", "sdpa_cudnn", None), "skipped": "no"}])
    [row] = rows_of(tmp_path, bar="dense causal 32K")
    assert row.status == vd.MISSING  # a skipped baseline is no baseline


@pytest.mark.parametrize("engine_ms, status", [(117.6, vd.MET), (117.7, vd.NOT_MET)])
def test_rank_block_bar_is_085_of_one_call_speed(tmp_path, engine_ms, status):
    write(tmp_path, "bench_gpu.jsonl", [line("rank_block", "W8_s65536_zigzag", "one_call_sdpa_flash", 100.0),
                                        line("rank_block", "W8_s65536_zigzag", "engine_blocks", engine_ms)])
    [row] = rows_of(tmp_path, bar="rank block")
    assert row.status == status, row


def test_documents_and_windows_bars(tmp_path):
    write(tmp_path, "bench_gpu.jsonl", [
        line("documents", "docs64_lognormal_s32768", "varlen_flash", 4.0),
        line("documents", "docs64_lognormal_s32768", "flex_attention", 2.0),  # not a flash baseline
        line("documents", "docs64_lognormal_s32768", "engine_w1_burst", 4.99),
        line("documents", "window4096_s32768", "varlen_flash", 10.0),
        line("documents", "window4096_s32768", "flash_attn", 8.0),
        line("documents", "window4096_s32768", "engine_w1_burst", 10.5),
        line("documents", "window_s32768", "causal_dense_sdpa_flash", 50.0)])  # the upper bound: no bar
    rows = rows_of(tmp_path, bar="varlen / windowed flash")
    assert [(r.bar.split(":")[0], r.status) for r in rows] == [("docs64_lognormal_s32768", vd.MET),
                                                               ("window4096_s32768", vd.NOT_MET)]
    assert "flash_attn 8.00 ms" in rows[1].figure


def test_sparse_bar_is_3x_the_fastest_dense_at_64k(tmp_path):
    write(tmp_path, "bench_gpu.jsonl", [
        line("sparse", "s65536", "dense_engine_w1_burst", 300.0), line("sparse", "s65536", "dense_sdpa_cudnn", 240.0),
        line("sparse", "dynamic_s65536", "sparse_dynamic", 80.0, sparsity=0.95),
        line("sparse", "static_s65536", "sparse_static", 81.0, sparsity=0.95),
        line("sparse", "s16384", "dense_engine_w1_burst", 30.0),
        line("sparse", "static_s16384", "sparse_static", 5.0, sparsity=0.9)])
    got = {r.bar.split(" (")[0]: r.status for r in rows_of(tmp_path, bar="sparse")}
    assert got == {"sparse dynamic_s65536 sparse_dynamic": vd.MET, "sparse static_s65536 sparse_static": vd.NOT_MET,
                   "sparse static_s16384 sparse_static": vd.MISSING}


SESSION_GPU = "torch 2.11.0+cu130 cuda 13.0 cudnn 91900 triton 3.6.0 NVIDIA H100 80GB HBM3\n"


def test_gpu_suite_from_the_pytest_closing_lines(tmp_path):
    (tmp_path / "session.log").write_text("cudnn-probe: start (limit 40s)\n" + SESSION_GPU)
    (tmp_path / "gpu_test.log").write_text("....\n===== 80 passed, 6 skipped in 200.1s =====\n")
    (tmp_path / "gpu_test_multi.log").write_text("F.\n1 failed, 16 passed in 100.0s\n")
    (tmp_path / "gpu_test_linear.log").write_text("sss\n11 skipped in 3.0s\n")
    got = [(r.bar, r.status, r.figure) for r in rows_of(tmp_path, bar="make gpu-test")]
    assert [g[1] for g in got] == [vd.MET, vd.NOT_MET, vd.MISSING], got
    assert got[0][2] == "80 passed, 6 skipped" and got[1][2] == "16 passed, 1 failed"
    (tmp_path / "gpu_test.log").write_text("killed\n")  # cut by the time limit: no closing line
    assert rows_of(tmp_path, bar="single-process")[0].status == vd.MISSING
    # the CPU dry run of gpu_session.sh passes the same files, but its probe found no GPU
    (tmp_path / "gpu_test.log").write_text("80 passed in 200.1s\n")
    (tmp_path / "session.log").write_text("nvidia-smi: command not found\nTraceback (most recent call last):\n")
    row = rows_of(tmp_path, bar="single-process")[0]
    assert row.status == vd.MISSING and "no GPU" in row.figure


def loss_line(variant, ms, peak_mib, dh, dw, device="cuda", **over):
    return {"tokens": 16384, "vocab": 131072, "hidden": 4096, "tp": 1, "variant": variant, "dtype": "bfloat16",
            "device": device, "time_s": ms / 1e3, "peak_bytes": peak_mib * 2 ** 20, "errors": {"dh": dh, "dw": dw},
            **over}


def test_loss_bar_needs_every_part_at_once(tmp_path):
    write(tmp_path, "bench_loss.jsonl", [
        loss_line("unfused", 115.7, 24576, 8.6e-4, 1.7e-4), loss_line("cce", 103.6, 1154, 1e-2, 4.6e-3),
        loss_line("fused", 98.0, 3200, 5.9e-4, 1.3e-4),       # fast, but above CCE's memory
        loss_line("fused_bwdw", 103.0, 1153, 5.9e-4, 1.3e-4),  # meets all four
        loss_line("fused_bwdw_2read", 106.5, 1153, 5.9e-4, 1.3e-4),  # an A/B figure, not a bar of its own
        {"tokens": 16384, "vocab": 131072, "hidden": 4096, "tp": 1, "variant": "liger", "skipped": "not installed"}])
    rows = rows_of(tmp_path, bar="fused loss")
    assert [r.status for r in rows] == [vd.NOT_MET, vd.MET]
    assert rows[0].figure.endswith("fails peak <= cce")
    assert rows[1].figure.endswith("forward reading each logit twice (fused_bwdw_2read): 106.5 ms")
    # candidate settings (bench loss's knob variants) are listed beside their variant, fastest first; the
    # bar still reads the variant itself (here: too slow, though a knob would meet it)
    write(tmp_path, "bench_loss.jsonl", [
        loss_line("unfused", 115.1, 12352, 2.4e-3, 2.4e-3), loss_line("cce", 175.3, 1153.67, 1.3e-2, 5e-3),
        loss_line("fused_bwdw", 117.0, 1153.4, 1.7e-3, 1.7e-3),
        loss_line("fused_bwdw:VOCAB_TILE=4096", 111.0, 1153.4, 1.7e-3, 1.7e-3),
        loss_line("fused_bwdw:PIECE_COST_BYTES=0", 121.5, 1153.5, 1.7e-3, 1.7e-3)])
    (row,) = rows_of(tmp_path, bar="fused loss")
    assert row.status == vd.NOT_MET and row.figure.endswith(
        "; knobs: VOCAB_TILE=4096 111.0 ms 1153.40 MiB, PIECE_COST_BYTES=0 121.5 ms 1153.50 MiB; fails time <= unfused")
    write(tmp_path, "bench_loss.jsonl", [loss_line("unfused", 100.0, 24576, 8.6e-4, 1.7e-4),
                                         loss_line("fused_bwdw", 90.0, 1000, 5.9e-4, 1.3e-4)])
    assert [r.status for r in rows_of(tmp_path, bar="fused loss")] == [vd.MISSING]  # no CCE: not comparable
    # the bar is at the bench's default logits (std 1): lines at another --logit-std do not count
    write(tmp_path, "bench_loss.jsonl", [
        loss_line("unfused", 115.7, 24576, 8.6e-4, 1.7e-4), loss_line("cce", 103.6, 1154, 1e-2, 4.6e-3),
        dict(loss_line("fused_bwdw", 103.0, 1153, 5.9e-4, 1.3e-4), logit_std=0.64)])
    assert [r.status for r in rows_of(tmp_path, bar="fused loss")] == [vd.MISSING]


def test_e2e_mfu_bar(tmp_path):
    def e2e(mfu, device="NVIDIA H100 80GB HBM3", smoke=False, returncode=0):
        write(tmp_path, "e2e/e2e_results.json", [])
        (tmp_path / "e2e" / "e2e_results.json").write_text(json.dumps(
            {"env": {"device": device}, "smoke": smoke,
             "results": [{"variant": "mlm_burst", "mfu": mfu, "tokens_per_s": 30000, "returncode": returncode},
                         {"variant": "sdpa", "mfu": 0.9}]}))
        return [r.status for r in rows_of(tmp_path, bar="MFU")]

    assert e2e(0.45) == [vd.MET]
    assert e2e(0.4499) == [vd.NOT_MET]
    assert e2e(0.5, device="cpu") == [vd.MISSING]
    assert e2e(0.5, smoke=True) == [vd.MISSING]  # a tiny model's MFU is not the bar's
    assert e2e(0.5, returncode=1) == [vd.MISSING]
    # the run without --te-free-fusions is shown beside mlm_burst's figure, not judged against the bar
    (tmp_path / "e2e" / "e2e_results.json").write_text(json.dumps(
        {"env": {"device": "NVIDIA H100 80GB HBM3"}, "smoke": False,
         "results": [{"variant": "mlm_burst", "mfu": 0.46, "tokens_per_s": 30000, "returncode": 0},
                     {"variant": "mlm_burst_unfused", "mfu": 0.406, "returncode": 0}]}))
    rows = rows_of(tmp_path, bar="MFU")
    assert [r.status for r in rows] == [vd.MET] and "without --te-free-fusions: MFU 40.6 %" in rows[0].figure


def test_failed_and_skipped_bars_are_listed_as_missing(tmp_path):
    """Every bar the bench names is a row: one whose runs all failed or were skipped says why, and a linear
    line whose fp32 reference failed (errors null) has no error half to compare."""
    shape = {"s": 32768, "b": 1, "h": 16, "d": 128, "W": 1}
    write(tmp_path, "bench_linear.jsonl", [
        line("local", "lasp2_token", "fla_direct", 10.0, shape=shape, errors=None),
        line("local", "lasp2_token", "fla", 10.0, shape=shape, errors=None),
        {"section": "local", "name": "gdn", "variant": "fla", "error": "OutOfMemoryError: CUDA out of memory", **GPU},
        {"section": "local", "name": "lasp2_channel", "variant": "fla", "skipped": "fla refuses", **GPU}])
    write(tmp_path, "bench_gpu.jsonl", [
        {"section": "sparse", "name": "static_s65536", "variant": "sparse_static", "error": "RuntimeError: boom", **GPU},
        {"section": "rank_block", "name": "W8_s65536_zigzag", "variant": "engine_blocks", "error": "oom", **GPU}])
    got = {r.bar.split(",")[0].split(":")[0]: (r.status, r.figure) for r in vd.verdict(str(tmp_path))[0]}
    assert got["lasp2_token"][0] == vd.MISSING and "no errors recorded" in got["lasp2_token"][1]
    assert got["gdn"][0] == vd.MISSING and "OutOfMemoryError" in got["gdn"][1]
    assert got["lasp2_channel"][0] == vd.MISSING and "fla refuses" in got["lasp2_channel"][1]
    assert got["sparse static_s65536 sparse_static"] == (vd.MISSING, "error: RuntimeError: boom")
    assert got["rank block W8_s65536_zigzag"][0] == vd.MISSING and "oom" in got["rank block W8_s65536_zigzag"][1]


def test_linear_bar_time_and_errors(tmp_path):
    shape = {"s": 32768, "b": 1, "h": 16, "d": 128, "W": 1}
    write(tmp_path, "bench_linear.jsonl", [
        line("local", "gdn", "fla_direct", 10.0, shape=shape, errors={"out": 2e-3, "dq": 3e-3}),
        line("local", "gdn", "fla", 11.0, shape=shape, errors={"out": 2e-3, "dq": 3e-3}),
        line("local", "gdn", "torch", 90.0, shape=shape, errors={"out": 1e-3, "dq": 1e-3}),
        line("local", "lasp2_token", "fla_direct", 10.0, shape=shape, errors={"out": 2e-3}),
        line("local", "lasp2_token", "fla", 10.0, shape=shape, errors={"out": 2.1e-3}),
        line("local", "lasp2_none", "fla_direct", 1.0, shape={**shape, "s": 8192}, errors={}),
        line("local", "lasp2_none", "fla", 1.0, shape={**shape, "s": 8192}, errors={})])
    got = {r.bar.split(",")[0]: (r.status, r.figure) for r in rows_of(tmp_path, "I3")}
    assert got["gdn"][0] == vd.MET and got["lasp2_none"][0] == vd.MISSING
    assert got["lasp2_token"] == (vd.NOT_MET, "10.00 ms vs 10.00 ms: 1.00x; errors above fla's: out 2.1e-03 > 2.0e-03")


def test_an_empty_directory_is_all_missing(tmp_path, capsys):
    assert vd.main([str(tmp_path), "--out", str(tmp_path / "verdict.md")]) == 0
    text = capsys.readouterr().out
    assert text == (tmp_path / "verdict.md").read_text()
    rows, _ = vd.verdict(str(tmp_path))
    assert rows and {r.status for r in rows} == {vd.MISSING}
    assert f"0 met, 0 not met, {len(rows)} missing" in text
    with pytest.raises(SystemExit):
        vd.main([str(tmp_path / "absent")])
