"""scripts/gpu_session.sh (what a GPU session runs in its one device call) on CPU, cut to its plumbing:
a part with a share runs and logs its exit status and seconds, a part without one is logged as skipped,
the GPU suite's part exits 0, the autotune pack and the verdict are written. The benches and suites
themselves have their own CPU tests. It runs in a copy of the tracked files: a checkout's carried
.whl / .triton / .autotune (git-ignored) would otherwise be installed into this python or used."""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _copy_tracked(repo) -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, tracked.stdout.split("\0")):
        if os.path.isfile(os.path.join(REPO, name)):  # the working tree's version (deleted files left out)
            os.makedirs(repo / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), repo / name)


NO_PARTS = {"PROBE_S": "0", "ATTN_BENCH_SHARE": "0", "LOSS_BENCH_SHARE": "0", "LINEAR_BENCH_SHARE": "0",
            "E2E_SHARE": "0", "SUITE_SHARE": "0"}


@pytest.mark.skipif(sys.platform != "linux", reason="the session script is bash on the GPU machine's Linux")
def test_session_script_runs_its_parts_and_writes_the_verdict(tmp_path):
    out, repo = tmp_path / "session", tmp_path / "repo"
    _copy_tracked(repo)
    env = {**os.environ, "PY": sys.executable, "PROBE_S": "0", "ATTN_BENCH_SHARE": "40",
           "GPU_BENCH_ARGS": "--smoke --sections dense", "LOSS_BENCH_SHARE": "0", "LINEAR_BENCH_SHARE": "0",
           "E2E_SHARE": "0", "SUITE_SHARE": "50", "GPU_TEST_ARGS": "-k fusions", "GPU_MULTI_ARGS": "",
           "GPU_TEST_WORKERS": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton_cache")}
    env.pop("MEGATRON_BURST_GPU_TESTS_ON_CPU", None)  # the suite's tests skip here: only the part's plumbing runs
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", str(out), "200"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=400)
    log = (out / "session.log").read_text()
    tail = f"{log}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, tail
    assert "attention-bench: start" in log and "attention-bench: exit 0 after" in log, tail
    for skipped in ("cudnn-probe", "loss-bench", "linear-bench", "e2e", "profile"):
        assert f"{skipped}: skipped (its limit would be 0s" in log, (skipped, tail)
    assert "gpu-suite: exit 0 after" in log, tail
    assert (out / "bench_gpu.jsonl").read_text().strip(), tail
    assert (out / "autotune.tgz").exists()
    verdict = (out / "verdict.md").read_text()
    assert "| I1 |" in verdict and "| I2 |" in verdict and "| I3 |" in verdict, verdict


@pytest.mark.skipif(sys.platform != "linux", reason="the session script is bash on the GPU machine's Linux")
def test_linear_tests_early_start_first_and_are_waited_for(tmp_path):
    """LINEAR_TESTS_EARLY=1 with a carried Triton bundle: test_gpu_linear.py starts right after the loss
    bench (the benches before it time variants one after another, on a quiet GPU), runs beside the later parts, and the session waits for it (within the budget) and logs its exit
    before the verdict. The bundle here is a stand-in holding no triton (the real one imports); the
    tests run as their CPU dry run."""
    import lzma  # noqa: F401  (tarfile's xz needs it)
    import tarfile

    out, repo = tmp_path / "session", tmp_path / "repo"
    _copy_tracked(repo)
    (repo / ".triton").mkdir()
    marker = tmp_path / "README"
    marker.write_text("a stand-in bundle: no triton inside\n")
    tag = f"{sys.version_info[0]}{sys.version_info[1]}"
    with tarfile.open(repo / ".triton" / f"triton-0.0-cp{tag}.tar.xz", "w:xz") as t:
        t.add(marker, "README")
    # one single-process test of the file is enough for the plumbing (test_gpu_suite_dry_run runs them all)
    env = {**os.environ, **NO_PARTS, "PY": sys.executable, "LINEAR_TESTS_EARLY": "1", "GPU_LINEAR_WORKERS": "0",
           "GPU_LINEAR_ARGS": "-k test_linear_op_through_fla_on_one_gpu",
           "MEGATRON_BURST_GPU_TESTS_ON_CPU": "1", "CARRIED_TRITON_DIR": str(tmp_path / "carried"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton_cache")}
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", str(out), "200"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=400)
    log = (out / "session.log").read_text()
    tail = f"{log}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, tail
    lines = log.splitlines()
    early = lines.index("linear-tests: start early, beside the parts below")
    first = lambda part: min(i for i, line in enumerate(lines) if line.startswith(part + ":"))  # noqa: E731
    assert first("loss-bench") < early < first("masked-tune"), tail
    assert any(line.startswith("linear-tests: exit 0 after") for line in lines), tail
    linear_log = (out / "gpu_test_linear.log").read_text()
    assert " passed" in linear_log and " deselected" in linear_log, linear_log[-2000:]
    assert "linear" in (out / "verdict.md").read_text()
