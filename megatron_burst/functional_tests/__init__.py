"""Megatron-LM-style functional tests of megatron-burst, runnable on CPU.

    python -m megatron_burst.functional_tests list              # the cases
    python -m megatron_burst.functional_tests run [CASE ...]    # run, compare with golden values, table
    python -m megatron_burst.functional_tests record [CASE ...] # (re)write golden_values_cpu.json
    python -m megatron_burst.functional_tests data DIR          # the corpus as ${DATA_PATH} for Megatron-LM
    python -m megatron_burst.functional_tests harness-command [CASE ...]  # Megatron-LM's run_ci_test.sh command

Cases live where Megatron-LM keeps its own, ``tests/functional_tests/test_cases/gpt/<case>/``
(``model_config.yaml`` + ``golden_values_cpu.json``), so the same directories run under a patched
Megatron-LM's harness on GPU.

Modules:
  cases    case directories, MODEL_ARGS -> the trainer's flags (Megatron-LM flags ignored, mapped, refused)
  golden   Megatron-LM's golden-values JSON and its comparison thresholds
  runner   one gloo process per rank, CP = 1 twins, ckpt-resume, the pass/fail table
"""
from megatron_burst.functional_tests.cases import Case, CaseError, list_cases, load_case, select_cases, trainer_argv
from megatron_burst.functional_tests.golden import compare, read_golden, to_golden, write_golden
from megatron_burst.functional_tests.runner import CaseResult, RunError, Runner, format_table, launch

__all__ = ["Case", "CaseError", "list_cases", "load_case", "select_cases", "trainer_argv", "compare",
           "read_golden", "to_golden", "write_golden", "CaseResult", "RunError", "Runner", "format_table", "launch"]
