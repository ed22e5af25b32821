"""Megatron-LM's golden-values JSON, built from the trainer's per-iteration metrics, and compared
with Megatron-LM's thresholds.

The file maps a metric name to ``{"start_step", "end_step", "step_interval", "values": {step: v}}``;
steps are the first one and every ``step_interval``-th after it, values rounded to 5 decimals (as
Megatron-LM's TensorBoard reader, ``python_test_utils/common.py``, records them). Metric names are
Megatron-LM's TensorBoard tags: ``lm loss``, ``num-zeros``, ``iteration-time`` (seconds).

Thresholds are Megatron-LM's ``CHECK_THRESHOLDS`` (``test_pretraining_regular_pipeline.py``):
a deterministic case must match exactly; otherwise ``np.isclose(rtol=0.05)``; ``iteration-time`` is
compared by its median, approximately only. Stricter than Megatron-LM in one respect: every step
must pass (Megatron-LM's pipeline lets a share of steps fail).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Dict, List, Mapping, Optional, Sequence, Union

# Megatron-LM tag -> the trainer's --metrics-file key
TRAINER_KEYS = {"lm loss": "lm_loss", "num-zeros": "num_zeros", "iteration-time": "elapsed_s"}
RECORDED = ("lm loss", "num-zeros", "iteration-time")
APPROXIMATE_RTOL = 0.05
APPROXIMATE_ONLY = ("iteration-time", "mem-allocated-bytes", "mem-max-allocated-bytes")
DIGITS = 5

Golden = Dict[str, Dict[str, object]]


def golden_steps(train_iters: int, step_interval: int, start_step: int = 1) -> List[int]:
    """Megatron-LM's recorded steps: the first, then every ``step_interval``-th."""
    return [k for k in range(start_step, train_iters + 1) if k == start_step or k % step_interval == 0]


def to_golden(rows: Sequence[Mapping[str, float]], train_iters: int, step_interval: int = 1,
              metrics: Sequence[str] = RECORDED) -> Golden:
    """Golden-values JSON content from --metrics-file rows (a step with no row is ``"nan"``, as
    Megatron-LM writes a step missing from its logs)."""
    by_step = {int(r["iteration"]): r for r in rows}
    steps = golden_steps(train_iters, step_interval, min(by_step) if by_step else 1)
    out: Golden = {}
    for name in metrics:
        key = TRAINER_KEYS[name]
        if not any(key in r for r in rows):
            continue  # not logged by this run (num-zeros needs --log-num-zeros-in-grad)
        values = {str(s): (round(float(by_step[s][key]), DIGITS) if s in by_step and key in by_step[s] else "nan")
                  for s in steps}
        out[name] = {"start_step": steps[0], "end_step": steps[-1], "step_interval": step_interval,
                     "values": values}
    return out


def read_golden(path: Path) -> Golden:
    """A golden-values file; a missing one says how to record it."""
    path = Path(path)
    if not path.exists():
        case = path.parent.name
        raise FileNotFoundError(f"{path} does not exist: record it with `python -m megatron_burst.functional_tests "
                                f"record {case}` (after checking the run is right), then commit it")
    with open(path) as f:
        return json.load(f)


def write_golden(path: Path, golden: Golden) -> None:
    with open(path, "w") as f:
        json.dump(golden, f)  # one line, as Megatron-LM's golden_values_*.json


@dataclass
class MetricCheck:
    """One metric's comparison: ``ok``, and ``message`` says which steps differ and by how much."""
    metric: str
    rule: str
    ok: bool
    message: str
    worst: Optional[float] = None  # largest relative difference, where one was measured


def _number(v: Union[str, float, int]) -> float:
    return math.inf if isinstance(v, str) else float(v)  # Megatron-LM: a "nan" string counts as inf


def _close(actual: float, golden: float, rtol: float) -> bool:
    if math.isinf(actual) or math.isinf(golden):
        return actual == golden
    return abs(actual - golden) <= rtol * abs(golden)  # np.isclose with atol 0


def compare_metric(name: str, golden: Mapping[str, object], actual: Optional[Mapping[str, object]],
                   deterministic: bool) -> MetricCheck:
    """``actual`` against ``golden`` for metric ``name`` at the golden steps."""
    approx_only = name in APPROXIMATE_ONLY
    rtol = 0.0 if deterministic and not approx_only else APPROXIMATE_RTOL
    rule = "exact" if rtol == 0 else f"rtol {rtol:g}" + (" (median)" if name == "iteration-time" else "")
    if actual is None:
        return MetricCheck(name, rule, False, f"{name}: not logged by this run (golden values have it)")
    gvals: Mapping[str, object] = golden["values"]  # type: ignore[assignment]
    avals: Mapping[str, object] = actual["values"]  # type: ignore[assignment]
    missing = [s for s in gvals if s not in avals]
    if missing:
        return MetricCheck(name, rule, False, f"{name}: steps {', '.join(missing)} missing from this run "
                                              f"(it logged steps {', '.join(avals) or 'none'})")
    if name == "iteration-time":
        a = median(_number(avals[s]) for s in gvals)  # type: ignore[arg-type]
        g = median(_number(v) for v in gvals.values())  # type: ignore[arg-type]
        ok = _close(a, g, rtol)
        return MetricCheck(name, rule, ok, f"{name}: median {a:.5f} s vs golden {g:.5f} s" +
                           ("" if ok else f", off by {abs(a - g) / g:.1%} > {rtol:.0%}"))
    bad = []
    for step, gv in gvals.items():
        a, g = _number(avals[step]), _number(gv)  # type: ignore[arg-type]
        if not _close(a, g, rtol):
            rel = abs(a - g) / abs(g) if g and not math.isinf(g) else math.inf
            bad.append(f"step {step}: {avals[step]} vs golden {gv} (relative {rel:.2e})")
    if bad:
        return MetricCheck(name, rule, False, f"{name} differs from golden values ({rule}) at "
                                              f"{len(bad)} of {len(gvals)} steps: " + "; ".join(bad[:4]) +
                           (" ..." if len(bad) > 4 else ""))
    return MetricCheck(name, rule, True, f"{name}: {len(gvals)} steps match ({rule})")


def compare(golden: Golden, actual: Golden, metrics: Sequence[str], deterministic: bool) -> List[MetricCheck]:
    """Every checked metric (the case's METRICS); one the golden file lacks fails."""
    out = []
    for name in metrics:
        if name not in golden:
            out.append(MetricCheck(name, "-", False, f"{name}: required by the case's METRICS but not in its golden "
                                                     "values; record them again"))
            continue
        out.append(compare_metric(name, golden[name], actual.get(name), deterministic))
    return out


def curves_match(name: str, actual: Sequence[float], reference: Sequence[float], rtol: float,
                 what: str) -> MetricCheck:
    """Two unrounded loss curves equal to ``rtol`` relative at every step (CP vs its CP = 1 twin)."""
    if len(actual) != len(reference):
        return MetricCheck(name, f"rtol {rtol:g}", False, f"{what}: {len(actual)} steps vs {len(reference)}")
    worst = max((abs(a - r) / abs(r) for a, r in zip(actual, reference)), default=0.0)
    ok = worst <= rtol
    return MetricCheck(name, f"rtol {rtol:g}", ok,
                       f"{what}: largest relative difference {worst:.2e} over {len(actual)} steps "
                       + ("<= " if ok else "> ") + f"{rtol:g}", worst)
