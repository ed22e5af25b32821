"""The test processes' start-up (tests/startup/sitecustomize.py): megatron.core's torch.compile
decorations deferred to the first call, the same compiled function, and no dynamo import before."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from harness import load_test_startup

startup = load_test_startup()


def test_compile_happens_at_the_first_call_once_and_returns_its_result(monkeypatch):
    compiled_calls = []

    def fake_compile(fn):
        compiled_calls.append(fn)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    monkeypatch.setattr(torch, "compile", fake_compile)

    def scaled(x, factor=2):
        """doc kept"""
        return x * factor

    deferred = startup.compile_at_first_call(scaled)
    assert compiled_calls == [] and deferred.__name__ == "scaled" and deferred.__doc__ == "doc kept"
    assert deferred(3) == ("compiled", 6)
    assert deferred(4, factor=3) == ("compiled", 12)
    assert compiled_calls == [scaled]  # compiled once, from the undecorated function


def test_megatron_imports_without_dynamo_and_its_fusions_are_deferred():
    code = ("import sys, torch, megatron.core.models.gpt, megatron.core.jit as jit, sitecustomize\n"
            "from megatron.core.fusions import fused_bias_gelu\n"
            "print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules,\n"
            "      jit.jit_fuser is sitecustomize.compile_at_first_call,\n"
            "      fused_bias_gelu.bias_gelu.__wrapped__.__module__)\n")
    # the environment this pytest process gives what it starts (tests/conftest.py)
    assert os.path.join(os.path.dirname(__file__), "startup") in os.environ["PYTHONPATH"].split(os.pathsep)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True", "megatron.core.fusions.fused_bias_gelu"]


def test_a_sitecustomize_further_along_the_path_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.hidden_sitecustomize_ran = True\n")
    startup_dir = os.path.join(os.path.dirname(__file__), "startup")
    code = "import builtins, sys; print(getattr(builtins, 'hidden_sitecustomize_ran', False), sys.modules['sitecustomize'].__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([startup_dir, str(tmp_path)])})
    assert out.returncode == 0, out.stderr
    ran, loaded = out.stdout.split()
    assert ran == "True" and loaded == os.path.join(startup_dir, "sitecustomize.py")
