"""Check the cases with Megatron-LM's own functional-test code (not vendored: read from a checkout).

    python -m megatron_burst.functional_tests check-megatron-lm [--megatron-lm DIR] [--actual-dir DIR]

For every case, with a Megatron-LM checkout that has ``patches/pretrain_gpt.patch`` applied:

* **golden values**: ``python_test_utils/common.py``'s reader loads ``golden_values_cpu.json`` and
  ``test_pretraining_regular_pipeline.test_regular_pipeline`` (which loads ``model_config.yaml``
  with its own YAML reading for ``METRICS``) passes it against a run's values (``--actual-dir``,
  as written by ``run --actual-dir``) or, without one, against itself; the same values with every
  ``lm loss`` 1 % off must fail there (so the check can fail). A ``ckpt-resume`` case also goes
  through ``test_resume_checkpoint_pipeline``.
* **flags**: ``megatron.training.arguments.parse_args`` with megatron-burst's
  ``extra_args_provider`` (what the patched ``pretrain_gpt.py`` passes) accepts every
  ``MODEL_ARGS`` (and ``MODEL_ARGS_2``) entry, turned into words by Megatron-LM's launcher rules.

Where the checkout comes from (:func:`find_megatron_lm`): ``--megatron-lm``, else
``$MEGATRON_LM_DIR``, else a checkout this command made before under the temp directory, else one
it makes there: ``git clone`` of ``$MEGATRON_LM_GIT`` (a URL or a local mirror) at
:data:`MEGATRON_LM_TAG`, then ``git apply patches/pretrain_gpt.patch``.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from megatron_burst.functional_tests.cases import REPO_ROOT, Case, CaseError, megatron_words, resolve_vars

MEGATRON_LM_TAG = "core_v0.16.1"
DEFAULT_GIT = "https://github.com/NVIDIA/Megatron-LM.git"
UTILS = Path("tests") / "functional_tests" / "python_test_utils"
PATCH = REPO_ROOT / "patches" / "pretrain_gpt.patch"


def _usable(path: Path) -> bool:
    return (path / UTILS / "common.py").exists() and (path / "megatron" / "training" / "arguments.py").exists()


def find_megatron_lm(explicit: Optional[Path] = None, log: Callable[[str], None] = print) -> Path:
    """A patched Megatron-LM checkout (see the module docstring); RuntimeError says how to provide one."""
    for candidate in (explicit, os.environ.get("MEGATRON_LM_DIR")):
        if candidate:
            if not _usable(Path(candidate)):
                raise RuntimeError(f"{candidate} is not a Megatron-LM checkout (no {UTILS}/common.py or "
                                   "megatron/training/arguments.py)")
            return Path(candidate)
    target = Path(tempfile.gettempdir()) / f"megatron-lm-{MEGATRON_LM_TAG}-burst"
    if _usable(target):
        return target
    source = os.environ.get("MEGATRON_LM_GIT", DEFAULT_GIT)
    log(f"fetching Megatron-LM {MEGATRON_LM_TAG} from {source} into {target}")
    tmp = Path(f"{target}.tmp-{os.getpid()}")
    try:
        clone = subprocess.run(["git", "clone", "-q", "--depth", "1", "--branch", MEGATRON_LM_TAG, source, str(tmp)],
                               capture_output=True, text=True, timeout=600)
        error = clone.stderr.strip()[-500:] if clone.returncode else ""
    except (subprocess.TimeoutExpired, OSError) as exc:
        error = str(exc)
    if error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"cannot fetch Megatron-LM {MEGATRON_LM_TAG} from {source}: {error}. "
                           "Pass --megatron-lm DIR (a checkout with patches/pretrain_gpt.patch applied) or set "
                           "MEGATRON_LM_GIT to a reachable clone URL or mirror")
    applied = subprocess.run(["git", "apply", str(PATCH)], cwd=tmp, capture_output=True, text=True)
    if applied.returncode != 0:
        raise RuntimeError(f"patches/pretrain_gpt.patch does not apply to {MEGATRON_LM_TAG}: {applied.stderr}")
    os.replace(tmp, target)
    return target


def _import_megatron_lm_test_utils(mlm: Path):
    """Megatron-LM's ``common`` and its two pretraining pipelines, imported from the checkout."""
    sys.path.insert(0, str(mlm))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        # common.py imports TensorBoard's event reader at module level, for read_tb_logs_as_list only
        # (reading a training run's event files); the JSON path checked here never calls it.
        for name in ("tensorboard", "tensorboard.backend", "tensorboard.backend.event_processing",
                     "tensorboard.backend.event_processing.event_accumulator"):
            sys.modules.setdefault(name, types.ModuleType(name))
        accumulator = sys.modules["tensorboard.backend.event_processing.event_accumulator"]
        accumulator.TENSORS, accumulator.SCALARS = "tensors", "scalars"  # type: ignore[attr-defined]
    from tests.functional_tests.python_test_utils import (common, test_pretraining_regular_pipeline,
                                                          test_pretraining_resume_checkpoint_pipeline)

    import logging

    logging.getLogger("tests.functional_tests.python_test_utils").setLevel(logging.CRITICAL)  # per-metric INFO lines
    logging.getLogger().setLevel(logging.WARNING)  # their basicConfig(INFO) would echo megatron.core's notes
    if not str(Path(common.__file__).resolve()).startswith(str(mlm.resolve())):
        raise RuntimeError(f"imported {common.__file__}, not Megatron-LM's under {mlm}")
    return common, test_pretraining_regular_pipeline, test_pretraining_resume_checkpoint_pipeline


def _parse_with_megatron_lm(words: List[str]) -> None:
    """Megatron-LM's parse_args over ``words`` with megatron-burst's args provider (SystemExit on a bad flag)."""
    from megatron.training import arguments

    from megatron_burst.megatron import megatron_lm as burst_lm

    argv, sys.argv = sys.argv, ["pretrain_gpt.py", *words]
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                arguments.parse_args(extra_args_provider=burst_lm.extra_args_provider)
            except SystemExit:
                raise ValueError(err.getvalue().strip().splitlines()[-1]) from None
    finally:
        sys.argv = argv


def check_case(case: Case, mlm_utils, actual_dir: Optional[Path]) -> List[str]:
    """Every check of one case: a list of failure messages (empty: all passed)."""
    common, regular, resume = mlm_utils
    failures = []
    config = str(case.path / "model_config.yaml")
    try:
        golden = common.read_golden_values_from_json(str(case.golden_path))
    except Exception as exc:  # pydantic's validation error names the field
        return [f"Megatron-LM's reader rejects {case.golden_path}: {exc}"]
    actual_path = actual_dir / f"{case.name}.json" if actual_dir else case.golden_path
    actual = common.read_golden_values_from_json(str(actual_path))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            regular.test_regular_pipeline(compare_approximate_results=False, golden_values=golden,
                                          actual_values=actual, model_config_path=config)
    except AssertionError as exc:
        failures.append(f"Megatron-LM's test_regular_pipeline fails {actual_path} against the golden values: {exc}")
    off = copy.deepcopy(actual)
    off["lm loss"].values = {k: v * 1.01 for k, v in off["lm loss"].values.items()}
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            regular.test_regular_pipeline(compare_approximate_results=False, golden_values=golden,
                                          actual_values=off, model_config_path=config)
        failures.append("Megatron-LM's test_regular_pipeline passes lm loss values 1 % off: the check cannot fail")
    except AssertionError:
        pass
    if case.test_type == "ckpt-resume":
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                resume.test_resume_checkpoint_pipeline(
                    compare_approximate_results=False, actual_values_first_run=copy.deepcopy(golden),
                    actual_values_second_run=copy.deepcopy(actual), train_iters=case.train_iters,
                    model_config_path=config)
        except AssertionError as exc:
            failures.append(f"Megatron-LM's test_resume_checkpoint_pipeline fails: {exc}")
    variables = {v: f"/placeholder/{v.lower()}" for v in ("DATA_PATH", "DATA_CACHE_PATH", "CHECKPOINT_SAVE_PATH",
                                                          "CHECKPOINT_LOAD_PATH", "TENSORBOARD_PATH", "OUTPUT_PATH")}
    for key, args in (("MODEL_ARGS", case.model_args), ("MODEL_ARGS_2", case.model_args_2)):
        if args is None:
            continue
        try:
            _parse_with_megatron_lm(megatron_words(resolve_vars(args, variables, config)))
        except ValueError as exc:
            failures.append(f"Megatron-LM's parse_args with megatron-burst's args provider rejects {key}: {exc}")
    return failures


def harness_golden(case: Case, name: Optional[str] = None) -> Path:
    """The golden-values file to hand Megatron-LM's ``run_ci_test.sh`` (GOLDEN_VALUES_PATH): ``name``
    when given (it must exist in the case), else a GPU environment's file when the case has one
    (``golden_values_<environment>_<platform>.json``, recorded from a first GPU run), else
    ``golden_values_cpu.json``, which every case has."""
    if name is not None:
        path = case.path / name
        if not path.exists():
            have = ", ".join(sorted(p.name for p in case.path.glob("golden_values_*.json")))
            raise CaseError(f"{case.name} has no {name} (it has {have}): record it from a first GPU run (README: "
                            "Functional tests, In Megatron-LM's own harness) or pass one it has")
        return path
    gpu = sorted(p for p in case.path.glob("golden_values_*.json") if p != case.golden_path)
    return gpu[0] if gpu else case.golden_path


def harness_command(case: Case, golden: Optional[str] = None, out: str = "/tmp/out",
                    data_path: str = "/data/burst/data") -> str:
    """The command that runs ``case`` under Megatron-LM's ``run_ci_test.sh`` (from the checkout's root,
    with the case directory copied to its tests/functional_tests/test_cases/gpt/): every variable it
    needs, the golden file the case has (:func:`harness_golden`), and one GPU per TP x CP rank."""
    gold = harness_golden(case, golden)
    where = f"tests/functional_tests/test_cases/gpt/{case.name}"
    return " \\\n    ".join([
        "bash tests/functional_tests/shell_test_utils/run_ci_test.sh",
        f"TRAINING_SCRIPT_PATH=pretrain_gpt.py TRAINING_PARAMS_PATH={where}/model_config.yaml",
        f"GOLDEN_VALUES_PATH={where}/{gold.name} OUTPUT_PATH={out}",
        f"TENSORBOARD_PATH={out}/tb CHECKPOINT_SAVE_PATH={out}/ckpt CHECKPOINT_LOAD_PATH={out}/ckpt",
        f"DATA_PATH={data_path} DATA_CACHE_PATH={out}/cache ENABLE_LIGHTWEIGHT_MODE=false N_REPEAT=1",
        f"GPUS_PER_NODE={case.world_size()}"])


def check(cases: Sequence[Case], megatron_lm: Optional[Path] = None, actual_dir: Optional[Path] = None) -> int:
    """Run :func:`check_case` on every case, one line each; 0 when all pass, 1 otherwise."""
    mlm = find_megatron_lm(megatron_lm)
    with contextlib.redirect_stdout(io.StringIO()):  # megatron.training's import-time notes
        utils = _import_megatron_lm_test_utils(mlm)
    print(f"Megatron-LM checkout: {mlm} ({MEGATRON_LM_TAG} expected); python_test_utils from "
          f"{Path(utils[0].__file__).parent}")
    bad = 0
    for case in cases:
        failures = check_case(case, utils, actual_dir)
        bad += bool(failures)
        what = ("golden values" if actual_dir is None else f"{actual_dir}/{case.name}.json against the golden "
                "values") + " pass test_regular_pipeline" + (
            " and test_resume_checkpoint_pipeline" if case.test_type == "ckpt-resume" else "") + \
            (" (1 % off fails)" if not failures else "") + "; parse_args accepts MODEL_ARGS" + \
            ("/MODEL_ARGS_2" if case.model_args_2 else "")
        print(f"{'ok  ' if not failures else 'FAIL'} {case.name}: " + ("; ".join(failures) if failures else what),
              flush=True)
    print(json.dumps({"cases": len(cases), "failed": bad}))
    return 1 if bad else 0
