"""The former public module paths keep working as pure re-exports of the renamed modules:
megatron_burst.checkpoint -> megatron_burst.activation_store, megatron_burst.plan ->
megatron_burst.cost_model (its ``python -m`` planner CLI included), and the mask modules ->
their homes in megatron_burst.masks (layout, documents, dispatch, sparse_plan, dynamic_pattern;
megatron_burst.sparse also keeps its sparse_cp_attention wrapper)."""
import importlib
import runpy
import sys

import pytest
import torch

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


M = "megatron_burst.masks."
# alias -> (home modules re-exported whole, {name: (home module, name there)} re-exported singly, own names)
MASK_ALIASES = {
    "megatron_burst.layout": ((M + "layout", M + "block"), {}, ()),
    "megatron_burst.dispatch": ((M + "dispatch",), {}, ()),
    "megatron_burst.dynamic_pattern": ((M + "dynamic",), {}, ()),
    "megatron_burst.documents": ((M + "documents", M + "window", M + "visible"),
                                 {"imbalance": (M + "imbalance", "document_imbalance"),
                                  "IMBALANCE_LAYOUTS": (M + "imbalance", "IMBALANCE_LAYOUTS"),
                                  "rank_pair_work": (M + "imbalance", "rank_pair_work"),
                                  "thd_padded": (M + "imbalance", "thd_padded")}, ()),
    "megatron_burst.sparse_plan": ((M + "vertical_slash",), {"imbalance": (M + "imbalance", "pattern_imbalance"),
                                                             "pair_work": (M + "imbalance", "pair_work")}, ()),
    "megatron_burst.sparse": ((M + "vertical_slash",), {"imbalance": (M + "imbalance", "pattern_imbalance"),
                                                        "pair_work": (M + "imbalance", "pair_work")},
                              ("sparse_cp_attention",)),
}


@pytest.mark.parametrize("alias", list(MASK_ALIASES))
def test_mask_alias_exposes_its_homes_objects(alias):
    """Every name of the alias is the very object of its home; the alias defines nothing else (sparse:
    only its sparse_cp_attention wrapper), and stays an attribute of the package."""
    homes, singles, own = MASK_ALIASES[alias]
    old = importlib.import_module(alias)
    expected = {}
    for home in homes:
        module = importlib.import_module(home)
        assert module.__all__, home
        expected.update({name: getattr(module, name) for name in module.__all__})
    for name, (home, there) in singles.items():
        expected[name] = getattr(importlib.import_module(home), there)
    assert set(old.__all__) == set(expected) | set(own) and len(old.__all__) == len(set(old.__all__))
    for name, obj in expected.items():
        assert getattr(old, name) is obj, f"{alias}.{name} is not its home's object"
    defined_here = {name for name, value in vars(old).items()
                    if not name.startswith("__") and getattr(value, "__module__", None) == alias}
    assert defined_here == set(own), f"{alias} defines {sorted(defined_here)}: an alias only re-exports"
    assert old.__doc__.startswith("Public alias of megatron_burst.masks.")
    import megatron_burst

    assert getattr(megatron_burst, alias.rsplit(".", 1)[1]) is old


def test_the_masks_package_imports_nothing_above_it():
    """masks sits below kernels, algorithms and the Megatron glue (the import graph from the source);
    it may use the transport (comm) and the environment overrides (env), both leaves below it."""
    from megatron_burst import _import_graph as ig

    graph = ig.import_graph()
    masks = [m for m in graph if m == "megatron_burst.masks" or m.startswith(M)]
    assert len(masks) >= 10
    above = ("megatron_burst.kernels", "megatron_burst.algorithms", "megatron_burst.megatron", "megatron_burst.train",
             "megatron_burst.linear", "megatron_burst.loss")
    for module in masks:
        outside = {t for t in graph[module] if not (t == "megatron_burst.masks" or t.startswith(M))}
        assert outside <= {"megatron_burst.comm", "megatron_burst.env"}, (module, outside)
        assert not [t for t in outside if t.startswith(above)]


def test_wrapping_the_dynamic_estimate_at_its_home_sees_the_engines_pattern(monkeypatch):
    """The engine calls the dynamic estimate through megatron_burst.masks.dynamic (the GPU suite and
    the bench wrap it there to see the pattern a call ran with)."""
    import megatron_burst as mb
    from megatron_burst.masks import dynamic

    seen = []
    original = dynamic.estimate
    monkeypatch.setattr(dynamic, "estimate", lambda *a, **kw: seen.append(original(*a, **kw)) or seen[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(128, 1, 2, 16, generator=g) for _ in range(3))
    mb.cp_attention(q, k, v, pattern="dynamic", layout="striped", stripe=64, algo="burst")
    assert len(seen) == 1 and isinstance(seen[0], mb.VerticalSlash)
