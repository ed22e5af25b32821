"""Start-up of every Python process ``make test`` runs (tests/conftest.py puts this directory first on
PYTHONPATH, so the pytest workers and everything they start import it; nothing outside the tests does).

megatron.core decorates its fused elementwise functions with ``torch.compile`` as it imports them
(``megatron.core.jit.jit_fuser``), and ``torch.compile`` imports dynamo and inductor: 2.3 s of CPU in
each of the ~40 fresh processes of a run that import megatron.core (trainer CLIs, benches, functional
tests), though few of them ever call a compiled form. Here ``jit_fuser`` becomes, as
``megatron.core.jit`` loads, a decorator that calls ``torch.compile`` at the function's first call
instead: the same compiled function, made later (``torch.compile`` itself only compiles at the first
call). tests/test_test_startup.py checks both halves.

As Python's ``sitecustomize`` this hides any other one further along sys.path, so it runs that one too.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, Callable

JIT_MODULE = "megatron.core.jit"


def compile_at_first_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)``, formed when the returned function is first called."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            import torch

            compiled.append(torch.compile(fn))
        return compiled[0](*args, **kwargs)

    return call


class _DeferMegatronCompile(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit through the other finders and swaps its ``jit_fuser`` once it has run."""

    defers_megatron_compile = True  # install()'s mark: this file may be loaded under two names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != JIT_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        run_module = spec.loader.exec_module

        def run_then_defer(module: Any) -> None:
            run_module(module)
            import torch

            if module.jit_fuser is torch.compile:  # megatron.core's choice on torch >= 2.2; others are left
                module.jit_fuser = compile_at_first_call

        spec.loader.exec_module = run_then_defer
        return spec


def install() -> None:
    """Idempotent; does nothing once megatron.core.jit is loaded (its users are decorated by then)."""
    if JIT_MODULE in sys.modules or any(getattr(f, "defers_megatron_compile", False) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferMegatronCompile())


def _run_the_hidden_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


install()
if __name__ == "sitecustomize":
    _run_the_hidden_sitecustomize()
