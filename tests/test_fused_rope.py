"""The fused RoPE op (megatron_burst.fusions.rope).

Under Triton's CPU interpreter (a fresh process, tests/rope_cases.py): the Triton kernel forward and
backward against rope_reference and Megatron's own unfused bshd / thd functions (fp32), 16-bit
within one output ulp of the reference on the same inputs, interleaved and not, pass-through
columns bitwise, ragged head blocks, odd S, strided q / k from a split fused projection with grads
flowing into it, freqs with spare rows, thd under context parallelism (cp 1, 2, 3, every rank),
and the kernel passing its own self-check. In this process: the CPU path, validation errors, the
thd positions, the CUDA decision path (self-check failures raise, are remembered, and fall back
only with MEGATRON_BURST_ALLOW_SLOW_KERNELS=1), and an ahead-of-time compile for sm_90."""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from harness import run_interpreted
from megatron_burst.fusions import rope
from megatron_burst.kernels import triton_env
from megatron_burst.kernels.choice import KernelSelfCheckError, SlowKernelError, SlowKernelWarning

HAVE_TRITON = importlib.util.find_spec("triton") is not None
TOL_FP32 = 1e-6  # relative to the largest reference magnitude (at least 1)
FP32_CASES = ["fp32_halves_r16_d24", "fp32_interleaved_r16_d24", "fp32_halves_full_d32", "fp32_interleaved_full_d32",
              "strided_split_halves", "strided_split_interleaved", "strided_gqa_split", "empty_s0"]
LOW_CASES = ["bf16_halves_r16_d24", "bf16_interleaved_r16_d24", "fp16_halves_d20"]
MEGATRON_CASES = ["fp32_halves_r16_d24", "fp32_interleaved_r16_d24", "fp32_halves_full_d32", "fp32_interleaved_full_d32"]
THD_CASES = {"thd_cp1": 1, "thd_cp1_interleaved": 1, "thd_cp2": 2, "thd_cp3": 3, "thd_cp2_interleaved": 2}


@pytest.fixture(scope="module")
def interpreted():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton): the Triton RoPE kernel is untested")
    return run_interpreted("rope_cases.py")


@pytest.fixture(autouse=True)
def fresh_decisions():
    rope.reset()
    yield
    rope.reset()


# ---------------------------------------------------------------------------------------------
# the kernel, under the interpreter
# ---------------------------------------------------------------------------------------------
def test_every_case_ran_the_kernel(interpreted):
    """Each case went through the Triton path (not the reference it is compared with)."""
    for name, r in interpreted.items():
        if "path" in r:
            assert "triton_rope" in r["path"], (name, r["path"])
    assert set(FP32_CASES + LOW_CASES + list(THD_CASES)) <= set(interpreted)


@pytest.mark.parametrize("case", FP32_CASES + list(THD_CASES))
def test_fp32_matches_reference(interpreted, case):
    r = interpreted[case]
    bound = TOL_FP32 * max(1.0, r["scale"])
    assert r["err_fwd"] <= bound and r["err_bwd"] <= bound, (case, r)
    assert r["pass_through"], (case, r)


@pytest.mark.parametrize("case", MEGATRON_CASES + list(THD_CASES))
def test_fp32_matches_megatron(interpreted, case):
    """Against megatron.core's _apply_rotary_pos_emb_bshd / _apply_rotary_pos_emb_thd, forward and
    backward (autograd through Megatron's ops)."""
    r = interpreted[case]
    bound = TOL_FP32 * max(1.0, r["scale"])
    assert r["meg_fwd"] <= bound and r["meg_bwd"] <= bound, (case, r)


@pytest.mark.parametrize("case", LOW_CASES)
def test_16bit_within_one_ulp_of_reference(interpreted, case):
    """Both compute in fp32 from the same 16-bit inputs and round once: at most one output ulp apart."""
    r = interpreted[case]
    assert r["ulps_fwd"] <= 1.0 and r["ulps_bwd"] <= 1.0, (case, r)
    assert r["out_dtype"] == r["grad_dtype"] == r["dtype"], r
    assert r["pass_through"], r


def test_cases_cover_shapes_and_layouts(interpreted):
    assert all(interpreted[c]["strided"] for c in ("strided_split_halves", "strided_split_interleaved",
                                                   "strided_gqa_split"))
    assert interpreted["fp32_halves_r16_d24"]["shape"] == [15, 2, 5, 24]  # odd S, B = 2, 5 heads (ragged block)
    assert interpreted["empty_s0"]["shape"] == [0, 2, 3, 16]
    assert [interpreted[c]["ranks"] for c in THD_CASES] == list(THD_CASES.values())
    assert interpreted["thd_cp3"]["tokens"] == [16, 16, 16]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernel_passes_its_own_self_check(interpreted, dtype):
    """The CUDA decision path, run on CPU tensors in the interpreter: the real kernel passes the
    self-check (its tolerances are not tighter than the kernel's rounding)."""
    r = interpreted[f"self_check_{dtype}"]
    assert r["verdict"], r
    assert r["describe"] == f"rope on cpu {'float32' if dtype == 'fp32' else 'bfloat16'}: triton_rope", r


# ---------------------------------------------------------------------------------------------
# this process: the CPU path, the reference, validation, thd positions
# ---------------------------------------------------------------------------------------------
def _inputs(S=9, B=2, H=3, D=24, R=16, rows=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(S, B, H, D, generator=g).to(dtype)
    freqs = (torch.randn(rows or S, 1, 1, R, generator=g) * 3).float()
    return t, freqs


@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_path_is_the_reference(monkeypatch, interleaved):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t, freqs = _inputs(rows=12)
    x = t.clone().requires_grad_()
    xr = t.clone().requires_grad_()
    y = rope.apply_rope(x, freqs, interleaved)
    yr = rope.rope_reference(xr, freqs, interleaved)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    assert torch.equal(y, yr) and torch.equal(x.grad, xr.grad)
    assert rope.describe("cpu", torch.float32) == "rope on cpu float32: torch reference"
    assert rope.describe(torch.device("cuda"), torch.float64).startswith("rope on cuda float64: torch reference")


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_is_megatrons_rope(interleaved):
    """rope_reference equals Megatron's unfused function in fp32 (forward and backward), passes the
    columns past R through, and rounds once in bf16 (Megatron rounds cos / sin first: close)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t, freqs = _inputs(S=11, D=32, R=24)
    x, xm = t.clone().requires_grad_(), t.clone().requires_grad_()
    y = rope.rope_reference(x, freqs, interleaved)
    ym = _apply_rotary_pos_emb_bshd(xm, freqs, rotary_interleaved=interleaved)
    dy = torch.randn_like(y)
    y.backward(dy)
    ym.backward(dy)
    torch.testing.assert_close(y, ym, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, xm.grad, rtol=0, atol=1e-6)
    assert torch.equal(y[..., 24:], t[..., 24:])
    yb = rope.rope_reference(t.bfloat16(), freqs, interleaved)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y.detach(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("t_shape, f_shape, f_dtype, match", [
    ((4, 3, 8), (4, 1, 1, 8), torch.float32, r"t has shape \(4, 3, 8\); it needs 4 dims \[S, B, H, D\]"),
    ((4, 1, 3, 8), (4, 8), torch.float32, r"freqs has shape \(4, 8\); it needs \[S_f, 1, 1, R\]"),
    ((4, 1, 3, 8), (4, 2, 1, 8), torch.float32, r"freqs has shape \(4, 2, 1, 8\); it needs \[S_f, 1, 1, R\]"),
    ((4, 1, 3, 8), (4, 1, 1, 8), torch.int64, r"freqs has dtype torch.int64; it needs a floating dtype"),
    ((4, 1, 3, 8), (3, 1, 1, 8), torch.float32, r"freqs has 3 rows .* 4 positions; pass at least one row"),
    ((4, 1, 3, 8), (4, 1, 1, 7), torch.float32, r"rotary dim 7 .* needs an even, positive rotary dim"),
    ((4, 1, 3, 8), (4, 1, 1, 10), torch.float32, r"rotary dim 10 .* exceeds the head dim 8 .* freqs\[\.\.\., :8\]"),
])
def test_validation_names_shapes_and_fix(t_shape, f_shape, f_dtype, match):
    t = torch.zeros(t_shape)
    freqs = torch.zeros(f_shape, dtype=f_dtype)
    with pytest.raises(ValueError, match=match):
        rope.apply_rope(t, freqs)


def test_validation_of_dtype_and_device():
    with pytest.raises(ValueError, match=r"t has dtype torch.int32; it needs a floating dtype"):
        rope.apply_rope(torch.zeros(2, 1, 1, 4, dtype=torch.int32), torch.zeros(2, 1, 1, 4))
    with pytest.raises(ValueError, match=r"freqs is on meta, t on cpu; move freqs to cpu"):
        rope.apply_rope(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4, device="meta"))


def _megatron_thd_positions(lengths, cp_size, cp_rank):
    """Positions Megatron's _get_thd_freqs_on_this_cp_rank gives (freqs = the positions themselves)."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    table = torch.arange(max(lengths) + 1)
    return torch.cat([_get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, torch.empty(n // cp_size), table)
                      for n in lengths])


@pytest.mark.parametrize("cp_size, lengths", [(1, [5, 1, 17, 2]), (2, [8, 4, 36]), (3, [6, 18, 12, 30]),
                                              (4, [8, 24, 16])])
def test_thd_positions_are_megatrons(cp_size, lengths):
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    for rank in range(cp_size):
        T = sum(n // cp_size for n in lengths)
        got = rope.thd_positions(cu, T, cp_size, rank)
        assert got.dtype == torch.int64 and torch.equal(got, _megatron_thd_positions(lengths, cp_size, rank)), rank


def test_thd_needs_no_host_synchronization():
    """On the meta device (no data: any host read of a value would raise) the positions and the op
    run: the shapes come from t and cu_seqlens' shapes alone."""
    cu = torch.tensor([0, 8, 28, 32], device="meta")
    assert rope.thd_positions(cu, 16, 2, 1).shape == (16,)
    t, freqs = torch.empty(16, 3, 24, device="meta"), torch.empty(40, 1, 1, 16, device="meta")
    assert rope.apply_rope_thd(t, cu, freqs, cp_size=2, cp_rank=1).shape == (16, 3, 24)


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_thd_cpu_path_matches_megatron(cp_size):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from rope_cases import FakeCPGroup, make_freqs

    lengths = [6 * cp_size, 2 * cp_size, 10 * cp_size]
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    freqs = make_freqs(max(lengths) + 1, 16, jitter=0.3)
    for rank in range(cp_size):
        t = torch.randn(sum(lengths) // cp_size, 3, 24)
        got = rope.apply_rope_thd(t, cu, freqs, cp_size, rank)
        want = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=FakeCPGroup(cp_size, rank))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("lengths, cp_size, cp_rank, T, rows, match", [
    ([8, 4], 2, 2, 6, 9, r"cp_rank 2 / cp_size 2; need integers with 0 <= cp_rank < cp_size"),
    ([8, 6], 2, 0, 7, 9, r"sequence lengths \[8, 6\] .* divisible by 2 \* cp_size = 4 \(pad each sequence\)"),
    ([8, 4], 2, 0, 5, 9, r"gives this rank 6 tokens .* but t has 5"),
    ([8, 4], 1, 0, 12, 7, r"longest sequence has 8 positions .* freqs only 7 rows"),
])
def test_thd_validation(lengths, cp_size, cp_rank, T, rows, match):
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    with pytest.raises(ValueError, match=match):
        rope.apply_rope_thd(torch.zeros(T, 2, 8), cu, torch.zeros(rows, 1, 1, 8), cp_size, cp_rank)
    with pytest.raises(ValueError, match=r"t has shape \(4, 1, 2, 8\); it needs 3 dims \[T, H, D\]"):
        rope.apply_rope_thd(torch.zeros(4, 1, 2, 8), cu, torch.zeros(rows, 1, 1, 8))


def test_launch_options():
    assert rope.launch_options(32, 128, interpret=False) == {"BLOCK_D": 128, "BLOCK_H": 32, "num_warps": 8}
    assert rope.launch_options(8, 128, interpret=False) == {"BLOCK_D": 128, "BLOCK_H": 8, "num_warps": 2}
    assert rope.launch_options(64, 80, interpret=False) == {"BLOCK_D": 128, "BLOCK_H": 32, "num_warps": 8}
    assert rope.launch_options(40, 192, interpret=False) == {"BLOCK_D": 256, "BLOCK_H": 16, "num_warps": 8}
    assert rope.launch_options(5, 24, interpret=True) == {"BLOCK_D": 32, "BLOCK_H": 4}


# ---------------------------------------------------------------------------------------------
# the CUDA decision path, on CPU tensors: FUSED_DEVICE_TYPES widened, the launcher replaced
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def as_cuda(monkeypatch):
    """CPU tensors take the CUDA path (self-check, then the launcher), triton counted as installed."""
    monkeypatch.setattr(rope, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(triton_env, "AVAILABLE", True)
    monkeypatch.delenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", raising=False)
    return monkeypatch


def _correct_launch(x, freqs, interleaved, backward):
    """A stand-in launcher computing what the kernel computes (the reference, and its adjoint)."""
    with torch.enable_grad():
        probe = torch.zeros(x.shape, dtype=x.dtype, requires_grad=True)
        y = rope.rope_reference(probe, freqs, interleaved)
        if backward:  # RoPE is linear in t: the adjoint is the vector-Jacobian product
            return torch.autograd.grad(y, probe, x.contiguous())[0].contiguous()
    return rope.rope_reference(x, freqs, interleaved).detach().contiguous()


def test_self_check_exception_names_kernel_device_dtype_and_cause(as_cuda):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("ptxas fatal: out of registers")

    as_cuda.setattr(rope, "_launch", broken)
    t, freqs = _inputs()
    with pytest.raises(KernelSelfCheckError) as info:
        rope.apply_rope(t, freqs)
    message = str(info.value)
    for part in ("triton_rope", "cpu", "torch.float32", "RuntimeError: ptxas fatal: out of registers",
                 "MEGATRON_BURST_ALLOW_SLOW_KERNELS=1"):
        assert part in message, (part, message)
    assert isinstance(info.value.__cause__, RuntimeError)
    # remembered: raised again without running the self-check again
    n = len(calls)
    with pytest.raises(KernelSelfCheckError) as again:
        rope.apply_rope(t, freqs)
    assert again.value is info.value and len(calls) == n
    # per (device, dtype): bf16 runs its own self-check
    with pytest.raises(KernelSelfCheckError, match="torch.bfloat16"):
        rope.apply_rope(t.bfloat16(), freqs)
    assert len(calls) > n


@pytest.mark.parametrize("wrong, what", [
    (lambda x, f, i, backward: _correct_launch(x, f, not i, backward), "forward"),  # the other rotation layout
    (lambda x, f, i, backward: _correct_launch(x, f, i, False), "backward"),  # the forward run as the backward
    (lambda x, f, i, backward: x.contiguous().clone(), "forward"),  # nothing rotated
])
def test_self_check_mismatch_raises(as_cuda, wrong, what):
    as_cuda.setattr(rope, "_launch", wrong)
    t, freqs = _inputs()
    with pytest.raises(KernelSelfCheckError, match=rf"triton_rope RoPE kernel on cpu / torch.float32 failed its "
                                                   rf"self-check .* {what}.* is off the torch reference"):
        rope.apply_rope(t, freqs)


def test_allow_slow_warns_once_and_runs_the_reference(as_cuda):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available")

    as_cuda.setattr(rope, "_launch", broken)
    as_cuda.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "1")
    t, freqs = _inputs()
    with pytest.warns(SlowKernelWarning, match=r"triton_rope .* cpu / torch.float32 .* no kernel image"):
        y = rope.apply_rope(t, freqs)
    assert torch.equal(y, rope.rope_reference(t, freqs))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)
        assert torch.equal(rope.apply_rope(t, freqs, True), rope.rope_reference(t, freqs, True))
    assert rope.describe("cpu", torch.float32) == ("rope on cpu float32: torch reference (slow fallback: triton_rope "
                                                   "failed its self-check)")


def test_passing_self_check_runs_the_kernel(as_cuda):
    """After a passing self-check (once per device and dtype) every call runs the launcher,
    forward and backward, through the autograd function."""
    calls = []

    def counting(x, freqs, interleaved, backward):
        calls.append(backward)
        return _correct_launch(x, freqs, interleaved, backward)

    as_cuda.setattr(rope, "_launch", counting)
    t, freqs = _inputs()
    x = t.clone().requires_grad_()
    y = rope.apply_rope(x, freqs)
    checks = len(calls)
    assert checks == 2 * 2 * len(rope.SELF_CHECK_CASES) + 1  # self-check fwd + bwd per case and layout, then ours
    y.backward(torch.ones_like(y))
    assert calls[checks:] == [True]
    rope.apply_rope(t, freqs)
    assert len(calls) == checks + 2  # no second self-check
    assert rope.describe("cpu", torch.float32) == "rope on cpu float32: triton_rope"


def test_no_triton_is_an_error_unless_allow_slow(as_cuda):
    as_cuda.setattr(triton_env, "AVAILABLE", False)
    t, freqs = _inputs()
    with pytest.raises(SlowKernelError, match=r"triton_rope .* cpu / torch.float32: triton is not installed. "
                                              r"Fix: pip install triton, or set MEGATRON_BURST_ALLOW_SLOW_KERNELS=1"):
        rope.apply_rope(t, freqs)
    as_cuda.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "1")
    with pytest.warns(SlowKernelWarning, match="triton is not installed"):
        assert torch.equal(rope.apply_rope(t, freqs), rope.rope_reference(t, freqs))


# ---------------------------------------------------------------------------------------------
# the GPU kernel, compiled without a GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_TRITON or triton_env.interpreting(), reason="needs triton, outside the interpreter")
@pytest.mark.parametrize("interleaved, backward", [(False, False), (True, True)])
def test_kernel_compiles_for_hopper(interleaved, backward):
    """bf16, 32 heads of 128 (the GPU launch options: one program per row, 8 warps), down to a
    cubin for sm_90: no shared memory, 16-byte vector loads and stores (R and D are constexprs;
    interleaved partners are swapped in registers), and cos / sin from libdevice (exact range
    reduction: positions up to 1M give angles far outside what sin.approx / cos.approx cover)."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's nvidia backend is not installed: cannot compile for sm_90")
    import rope_cases

    got = rope_cases.compile_for_gpu(torch.bfloat16, 32, 128, 128, interleaved, backward)
    print(got)
    assert "cubin" in got["stages"] and got["shared"] == 0, got
    assert (got["BLOCK_H"], got["BLOCK_D"], got["num_warps"]) == (32, 128, 8), got
    ops = got["memory_ops"]
    assert ops.get("st.global.v4.b32", 0) > 0 and not any(op.startswith("st.global") and ".v4" not in op for op in ops), ops
    assert not any(op.endswith(".b16") for op in ops), ops  # no element-wise 16-bit loads (unvectorized)
    assert got["approx_trig"] == 0 and got["libdevice"] == ["__nv_cosf", "__nv_sinf"], got
