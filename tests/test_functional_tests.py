"""megatron_burst.functional_tests: the cases parse and map to the trainer's flags, the runner compares
with Megatron-LM's rules and says what is wrong (a metric off, a missing golden file, unknown flags,
a CP run that differs from its CP = 1 twin), a CI subset of the cases passes end to end, and
Megatron-LM's own python_test_utils and argument parser accept the cases."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import pythonpath

from megatron_burst.functional_tests import cases as fc
from megatron_burst.functional_tests import golden as gv
from megatron_burst.functional_tests import runner as fr

REPO = Path(__file__).resolve().parents[1]
# the cases CI runs end to end (make functional-test runs them all): CP 2 and 4, ckpt-resume across CP sizes
CI_CASES = ["gpt_cp2_burst_striped", "gpt_cp4_ring_striped", "gpt_ckpt_resume_cp2_to_cp1"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath(str(REPO))}


def _cli(*argv, timeout=900):
    return subprocess.run([sys.executable, "-m", "megatron_burst.functional_tests", *argv], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _cli_in_process(capsys, *argv):
    """The CLI's main() in this process, for commands that only read the cases (list, harness-command,
    usage errors): a CompletedProcess-like (returncode, stdout, stderr). The `python -m` entry point
    itself runs as a subprocess in test_ci_cases_pass_end_to_end."""
    import types
    import warnings

    from megatron_burst.functional_tests.__main__ import main

    capsys.readouterr()
    with warnings.catch_warnings():  # main() silences warnings process-wide; keep that to this call
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    out, err = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_every_case_maps_to_the_trainer_and_has_golden_values():
    cases = fc.list_cases()
    assert len(cases) >= 12
    variables = fc.paths_env(Path("/w"), Path("/d"))
    for case in cases:
        for args in filter(None, (case.model_args, case.model_args_2)):
            mapped = fc.trainer_argv(fc.resolve_vars(args, variables, case.name), case.name)
            assert "--distributed-backend" in mapped.argv and "gloo" in mapped.argv, case.name
            assert mapped.argv[mapped.argv.index("--data-path") + 1] == f"/d/{fr.CORPUS_NAME}"
        golden = gv.read_golden(case.golden_path)
        assert set(gv.RECORDED) <= set(golden), case.name
        for metric in golden.values():
            assert list(metric["values"]) == [str(s) for s in range(1, case.train_iters + 1)], case.name
            assert (metric["start_step"], metric["end_step"], metric["step_interval"]) == (1, case.train_iters, 1)
        assert case.deterministic and case.metrics == ["lm loss", "num-zeros"]
        twin = fc.cp1_twin(case.model_args)
        assert twin["--context-parallel-size"] == 1 and not set(fc.CP_ONLY_FLAGS) & set(twin)


def test_the_cases_cover_every_feature():
    """One case per feature a user enables (the issue's list); a new CP algorithm or flag adds a directory."""
    seen = {c.name: c.model_args for c in fc.list_cases()}
    sizes = {(a.get("--cp-algo"), a["--context-parallel-size"]) for a in seen.values()}
    assert {(algo, cp) for algo in ("ring", "burst", "auto") for cp in (2, 4)} <= sizes
    assert {"contiguous", "zigzag", "striped", "balanced"} <= {a.get("--cp-layout") for a in seen.values()}
    assert any(a["--tensor-model-parallel-size"] == 2 and a["--context-parallel-size"] == 2 for a in seen.values())
    assert any("--cp-ranks-per-node" in a for a in seen.values())
    assert any("--seq-selective-ckpt-ratio" in a and "--recompute-granularity" in a for a in seen.values())
    assert any(a.get("--fused-lm-loss") is True for a in seen.values())
    assert any("--linear-attention-type" in a for a in seen.values())
    resume = [c for c in fc.list_cases() if c.test_type == "ckpt-resume"]
    assert any(c.size("--context-parallel-size") != c.size("--context-parallel-size", True) for c in resume)


def test_model_args_become_words_by_megatron_lms_launcher_rules():
    words = fc.megatron_words({"--a": True, "--b": 3, "--c": "[2 2]", "--d": "x y", "--e": 1e-05, "--f": [1, 2]})
    assert words == ["--a", "--b", "3", "--c", "2", "2", "--d", "x y", "--e", "1e-05", "--f", "1", "2"]
    with pytest.raises(fc.CaseError, match="drop the flag"):
        fc.megatron_words({"--bf16": False})


def test_unknown_refused_and_mapped_flags_are_reported():
    base = fc.list_cases()[0].model_args
    resolved = fc.resolve_vars(base, fc.paths_env(Path("/w"), Path("/d")), "x")
    bad = {**resolved, "--frobnicate": 1, "--bf16": True, "--pipeline-model-parallel-size": 2, "--ckpt-format":
           "torch_dist", "--log-params-norm": True}
    with pytest.raises(fc.CaseError) as exc:
        fc.trainer_argv(bad, "case_x/model_config.yaml")
    text = str(exc.value)
    assert "case_x/model_config.yaml: cannot run on CPU" in text
    assert "unknown flag(s) --frobnicate" in text and "--log-params-norm" not in text
    assert "--bf16: the CPU runner trains in fp32" in text
    assert "--pipeline-model-parallel-size 2: the CPU trainer has no pipeline parallelism" in text
    assert "--ckpt-format torch_dist" in text
    ok = fc.trainer_argv({**resolved, "--log-params-norm": True, "--lr-warmup-fraction": 0.3,
                          "--pipeline-model-parallel-size": 1}, "x")
    assert "--log-params-norm" in ok.ignored and "--tensorboard-dir" in ok.ignored
    assert any("nccl -> gloo" in m for m in ok.mapped)
    assert ok.argv[ok.argv.index("--lr-warmup-iters", ok.argv.index("--lr-warmup-iters") + 1) + 1] == "3"
    with pytest.raises(fc.CaseError, match=r"unknown variable 'NOPE'.*\$\{DATA_PATH\}"):
        fc.resolve_vars({"--data-path": "${NOPE}/x"}, fc.paths_env(Path("/w"), Path("/d")), "x")


def _rows(losses, times=None):
    return [{"iteration": i + 1, "lm_loss": v, "num_zeros": 100 + i, "elapsed_s": (times or [0.1] * len(losses))[i]}
            for i, v in enumerate(losses)]


def test_comparison_follows_megatron_lm_thresholds():
    losses = [5.0, 4.5, 4.2, 4.0]
    golden = gv.to_golden(_rows(losses), 4)
    assert golden["lm loss"]["values"] == {"1": 5.0, "2": 4.5, "3": 4.2, "4": 4.0}
    same = gv.compare(golden, gv.to_golden(_rows([v + 1e-7 for v in losses]), 4), ["lm loss", "num-zeros"], True)
    assert all(c.ok for c in same)  # below the 5 recorded decimals
    off = gv.compare(golden, gv.to_golden(_rows([5.0, 4.5, 4.20002, 4.0]), 4), ["lm loss"], True)[0]
    assert not off.ok and off.rule == "exact"
    assert "lm loss differs from golden values (exact) at 1 of 4 steps: step 3: 4.20002 vs golden 4.2" in off.message
    approx = lambda scale: gv.compare(golden, gv.to_golden(_rows([v * scale for v in losses]), 4),  # noqa: E731
                                      ["lm loss"], False)[0]
    assert approx(1.04).ok and not approx(1.06).ok and "rtol 0.05" in approx(1.06).message
    # iteration time: median, approximate even in a deterministic case
    timed = gv.to_golden(_rows(losses, [1.0, 0.2, 0.2, 0.2]), 4)
    check = lambda t: gv.compare(timed, gv.to_golden(_rows(losses, t), 4), ["iteration-time"], True)[0]  # noqa
    assert check([9.0, 0.204, 0.21, 0.2]).ok and not check([0.3, 0.3, 0.3, 0.3]).ok
    missing = gv.compare({"lm loss": golden["lm loss"]}, golden, ["lm loss", "num-zeros"], True)[1]
    assert not missing.ok and "not in its golden values; record them again" in missing.message
    short = gv.compare(golden, gv.to_golden(_rows(losses[:3]), 3), ["lm loss"], True)[0]
    assert not short.ok and "steps 4 missing from this run" in short.message


def _copy_case(tmp_path, name="gpt_cp2_burst_striped", keep_golden=True):
    src = fc.CASES_DIR / name
    dst = tmp_path / "cases" / name
    shutil.copytree(src, dst)
    if not keep_golden:
        (dst / "golden_values_cpu.json").unlink()
    return fc.load_case(dst)


class FakeLaunch:
    """Stands in for the training processes: losses by CP size (``cp_offset`` makes CP > 1 differ)."""

    def __init__(self, cp_offset=0.0):
        self.calls = []
        self.cp_offset = cp_offset

    def __call__(self, world_size, argv, cwd, log_path, env=None):
        self.calls.append((world_size, list(argv)))
        cp = int(argv[argv.index("--context-parallel-size") + 1])
        return _rows([5.0 - 0.1 * i + (self.cp_offset if cp > 1 else 0.0) for i in range(10)])


def test_missing_golden_file_says_how_to_record(tmp_path, monkeypatch):
    fake = FakeLaunch()
    monkeypatch.setattr(fr, "launch", fake)
    case = _copy_case(tmp_path, keep_golden=False)
    result = fr.Runner(tmp_path / "work").run(case)
    assert not result.ok and not fake.calls  # fails before training
    assert ("golden_values_cpu.json does not exist: record it with `python -m megatron_burst.functional_tests "
            "record gpt_cp2_burst_striped`") in result.error
    assert "ERROR" in fr.format_table([result])


def test_record_refuses_when_cp_run_differs_from_its_twin(tmp_path, monkeypatch):
    """Golden values must not record whatever the code did: a CP = 2 loss 1e-3 off its twin is refused."""
    monkeypatch.setattr(fr, "launch", FakeLaunch(cp_offset=1e-3))
    case = _copy_case(tmp_path, keep_golden=False)
    result = fr.Runner(tmp_path / "work").run(case, record=True)
    assert not result.ok and not case.golden_path.exists()
    assert "not recording golden values: CP=2 vs CP=1 twin: largest relative difference" in result.error
    monkeypatch.setattr(fr, "launch", FakeLaunch(cp_offset=1e-6))  # float rounding: recorded
    result = fr.Runner(tmp_path / "work").run(case, record=True)
    assert result.ok and case.golden_path.exists(), result.error
    recorded = gv.read_golden(case.golden_path)
    assert recorded["lm loss"]["values"]["1"] == 5.0  # rounded to 5 decimals
    # the twin ran once on one rank with the CP-only flags dropped
    monkeypatch.setattr(fr, "launch", fake := FakeLaunch())
    runner = fr.Runner(tmp_path / "work")
    runner.run(case)
    runner.run(case)
    assert [w for w, _ in fake.calls] == [2, 1, 2]
    assert "--cp-algo" not in fake.calls[1][1] and "--cp-layout" not in fake.calls[1][1]


def test_metric_off_by_more_than_tolerance_fails_with_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(fr, "launch", FakeLaunch())
    case = _copy_case(tmp_path)
    golden = gv.to_golden(_rows([5.0 - 0.1 * i for i in range(10)]), 10)
    golden["lm loss"]["values"]["7"] = 4.5  # the run has 4.4
    gv.write_golden(case.golden_path, golden)
    result = fr.Runner(tmp_path / "work").run(case)
    assert not result.ok
    table = fr.format_table([result])
    assert "| lm loss " in table and "FAIL" in table and "0/1 cases passed" in table
    assert "step 7: 4.4 vs golden 4.5" in fr.failures([result])


def test_cli_lists_cases_and_refuses_unknown_ones(capsys):
    res = _cli_in_process(capsys, "list")
    assert res.returncode == 0, res.stderr
    for case in fc.list_cases():
        assert case.name in res.stdout
    assert "gpt_ckpt_resume_cp2_to_cp1               ckpt-resume  TP 1 CP 2 -> CP 1" in res.stdout
    res = _cli_in_process(capsys, "run", "gpt_no_such_case")
    assert res.returncode == 2 and "unknown case(s) gpt_no_such_case; known: " in res.stderr


def test_ci_cases_pass_end_to_end(tmp_path):
    """The CI subset through the CLI: real gloo ranks, CP = 1 twins, the ckpt-resume flow, golden values."""
    res = _cli("run", *CI_CASES, "--work-dir", str(tmp_path / "work"), "--actual-dir", str(tmp_path / "actual"))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert f"{len(CI_CASES)}/{len(CI_CASES)} cases passed" in res.stdout
    assert "lm loss = CP=1 twin" in res.stdout and "lm loss after resume" in res.stdout
    assert "FAIL" not in res.stdout and "ERROR" not in res.stdout
    assert res.stdout.count("CP = 1 twin on 1 rank(s)") == 1  # one twin serves all three
    for name in CI_CASES:
        assert json.loads((tmp_path / "actual" / f"{name}.json").read_text())["lm loss"]["end_step"] == 10
    if _megatron_lm() is not None:  # Megatron-LM's own pipeline accepts this run's values too
        res = _cli("check-megatron-lm", *CI_CASES, "--megatron-lm", str(_megatron_lm()), "--actual-dir",
                   str(tmp_path / "actual"))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _megatron_lm():
    from megatron_burst.functional_tests.megatron_lm import find_megatron_lm

    try:
        return find_megatron_lm(log=lambda line: None)
    except RuntimeError:
        return None


def test_megatron_lms_harness_accepts_every_case(tmp_path):
    """Megatron-LM's python_test_utils (read from a checkout fetched at run time, not vendored) validate
    every golden-values file and the argument parser with our provider takes every MODEL_ARGS entry;
    a case with a flag Megatron-LM does not know fails."""
    mlm = _megatron_lm()
    if mlm is None:
        pytest.skip("no Megatron-LM checkout: set MEGATRON_LM_DIR, or MEGATRON_LM_GIT to a reachable clone URL/mirror")
    cases_dir = tmp_path / "cases"
    shutil.copytree(fc.CASES_DIR, cases_dir)
    bad = cases_dir / "gpt_zz_bad_flag"
    shutil.copytree(cases_dir / "gpt_cp2_burst_striped", bad)
    config = (bad / "model_config.yaml").read_text()
    (bad / "model_config.yaml").write_text(config.replace("MODEL_ARGS:\n", "MODEL_ARGS:\n  --frobnicate: 1\n"))
    res = _cli("--cases-dir", str(cases_dir), "check-megatron-lm", "--megatron-lm", str(mlm))
    lines = [line for line in res.stdout.splitlines() if line.startswith(("ok  ", "FAIL"))]
    assert len(lines) == len(fc.list_cases()) + 1, res.stdout + res.stderr[-3000:]
    for line in lines:
        if "gpt_zz_bad_flag" in line:
            assert line.startswith("FAIL") and "rejects MODEL_ARGS: " in line and "--frobnicate" in line, line
        else:
            assert line.startswith("ok  ") and "(1 % off fails)" in line, line
    assert "test_resume_checkpoint_pipeline" in res.stdout and res.returncode == 1


def test_ckpt_resume_without_the_middle_checkpoint_is_an_error(tmp_path, monkeypatch):
    """The resume half of a ckpt-resume case needs the first run's checkpoint at --train-iters / 2."""
    monkeypatch.setattr(fr, "launch", fake := FakeLaunch())  # trains nothing, so saves nothing
    case = _copy_case(tmp_path, "gpt_ckpt_resume_cp2_to_cp1")
    result = fr.Runner(tmp_path / "work").run(case)
    assert not result.ok and len(fake.calls) == 2  # the first run and its twin, no resumed run
    assert "the first run left no checkpoint at iteration 5" in result.error
    assert "--save-interval 5" in result.error


class FakeCheckpointingLaunch(FakeLaunch):
    """FakeLaunch that saves like the trainer (iter_XXXXXXX every --save-interval, tracker at the end)
    and, given --load, resumes after the tracker's iteration."""

    def __call__(self, world_size, argv, cwd, log_path, env=None):
        rows = super().__call__(world_size, argv, cwd, log_path, env)
        flag = lambda name: argv[argv.index(name) + 1] if name in argv else None  # noqa: E731
        start = 0
        if flag("--load") and (Path(flag("--load")) / "latest_checkpointed_iteration.txt").exists():
            start = int((Path(flag("--load")) / "latest_checkpointed_iteration.txt").read_text())
            self.loaded = (start, sorted(p.name for p in Path(flag("--load")).iterdir()))
        if flag("--save"):
            save, every = Path(flag("--save")), int(flag("--save-interval"))
            for it in range(start + 1, len(rows) + 1):
                if it % every == 0:
                    (save / f"iter_{it:07d}").mkdir(parents=True, exist_ok=True)
            (save / "latest_checkpointed_iteration.txt").write_text(str(len(rows)))
        return rows[start:]


def test_ckpt_resume_drops_the_last_checkpoint_and_resumes_from_the_middle(tmp_path, monkeypatch):
    """Megatron-LM's ckpt-resume flow: the first run saves at 5 and 10; iter_0000010 goes, the tracker
    says 5, MODEL_ARGS_2 (CP = 1, one rank) resumes, and its iterations 6-10 are compared."""
    monkeypatch.setattr(fr, "launch", fake := FakeCheckpointingLaunch())
    case = _copy_case(tmp_path, "gpt_ckpt_resume_cp2_to_cp1")
    gv.write_golden(case.golden_path, gv.to_golden(_rows([5.0 - 0.1 * i for i in range(10)]), 10))
    result = fr.Runner(tmp_path / "work").run(case)
    assert result.ok, (result.error, [c.message for c in result.checks])
    assert [w for w, _ in fake.calls] == [2, 1, 1]  # first run, twin, resumed run at CP = 1
    assert fake.loaded == (5, ["iter_0000005", "latest_checkpointed_iteration.txt"])
    resume = [c for c in result.checks if c.metric == fr.RESUME_CHECK]
    assert len(resume) == 1 and "resumed at CP=1 vs first run at CP=2, iterations 6-10" in resume[0].message


def test_a_failing_rank_stops_the_run_with_its_status_and_log(tmp_path):
    """A bad flag on the trainer: the first rank to exit 2 stops the others; RunError names the statuses
    and shows the log."""
    with pytest.raises(fr.RunError) as exc:
        fr.launch(2, ["--num-layers", "1"], tmp_path, tmp_path / "train.log", timeout=300)
    text = str(exc.value)
    assert "training failed (rank 0: " in text and "exit 2" in text and "arguments are required" in text
    assert fr._status(-6) == "killed by SIGABRT"


def test_num_zeros_must_equal_the_twins(tmp_path, monkeypatch):
    class ZerosOff(FakeLaunch):
        def __call__(self, world_size, argv, cwd, log_path, env=None):
            rows = super().__call__(world_size, argv, cwd, log_path, env)
            if world_size > 1:
                rows[3]["num_zeros"] += 1
            return rows

    monkeypatch.setattr(fr, "launch", ZerosOff())
    case = _copy_case(tmp_path, keep_golden=False)
    result = fr.Runner(tmp_path / "work").run(case, record=True)
    assert not result.ok and not case.golden_path.exists()
    assert "not recording golden values: CP=2 vs CP=1 twin: num-zeros [100, 101, 102, 104," in result.error


def test_readme_harness_command_reads_a_golden_file_every_case_has():
    """Issue M2: the documented run_ci_test.sh command read golden_values_dev_dgx_h100.json, which no
    case has (Megatron-LM's harness then fails reading it). The command lives in
    docs/functional-tests.md, which the README links to."""
    import re

    readme = (REPO / "README.md").read_text()
    assert "docs/functional-tests.md#in-megatron-lms-own-harness-gpu" in readme
    page = (REPO / "docs" / "functional-tests.md").read_text()
    named = re.findall(r"GOLDEN_VALUES_PATH=\$CASE/(\S+)", page)
    assert named, "docs/functional-tests.md shows no run_ci_test.sh command"
    for name in named:
        missing = [c.name for c in fc.list_cases() if not (c.path / name).exists()]
        assert not missing, f"README passes GOLDEN_VALUES_PATH=$CASE/{name}, which {missing} lack"


def test_harness_command_names_each_cases_golden_file_and_ranks(capsys):
    import re

    cases = fc.list_cases()
    res = _cli_in_process(capsys, "harness-command")
    assert res.returncode == 0, res.stderr
    blocks = res.stdout.split("# ")[1:]
    assert [b.split("\n", 1)[0] for b in blocks] == [c.name for c in cases]
    for case, block in zip(cases, blocks):
        gold = re.search(r"GOLDEN_VALUES_PATH=tests/functional_tests/test_cases/gpt/(\S+)/(\S+)", block)
        assert gold and gold.group(1) == case.name and (case.path / gold.group(2)).exists(), block
        assert f"GPUS_PER_NODE={case.world_size()}" in block and "run_ci_test.sh" in block, block
    res = _cli_in_process(capsys, "harness-command", "gpt_cp2_burst_striped", "--golden",
                          "golden_values_dev_dgx_h100.json")
    assert res.returncode == 2
    assert "has no golden_values_dev_dgx_h100.json (it has golden_values_cpu.json)" in res.stderr
