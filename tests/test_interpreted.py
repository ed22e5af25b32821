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


ROUNDING_CODE = r"""
import json, torch, triton, triton.language as tl

@triton.jit
def down(X, Y16, Yh, Yz, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok)
    tl.store(Y16 + offs, x.to(tl.bfloat16), mask=ok)
    tl.store(Yh + offs, x.to(tl.float16), mask=ok)
    tl.store(Yz + offs, x.to(tl.bfloat16, fp_downcast_rounding="rtz"), mask=ok)

g = torch.Generator().manual_seed(0)
x = torch.cat([torch.randn(3000, generator=g) * 10.0 ** torch.randint(-40, 38, (3000,), generator=g),
               # ties, carries into the exponent (mantissa all ones), the largest finite, subnormals, specials
               torch.tensor([1.00390625, 1.01171875, -1.00390625, 1.9999999, 3.4e38, -3.39e38, 1e-39, -2e-41, 0.0,
                             -0.0, float("inf"), float("-inf")])])
n = x.numel()
y16, yh, yz = (torch.empty(n, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.bfloat16))
down[(1,)](x, y16, yh, yz, n, BLOCK=4096)
trunc = (x.view(torch.int32) >> 16).to(torch.int16)
normal = torch.isfinite(x) & (x.abs() >= torch.finfo(torch.float32).tiny)  # (Triton's own subnormal handling aside)
print(json.dumps({"bf16": bool(torch.equal(y16.view(torch.int16), x.bfloat16().view(torch.int16))),
                  "fp16": bool(torch.equal(yh.view(torch.int16), x.half().view(torch.int16))),
                  "rtz_truncates": bool(torch.equal(yz.view(torch.int16)[normal], trunc[normal])),
                  "any_differs_from_truncation": bool((y16.view(torch.int16) != trunc).any())}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_downcasts_round_to_nearest_even_as_on_the_gpu():
    """The launcher makes fp32 -> bf16 / fp16 casts round to nearest even -- torch's (and the GPU's)
    bits exactly, over random magnitudes, ties, carries into the exponent, subnormals and specials
    -- where Triton's interpreter truncates (so some bits differ from truncation's); an explicit
    round-toward-zero still truncates."""
    r = run_interpreted("", code=ROUNDING_CODE)
    assert r == {"bf16": True, "fp16": True, "rtz_truncates": True, "any_differs_from_truncation": True}, r


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_cached_numpy_dtypes_are_the_interpreters_own(monkeypatch):
    """The launcher's cached Triton -> numpy dtype lookup answers as the interpreter's own for every
    Triton scalar type, as a block's element, and for pointers (to blocks too); a second ask is a
    cache hit (the interpreter's lookup is not called again)."""
    import triton.language as tl
    from triton.runtime import interpreter as it

    import interpreted

    own = it._get_np_dtype
    calls = []
    monkeypatch.setattr(it, "_get_np_dtype", lambda t: calls.append(t) or own(t))
    assert interpreted.memoize_numpy_dtypes()
    cached = it._get_np_dtype
    scalars = [t for t in vars(tl).values() if isinstance(t, tl.dtype) and not isinstance(t, (tl.pointer_type,
                                                                                               tl.block_type))]
    known = [t for t in scalars if _answers(own, t)]
    assert {"fp32", "bf16", "int1", "int64", "fp8e5"} <= {str(t) for t in known}, known
    asked = [t for s in known for t in (s, tl.block_type(s, [4, 8]), tl.pointer_type(s),
                                        tl.block_type(tl.pointer_type(s), [16]))]
    for t in asked:
        assert cached(t) == own(t), t
    calls.clear()
    for t in asked:
        cached(t)
    assert all(isinstance(t, tl.pointer_type) for t in calls), calls  # only pointers reach the lookup again


def _answers(lookup, t) -> bool:
    try:
        lookup(t)
        return True
    except KeyError:
        return False


SHARED_SHAPES_CODE = r"""
import json, torch
import triton.language as tl
from triton.language.semantic import TritonSemantic
import interpreted
from megatron_burst.kernels import triton_masked
from triton_masked_cases import docs, inputs

def masked():
    q, k, v, dout = inputs(1, 4, 2, 48, 48, 16, seed=3, sbhd=True)
    pos = (torch.arange(48), torch.arange(48), docs(9, 20, 19), docs(9, 20, 19), (5, 0))
    out, lse = triton_masked.forward(q, k, v, "positions", 1, 0.3, pos)
    grads = triton_masked.backward(dout, q, k, v, (dout * out).sum(-1), lse, "positions", 1, 0.3, pos)
    return [out, lse, *grads]

def described(make):
    '''A type's or tensor's fields as plain values (shape objects compared by content).'''
    t = make()
    return {"type": str(type(t).__name__), "name": str(getattr(t, "name", "")),
            "shape": [getattr(s, "value", s) for s in t.shape], "shape_types": [type(s).__name__ for s in t.shape],
            "shape_tuple": type(t.shape).__name__, "shape_str": str(t.shape),
            "numel": getattr(t.numel, "value", t.numel), "numel_type": type(t.numel).__name__,
            "dtype": str(getattr(t, "dtype", "")), "type_of": str(getattr(t, "type", ""))}

makers = [lambda: tl.block_type(tl.float32, [16, 32]), lambda: tl.block_type(tl.bfloat16, [tl.constexpr(16), 32]),
          lambda: tl.block_type(tl.pointer_type(tl.float16), [64]), lambda: tl.block_type(tl.int1, [2, 4, 8]),
          lambda: tl.tensor(None, tl.block_type(tl.float32, [16, 32])), lambda: tl.tensor(None, tl.int32)]

def refusals():
    said = []
    for shape in ([3, 4], [], [16, 2], [16, 2.0], (16, 2), [True, 4]):
        for _ in range(2):  # a second time too: nothing refused is remembered
            try:
                tl.block_type(tl.float32, shape)
                said.append("accepted")
            except (TypeError, ValueError, AssertionError) as exc:
                said.append(f"{type(exc).__name__}: {exc}")
    return said

stock = masked(), [described(m) for m in makers], refusals()
assert interpreted.share_block_shapes()
shared = masked(), [described(m) for m in makers], refusals()
# broadcasting two blocks of one shape returns them; of two shapes, Triton's own walk runs
sem = TritonSemantic(None)
a = tl.tensor("a", tl.block_type(tl.float32, [16, 32]))
b = tl.tensor("b", tl.block_type(tl.int32, [16, 32]))
same = sem.broadcast_impl_value(a, b)
print(json.dumps({"bits": [bool(torch.equal(x, y)) for x, y in zip(stock[0], shared[0])],
                  "fields": stock[1] == shared[1], "stock_fields": stock[1], "shared_fields": shared[1],
                  "refusals": stock[2] == shared[2], "refused": shared[2],
                  "same_shape_unchanged": same[0] is a and same[1] is b,
                  "shape_shared": a.type.shape is b.type.shape and a.shape is b.shape}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_shared_block_shapes_change_no_bit_and_no_field(monkeypatch):
    """With the launcher's shared shape objects the masked-attention kernels (forward, dq, dk/dv over
    documents and a window, GQA, strided) give the same bits; block types and tensors have the same
    fields as Triton builds them; shapes Triton refuses (not a power of 2, 0-d, a float) are refused
    with the same message, twice (a python tuple too); two blocks of one shape broadcast to themselves."""
    monkeypatch.setenv("MEGATRON_BURST_INTERPRETER_SHARED_SHAPES", "0")  # the launcher leaves it to the code
    r = run_interpreted("", code=SHARED_SHAPES_CODE)
    assert r["bits"] == [True] * 5, r
    assert r["fields"], (r["stock_fields"], r["shared_fields"])
    assert r["refusals"], r["refused"]  # the same answers as stock Triton's, for each shape twice:
    accepted = [said == "accepted" for said in r["refused"]]
    # [16, 2.0] and a python tuple (16, 2) after [16, 2]
    assert accepted[:10] == [False] * 4 + [True] * 2 + [False] * 4, r["refused"]
    assert r["same_shape_unchanged"] and r["shape_shared"], r
