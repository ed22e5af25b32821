"""No core module reads Megatron-LM's global args (issue K, part 2: options as data).

Megatron-LM keeps its parsed args (and tokenizer, timers ...) in ``megatron.training.global_vars``.
Only the flag boundary on the Megatron-LM side, :mod:`megatron_burst.megatron.megatron_lm` (what the
patched ``pretrain_gpt.py`` calls), may read them: it resolves the flags once into options and hands
them down through the layer specs. Every other module of the package takes its options as
arguments. The scan below walks the package's source (AST, so comments and docstrings do not
count) and fails naming file, line and what it found.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Tuple

import megatron_burst

PACKAGE = Path(megatron_burst.__file__).resolve().parent

# Modules allowed to touch Megatron-LM's globals: the patched pretrain_gpt.py's entry (flag boundary).
GLOBALS_BOUNDARY = {"megatron/megatron_lm.py"}
# Modules allowed to import megatron.training at all: the boundary, and the functional-test checker
# (it runs Megatron-LM's own parse_args in a checkout; parse_args returns the args, it sets no global).
TRAINING_IMPORTS = GLOBALS_BOUNDARY | {"functional_tests/megatron_lm.py"}

# megatron.training's accessors of its global state, and the module holding it
GLOBAL_NAMES = {"get_args", "set_args", "_GLOBAL_ARGS", "global_vars", "get_tokenizer", "get_timers",
                "get_signal_handler", "get_wandb_writer", "get_tensorboard_writer", "get_one_logger"}


def _is_training(module: str) -> bool:
    return module == "megatron.training" or module.startswith("megatron.training.")


def global_args_uses(source: str, rel: str) -> List[Tuple[str, int, str]]:
    """(file, line, what) for every read of Megatron-LM's global state in ``source``, and every
    megatron.training import in a module not allowed one."""
    found = []
    globals_ok = rel in GLOBALS_BOUNDARY
    imports_ok = rel in TRAINING_IMPORTS
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_training(alias.name):
                    if not imports_ok or (not globals_ok and alias.name.split(".")[-1] in GLOBAL_NAMES):
                        found.append((rel, node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and _is_training(node.module):
            names = [alias.name for alias in node.names]
            bad = not imports_ok or (not globals_ok and (node.module.split(".")[-1] in GLOBAL_NAMES
                                                         or any(n in GLOBAL_NAMES or n == "*" for n in names)))
            if bad:
                found.append((rel, node.lineno, f"from {node.module} import {', '.join(names)}"))
        elif not globals_ok and isinstance(node, ast.Attribute) and node.attr in GLOBAL_NAMES:
            found.append((rel, node.lineno, f".{node.attr}"))
        elif not globals_ok and isinstance(node, ast.Name) and node.id in GLOBAL_NAMES:
            found.append((rel, node.lineno, node.id))
        elif isinstance(node, ast.Call):  # import_module("megatron.training..."), getattr(vars, "_GLOBAL_ARGS")
            for arg in node.args:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    continue
                if not imports_ok and _is_training(arg.value):
                    found.append((rel, node.lineno, f"{arg.value!r} imported by name"))
                elif not globals_ok and arg.value in GLOBAL_NAMES:
                    found.append((rel, node.lineno, f"{arg.value!r} looked up by name"))
    return found


def _package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_no_core_module_reads_megatron_lm_globals():
    found = []
    for rel, source in _package_sources():
        found += global_args_uses(source, rel)
    assert not found, ("modules other than the flag boundary (" + ", ".join(sorted(GLOBALS_BOUNDARY)) + ") read "
                       "Megatron-LM's global args; take the options as arguments instead:\n"
                       + "\n".join(f"  megatron_burst/{rel}:{line}: {what}" for rel, line, what in found))


def test_the_boundary_exists_and_the_scan_can_fail():
    """The allowed modules exist (a rename must update the list), and the scan flags the pattern the
    attention layers used to read the flags with (megatron/args.py's megatron_lm_cp_flags)."""
    for rel in TRAINING_IMPORTS:
        assert (PACKAGE / rel).is_file(), rel
    old = ("def megatron_lm_cp_flags():\n"
           "    from megatron.training import global_vars\n"
           "    return getattr(global_vars, '_GLOBAL_ARGS', None)\n")
    assert sorted(what for _, _, what in global_args_uses(old, "megatron/args.py")) == [
        "'_GLOBAL_ARGS' looked up by name", "from megatron.training import global_vars", "global_vars"]
    caller = "from megatron.training import get_args\nargs = get_args()\n"
    assert sorted(global_args_uses(caller, "megatron/attention.py")) == [
        ("megatron/attention.py", 1, "from megatron.training import get_args"), ("megatron/attention.py", 2, "get_args")]
    assert global_args_uses(caller, "megatron/megatron_lm.py") == []
    assert global_args_uses("import importlib\nimportlib.import_module('megatron.training.global_vars')\n",
                            "train/setup.py") == [("train/setup.py", 2, "'megatron.training.global_vars' imported "
                                                                        "by name")]
    assert global_args_uses("from megatron.training import arguments\n", "functional_tests/megatron_lm.py") == []


def test_layers_ignore_megatron_lm_globals(monkeypatch):
    """A Megatron-LM process with (other) flags in its global args: the layers take only what they
    are given. The attention used to pick --cp-algo/--cp-layout up from megatron.training.global_vars."""
    import argparse
    import sys
    import types

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_burst.megatron.args import add_args
    from megatron_burst.megatron.attention import CPCoreAttention
    from megatron_burst.megatron.linear_attention import LinearSelfAttention  # noqa: F401  (imports cleanly)

    flags = add_args(argparse.ArgumentParser()).parse_args(["--cp-algo", "ring", "--cp-layout", "striped",
                                                            "--cp-stripe", "4"])
    training = types.ModuleType("megatron.training")
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = flags
    training.global_vars = global_vars
    training.get_args = lambda: flags
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                               use_cpu_initialization=True)
    attention = CPCoreAttention(config, 1, AttnMaskType.causal, "self")
    assert (attention.options.algo, attention.options.layout, attention.options.stripe) == ("burst", "zigzag", 1)
    assert not attention._layout_fixed  # free to follow the model's layout
