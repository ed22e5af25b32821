"""Functional-test cases in Megatron-LM's layout, and their flags turned into this trainer's argv.

A case is a directory ``tests/functional_tests/test_cases/gpt/<case>/`` holding
``model_config.yaml`` (``ENV_VARS``, ``MODEL_ARGS``, optional ``MODEL_ARGS_2`` for the second run of
a ``ckpt-resume`` case, ``TEST_TYPE``, optional ``METRICS``) and ``golden_values_<env>.json``.
``MODEL_ARGS`` become command-line flags by Megatron-LM's launcher rules
(``shell_test_utils/_run_training.sh``): ``true`` is the bare flag, a ``[a b]`` list is spread into
words, any other value is one word. ``${VAR}`` references are resolved from the runner's paths.

Megatron-LM flags that this CPU trainer does not define are either dropped because they only change
logging or GPU kernels (:data:`IGNORED_ON_CPU`), translated (:data:`MAPPED_ON_CPU`), or refused with
the reason (:data:`REFUSED_ON_CPU`); anything else is reported as unknown.
"""
from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES_DIR = REPO_ROOT / "tests" / "functional_tests" / "test_cases" / "gpt"
GOLDEN_ENV = "cpu"  # golden_values_cpu.json; Megatron-LM's CI keeps e.g. golden_values_dev_dgx_h100.json
TEST_TYPES = ("regular", "ckpt-resume")
DEFAULT_METRICS = ("lm loss", "num-zeros")  # Megatron-LM's default when a case has no METRICS

# Megatron-LM flags that change logging, evaluation or which GPU kernels run, not what this trainer
# computes on CPU: dropped, and listed in the case's report.
IGNORED_ON_CPU = {
    "--log-params-norm", "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-throughput", "--tensorboard-dir", "--timing-log-level",
    "--eval-interval", "--eval-iters", "--use-mcore-models", "--no-gradient-accumulation-fusion",
    "--attention-softmax-in-fp32", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--use-cpu-initialization", "--dist-ckpt-strictness", "--deterministic-mode", "--attention-backend",
    "--transformer-impl", "--use-distributed-optimizer", "--exit-interval", "--num-workers",
}
# Megatron-LM flags the CPU runner refuses (the trainer lacks them, or the case's CPU golden values
# would not hold): flag -> reason
REFUSED_ON_CPU = {
    "--bf16": "the CPU runner trains in fp32 (its golden values are golden_values_cpu.json); a bf16 case runs "
              "under Megatron-LM on GPU with its own golden_values_<env>.json",
    "--fp16": "the CPU runner trains in fp32; run fp16 cases under Megatron-LM on GPU",
    "--fp8-format": "FP8 needs Transformer Engine on GPU: run the case under Megatron-LM",
    "--sequence-parallel": "the CPU trainer has no sequence parallelism: run the case under Megatron-LM",
    "--tp-comm-overlap": "Transformer Engine's TP overlap needs GPUs: run the case under Megatron-LM",
    "--num-experts": "the CPU trainer builds dense GPTs: run MoE cases under Megatron-LM",
    "--expert-model-parallel-size": "the CPU trainer builds dense GPTs: run MoE cases under Megatron-LM",
    "--use-legacy-models": "megatron-burst works with megatron.core's GPTModel: drop the flag",
}


@dataclass
class Mapped:
    """What a mapped flag becomes: ``argv`` words for the trainer, and a note for the report."""
    argv: List[str]
    note: str


def _map_pipeline(value: str, args: Mapping[str, Any]) -> Mapped:
    if int(value) != 1:
        raise CaseError(f"--pipeline-model-parallel-size {value}: the CPU trainer has no pipeline parallelism; "
                        "use 1 or run the case under Megatron-LM")
    return Mapped([], "--pipeline-model-parallel-size 1 is the trainer's only size")


def _map_backend(value: str, args: Mapping[str, Any]) -> Mapped:
    return Mapped(["--distributed-backend", "gloo"], f"--distributed-backend {value} -> gloo (CPU ranks)")


def _map_warmup_fraction(value: str, args: Mapping[str, Any]) -> Mapped:
    decay = args.get("--lr-decay-iters", args.get("--train-iters"))
    if decay is None:
        raise CaseError("--lr-warmup-fraction needs --lr-decay-iters or --train-iters in MODEL_ARGS")
    iters = int(float(value) * int(decay))  # Megatron-LM: warmup steps = fraction x decay steps
    return Mapped(["--lr-warmup-iters", str(iters)], f"--lr-warmup-fraction {value} -> --lr-warmup-iters {iters}")


def _map_ckpt_format(value: str, args: Mapping[str, Any]) -> Mapped:
    if value != "torch":
        raise CaseError(f"--ckpt-format {value}: the CPU trainer writes Megatron-LM's legacy 'torch' "
                        "checkpoints; use --ckpt-format torch or run the case under Megatron-LM")
    return Mapped([], "--ckpt-format torch is the trainer's format")


MAPPED_ON_CPU: Dict[str, Callable[[str, Mapping[str, Any]], Mapped]] = {
    "--pipeline-model-parallel-size": _map_pipeline,
    "--distributed-backend": _map_backend,
    "--lr-warmup-fraction": _map_warmup_fraction,
    "--ckpt-format": _map_ckpt_format,
}
# Flags that only concern context parallelism: dropped (with CP size 1) to make a case's CP = 1 twin.
CP_ONLY_FLAGS = ("--cp-algo", "--cp-layout", "--cp-stripe", "--cp-ring", "--cp-ranks-per-node", "--cp-comm-type",
                 "--hierarchical-context-parallel-sizes", "--linear-cp-algo")


class CaseError(ValueError):
    """A case that cannot run here: the message names the case file, flag or value and the fix."""


@dataclass
class Case:
    """One functional-test case directory."""
    name: str
    path: Path
    env_vars: Dict[str, str]
    model_args: Dict[str, Any]
    model_args_2: Optional[Dict[str, Any]]
    test_type: str
    metrics: List[str]
    raw: Dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def golden_path(self) -> Path:
        return self.path / f"golden_values_{GOLDEN_ENV}.json"

    @property
    def deterministic(self) -> bool:
        """Megatron-LM compares exactly unless the case allows nondeterministic algorithms."""
        return str(self.env_vars.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")) != "1"

    def size(self, key: str, second_run: bool = False) -> int:
        args = self.model_args_2 if second_run and self.model_args_2 is not None else self.model_args
        return int(args.get(key, 1))

    def world_size(self, second_run: bool = False) -> int:
        """Ranks to launch: TP x CP (the cases keep data parallelism at 1)."""
        return (self.size("--tensor-model-parallel-size", second_run) *
                self.size("--context-parallel-size", second_run))

    def environ(self) -> Dict[str, str]:
        """The case's ENV_VARS over this process's environment (CUDA-only ones are harmless on CPU)."""
        return {**os.environ, **self.env_vars}

    @property
    def train_iters(self) -> int:
        return int(self.model_args["--train-iters"])


def load_case(path: Path) -> Case:
    """Read ``path/model_config.yaml`` (the case name is the directory's)."""
    path = Path(path)
    config_file = path / "model_config.yaml"
    if not config_file.exists():
        raise CaseError(f"{config_file} does not exist: a case directory holds model_config.yaml")
    with open(config_file) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict) or not isinstance(raw.get("MODEL_ARGS"), dict):
        raise CaseError(f"{config_file}: needs a MODEL_ARGS mapping of flag: value")
    test_type = raw.get("TEST_TYPE", "regular")
    if test_type not in TEST_TYPES:
        raise CaseError(f"{config_file}: TEST_TYPE {test_type!r} is not one of {', '.join(TEST_TYPES)}")
    if test_type == "ckpt-resume" and int(raw["MODEL_ARGS"].get("--train-iters", 0)) % 2:
        raise CaseError(f"{config_file}: a ckpt-resume case resumes at --train-iters / 2: make it even")
    return Case(name=path.name, path=path, env_vars={k: str(v) for k, v in (raw.get("ENV_VARS") or {}).items()},
                model_args=dict(raw["MODEL_ARGS"]), model_args_2=raw.get("MODEL_ARGS_2"), test_type=test_type,
                metrics=list(raw.get("METRICS", DEFAULT_METRICS)), raw=raw)


def list_cases(root: Path = CASES_DIR) -> List[Case]:
    """Every case under ``root``, by name."""
    return [load_case(p) for p in sorted(Path(root).iterdir()) if (p / "model_config.yaml").exists()]


def select_cases(names: Sequence[str], root: Path = CASES_DIR) -> List[Case]:
    """The named cases (all when ``names`` is empty); an unknown name lists the known ones."""
    cases = list_cases(root)
    if not names:
        return cases
    by_name = {c.name: c for c in cases}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise CaseError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def megatron_words(model_args: Mapping[str, Any]) -> List[str]:
    """MODEL_ARGS as command-line words, by Megatron-LM's launcher rules (see module docstring)."""
    words: List[str] = []
    for key, value in model_args.items():
        if value is True:
            words.append(key)
        elif value is False or value is None:
            raise CaseError(f"{key}: {value}: Megatron-LM's launcher passes the value as a word; drop the flag "
                            "instead of setting it false")
        else:
            text = _yaml_scalar_text(value)
            if re.fullmatch(r"\[[^]]+\]", text):
                words += [key, *text[1:-1].split()]
            else:
                words += [key, text]
    return words


def _yaml_scalar_text(value: Any) -> str:
    if isinstance(value, list):  # a YAML sequence: the words, as Megatron-LM's [a b] strings
        return "[" + " ".join(_yaml_scalar_text(v) for v in value) + "]"
    return str(value)


def resolve_vars(model_args: Mapping[str, Any], variables: Mapping[str, str], where: str) -> Dict[str, Any]:
    """``${VAR}`` in string values substituted; an unknown variable names itself and the known ones."""
    out = {}
    for key, value in model_args.items():
        if isinstance(value, str) and "$" in value:
            try:
                value = string.Template(value).substitute(variables)
            except (KeyError, ValueError) as exc:
                raise CaseError(f"{where}: {key}: {value}: unknown variable {exc}; the runner provides "
                                f"{', '.join('${' + v + '}' for v in sorted(variables))}") from None
        out[key] = value
    return out


@dataclass
class TrainerArgv:
    """A case's MODEL_ARGS as the CPU trainer's argv, and what was dropped or translated."""
    argv: List[str]
    ignored: List[str]
    mapped: List[str]


def trainer_argv(model_args: Mapping[str, Any], where: str) -> TrainerArgv:
    """Map resolved MODEL_ARGS to ``python -m megatron_burst.train`` flags.

    Raises CaseError listing every refused flag (with why) and every unknown flag at once.
    """
    from megatron_burst.train.args import build_parser

    known = set(build_parser()._option_string_actions)
    argv: List[str] = []
    ignored: List[str] = []
    mapped: List[str] = []
    problems: List[str] = []
    unknown: List[str] = []
    for key, value in model_args.items():
        words = megatron_words({key: value})
        if key in REFUSED_ON_CPU:
            problems.append(f"{key}: {REFUSED_ON_CPU[key]}")
        elif key in MAPPED_ON_CPU:
            try:
                m = MAPPED_ON_CPU[key](words[1] if len(words) > 1 else "", model_args)
            except CaseError as exc:
                problems.append(str(exc))
                continue
            argv += m.argv
            mapped.append(m.note)
        elif key in known:
            argv += words
        elif key in IGNORED_ON_CPU:
            ignored.append(key)
        else:
            unknown.append(key)
    if unknown:
        problems.append(f"unknown flag(s) {', '.join(unknown)}: neither megatron_burst.train's nor in the runner's "
                        "tables of Megatron-LM flags (megatron_burst/functional_tests/cases.py: IGNORED_ON_CPU, "
                        "MAPPED_ON_CPU, REFUSED_ON_CPU)")
    if problems:
        raise CaseError(f"{where}: cannot run on CPU:\n  " + "\n  ".join(problems))
    return TrainerArgv(argv, ignored, mapped)


def cp1_twin(model_args: Mapping[str, Any]) -> Dict[str, Any]:
    """The same run at context-parallel size 1: CP-only flags dropped (the model, data, recompute,
    fused loss and linear-attention flags kept)."""
    twin = {k: v for k, v in model_args.items() if k not in CP_ONLY_FLAGS}
    twin["--context-parallel-size"] = 1
    return twin


def paths_env(work_dir: Path, data_path: Path, data_cache: Optional[Path] = None) -> Dict[str, str]:
    """The ``${VAR}``s a case may use, as Megatron-LM's launcher names them (``data_cache``: GPTDataset's
    index cache, shared by cases; default under ``work_dir``)."""
    return {"DATA_PATH": str(data_path), "DATA_CACHE_PATH": str(data_cache or work_dir / "data_cache"),
            "CHECKPOINT_SAVE_PATH": str(work_dir / "checkpoints"),
            "CHECKPOINT_LOAD_PATH": str(work_dir / "checkpoints"),
            "TENSORBOARD_PATH": str(work_dir / "tensorboard"), "OUTPUT_PATH": str(work_dir)}
