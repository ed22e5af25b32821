"""A GPU session's results against the open issues' done-when bars.

    python -m megatron_burst.bench verdict OUT_DIR [--out verdict.md]

Reads what ``scripts/gpu_session.sh OUT_DIR`` leaves there -- ``bench_gpu.jsonl`` (``bench gpu``),
``bench_loss.jsonl`` (``bench loss --out``), ``bench_linear.jsonl`` (``bench linear --gpu``),
``e2e/e2e_results.json`` (``examples/e2e_gpt_1b.py``) and the pytest logs ``gpu_test*.log`` -- and
prints Markdown: the machine each file was measured on, then one row per bar with the figure, the
bar, and **met**, **not met** or **missing**. Nothing is inferred: a bar whose measurement is absent,
skipped or failed is "missing" (the row says which file and record it looked for), never met, and a
figure measured on a CPU never meets a GPU bar. A benchmark is not a test: this reads timings, it
gates nothing in CI.

The bars (issues I1, I2, I3), as :data:`BARS` states them:

* I1 dense: ``cp_attention`` at W = 1, fwd+bwd ms <= 1.05 x the best SDPA backend (flash, cuDNN) at
  32K tokens; rank block: one rank's W = 8 block work at >= 0.85 x the speed of one flash call of the
  same FLOPs (engine ms <= one-call ms / 0.85); documents and windows at >= 0.8 x varlen / windowed
  flash (engine ms <= baseline ms / 0.8); sparse at 64K >= 3 x faster than the fastest dense run; the
  GPU suite passes.
* I2: the fused loss (any one of our variants) at (16K, 128K, 4096) bf16 no slower than CCE and than
  the unfused path, peak memory <= CCE's, dh / dW errors <= the unfused path's; the end-to-end MFU
  >= 45 % with our attention (Megatron-LM's FLOP count).
* I3: LASP-2 (every decay form) and GDN with fla behind them <= 1.1 x fla's own kernel at W = 1,
  errors against our fp32 path <= fla's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Row", "BARS", "verdict", "main"]

MET, NOT_MET, MISSING = "met", "not met", "missing"


@dataclass
class Row:
    """One bar's outcome: ``figure`` is what was measured (text), ``status`` one of met / not met / missing."""

    issue: str
    bar: str
    figure: str
    status: str


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a time-out
                    continue
    return out


def _timed(records: list[dict], section: str) -> dict[str, dict[str, dict]]:
    """name -> variant -> the last record of ``section`` that has a time (skips and errors have none)."""
    by: dict[str, dict[str, dict]] = {}
    for r in records:
        if r.get("section") == section and isinstance(r.get("ms"), (int, float)):
            by.setdefault(r["name"], {})[r["variant"]] = r
    return by


def _untimed(records: list[dict], section: str) -> dict[str, dict[str, str]]:
    """name -> variant -> why it has no time (its last "skipped" or "error" line), for every name the
    section mentions: a bar whose runs all failed is listed, as missing, not dropped."""
    by: dict[str, dict[str, str]] = {}
    for r in records:
        if r.get("section") == section and "name" in r:
            why = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error") and f"error: {r['error']}"
            by.setdefault(r["name"], {})
            if why and not isinstance(r.get("ms"), (int, float)):
                by[r["name"]][r.get("variant", "?")] = str(why).splitlines()[0][:160]
    return by


def _on_gpu(record: dict) -> bool:
    """A bench line measured on a GPU (its capability is recorded; a CUDA build of torch on a CPU has none)."""
    return record.get("capability") is not None


def _ratio_row(issue: str, bar: str, limit: float, engine: Optional[dict], baselines: list[Optional[dict]],
               looked_for: str, why: Optional[dict] = None) -> Row:
    """Row for "engine ms <= limit x the fastest baseline's ms" (``why``: variant -> why it has no time)."""
    base = [b for b in baselines if b is not None]
    if engine is None or not base:
        reasons = "; ".join(f"{v} {w}" for v, w in (why or {}).items())
        return Row(issue, bar, f"no timing of {looked_for}" + (f" ({reasons})" if reasons else ""), MISSING)
    ref = min(base, key=lambda b: b["ms"])
    ratio = engine["ms"] / ref["ms"]
    figure = f"{engine['ms']:.2f} ms vs {ref['variant']} {ref['ms']:.2f} ms: {ratio:.2f}x"
    if not (_on_gpu(engine) and _on_gpu(ref)):
        return Row(issue, bar, figure + " (not on a GPU)", MISSING)
    return Row(issue, bar, figure, MET if ratio <= limit else NOT_MET)


def _attention_rows(records: list[dict]) -> list[Row]:
    rows = []
    dense, why = _timed(records, "dense"), _untimed(records, "dense")
    name = "causal_s32768"
    d = dense.get(name, {})
    rows.append(_ratio_row("I1", "dense causal 32K, W = 1: engine <= 1.05 x best SDPA backend", 1.05,
                           d.get("engine_w1_burst"), [d.get("sdpa_flash"), d.get("sdpa_cudnn")],
                           f"bench_gpu.jsonl dense/{name} engine_w1_burst and sdpa_flash / sdpa_cudnn",
                           why.get(name)))
    blocks, why = _timed(records, "rank_block"), _untimed(records, "rank_block")
    w8 = sorted(n for n in set(blocks) | set(why) if n.startswith("W8_"))
    for n in w8 or ["W8_*"]:
        b = blocks.get(n, {})
        rows.append(_ratio_row("I1", f"rank block {n}: engine >= 0.85 x one flash call (<= 1.18 x its time)",
                               1 / 0.85, b.get("engine_blocks"),
                               [b.get("one_call_sdpa_flash"), b.get("one_call_sdpa_cudnn")],
                               f"bench_gpu.jsonl rank_block/{n} engine_blocks and one_call_sdpa_*", why.get(n)))
    docs, why = _timed(records, "documents"), _untimed(records, "documents")
    doc_names = sorted((n for n in set(docs) | set(why) if re.fullmatch(r"(docs\d+_\w+|window\d+)_s\d+", n)),
                       key=lambda n: (n.startswith("window"), n))
    for n in doc_names or ["docs*/window*"]:
        b = docs.get(n, {})
        rows.append(_ratio_row("I1", f"{n}: engine >= 0.8 x varlen / windowed flash (<= 1.25 x its time)", 1 / 0.8,
                               b.get("engine_w1_burst"), [b.get("varlen_flash"), b.get("flash_attn")],
                               f"bench_gpu.jsonl documents/{n} engine_w1_burst and varlen_flash / flash_attn",
                               why.get(n)))
    sparse, why = _timed(records, "sparse"), _untimed(records, "sparse")
    dense_runs = {n: v for n, v in sparse.items() if re.fullmatch(r"s\d+", n)}
    for n in sorted(set(sparse) | set(why)):
        m = re.fullmatch(r"(static|dynamic)_s(\d+)", n)
        if not m:
            continue
        base = dense_runs.get(f"s{m.group(2)}", {})
        ref = min(base.values(), key=lambda r: r["ms"]) if base else None
        for variant, reason in sorted(why.get(n, {}).items()):  # a sparse run that failed or was skipped
            if variant.startswith("sparse_") and variant not in sparse.get(n, {}):
                rows.append(Row("I1", f"sparse {n} {variant}: >= 3 x faster than dense", reason, MISSING))
        for variant, r in sorted(sparse.get(n, {}).items()):
            bar = f"sparse {n} {variant} (sparsity {r.get('sparsity', float('nan')):.3f}): >= 3 x faster than dense"
            if ref is None:
                rows.append(Row("I1", bar, f"no dense timing s{m.group(2)} in bench_gpu.jsonl", MISSING))
                continue
            speed = ref["ms"] / r["ms"]
            figure = f"{r['ms']:.1f} ms vs {ref['variant']} {ref['ms']:.1f} ms: {speed:.2f}x faster"
            if not (_on_gpu(r) and _on_gpu(ref)):
                rows.append(Row("I1", bar, figure + " (not on a GPU)", MISSING))
            elif int(m.group(2)) < 65536:
                rows.append(Row("I1", bar, figure + " (the bar is at 64K)", MISSING))
            else:
                rows.append(Row("I1", bar, figure, MET if speed >= 3 else NOT_MET))
    if not any(r.bar.startswith("sparse") for r in rows):
        rows.append(Row("I1", "sparse 64K: >= 3 x faster than dense", "no sparse timing in bench_gpu.jsonl", MISSING))
    return rows


def pytest_summary(path: str) -> Optional[dict]:
    """Counts from a pytest log's closing line ({"passed", "failed", "errors", "skipped"}), None without one."""
    if not os.path.exists(path):
        return None
    last = None
    with open(path, errors="replace") as f:
        for line in f:
            if re.search(r"\b(passed|failed|errors?|skipped|no tests ran)\b.* in [\d.]+s", line):
                last = line
    if last is None:
        return None
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped")}
    for num, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last):
        counts["errors" if word.startswith("error") else word] += int(num)
    return counts


def session_gpu(out_dir: str) -> Optional[str]:
    """The GPU line gpu_session.sh's probe wrote to session.log ("torch <version> cuda <version> ... <device>"),
    or None: without it the pytest logs are no evidence of a GPU run (the CPU dry run passes them too)."""
    path = os.path.join(out_dir, "session.log")
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return next((line.strip() for line in f if re.match(r"torch \S+ cuda \d", line)), None)


def _suite_rows(out_dir: str) -> list[Row]:
    rows = []
    gpu = session_gpu(out_dir)
    for log, what in (("gpu_test.log", "tests/gpu (single-process tests)"),
                      ("gpu_test_multi.log", "tests/gpu/test_gpu_cp_multi.py (W ranks on one GPU)"),
                      ("gpu_test_linear.log", "tests/gpu/test_gpu_linear.py (carried Triton)")):
        path = os.path.join(out_dir, log)
        if log == "gpu_test_linear.log" and not os.path.exists(path):
            continue  # the linear tests ran inside gpu_test.log (no carried Triton)
        c = pytest_summary(path)
        if c is None:
            rows.append(Row("I1", f"make gpu-test: {what}", f"no pytest closing line in {log}", MISSING))
            continue
        figure = ", ".join(f"{n} {k}" for k, n in c.items() if n) or "no test ran"
        if c["failed"] or c["errors"]:
            status = NOT_MET
        elif gpu is None:  # passes of the CPU dry run (or of an unknown machine) are no GPU evidence
            status, figure = MISSING, figure + " (session.log shows no GPU)"
        else:  # all skipped (no CUDA) is no evidence either way
            status = MET if c["passed"] else MISSING
        rows.append(Row("I1", f"make gpu-test: {what}", figure, status))
    return rows


LOSS_SHAPE = (16384, 131072, 4096)
OURS = ("fused", "fused_bwdw", "fused_recompute")


def _loss_rows(records: list[dict], e2e: Optional[dict]) -> list[Row]:
    rows = []
    N, V, d = LOSS_SHAPE
    at = {r["variant"]: r for r in records if (r.get("tokens"), r.get("vocab"), r.get("hidden"), r.get("tp"))
          == (N, V, d, 1) and r.get("dtype") == "bfloat16" and r.get("logit_std", 1.0) == 1.0  # the bench's default
          and "time_s" in r}
    unfused, cce = at.get("unfused"), at.get("cce")
    bar = "fused loss (16K, 128K, 4096) bf16: time <= CCE and <= unfused, peak <= CCE, errors <= unfused"
    if unfused is None or cce is None or not any(v in at for v in OURS):
        have = ", ".join(sorted(at)) or "none"
        rows.append(Row("I2", bar, f"bench_loss.jsonl lacks unfused, cce or ours (timed: {have})", MISSING))
    else:
        for v in OURS:
            r = at.get(v)
            if r is None:
                continue
            err, ref = r.get("errors", {}), unfused.get("errors", {})
            checks = {"time <= cce": r["time_s"] <= cce["time_s"], "time <= unfused": r["time_s"] <= unfused["time_s"],
                      "peak <= cce": r["peak_bytes"] <= cce["peak_bytes"],
                      "errors <= unfused": all(k in err and k in ref and err[k] <= ref[k] for k in ("dh", "dw"))}
            figure = (f"{v}: {r['time_s'] * 1e3:.1f} ms, {r['peak_bytes'] / 2 ** 20:.0f} MiB (cce {cce['time_s'] * 1e3:.1f} ms, "
                      f"{cce['peak_bytes'] / 2 ** 20:.0f} MiB; unfused {unfused['time_s'] * 1e3:.1f} ms); "
                      f"dh {err.get('dh', float('nan')):.1e} dW {err.get('dw', float('nan')):.1e} "
                      f"(unfused {ref.get('dh', float('nan')):.1e} / {ref.get('dw', float('nan')):.1e})")
            two_reads = at.get(v + "_2read")  # the A/B of the one-read forward (loss.fast.ONE_READ_FORWARD)
            if two_reads is not None:
                figure += f"; forward reading each logit twice ({v}_2read): {two_reads['time_s'] * 1e3:.1f} ms"
            tuned = sorted((k for k in at if k.startswith(v + ":")), key=lambda k: at[k]["time_s"])
            if tuned:  # candidate settings of the fast path (bench loss's KNOBS), fastest first; the bar reads v
                figure += "; knobs: " + ", ".join(f"{k.partition(':')[2]} {at[k]['time_s'] * 1e3:.1f} ms "
                                                  f"{at[k]['peak_bytes'] / 2 ** 20:.2f} MiB" for k in tuned)
            failed = [k for k, ok in checks.items() if not ok]
            if not str(r.get("device", "")).startswith("cuda"):
                rows.append(Row("I2", bar, figure + " (not on a GPU)", MISSING))
            else:
                rows.append(Row("I2", bar, figure + (f"; fails {', '.join(failed)}" if failed else ""),
                                NOT_MET if failed else MET))
    bar = "end to end, 1.17B GPT at 16K, CP = 1, our attention: MFU >= 45 %"
    ours = [r for r in (e2e or {}).get("results", []) if r.get("variant") in ("mlm_burst", "burst")
            and isinstance(r.get("mfu"), (int, float))]
    if not ours:
        rows.append(Row("I2", bar, "no MFU of mlm_burst or burst in e2e/e2e_results.json", MISSING))
    unfused = next((r for r in (e2e or {}).get("results", []) if r.get("variant") == "mlm_burst_unfused"
                    and isinstance(r.get("mfu"), (int, float))), None)
    for r in ours:
        figure = (f"{r['variant']}: MFU {r['mfu'] * 100:.1f} %, {r.get('tokens_per_s', float('nan')):.0f} tokens/s, "
                  f"peak {r.get('peak_memory_gib', float('nan'))} GiB")
        if r["variant"] == "mlm_burst" and unfused is not None:  # the same run without --te-free-fusions
            figure += f" (mlm_burst_unfused, without --te-free-fusions: MFU {unfused['mfu'] * 100:.1f} %)"
        gpu = (e2e or {}).get("env", {}).get("device", "cpu") != "cpu"
        unfit = ("not on a GPU" if not gpu else "a --smoke run" if (e2e or {}).get("smoke")
                 else f"return code {r.get('returncode')}" if r.get("returncode") not in (0, None) else None)
        rows.append(Row("I2", bar, figure + (f" ({unfit})" if unfit else ""),
                        MISSING if unfit else (MET if r["mfu"] >= 0.45 else NOT_MET)))
    return rows


def _linear_rows(records: list[dict]) -> list[Row]:
    rows = []
    local, why = _timed(records, "local"), _untimed(records, "local")
    names = sorted(n for n in set(local) | set(why) if n.startswith("lasp2_") or n == "gdn")
    for n in names or ["lasp2_* / gdn"]:
        v = local.get(n, {})
        ours, fla = v.get("fla"), v.get("fla_direct")
        bar = f"{n}, W = 1: ours (fla behind it) <= 1.1 x fla's own kernel, errors <= fla's"
        if ours is None or fla is None:
            reasons = "; ".join(f"{k} {w}" for k, w in why.get(n, {}).items() if k in ("fla", "fla_direct"))
            rows.append(Row("I3", bar, f"no timing of bench_linear.jsonl local/{n} fla and fla_direct"
                            + (f" ({reasons})" if reasons else ""), MISSING))
            continue
        ratio = ours["ms"] / fla["ms"]
        e_ours, e_fla = ours.get("errors") or {}, fla.get("errors") or {}
        if not e_ours or not e_fla:  # the fp32 reference failed (e.g. out of memory): the error half is unknown
            rows.append(Row("I3", bar, f"{ours['ms']:.2f} ms vs {fla['ms']:.2f} ms: {ratio:.2f}x; no errors recorded",
                            MISSING))
            continue
        worse = [k for k in e_ours if k in e_fla and e_ours[k] > e_fla[k]]
        figure = f"{ours['ms']:.2f} ms vs {fla['ms']:.2f} ms: {ratio:.2f}x" + \
            (f"; errors above fla's: {', '.join(f'{k} {e_ours[k]:.1e} > {e_fla[k]:.1e}' for k in worse)}" if worse else "")
        shape = ours.get("shape", {})
        if not (_on_gpu(ours) and _on_gpu(fla)):
            rows.append(Row("I3", bar, figure + " (not on a GPU)", MISSING))
        elif shape.get("s") != 32768 or shape.get("h") != 16 or shape.get("d") != 128:
            rows.append(Row("I3", bar, figure + f" (shape {shape}; the bar is at 32K x 16 x 128)", MISSING))
        else:
            rows.append(Row("I3", bar, figure, MET if ratio <= 1.1 and not worse else NOT_MET))
    return rows


def _machines(*groups: list[dict]) -> list[str]:
    seen = []
    for records in groups:
        for r in records:
            desc = ", ".join(str(r[k]) for k in ("device_name", "device", "torch", "cuda", "triton") if r.get(k))
            if desc and desc not in seen:
                seen.append(desc)
    return seen


BARS: dict[str, Callable] = {"attention": _attention_rows, "suite": _suite_rows, "loss": _loss_rows,
                             "linear": _linear_rows}


def verdict(out_dir: str) -> tuple[list[Row], list[str]]:
    """(rows, machines) for the results in ``out_dir``."""
    attention = _jsonl(os.path.join(out_dir, "bench_gpu.jsonl"))
    loss = _jsonl(os.path.join(out_dir, "bench_loss.jsonl"))
    linear = _jsonl(os.path.join(out_dir, "bench_linear.jsonl"))
    e2e = None
    path = os.path.join(out_dir, "e2e", "e2e_results.json")
    if os.path.exists(path):
        with open(path) as f:
            e2e = json.load(f)
    rows = (BARS["attention"](attention) + BARS["suite"](out_dir) + BARS["loss"](loss, e2e)
            + BARS["linear"](linear))
    machines = _machines(attention, loss, linear, [e2e["env"]] if e2e and e2e.get("env") else [])
    gpu = session_gpu(out_dir)
    if gpu:
        machines.append(f"session.log: {gpu}")
    return rows, machines


def render(rows: list[Row], machines: list[str], out_dir: str) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in (MET, NOT_MET, MISSING)}
    lines = [f"# Done-when bars, from {out_dir}", "",
             "Measured on: " + ("; ".join(machines) if machines else "(no machine recorded)"), "",
             f"{counts[MET]} met, {counts[NOT_MET]} not met, {counts[MISSING]} missing", "",
             "| issue | bar | measured | status |", "|---|---|---|---|"]
    lines += [f"| {r.issue} | {r.bar} | {r.figure} | **{r.status}** |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench verdict", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="the directory scripts/gpu_session.sh wrote")
    p.add_argument("--out", default=None, help="also write the Markdown here")
    args = p.parse_args(argv)
    if not os.path.isdir(args.out_dir):
        p.error(f"{args.out_dir!r} is not a directory: pass the OUT_DIR given to scripts/gpu_session.sh")
    rows, machines = verdict(args.out_dir)
    text = render(rows, machines, args.out_dir)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
