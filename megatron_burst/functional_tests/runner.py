"""Run functional-test cases on CPU: one gloo process per rank, through ``python -m megatron_burst.train``.

For each case: its MODEL_ARGS run as the trainer's flags (:mod:`.cases`); the per-iteration metrics
become Megatron-LM's golden-values JSON (:mod:`.golden`) and are compared with the stored
``golden_values_cpu.json``. A case at CP > 1 is also run at CP = 1 (its *twin*: same model, data and
flags, CP-only flags dropped) and its loss curve must equal the twin's to :data:`TWIN_RTOL`, so golden
values never just record whatever the code did: ``record`` refuses to write them when that fails. A
``ckpt-resume`` case runs as Megatron-LM's harness runs it: train ``--train-iters`` saving every half,
drop the last checkpoint, resume from the middle one with ``MODEL_ARGS_2`` (if given; e.g. another CP
size), and compare the resumed half with the first run's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_burst.functional_tests import golden as gv
from megatron_burst.functional_tests.cases import (REPO_ROOT, Case, CaseError, cp1_twin, paths_env, resolve_vars,
                                                   trainer_argv)

TWIN_RTOL = 1e-4  # a CP > 1 loss curve vs its CP = 1 twin, every step, unrounded
TWIN_CHECK, ZEROS_TWIN_CHECK = "lm loss = CP=1 twin", "num-zeros = CP=1 twin"  # the table's names of these
RESUME_CHECK = "lm loss after resume"                                            # checks
CORPUS_BYTES = 256 * 1024
CORPUS_NAME = "megatron_burst_stdlib_text_document"  # under ${DATA_PATH}
RUN_TIMEOUT_S = 600
STEP_INTERVAL = 1  # tiny cases: every step is recorded
# flags a twin (a plain reference run) does not take from its case: it saves and loads nothing
_CHECKPOINT_FLAGS = ("--save", "--load", "--save-interval")


class RunError(RuntimeError):
    """A training run that did not finish: names the case, command, rank exit statuses and log tail."""


@dataclass
class CaseResult:
    """What one case did: its checks (golden values, twin, resume), the seconds it took, and its
    golden-values content of the first run."""
    case: Case
    checks: List[gv.MetricCheck] = field(default_factory=list)
    seconds: float = 0.0
    actual: Optional[gv.Golden] = None
    error: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.checks)


FAILED_RANK_GRACE_S = 10.0  # how long the other ranks may take to exit once one has failed


def prepare_data(work_root: Path) -> Path:
    """``${DATA_PATH}``: a directory holding the built-in byte corpus as ``CORPUS_NAME.{bin,idx}``
    (Megatron indexed data; NullTokenizer with --vocab-size 256 reads it: bytes, EOD 256)."""
    from megatron_burst import data

    data_path = Path(work_root) / "data"
    data_path.mkdir(parents=True, exist_ok=True)
    prefix = data.default_corpus(str(Path(work_root) / "corpus"), max_bytes=CORPUS_BYTES)
    for ext in (".bin", ".idx"):
        link = data_path / (CORPUS_NAME + ext)
        if link.is_symlink() and os.readlink(link) != os.path.abspath(prefix + ext):
            link.unlink()  # left by an older corpus
        if not link.exists():
            os.symlink(os.path.abspath(prefix + ext), link)
    return data_path


def launch(world_size: int, argv: Sequence[str], cwd: Path, log_path: Path, timeout: float = RUN_TIMEOUT_S,
           env: Optional[Dict[str, str]] = None) -> List[Dict[str, float]]:
    """Run ``python -m megatron_burst.train argv`` on ``world_size`` gloo ranks (one process each, as
    torchrun would set them up); returns rank 0's per-iteration metrics. Any rank failing (a nonzero
    status, a signal, the timeout) stops the others and raises RunError.

    A run that failed in the rendezvous (before the trainer's first line: e.g. another process took the
    free port between choosing and binding it, on a shared machine) is started once more on a new port.
    """
    try:
        return _launch_once(world_size, argv, cwd, log_path, timeout, env)
    except RunError as exc:
        text = log_path.read_text() if log_path.exists() else ""
        if "megatron-burst train:" in text or not any(s in text for s in _RENDEZVOUS_ERRORS):
            raise
        print(f"rendezvous failed ({exc.args[0].splitlines()[0]}); starting the run once more on a new port",
              flush=True)
        return _launch_once(world_size, argv, cwd, log_path, timeout, env)


_RENDEZVOUS_ERRORS = ("TCPStore", "DistNetworkError", "rendezvous", "Address already in use")


def _launch_once(world_size: int, argv: Sequence[str], cwd: Path, log_path: Path, timeout: float,
                 env: Optional[Dict[str, str]]) -> List[Dict[str, float]]:
    from megatron_burst.world import free_port

    cwd.mkdir(parents=True, exist_ok=True)
    metrics_file = cwd / f"metrics-{os.getpid()}-{time.monotonic_ns()}.json"
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    base["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [base.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "megatron_burst.train", *argv, "--metrics-file", str(metrics_file)]
    procs = []
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        for rank in range(world_size):
            procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        deadline = time.monotonic() + timeout
        codes: List[Optional[int]] = [None] * world_size
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                # one rank failed (or time is up): the others would wait forever. A short grace first,
                # so that a rank failing on the same error (rank 0 prints usage errors) gets it logged
                grace = time.monotonic() + (FAILED_RANK_GRACE_S if time.monotonic() <= deadline else 0.0)
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(0.05)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for i, p in enumerate(procs):
                    codes[i] = p.wait()
                break
            time.sleep(0.05)
    if any(codes) or not metrics_file.exists():
        timed_out = time.monotonic() > deadline
        status = ", ".join(f"rank {r}: {_status(c)}" for r, c in enumerate(codes))
        tail = log_path.read_text()[-3000:]
        raise RunError(f"training {'timed out' if timed_out else 'failed'} ({status}); log {log_path}:\n{tail}")
    with open(metrics_file) as f:
        rows = json.load(f)["metrics"]
    metrics_file.unlink()
    return rows


def _status(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


class Runner:
    """Runs cases under ``work_root`` (scratch: data, checkpoints, logs); CP = 1 twins are cached by
    their flags, so cases sharing a model run their twin once."""

    def __init__(self, work_root: Optional[Path] = None, echo=print):
        self.work_root = Path(work_root or tempfile.mkdtemp(prefix="burst-functional-"))
        self.work_root.mkdir(parents=True, exist_ok=True)
        self.data_path = prepare_data(self.work_root)
        self.echo = echo
        self._twins: Dict[Tuple[int, Tuple[str, ...]], List[Dict[str, float]]] = {}

    def _args(self, case: Case, model_args, work: Path):
        variables = paths_env(work, self.data_path, self.work_root / "data_cache")  # one cache: twins compare equal
        resolved = resolve_vars(model_args, variables, f"{case.path}/model_config.yaml")
        return resolved, trainer_argv(resolved, f"{case.name}/model_config.yaml")

    def _twin(self, case: Case, resolved, world_size: int, tp: int) -> List[Dict[str, float]]:
        twin_args = {k: v for k, v in cp1_twin(resolved).items() if k not in _CHECKPOINT_FLAGS}
        argv = trainer_argv(twin_args, f"{case.name} (CP = 1 twin)").argv
        key = (tp, tuple(argv))
        if key not in self._twins:
            work = self.work_root / "twins" / hashlib.sha1(repr(key).encode()).hexdigest()[:12]
            if work.exists():
                shutil.rmtree(work)
            work.mkdir(parents=True)
            self.echo(f"  CP = 1 twin on {tp} rank(s)")
            self._twins[key] = launch(tp, argv, work, work / "train.log", env=case.environ())
        return self._twins[key]

    def run(self, case: Case, record: bool = False) -> CaseResult:
        """Run ``case``; compare with its golden values (``record``: write them, if the twin and
        resume checks pass)."""
        result = CaseResult(case)
        t0 = time.monotonic()
        try:
            self._run(case, result, record)
        except (CaseError, RunError, FileNotFoundError) as exc:
            result.error = str(exc)
        result.seconds = time.monotonic() - t0
        return result

    def _run(self, case: Case, result: CaseResult, record: bool) -> None:
        work = self.work_root / "cases" / case.name
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        resolved, targv = self._args(case, case.model_args, work)
        result.notes += [f"ignored on CPU: {', '.join(targv.ignored)}"] if targv.ignored else []
        result.notes += [f"mapped: {'; '.join(targv.mapped)}"] if targv.mapped else []
        second = None
        if case.test_type == "ckpt-resume":  # check MODEL_ARGS_2 before training anything
            second = self._args(case, case.model_args_2 or case.model_args, work)
        if not record:
            gv.read_golden(case.golden_path)  # a missing file fails now, saying how to record it
        world = case.world_size()
        tp = case.size("--tensor-model-parallel-size")
        self.echo(f"{case.name}: {case.test_type} on {world} rank(s)")
        rows = launch(world, targv.argv, work, work / "train.log", env=case.environ())
        losses = [r["lm_loss"] for r in rows]
        if case.size("--context-parallel-size") > 1:
            twin_rows = self._twin(case, resolved, world, tp)
            what = f"CP={case.size('--context-parallel-size')} vs CP=1 twin"
            result.checks.append(gv.curves_match(TWIN_CHECK, losses, [r["lm_loss"] for r in twin_rows], TWIN_RTOL,
                                                 what))
            if all("num_zeros" in r for r in rows + twin_rows):  # the same gradient zeros (unseen tokens' rows)
                zeros, twin_zeros = [r["num_zeros"] for r in rows], [r["num_zeros"] for r in twin_rows]
                result.checks.append(gv.MetricCheck(
                    ZEROS_TWIN_CHECK, "exact", zeros == twin_zeros,
                    f"{what}: num-zeros {'equal' if zeros == twin_zeros else f'{zeros} differ from {twin_zeros}'}"))
        if second is not None:
            self._resume(case, result, rows, resolved, second, work)
        result.actual = gv.to_golden(rows, case.train_iters, STEP_INTERVAL)
        if record:
            if not all(c.ok for c in result.checks):
                raise CaseError(f"{case.name}: not recording golden values: "
                                + "; ".join(c.message for c in result.checks if not c.ok))
            gv.write_golden(case.golden_path, result.actual)
            result.checks.append(gv.MetricCheck("golden values", "-", True, f"recorded {case.golden_path}"))
            return
        golden = gv.read_golden(case.golden_path)
        result.checks += gv.compare(golden, result.actual, case.metrics, case.deterministic)

    def _resume(self, case: Case, result: CaseResult, first: List[Dict[str, float]], resolved, second,
                work: Path) -> None:
        """Megatron-LM's ckpt-resume: keep the middle checkpoint, resume, compare the second half."""
        resolved2, targv2 = second
        if not resolved.get("--save") or resolved2.get("--load") != resolved["--save"]:
            raise CaseError(f"{case.name}: a ckpt-resume case saves with --save and resumes with --load from the "
                            "same directory (Megatron-LM: ${CHECKPOINT_SAVE_PATH}, ${CHECKPOINT_LOAD_PATH})")
        save_dir = Path(str(resolved["--save"]))
        half = case.train_iters // 2
        tracker = save_dir / "latest_checkpointed_iteration.txt"
        if not (save_dir / f"iter_{half:07d}").is_dir():
            raise CaseError(f"{case.name}: the first run left no checkpoint at iteration {half} in {save_dir}: "
                            f"a ckpt-resume case needs --save, --load and --save-interval {half}")
        last = save_dir / f"iter_{case.train_iters:07d}"
        if last.is_dir():
            shutil.rmtree(last)
        tracker.write_text(str(half))
        world2 = case.world_size(second_run=True)
        cp1, cp2 = case.size("--context-parallel-size"), case.size("--context-parallel-size", second_run=True)
        self.echo(f"  resume from iteration {half} on {world2} rank(s) (CP {cp1} -> {cp2})")
        rows2 = launch(world2, targv2.argv, work / "resume", work / "resume.log", env=case.environ())
        steps2 = [int(r["iteration"]) for r in rows2]
        if steps2 != list(range(half + 1, case.train_iters + 1)):
            result.checks.append(gv.MetricCheck(RESUME_CHECK, "-", False, f"resumed run logged iterations {steps2}, "
                                                f"not {half + 1}..{case.train_iters}"))
            return
        what = f"resumed at CP={cp2} vs first run at CP={cp1}, iterations {half + 1}-{case.train_iters}"
        if cp1 == cp2 and case.deterministic:  # Megatron-LM's rule: the same run again, exactly
            a = gv.to_golden(rows2, case.train_iters, STEP_INTERVAL)
            g = gv.to_golden(first[half:], case.train_iters, STEP_INTERVAL)
            for check in gv.compare(g, a, ["lm loss"], True):
                check.metric, check.message = RESUME_CHECK, f"{what}: {check.message}"
                result.checks.append(check)
        else:  # another CP size: equal up to float rounding, as CP vs its twin
            result.checks.append(gv.curves_match(RESUME_CHECK, [r["lm_loss"] for r in rows2],
                                                 [r["lm_loss"] for r in first[half:]], TWIN_RTOL, what))


def format_table(results: Sequence[CaseResult]) -> str:
    """A pass/fail table: one row per case and check, then the total time."""
    rows = [("case", "check", "rule", "result", "max rel. diff", "seconds")]
    for r in results:
        if r.error is not None:
            rows.append((r.case.name, "run", "-", "ERROR", "", f"{r.seconds:.0f}"))
            continue
        for i, c in enumerate(r.checks):
            rows.append((r.case.name if i == 0 else "", c.metric, c.rule, "pass" if c.ok else "FAIL",
                         "" if c.worst is None else f"{c.worst:.1e}", f"{r.seconds:.0f}" if i == 0 else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    passed = sum(r.ok for r in results)
    lines.append(f"{passed}/{len(results)} cases passed in {sum(r.seconds for r in results):.0f} s")
    return "\n".join(lines)


def failures(results: Sequence[CaseResult]) -> str:
    """The messages of everything that failed, per case."""
    out = []
    for r in results:
        if r.error is not None:
            out.append(f"{r.case.name}: {r.error}")
        out += [f"{r.case.name}: {c.message}" for c in r.checks if not c.ok]
    return "\n".join(out)
