"""tests/interpreted.py (the launcher of every Triton-interpreter run): skipping the interpreter's
re-patching inside a launch leaves our kernels' results bit for bit the same, and it does skip."""
import importlib.util

import pytest

from harness import run_interpreted

CODE = r"""
import json, torch
from triton.runtime import interpreter as it
import interpreted
from megatron_burst.kernels import triton_masked
from triton_masked_cases import docs, inputs

stock = it._patch_lang
patches = {"n": 0}
def counted(fn):
    patches["n"] += 1
    return stock(fn)
it._patch_lang = counted

# a sliding window over documents, GQA, strided q/k/v: the kernels' helpers and triton's own (tl.zeros)
q, k, v, dout = inputs(1, 4, 2, 48, 48, 16, seed=3, sbhd=True)
pos = (torch.arange(48), torch.arange(48), docs(9, 20, 19), docs(9, 20, 19), (5, 0))
def run():
    patches["n"] = 0
    out, lse = triton_masked.forward(q, k, v, "positions", 1, 0.3, pos)
    D = (dout * out).sum(-1)
    grads = triton_masked.backward(dout, q, k, v, D, lse, "positions", 1, 0.3, pos)
    return (out, lse) + tuple(grads), patches["n"]

# the launcher's way first, in a fresh interpreter (stock Triton leaves tl.core patched after a launch)
launch = it.GridExecutor.__call__
assert interpreted.skip_nested_repatching()
fast_results, fast_patches = run()
again_results, _ = run()  # a second round: each launch starts from a restored language
it._patch_lang, it.GridExecutor.__call__ = counted, launch  # stock Triton again
stock_results, stock_patches = run()
same = [bool(torch.equal(a, b)) and bool(torch.equal(a, c)) for a, b, c in zip(stock_results, fast_results, again_results)]
print(json.dumps({"same": same, "stock_patches": stock_patches, "fast_patches": fast_patches}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_skipping_the_re_patching_changes_no_bit(monkeypatch):
    monkeypatch.setenv("MEGATRON_BURST_INTERPRETER_REPATCH", "1")  # the launcher leaves it to the code
    r = run_interpreted("", code=CODE)
    assert r["same"] == [True] * 5, r
    launches = 3  # forward, dq, dk/dv
    assert r["fast_patches"] < r["stock_patches"], r
    assert r["fast_patches"] <= 2 * launches, r  # each launch: its own patch and tl.core's once
