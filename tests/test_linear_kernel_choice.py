"""The linear family's kernel choice (megatron_burst.linear.kernel_choice) on the CUDA decision path,
driven on CPU: "cpu" is added to FUSED_DEVICE_TYPES and a plain-torch stand-in for fla.ops
(tests/fla_standin.py) sits in sys.modules.

* the fla adapter gives exactly our torch path's outputs and gradients for every decay form (LASP-2)
  and for the gated delta rule, in every layout at W = 1 (one, two and three segments);
* a wrong stand-in (doubled output, current token left out, no final state, an exception) makes the
  first call raise KernelSelfCheckError naming kernel, device, dtype, head dims and the cause --
  every call after it too, never a silent torch run; MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 turns it
  into a warning and the torch path;
* without fla the CUDA path warns once (SlowKernelWarning naming the op and pip install
  flash-linear-attention), and MEGATRON_BURST_ALLOW_SLOW_KERNELS=0 raises SlowKernelError;
* kernel="torch" (or MEGATRON_BURST_LINEAR_KERNEL=torch) never consults fla; CPU "auto" is silent.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fla_standin
from megatron_burst.kernels import choice as attention_choice
from megatron_burst.kernels.choice import KernelSelfCheckError, SlowKernelError, SlowKernelWarning
from megatron_burst.linear import gated_delta_rule, kernel_choice, linear_attention

REL = 1e-5  # relative Frobenius error per tensor (fp32: a token loop against the chunked path)
LAYOUTS = [("contiguous", 1, 90), ("zigzag", 1, 90), ("striped", 64, 192)]  # 1, 2 and 3 segments at W = 1
FORMS = ("none", "head", "head_fixed", "token", "channel")


pytestmark = pytest.mark.usefixtures("fresh_kernel_choices")  # tests/conftest.py


@pytest.fixture
def cuda_path(monkeypatch):
    """The CUDA decision path on CPU tensors."""
    monkeypatch.setattr(attention_choice, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))


def lasp2_inputs(form: str, s: int, qkv_format: str = "sbhd", seed: int = 0):
    """q, k, v [s, 2, 3, dk/dv] (or bshd), g in ``form`` ("head_fixed": a per-head decay without grad), dout."""
    gen = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 8, 5
    tok = (s, b) if qkv_format == "sbhd" else (b, s)
    q, k, v = (torch.randn(*tok, h, d, generator=gen) for d in (dk, dk, dv))
    g = {"none": None, "head": -torch.tensor([0.02, 0.1, 0.5]), "head_fixed": -torch.tensor([0.02, 0.1, 0.5]),
         "token": -torch.rand(*tok, h, generator=gen) * 0.3,
         "channel": -torch.rand(*tok, h, dk, generator=gen) * 0.3}[form]
    return q, k, v, g, torch.randn(*tok, h, dv, generator=gen)


def run_lasp2(q, k, v, g, dout, form, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    gl = None if g is None else g.clone().requires_grad_(form != "head_fixed")
    out = linear_attention(*leaves, g=gl, **kw)
    out.backward(dout)
    grads = [t.grad for t in leaves] + ([gl.grad] if gl is not None and gl.requires_grad else [])
    return [out.detach()] + grads


def gdn_inputs(s: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 8, 5
    q = torch.randn(s, b, h, dk, generator=gen)
    k = F.normalize(torch.randn(s, b, h, dk, generator=gen), dim=-1)
    v = torch.randn(s, b, h, dv, generator=gen)
    g = -torch.rand(s, b, h, generator=gen) * 0.3
    beta = torch.rand(s, b, h, generator=gen)
    return q, k, v, g, beta, torch.randn(s, b, h, dv, generator=gen)


def run_gdn(q, k, v, g, beta, dout, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    out = gated_delta_rule(*leaves, **kw)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def assert_same(got, want, what):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (what, i, a.shape, b.shape)
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err <= REL, f"{what} tensor {i}: relative error {err:.2e} > {REL:.0e}"


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout,stripe,s", LAYOUTS)
def test_lasp2_through_fla_equals_the_torch_path(monkeypatch, cuda_path, form, layout, stripe, s):
    fla_standin.install(monkeypatch)
    q, k, v, g, dout = lasp2_inputs(form, s)
    want = run_lasp2(q, k, v, g, dout, form, layout=layout, stripe=stripe, kernel="torch")
    assert not fla_standin.calls, "kernel='torch' consulted fla"
    got = run_lasp2(q, k, v, g, dout, form, layout=layout, stripe=stripe)  # "auto" on the CUDA path
    family = "chunk_gla" if form == "channel" else "chunk_simple_gla"
    assert fla_standin.calls[family] > 0, f"auto did not run fla's {family}"
    assert_same(got, want, f"lasp2 {form} {layout}")
    assert any(family in line and "self-checked" for line in kernel_choice.report()), kernel_choice.report()


@pytest.mark.parametrize("form", ("token", "channel"))
def test_lasp2_bshd_and_lasp1_through_fla(monkeypatch, cuda_path, form):
    fla_standin.install(monkeypatch)
    q, k, v, g, dout = lasp2_inputs(form, 90, "bshd")
    for algo in ("lasp2", "lasp1"):
        kw = dict(layout="zigzag", qkv_format="bshd", algo=algo)
        assert_same(run_lasp2(q, k, v, g, dout, form, kernel="fla", **kw),
                    run_lasp2(q, k, v, g, dout, form, kernel="torch", **kw), f"{algo} bshd {form}")


@pytest.mark.parametrize("layout,stripe,s", LAYOUTS)
def test_gdn_through_fla_equals_the_torch_path(monkeypatch, cuda_path, layout, stripe, s):
    fla_standin.install(monkeypatch)
    inputs = gdn_inputs(s)
    want = run_gdn(*inputs, layout=layout, stripe=stripe, kernel="torch")
    assert not fla_standin.calls
    got = run_gdn(*inputs, layout=layout, stripe=stripe)
    assert fla_standin.calls["chunk_gated_delta_rule"] > 0
    assert_same(got, want, f"gdn {layout}")


@pytest.mark.parametrize("layout,stripe,s", LAYOUTS[1:])
def test_one_rank_runs_any_layout_as_one_plain_fla_call(monkeypatch, cuda_path, layout, stripe, s):
    """At W = 1 a rank holds the whole sequence in order whatever the layout (zigzag's two segments,
    the stripes, are consecutive): the gated delta rule is one fla call over [b, s] rows from a zero
    state with no final state and no maps (the wide call with [0 | I] entering states, which zigzag
    and striped took here before, is for W > 1: test_fla_kernel_path_matches_the_recurrence); none
    of our chunked algebra runs."""
    import functools

    from megatron_burst.linear import delta

    import sys

    fla_standin.install(monkeypatch)
    inputs = gdn_inputs(s)
    want = run_gdn(*inputs, layout=layout, stripe=stripe, kernel="torch")
    run_gdn(*inputs, layout=layout, stripe=stripe)  # the first call self-checks (it calls our torch path)
    module = sys.modules["fla.ops.gated_delta_rule"]
    standin, seen = module.chunk_gated_delta_rule, []

    @functools.wraps(standin)
    def recording(q, k, v, g, beta, **kw):
        seen.append((tuple(v.shape), kw["initial_state"], kw["output_final_state"]))
        return standin(q, k, v, g, beta, **kw)

    monkeypatch.setattr(module, "chunk_gated_delta_rule", recording)
    monkeypatch.setattr(delta, "delta_segment_maps", lambda *a, **k: pytest.fail("torch maps on the fla path"))
    got = run_gdn(*inputs, layout=layout, stripe=stripe)
    assert_same(got, want, f"gdn {layout}")
    (_, b, h, _), dv = inputs[0].shape, inputs[2].shape[-1]
    assert seen == [((b, s, h, dv), None, False)]


@pytest.mark.parametrize("op,form", [("lasp2", "none"), ("lasp2", "head"), ("lasp2", "token"), ("lasp2", "channel"),
                                     ("gdn", None)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_one_global_segment_is_one_fla_call_without_a_final_state(monkeypatch, cuda_path, op, form, layout):
    """W = 1 (contiguous, or zigzag: its two segments are consecutive on one rank): the op is fla's
    own call -- one call per step, asking for no final state (a state nobody reads would cost fla a
    write forward and a zero-gradient read backward)."""
    import functools
    import sys

    fla_standin.install(monkeypatch)
    if op == "lasp2":
        inputs, run = lasp2_inputs(form, 90), lambda: run_lasp2(*inputs, form, layout=layout)
    else:
        inputs, run = gdn_inputs(90), lambda: run_gdn(*inputs, layout=layout)
    want = (run_lasp2(*inputs, form, kernel="torch", layout=layout) if op == "lasp2" else
            run_gdn(*inputs, kernel="torch", layout=layout))
    run()  # the first call self-checks (asking fla for states)
    name = {"gdn": "chunk_gated_delta_rule", "channel": "chunk_gla"}.get(op if op == "gdn" else form, "chunk_simple_gla")
    module = sys.modules[{"chunk_gated_delta_rule": "fla.ops.gated_delta_rule", "chunk_gla": "fla.ops.gla"}.get(
        name, "fla.ops.simple_gla")]
    standin, asked = getattr(module, name), []

    @functools.wraps(standin)
    def recording(*a, **kw):
        asked.append(kw.get("output_final_state", False))
        return standin(*a, **kw)

    monkeypatch.setattr(module, name, recording)
    assert_same(run(), want, f"{op} {form} one segment")
    assert asked == [False], f"{name} was called {len(asked)} time(s) asking for final states {asked}"


# ------------------------------------------------------------------------------------------ loud failures
@pytest.mark.parametrize("fault,expect", [("scale2", "out is off"), ("exclusive", "out is off"),
                                          ("no_state", "no final state"), ("raise", "expected int32")])
def test_a_wrong_fla_fails_the_first_call_loudly(monkeypatch, cuda_path, fault, expect):
    fla_standin.install(monkeypatch, fault)
    q, k, v, g, dout = lasp2_inputs("token", 90)
    for attempt in range(2):  # the verdict is remembered: every call raises, none runs torch silently
        with pytest.raises(KernelSelfCheckError) as info:
            linear_attention(q, k, v, g=g)
        text = str(info.value)
        for part in ("chunk_simple_gla", "cpu", "float32", "dk 8 dv 5", "per-token decay", expect,
                     "MEGATRON_BURST_LINEAR_KERNEL=torch"):
            assert part in text, (part, text)
    if fault == "raise":
        assert isinstance(info.value.__cause__, RuntimeError) and "int32" in str(info.value.__cause__)


def test_a_wrong_gdn_kernel_fails_loudly(monkeypatch, cuda_path):
    fla_standin.install(monkeypatch, "scale2")
    with pytest.raises(KernelSelfCheckError, match=r"chunk_gated_delta_rule for gdn .* on cpu / float32 / dk 8 dv 5"):
        run_gdn(*gdn_inputs(64))


@pytest.mark.parametrize("documents", [False, True])
def test_a_gdn_backward_that_drops_the_maps_gradient_fails_its_self_check(monkeypatch, documents):
    """The maps A ride in the wide call's last dk value columns and are orders of magnitude smaller
    than B: the self-check compares each term's share of every gradient on its own, so a fla whose
    backward loses the gradient of those columns fails (a summed check passed it)."""
    from megatron_burst.linear.delta import fla_chunk_gated_delta_rule, torch_segment_terms

    fla_standin.install(monkeypatch, "state_tail_no_grad")
    with pytest.raises(KernelSelfCheckError, match=r"wide call \(maps\), through A: dk is off"):
        kernel_choice.self_check("gdn", "token", fla_chunk_gated_delta_rule(), torch.device("cpu"), torch.float32,
                                 8, 8, gdn_torch_terms=torch_segment_terms, documents=documents)
    fla_standin.install(monkeypatch)
    kernel_choice.self_check("gdn", "token", fla_chunk_gated_delta_rule(), torch.device("cpu"), torch.float32,
                             8, 8, gdn_torch_terms=torch_segment_terms, documents=documents)


def test_allow_slow_turns_a_failed_self_check_into_a_warning(monkeypatch, cuda_path):
    fla_standin.install(monkeypatch, "scale2")
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "1")
    q, k, v, g, dout = lasp2_inputs("channel", 90)
    with pytest.warns(SlowKernelWarning, match="chunk_gla .* failed its self-check"):
        got = run_lasp2(q, k, v, g, dout, "channel")
    assert_same(got, run_lasp2(q, k, v, g, dout, "channel", kernel="torch"), "allow-slow fallback")
    with pytest.raises(KernelSelfCheckError):  # an explicit kernel='fla' is never replaced
        linear_attention(q, k, v, g=g, kernel="fla")


def test_a_broken_fla_install_is_loud(monkeypatch, cuda_path):
    def broken(op, form):
        raise RuntimeError("flash-linear-attention is installed but importing fla.ops.simple_gla failed: "
                           "RuntimeError: 0 active drivers ([])")
    monkeypatch.setattr(kernel_choice, "load_fla", broken)
    q, k, v, g, _ = lasp2_inputs("none", 90)
    with pytest.raises(KernelSelfCheckError, match="0 active drivers"):
        linear_attention(q, k, v)


# ------------------------------------------------------------------------------------------ without fla
def test_cuda_without_fla_warns_once_naming_the_op_and_the_fix(monkeypatch, cuda_path):
    fla_standin.uninstall(monkeypatch)
    q, k, v, g, dout = lasp2_inputs("token", 90)
    with pytest.warns(SlowKernelWarning) as record:
        got = run_lasp2(q, k, v, g, dout, "token")
    texts = [str(w.message) for w in record if issubclass(w.category, SlowKernelWarning)]
    assert len(texts) == 1 and "lasp2 (per-token decay)" in texts[0] and "pip install flash-linear-attention" in texts[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)  # once per process and key
        again = run_lasp2(q, k, v, g, dout, "token")
    assert_same(got, again, "slow path")
    with pytest.warns(SlowKernelWarning, match=r"gdn \(per-token decay\).*pip install flash-linear-attention"):
        run_gdn(*gdn_inputs(64))


def test_strict_policy_makes_a_missing_fla_an_error(monkeypatch, cuda_path):
    fla_standin.uninstall(monkeypatch)
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "0")
    q, k, v, g, _ = lasp2_inputs("head", 90)
    with pytest.raises(SlowKernelError, match="pip install flash-linear-attention"):
        linear_attention(q, k, v, g=g)
    with pytest.raises(SlowKernelError, match="gdn"):
        run_gdn(*gdn_inputs(64))


def test_explicit_fla_without_fla_raises(monkeypatch):
    fla_standin.uninstall(monkeypatch)
    q, k, v, g, _ = lasp2_inputs("none", 90)
    with pytest.raises(ValueError, match="pip install flash-linear-attention"):
        linear_attention(q, k, v, kernel="fla")
    with pytest.raises(ValueError, match="flash-linear-attention"):
        run_gdn(*gdn_inputs(64), kernel="fla")


# ------------------------------------------------------------------------------------------ torch is torch
def test_kernel_torch_never_consults_fla(monkeypatch, cuda_path):
    def must_not_load(*args):
        raise AssertionError("fla was consulted")
    monkeypatch.setattr(kernel_choice, "load_fla", must_not_load)
    fla_standin.install(monkeypatch, "raise")
    from megatron_burst.linear import delta
    monkeypatch.setattr(delta, "fla_chunk_gated_delta_rule", must_not_load)
    q, k, v, g, _ = lasp2_inputs("channel", 90)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_attention(q, k, v, g=g, kernel="torch")
        run_gdn(*gdn_inputs(64), kernel="torch")
        monkeypatch.setenv("MEGATRON_BURST_LINEAR_KERNEL", "torch")
        linear_attention(q, k, v, g=g)
        run_gdn(*gdn_inputs(64))
    assert not fla_standin.calls


def test_cpu_auto_is_the_torch_path_silently(monkeypatch):
    fla_standin.install(monkeypatch, "raise")  # installed, and wrong: CPU "auto" must not even look
    q, k, v, g, _ = lasp2_inputs("token", 90)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_attention(q, k, v, g=g)
        run_gdn(*gdn_inputs(64))
    assert not fla_standin.calls


def test_policy_values_are_checked():
    with pytest.raises(ValueError, match="MEGATRON_BURST_LINEAR_KERNEL='triton'"):
        kernel_choice.LinearKernelPolicy(forced="triton")
    with pytest.raises(ValueError, match="unknown linear attention kernel 'cuda'"):
        linear_attention(*lasp2_inputs("none", 90)[:3], kernel="cuda")


def test_fla_refusing_gated_backward_on_this_triton_is_a_loud_torch_path(monkeypatch, cuda_path):
    """fla 0.6 refuses its gated backward on Hopper with 3.4 <= Triton < 3.7.1 (seen on an H100,
    Triton 3.6): the gated forms run our torch path with one warning naming fla's issue and the fix
    (not a self-check failure that stops training); ungated forms still take fla; kernel='fla' raises."""
    fla_standin.install(monkeypatch)
    monkeypatch.setattr(kernel_choice, "_fla_flags", lambda: (True, True, False))
    q, k, v, g, dout = lasp2_inputs("token", 90)
    with pytest.warns(SlowKernelWarning, match=r"per-token decay.*#640.*Triton to >= 3.7.1"):
        got = run_lasp2(q, k, v, g, dout, "token")
    assert_same(got, run_lasp2(q, k, v, g, dout, "token", kernel="torch"), "gated form on the torch path")
    with pytest.warns(SlowKernelWarning, match=r"gdn \(per-token decay\).*#640"):
        run_gdn(*gdn_inputs(64))
    with pytest.raises(ValueError, match="#640"):
        linear_attention(q, k, v, g=g, kernel="fla")
    q, k, v, _, dout = lasp2_inputs("none", 90)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)
        run_lasp2(q, k, v, None, dout, "none")
    assert any(c.uses_fla and c.form == "none" for c in kernel_choice._CHOSEN.values())
    monkeypatch.setattr(kernel_choice, "_fla_flags", lambda: (True, True, True))  # Triton >= 3.7.1
    assert kernel_choice.fla_refusal("lasp2", "token") is None
