"""The package has no import circle (megatron_burst._import_graph: module-level and lazy imports
from the AST).

    python -m megatron_burst._import_graph     # lists the circles; exit status 1 if there are any
"""
import textwrap

from megatron_burst import _import_graph as ig

# the engine: never in a circle (algorithms, kernels, masks with their public alias modules)
ENGINE = ("megatron_burst.algorithms", "megatron_burst.kernels", "megatron_burst.masks", "megatron_burst.sparse",
          "megatron_burst.sparse_plan", "megatron_burst.dynamic_pattern", "megatron_burst.layout",
          "megatron_burst.documents", "megatron_burst.dispatch", "megatron_burst.topology", "megatron_burst.comm")


def test_no_new_import_circles():
    graph = ig.import_graph()
    assert "megatron_burst.masks.vertical_slash" in graph and len(graph) > 90
    problems = [ig.describe(graph, component) for component in ig.cycles(graph)]
    assert not problems, "import circles:\n" + "\n".join(problems)


def test_engine_is_acyclic_and_layered():
    """No engine module is in any circle; masks (patterns and plans included) sit below kernels and
    algorithms and import no public alias module."""
    graph = ig.import_graph()
    in_circles = {m for c in ig.cycles(graph) for m in c}
    assert not [m for m in in_circles if m.startswith(ENGINE)]
    masks = [m for m in graph if m.startswith("megatron_burst.masks")]
    for low in masks:
        assert not [t for t in graph[low] if t.startswith(("megatron_burst.algorithms", "megatron_burst.kernels",
                                                            "megatron_burst.sparse", "megatron_burst.layout",
                                                            "megatron_burst.documents", "megatron_burst.dispatch",
                                                            "megatron_burst.dynamic_pattern"))], (low, graph[low])
    for submodule in masks:  # the package face imports its submodules; none of them imports the face
        assert "megatron_burst.masks" not in graph[submodule] or submodule == "megatron_burst.masks", submodule
    for kernel in ("block_sparse", "triton_block_sparse", "row_gather"):
        assert "megatron_burst.sparse" not in graph[f"megatron_burst.kernels.{kernel}"]
        assert not [t for t in graph[f"megatron_burst.kernels.{kernel}"] if t.startswith("megatron_burst.sparse")]


def test_checker_sees_lazy_and_relative_imports_and_the_package_rule(tmp_path):
    """On a small package: a lazy (function-level) import closes a circle; a relative import is
    resolved; TYPE_CHECKING imports are left out; a submodule importing a sibling through its
    package is an edge to the sibling only, while an outside module importing pkg.sub also runs
    pkg/__init__."""
    root = tmp_path / "demo"
    files = {
        "__init__.py": "from demo import a\n",
        "a.py": "from demo.sub import b\n",
        "sub/__init__.py": "from demo.sub import b\nfrom demo.sub.b import thing\n",
        "sub/b.py": "thing = 1\ndef f():\n    from . import c\n",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo import a\n"
                    "def g():\n    from ..sub import b\n",
        "d.py": "import demo.e\n",
        "e.py": "def h():\n    import demo.d as d\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    graph = ig.import_graph(root, "demo")
    assert set(graph["demo.a"]) == {"demo.sub", "demo.sub.b"}  # demo.sub's __init__ runs first: outside it
    assert set(graph["demo.sub"]) == {"demo.sub.b"}  # inside: the sibling only
    assert set(graph["demo.sub.b"]) == {"demo.sub.c"}
    assert set(graph["demo.sub.c"]) == {"demo.sub.b"}  # the TYPE_CHECKING import of demo.a is left out
    assert ig.cycles(graph) == [["demo.d", "demo.e"], ["demo.sub.b", "demo.sub.c"]]
    assert ig.main([]) == 1 or not ig.cycles(ig.import_graph())
