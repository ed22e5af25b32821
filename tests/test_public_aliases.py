"""The former public module paths keep working as pure re-exports of the renamed modules:
megatron_burst.checkpoint -> megatron_burst.activation_store, megatron_burst.plan ->
megatron_burst.cost_model (its ``python -m`` planner CLI included)."""
import importlib
import runpy
import sys

import pytest

ALIASES = [("megatron_burst.checkpoint", "megatron_burst.activation_store"),
           ("megatron_burst.plan", "megatron_burst.cost_model")]


@pytest.mark.parametrize("alias,module", ALIASES)
def test_alias_exposes_the_same_objects(alias, module):
    old, new = importlib.import_module(alias), importlib.import_module(module)
    assert old.__all__ == new.__all__ and len(new.__all__) > 5
    for name in new.__all__:
        assert getattr(old, name) is getattr(new, name), f"{alias}.{name} is not {module}.{name}"
    defined_here = {name for name, value in vars(old).items()
                    if not name.startswith("__") and getattr(value, "__module__", module) == alias}
    assert not defined_here, f"{alias} defines {sorted(defined_here)}: an alias only re-exports"
    assert old.__doc__.startswith(f"public alias of {module}")


# run in this process, where the modules are already imported: runpy warns that a module it runs
# as __main__ is in sys.modules, which is harmless here (main() reads nothing from module state)
@pytest.mark.filterwarnings("ignore:'megatron_burst.*' found in sys.modules:RuntimeWarning")
def test_the_old_planner_cli_still_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["python -m megatron_burst.plan", "--nodes", "1", "--gpus-per-node", "2",
                                      "--seq", "8K", "--heads", "8"])
    runpy.run_module("megatron_burst.plan", run_name="__main__")
    new = capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["python -m megatron_burst.cost_model", "--nodes", "1", "--gpus-per-node", "2",
                                      "--seq", "8K", "--heads", "8"])
    runpy.run_module("megatron_burst.cost_model", run_name="__main__")
    assert new and new == capsys.readouterr().out
