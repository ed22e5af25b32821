"""The package's import graph from the source (AST), and its circles (strongly connected components).

    python -m megatron_burst._import_graph            # lists every circle; exit status 1 if any
    python -m megatron_burst._import_graph --edges    # and every edge inside the package

Every ``import`` / ``from ... import`` statement of every module under the package counts:
module-level ones and the lazy ones inside functions and methods alike (a lazy import hides a
circle from the interpreter, not from the design). Statements under ``if TYPE_CHECKING:`` never
run and are left out. Only edges between the package's own modules are kept.

What an import statement is an edge to:

* ``import a.b.c`` / ``from a.b.c import x``: the deepest module of the dotted name that exists
  (``from a.b import c`` with ``a/b/c.py`` present: the submodule ``a.b.c``; otherwise ``a.b``,
  whose namespace defines ``x``).
* Importing a submodule also runs its parent packages' ``__init__`` first. That is an edge to each
  parent package *unless the importing module lives inside it*: a module inside ``pkg`` can only
  run once ``pkg/__init__.py`` has started, so reaching ``pkg.sub`` through ``pkg`` from inside is
  an edge to ``pkg.sub`` alone (otherwise every ``pkg/__init__.py`` that imports one of its own
  submodules would be a circle). ``from pkg import name`` where ``name`` is not a submodule is a
  real edge to ``pkg/__init__.py`` from anywhere.
* Relative imports are resolved against the importing module's package.
* Dynamic imports (``importlib.import_module(f"...")``) are not seen: a registry that maps names
  to modules is data, which is what breaking a circle by passing data means.

:func:`import_graph` returns {module: {imported module: [line numbers]}}; :func:`cycles` the
strongly connected components with more than one module (each sorted; sorted by first module).
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path
from typing import Iterable, Optional

PACKAGE = "megatron_burst"
ROOT = Path(__file__).resolve().parent


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package's name -> its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        if any(not p.isidentifier() for p in parts):  # not importable (e.g. a stray "x-y.py")
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if "__pycache__" in parts:
            continue
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterable[ast.stmt]:
    """Every Import/ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _targets(module: str, is_package: bool, node: ast.stmt, modules: dict[str, Path]) -> list[str]:
    """The package modules one import statement is an edge to (see the module docstring)."""
    named: list[str] = []  # (dotted names the statement imports: the deepest existing module of each)
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _resolve_relative(module, is_package, node.level, node.module) if node.level else (node.module or "")
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            named.append(".".join(parts))
    out: list[str] = []
    for target in named:
        for parent in _parents(target):  # parent packages run first, unless the importer is inside them
            if parent in modules and not _inside(module, parent):
                out.append(parent)
        out.append(target)
    return [t for t in out if t != module]


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, list[int]]]:
    """{module: {imported package module: [line numbers]}} for every module of the package."""
    modules = module_files(root, package)
    graph: dict[str, dict[str, list[int]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[str, list[int]] = {}
        for node in _imports(tree):
            for target in dict.fromkeys(_targets(name, path.name == "__init__.py", node, modules)):
                edges.setdefault(target, []).append(node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cycle_edges(graph: dict[str, dict[str, list[int]]], component: Iterable[str]) -> list[tuple[str, str, list[int]]]:
    """The edges inside one component: (importer, imported, line numbers), sorted."""
    members = set(component)
    return sorted((a, b, lines) for a in members for b, lines in graph.get(a, {}).items() if b in members)


def _file_of(module: str, modules: dict[str, Path]) -> str:
    return os.path.relpath(modules[module], ROOT.parent)


def describe(graph: dict[str, dict[str, list[int]]], component: Iterable[str]) -> str:
    """A component as text: its modules and every import inside it with file and line."""
    modules = module_files()
    component = list(component)
    lines = [f"circle of {len(component)} modules: {', '.join(component)}"]
    for a, b, at in cycle_edges(graph, component):
        lines.append(f"  {_file_of(a, modules)}:{','.join(map(str, at))} imports {b}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_burst._import_graph",
                                     description="List the import circles of the megatron_burst package.")
    parser.add_argument("--edges", action="store_true", help="also print every edge inside the package")
    args = parser.parse_args(argv)
    graph = import_graph()
    if args.edges:
        for a in sorted(graph):
            for b, at in sorted(graph[a].items()):
                print(f"{a} -> {b} (line {','.join(map(str, at))})")
    found = cycles(graph)
    for component in found:
        print(describe(graph, component))
    print(f"{len(found)} import circle(s) in {len(graph)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
