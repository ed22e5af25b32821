"""``python -m megatron_burst.functional_tests {list,run,record,data,check-megatron-lm,harness-command}``: see
the package docstring."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from megatron_burst.functional_tests.cases import CASES_DIR, CaseError, select_cases


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.functional_tests",
                                description="Megatron-LM-style functional tests of megatron-burst on CPU")
    p.add_argument("--cases-dir", type=Path, default=CASES_DIR, help=f"default {CASES_DIR}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the cases")
    for name, text in (("run", "run cases and compare with their golden values"),
                       ("record", "run cases and (re)write golden_values_cpu.json when the CP = 1 twin and "
                                  "resume checks pass")):
        s = sub.add_parser(name, help=text)
        s.add_argument("cases", nargs="*", help="case names (default: all)")
        s.add_argument("--work-dir", type=Path, default=None,
                       help="scratch directory for data, checkpoints and logs (default: a new temporary one)")
        s.add_argument("--actual-dir", type=Path, default=None,
                       help="also write each case's values of this run, in golden-values format, as DIR/<case>.json")
    s = sub.add_parser("data", help="write the corpus the cases read as ${DATA_PATH} (for Megatron-LM's harness)")
    s.add_argument("dir", type=Path)
    s = sub.add_parser("check-megatron-lm", help="check the cases with Megatron-LM's own python_test_utils and "
                                                  "argument parser (see megatron_burst/functional_tests/megatron_lm.py)")
    s.add_argument("cases", nargs="*", help="case names (default: all)")
    s.add_argument("--megatron-lm", type=Path, default=None,
                   help="a Megatron-LM checkout with patches/pretrain_gpt.patch applied (default: $MEGATRON_LM_DIR, "
                        "or one fetched into the temp directory)")
    s.add_argument("--actual-dir", type=Path, default=None,
                   help="values of a run (run --actual-dir) to compare with the golden values (default: the golden "
                        "values themselves)")
    s = sub.add_parser("harness-command", help="print the run_ci_test.sh command that runs cases under Megatron-LM's "
                                                "own harness (GPU), with the golden-values file each case has")
    s.add_argument("cases", nargs="*", help="case names (default: all)")
    s.add_argument("--golden", default=None, metavar="FILE",
                   help="golden-values file name in the case directory (default: a GPU environment's "
                        "golden_values_<env>.json when the case has one, else golden_values_cpu.json)")
    s.add_argument("--output-path", default="/tmp/out", help="OUTPUT_PATH (default /tmp/out)")
    s.add_argument("--data-path", default="/data/burst/data",
                   help="DATA_PATH, as printed by the data command (default /data/burst/data)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")  # megatron.core's import-time notes about Apex / Transformer Engine
    if args.command == "data":
        from megatron_burst.functional_tests.runner import CORPUS_NAME, prepare_data

        data_path = prepare_data(args.dir)
        print(f"DATA_PATH={data_path} ({CORPUS_NAME}.bin/.idx)")
        return 0
    try:
        cases = select_cases(getattr(args, "cases", []), args.cases_dir)
    except CaseError as exc:
        p.error(str(exc))
    if args.command == "list":
        for c in cases:
            tp, cp = c.size("--tensor-model-parallel-size"), c.size("--context-parallel-size")
            then = f" -> CP {c.size('--context-parallel-size', True)}" if c.test_type == "ckpt-resume" else ""
            print(f"{c.name:40s} {c.test_type:12s} TP {tp} CP {cp}{then}  ranks {c.world_size()}")
        return 0
    if args.command == "harness-command":
        from megatron_burst.functional_tests.megatron_lm import harness_command

        try:
            for case in cases:
                print(f"# {case.name}\n{harness_command(case, args.golden, args.output_path, args.data_path)}")
        except CaseError as exc:
            p.error(str(exc))
        return 0
    if args.command == "check-megatron-lm":
        from megatron_burst.functional_tests.megatron_lm import check

        try:
            return check(cases, args.megatron_lm, args.actual_dir)
        except RuntimeError as exc:
            print(f"check-megatron-lm: {exc}", file=sys.stderr)
            return 2
    from megatron_burst.functional_tests.golden import write_golden
    from megatron_burst.functional_tests.runner import Runner, failures, format_table

    runner = Runner(args.work_dir, echo=lambda line: print(line, flush=True))
    results = []
    for case in cases:
        results.append(runner.run(case, record=args.command == "record"))
        if args.actual_dir and results[-1].actual is not None:
            args.actual_dir.mkdir(parents=True, exist_ok=True)
            write_golden(args.actual_dir / f"{case.name}.json", results[-1].actual)
    print(format_table(results))
    bad = failures(results)
    if bad:
        print("\nfailures:\n" + bad)
    print(f"(logs under {runner.work_root})")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
