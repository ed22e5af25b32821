"""Which local kernel runs each mask kind (megatron_burst.kernels.choice), and that a slow path is
never silent: a self-check that raises surfaces its exception; a wrong kernel is refused; a CUDA
mask kind without a fused kernel warns (or errors) naming the kind and the fix; ranks agree; the
CUDA adapters bind torch's private op schemas (checked on fake CUDA tensors, no GPU needed); the
dispatcher's non-square causal split; the single-block path at one rank.

The GPU branch of the choice is exercised on CPU by declaring "cpu" a fused device type and
registering stand-in kernel modules (correct ones wrap the tiled kernel)."""
from __future__ import annotations

import logging
import math
import sys
import types
import warnings

import pytest
import torch

import megatron_burst as mb
from megatron_burst import kernels
from megatron_burst.kernels import choice, cpu_flash, cuda_flash, cudnn_sdpa, reference, tiled, torch_ops
from megatron_burst.masks.block import BlockMask
from harness import run_ranks

CPU = torch.device("cpu")


def _stand_in(name: str, raises: Exception | None = None, ignore_d: bool = False, dtypes=None, kinds=None,
              square_only: bool = False, unavailable: str | None = None, calls: list | None = None):
    """A kernel module named ``name`` wrapping tiled: optionally raising, ignoring D, limited to
    ``dtypes``/``kinds``, or unavailable."""
    mod = types.ModuleType(f"megatron_burst.kernels.{name}")

    def forward(q, k, v, kind="full", block=1, scale=1.0, positions=None):
        if calls is not None:
            calls.append(("forward", kind, tuple(q.shape), tuple(k.shape)))
        if raises is not None:
            raise raises
        return tiled.forward(q, k, v, kind, block, scale, positions)

    def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, positions=None):
        if calls is not None:
            calls.append(("backward", kind, tuple(q.shape), tuple(k.shape)))
        return tiled.backward(dout, q, k, v, torch.zeros_like(D) if ignore_d else D, lse, kind, block, scale, positions)

    mod.forward, mod.backward = forward, backward
    mod.unavailable = lambda: unavailable
    mod.supports = lambda dtype, head_dim, kind: (
        f"not {dtype}" if dtypes is not None and dtype not in dtypes else
        f"not {kind}" if kinds is not None and kind not in kinds else None)
    mod.SQUARE_CAUSAL_ONLY = square_only
    return mod


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Treat CPU as a fused device type, with stand-in modules for the GPU kernels; returns a
    function installing a module under a kernel name."""
    monkeypatch.setattr(choice, "FUSED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(choice, "_VERIFIED", {})
    monkeypatch.setattr(choice, "_WARNED", set())
    monkeypatch.setattr(choice, "_CHOSEN", {})
    for var in ("MEGATRON_BURST_KERNEL", "MEGATRON_BURST_SPARSE_KERNEL", "MEGATRON_BURST_ALLOW_SLOW_KERNELS"):
        monkeypatch.delenv(var, raising=False)
    modules = {}

    def install(name: str, mod) -> None:
        modules[name] = mod

    real = choice.module
    monkeypatch.setattr(choice, "module", lambda name: modules[name] if name in modules else real(name))
    for name, kinds in (("cudnn", ("full", "causal")), ("cuda_flash", ("full", "causal")),
                        ("triton_masked", ("full", "causal", "block_causal", "positions"))):
        install(name, _stand_in(name, kinds=kinds, dtypes=(torch.bfloat16, torch.float16)))
    sparse = _stand_in("triton_block_sparse")
    sparse.verify = lambda device, dtype: True
    install("triton_block_sparse", sparse)
    return install


def test_self_check_surfaces_the_exception_naming_kernel_device_dtype(fused_on_cpu):
    """What the first GPU run needed: the op raised (int64 where int32 was wanted) and the check
    turned it into a silent fallback. Now it is an error carrying the original exception."""
    calls = []
    fused_on_cpu("cuda_flash", _stand_in("cuda_flash", raises=RuntimeError("cu_seqlens_q must have dtype int32"),
                                         calls=calls))
    with pytest.raises(choice.KernelSelfCheckError) as info:
        choice.checked("cuda_flash", CPU, torch.bfloat16, 64, ("causal",))
    text = str(info.value)
    for part in ("cuda_flash", "cpu", "bfloat16", "head dim 64", "causal", "cu_seqlens_q must have dtype int32",
                 "MEGATRON_BURST_ALLOW_SLOW_KERNELS=1"):
        assert part in text, (part, text)
    assert isinstance(info.value.__cause__, RuntimeError)
    n = len(calls)
    with pytest.raises(choice.KernelSelfCheckError):  # remembered: not re-run, same error
        choice.checked("cuda_flash", CPU, torch.bfloat16, 64, ("causal",))
    assert len(calls) == n


def test_self_check_refuses_wrong_gradients(fused_on_cpu):
    fused_on_cpu("cudnn", _stand_in("cudnn", ignore_d=True))
    with pytest.raises(choice.KernelSelfCheckError, match=r"\(causal block 80x80\): dq is off the float64 reference"):
        choice.checked("cudnn", CPU, torch.float32, 32, ("causal",))


def _positions_altered(alter):
    """A stand-in positions kernel (tiled) whose every call sees ``alter(positions)`` instead."""
    mod = _stand_in("triton_masked")

    def forward(q, k, v, kind="full", block=1, scale=1.0, positions=None):
        return tiled.forward(q, k, v, kind, block, scale, alter(positions))

    def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, positions=None):
        return tiled.backward(dout, q, k, v, D, lse, kind, block, scale, alter(positions))

    mod.forward, mod.backward = forward, backward
    return mod


@pytest.mark.parametrize("flaw", ["holes ignored", "per-head columns ignored", "band clamped at the diagonal"])
def test_positions_self_check_catches_what_only_the_engines_masks_use(fused_on_cpu, flaw):
    """The positions self-check runs the masks the engine now makes on CUDA: a sparse pattern's
    per-head bands with holes and per-head columns, and a block_causal block's stripe rest (band
    (-1, None)). A kernel that gets any one of them wrong fails it, before any training step."""
    from megatron_burst.masks.block import HeadBands

    def alter(positions):
        q_pos, kv_pos, q_doc, kv_doc, band = positions
        if flaw == "holes ignored" and isinstance(band, HeadBands):
            band = HeadBands(band.bounds, band.keys, None)
        elif flaw == "per-head columns ignored" and isinstance(band, HeadBands):
            band = HeadBands(band.bounds, None, band.holes)
        elif flaw == "band clamped at the diagonal" and band == (-1, None):
            band = (0, None)
        return q_pos, kv_pos, q_doc, kv_doc, band

    fused_on_cpu("triton_masked", _positions_altered(alter))
    with pytest.raises(choice.KernelSelfCheckError, match=r"failed its self-check \(positions block"):
        choice.checked("triton_masked", CPU, torch.float32, 32, ("positions",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiled", "cpu_flash", "reference"])
def test_correct_kernels_pass_the_self_check_for_every_dense_kind(name, dtype):
    choice.self_check(name, CPU, dtype, 24, choice.DENSE_KINDS)


def test_gpu_choice_per_mask_kind(fused_on_cpu, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_burst.kernels"):
        got = choice.choose(CPU, torch.bfloat16, 64, choice.DENSE_KINDS + ("sparse",))
    assert [(k, f) for k, f, b in got.kernels] == [("full", "cudnn"), ("causal", "cudnn"),
                                                   ("block_causal", "triton_masked"),
                                                   ("positions", "triton_masked"), ("sparse", "triton_block_sparse")]
    line = ("attention kernels on cpu bfloat16 head dim 64: full=cudnn causal=cudnn block_causal=triton_masked "
            "positions=triton_masked sparse=triton_block_sparse")
    assert got.describe() == line
    assert any(line in r.getMessage() for r in caplog.records)
    assert line in choice.report()


def test_next_fused_candidate_when_one_does_not_cover_the_dtype(fused_on_cpu):
    fused_on_cpu("cudnn", _stand_in("cudnn", dtypes=(torch.float16,)))
    got = choice.choose(CPU, torch.bfloat16, 64, ("causal",))
    assert got.get("causal", "forward") == got.get("causal", "backward") == "cuda_flash"


def test_no_fused_kernel_warns_naming_the_kind_and_the_fix(fused_on_cpu, monkeypatch):
    fused_on_cpu("triton_masked", _stand_in("triton_masked", unavailable="triton is not installed"))
    with pytest.warns(choice.SlowKernelWarning, match=r"no fused kernel runs 'positions' blocks on cpu / "
                                                      r"torch.bfloat16 / head dim 64 \(.*triton_masked: triton is not "
                                                      r"installed\).*pip install triton"):
        got = choice.choose(CPU, torch.bfloat16, 64, ("positions",))
    assert got.get("positions", "forward") == "tiled"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (kind, device, dtype, head dim)
        choice.choose(CPU, torch.bfloat16, 64, ("positions",))
    with pytest.warns(choice.SlowKernelWarning, match="train in bf16"):
        assert choice.choose(CPU, torch.float32, 64, ("full",)).get("full", "forward") == "tiled"
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "0")
    with pytest.raises(choice.SlowKernelError, match="'positions' blocks"):
        choice.choose(CPU, torch.bfloat16, 64, ("positions",))


def test_failed_self_check_raises_unless_slow_kernels_are_allowed(fused_on_cpu, monkeypatch):
    fused_on_cpu("cudnn", _stand_in("cudnn", raises=RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")))
    with pytest.raises(choice.KernelSelfCheckError, match="cudnn.*CUDNN_STATUS_NOT_SUPPORTED"):
        choice.choose(CPU, torch.bfloat16, 64, ("full",))
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "1")
    with pytest.warns(choice.SlowKernelWarning, match="CUDNN_STATUS_NOT_SUPPORTED.*the next kernel runs instead"):
        got = choice.choose(CPU, torch.bfloat16, 64, ("full",))
    assert got.get("full", "forward") == "cuda_flash"
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "yes")
    with pytest.raises(ValueError, match="MEGATRON_BURST_ALLOW_SLOW_KERNELS='yes'"):
        choice.choose(CPU, torch.bfloat16, 64, ("full",))


def test_forced_kernel_applies_to_the_kinds_it_covers(fused_on_cpu, monkeypatch):
    monkeypatch.setenv("MEGATRON_BURST_KERNEL", "cuda_flash")
    got = choice.choose(CPU, torch.bfloat16, 64, ("full", "causal", "positions"))
    assert [f for _, f, _ in got.kernels] == ["cuda_flash", "cuda_flash", "triton_masked"]
    monkeypatch.setenv("MEGATRON_BURST_KERNEL", "tiled")  # a plain kernel by name: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choice.choose(CPU, torch.bfloat16, 64, ("positions",)).get("positions", "forward") == "tiled"
    monkeypatch.setenv("MEGATRON_BURST_KERNEL", "fast")
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'"):
        choice.choose(CPU, torch.bfloat16, 64, ("full",))


def test_cpu_choice_is_the_measured_default(monkeypatch):
    monkeypatch.delenv("MEGATRON_BURST_KERNEL", raising=False)
    got = choice.choose(CPU, torch.bfloat16, 64, choice.DENSE_KINDS + choice.SPARSE_KINDS)
    assert got.kernels == (("full", "cpu_flash", "tiled"), ("causal", "cpu_flash", "tiled"),
                           ("block_causal", "cpu_flash", "tiled"), ("positions", "cpu_flash", "tiled"),
                           ("sparse", "block_sparse", "block_sparse"), ("gather", "row_gather", "row_gather"))
    assert choice.choose(CPU, torch.float32, 64, ("causal",)).kernels == (("causal", "cpu_flash", "cpu_flash"),)
    # the CPU op's backward takes fp32 only: fp64 (exactness runs) goes to tiled
    assert choice.choose(CPU, torch.float64, 64, ("causal",)).kernels == (("causal", "cpu_flash", "tiled"),)


# ------------------------------------------------------------------------------- ranks agree


def _agree_on(texts: list[str]) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    c = choice.KernelChoice("cuda", torch.bfloat16, 128, (("causal", texts[rank], texts[rank]),))
    try:
        choice.agree(c)
    except RuntimeError as e:
        return str(e)
    return "agreed"


def test_ranks_of_a_group_agree_on_the_kernels_or_fail():
    assert run_ranks(3, _agree_on, ["cudnn"] * 3) == ["agreed"] * 3
    got = run_ranks(3, _agree_on, ["cudnn", "cudnn", "tiled"])
    for text in got:
        assert "chose different attention kernels" in text
        assert "rank 2: attention kernels on cuda bfloat16 head dim 128: causal=tiled" in text
        assert "rank 0: attention kernels on cuda bfloat16 head dim 128: causal=cudnn" in text


# ------------------------------------------------------------------ mask kinds of a call


def _configs():
    from megatron_burst.algorithms.schedule import CPConfig
    from megatron_burst.masks.documents import check_cu_seqlens
    from megatron_burst.topology import CPTopology

    for W in (1, 2, 3):
        n = 24
        for layout, stripe in (("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 4)):
            for causal in (True, False):
                for docs in (None, [0, 7, 11, 12, n * W]):
                    for window in (None, (5, 0)):
                        documents = check_cu_seqlens(torch.tensor(docs), n * W, 1) if docs else None
                        yield n, CPConfig(CPTopology(None, 0, W, W, None), "flat", layout, stripe, causal, 0.1,
                                          documents=documents, window=window)


@pytest.mark.parametrize("split", [False, True])
def test_mask_kinds_cover_every_block_a_call_produces(split, monkeypatch):
    """Ranks agree on the kernels of cfg.mask_kinds before any block runs: it must contain the kind
    of every block of every rank pair (and be the same tuple on every rank); ``split``: block_causal
    blocks split as on CUDA (CPConfig.splits_block_causal)."""
    from megatron_burst.algorithms.schedule import CPConfig

    if split:
        monkeypatch.setattr(CPConfig, "splits_block_causal", property(lambda self: self.stripe > 1))
    for n, cfg in _configs():
        seen = {m.kind for q in range(cfg.world_size) for k in range(cfg.world_size) for _, m in cfg.blocks(q, k, n)}
        assert seen <= set(cfg.mask_kinds), (cfg.layout, cfg.stripe, cfg.causal, cfg.window, seen, cfg.mask_kinds)


@pytest.mark.parametrize("forced", [None, "triton_masked"])
def test_block_causal_kernel_is_chosen_only_where_its_blocks_run(fused_on_cpu, monkeypatch, forced):
    """Block-striped layouts: where a dense op runs the causal blocks, every block_causal block is
    split (CPConfig.splits_block_causal, on CUDA), so no block_causal kernel is chosen, self-checked
    or compiled (seconds of Triton compile per process on a GPU); where the causal blocks run the
    Triton kernel too (forced here), block_causal blocks stay whole and get their kernel. CUDA's
    split is stood in for by its rule on the stand-ins (the device here is the CPU)."""
    from megatron_burst.algorithms.prepare import choose_kernels
    from megatron_burst.algorithms.schedule import DENSE_CAUSAL_OPS, CPConfig
    from megatron_burst.topology import CPTopology

    monkeypatch.setattr(CPConfig, "splits_block_causal", property(
        lambda self: self.stripe > 1 and self.kernel is not None
        and self.kernel.get("causal", "forward") in DENSE_CAUSAL_OPS))
    calls = []
    fused_on_cpu("triton_masked", _stand_in("triton_masked", calls=calls, dtypes=(torch.bfloat16,)))
    if forced:
        monkeypatch.setenv("MEGATRON_BURST_KERNEL", forced)
    cfg = CPConfig(CPTopology(None, 0, 2, 2, None), "flat", "striped", 4, True, 0.1)
    assert "block_causal" in cfg.mask_kinds
    q = torch.zeros(1, 4, 32, 16, dtype=torch.bfloat16)
    choose_kernels(cfg, q, 16, None, None)
    checked = {kind for _, kind, _, _ in calls}
    if forced:
        assert cfg.kernel.get("block_causal", "forward") == "triton_masked" and "block_causal" in checked
        assert not cfg.splits_block_causal
    else:
        assert cfg.kernel.get("causal", "forward") in DENSE_CAUSAL_OPS and cfg.splits_block_causal
        assert "block_causal" not in cfg.kernel.kinds and "block_causal" not in checked, (cfg.kernel, checked)
        assert {m.kind for r in range(2) for o in range(2) for _, m in cfg.blocks(r, o, 32)} <= set(cfg.kernel.kinds)


# ------------------------------------------------------ CUDA adapters on fake CUDA tensors


def test_cuda_adapters_bind_torch_schemas_on_fake_cuda_tensors(monkeypatch):
    """torch's fused CUDA ops run under FakeTensorMode on a CPU-only build: argument names, the
    backward's placeholders and output shapes are checked without a GPU. The backward gets what the
    forward returns for a dense call (None for the varlen lengths), never hand-made tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = {}
    real_call = torch_ops.call

    def recording_call(name, **kw):
        seen.setdefault(name, kw)
        return real_call(name, **kw)

    monkeypatch.setattr(torch_ops, "call", recording_call)
    with FakeTensorMode():
        q = torch.empty(2, 4, 80, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 2, 80, 64, device="cuda", dtype=torch.bfloat16)
        D = torch.empty(2, 4, 80, device="cuda")
        for impl in (cuda_flash, cudnn_sdpa):
            assert impl.unavailable() is None
            out, lse = impl.forward(q, k, k, "causal", 1, 0.125)
            assert out.shape == (2, 4, 80, 64) and lse.shape == (2, 4, 80) and lse.dtype == torch.float32
            for extra in ({}, {"out": out}):
                dq, dk, dv = impl.backward(q, q, k, k, D, lse, "causal", 1, 0.125, **extra)
                assert dq.shape == (2, 4, 80, 64) and dk.shape == dv.shape == (2, 2, 80, 64)
    bwd = seen["_scaled_dot_product_flash_attention_backward"]
    assert bwd["cum_seq_q"] is None and bwd["cum_seq_k"] is None  # what the dense forward returns
    assert bwd["max_q"] == 80 and bwd["scale"] == 0.125
    assert seen["_scaled_dot_product_cudnn_attention_backward"]["logsumexp"].dim() == 4  # cuDNN's [b, h, s, 1]


def test_torch_ops_call_refuses_unknown_and_missing_arguments():
    with pytest.raises(torch_ops.OpSchemaError, match="has no argument.*cu_seqlens"):
        torch_ops.call("_scaled_dot_product_flash_attention", query=torch.zeros(1), cu_seqlens=None)
    with pytest.raises(torch_ops.OpSchemaError, match="requires 'value'"):
        torch_ops.call("_scaled_dot_product_flash_attention", query=torch.zeros(1), key=torch.zeros(1))
    assert torch_ops.missing_reason("no_such_attention_op", ()) == f"torch {torch.__version__} has no aten::no_such_attention_op"
    assert torch_ops.missing_reason("_scaled_dot_product_flash_attention", ("query", "window")) is not None


# ------------------------------------------------------ dispatcher: square causal, one block


@pytest.mark.parametrize("rows,cols", [(37, 53), (53, 37), (20, 20)])
def test_non_square_causal_runs_as_square_parts_on_square_only_kernels(monkeypatch, rows, cols):
    calls = []
    square = _stand_in("square_only", square_only=True, calls=calls)
    monkeypatch.setattr(choice, "module", lambda name: square)
    g = torch.Generator().manual_seed(3)
    q, do = torch.randn(2, 4, 60, 16, generator=g), torch.randn(2, 4, 60, 16, generator=g)
    k, v = torch.randn(2, 2, 60, 16, generator=g), torch.randn(2, 2, 60, 16, generator=g)
    mask = BlockMask("causal", 60 - rows, 60, 2, 2 + cols)
    out, lse = kernels.block_forward(q, k, v, mask, 0.25, "tiled")
    ref_out, ref_lse = reference.forward(q[:, :, 60 - rows:], k[:, :, 2:2 + cols], v[:, :, 2:2 + cols], "causal", 1, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    D = torch.randn(2, 4, 60, generator=g)
    lse_all = torch.randn(2, 4, 60, generator=g) + 5
    got = kernels.block_backward(do, q, k, v, D, lse_all, mask, 0.25, "tiled")
    ref = reference.backward(do[:, :, 60 - rows:], q[:, :, 60 - rows:], k[:, :, 2:2 + cols], v[:, :, 2:2 + cols],
                             D[:, :, 60 - rows:], lse_all[:, :, 60 - rows:], "causal", 1, 0.25)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)
    shapes = {(c[1], c[2][2], c[3][2]) for c in calls}
    assert all(kind == "full" or sq == sk for kind, sq, sk in shapes), shapes
    assert len(calls) == (2 if rows == cols else 4 if rows > cols else 2)


def test_one_rank_runs_one_kernel_call_each_way(monkeypatch):
    """At world size 1 with one block: one forward and one backward kernel call, no merge, the
    final output handed to the backward (no stand-in, and no D for a kernel that reads the
    output); results equal the reference."""
    calls = []
    seen_out = []
    spy = _stand_in("spy", calls=calls)
    real_backward = spy.backward

    def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, positions=None, out=None):
        seen_out.append((out is not None, D is None))
        if out is not None:  # like torch's fused ops: D from the output it is given
            D = (dout.float() * out.float()).sum(-1)
        return real_backward(dout, q, k, v, D, lse, kind, block, scale, positions)

    spy.backward, spy.TAKES_OUT = backward, True
    monkeypatch.setattr(choice, "module", lambda name: spy)
    import megatron_burst.algorithms.ring as ring

    monkeypatch.setattr(ring, "merge_into", lambda *a: pytest.fail("merged on the single-block path"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(33, 2, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(33, 2, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(33, 2, 2, 16, generator=g, requires_grad=True)
    out = mb.cp_attention(q, k, v, layout="contiguous")
    out.backward(torch.ones_like(out))
    assert [c[0] for c in calls] == ["forward", "backward"] and seen_out == [(True, True)]
    qr, kr, vr = (t.detach().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    ref, _ = reference.forward(qr, kr, vr, "causal", 1, 1 / math.sqrt(16))
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out.permute(1, 2, 0, 3), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q.grad.permute(1, 2, 0, 3), qr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.grad.permute(1, 2, 0, 3), kr.grad, atol=1e-5, rtol=1e-5)


def test_cudnn_blocks_torch_refuses_run_flash_and_the_gate_is_cached(monkeypatch):
    """cuDNN's private op has none of SDPA's shape/layout checks (a block outside its support crashed
    the process on an H100): each block asks torch's public eligibility test first, and a refused
    block runs torch's flash op, forward and backward; the verdict is cached per tensor signature."""
    asked = []

    def would_run(q, k, v, causal):
        asked.append((tuple(q.shape), causal))
        return q.shape[2] % 64 == 0

    monkeypatch.setattr(cudnn_sdpa, "_torch_would_run_cudnn", would_run)
    monkeypatch.setattr(cudnn_sdpa, "native_gqa", lambda device, dtype: True)
    monkeypatch.setattr(cudnn_sdpa, "_TAKES", {})
    ran = []
    monkeypatch.setattr(cudnn_sdpa, "_forward_op", lambda q, k, v, causal, scale: (
        ran.append("cudnn") or (torch.zeros_like(q), torch.zeros(*q.shape[:3], 1))))
    monkeypatch.setattr(cuda_flash, "forward", lambda q, k, v, kind, block, scale: (
        ran.append("flash") or (torch.zeros_like(q), torch.zeros(q.shape[:3]))))
    monkeypatch.setattr(cuda_flash, "backward", lambda dout, q, k, v, D, lse, kind, block, scale, out=None: (
        ran.append("flash_bwd") or (q, k, v)))
    for sq in (128, 80, 128, 80):
        q, k = torch.zeros(1, 4, sq, 16), torch.zeros(1, 2, sq, 16)
        out, lse = cudnn_sdpa.forward(q, k, k, "causal", 1, 0.25)
        assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert ran == ["cudnn", "flash", "cudnn", "flash"]
    assert asked == [((1, 4, 128, 16), True), ((1, 4, 80, 16), True)]  # once per signature
    q = torch.zeros(1, 4, 80, 16)
    assert cudnn_sdpa.backward(q, q, torch.zeros(1, 2, 80, 16), torch.zeros(1, 2, 80, 16), None,
                               torch.zeros(1, 4, 80), "causal", 1, 0.25, out=q)[0] is q
    assert ran[-1] == "flash_bwd"


def test_cudnn_backward_copies_o_and_do_only_when_their_layouts_differ(monkeypatch):
    """The op reads O and dO with one set of strides. A one-block call hands both as sbhd views
    (as SDPA itself does): they go through as they are. Different layouts (the CP schedules' contiguous
    dO against the output's sbhd view) are both made contiguous, as are non-dense ones."""
    monkeypatch.setattr(cudnn_sdpa, "_torch_would_run_cudnn", lambda q, k, v, causal: True)
    monkeypatch.setattr(cudnn_sdpa, "native_gqa", lambda device, dtype: True)
    monkeypatch.setattr(cudnn_sdpa, "_TAKES", {})
    monkeypatch.setattr(cudnn_sdpa, "_placeholders", lambda device, dtype: (None, None, None, None, 3))
    seen = {}

    def call(name, **kw):
        seen.update(grad_out=kw["grad_out"], out=kw["out"])
        return torch.zeros_like(kw["query"]), torch.zeros_like(kw["key"]), torch.zeros_like(kw["value"])

    monkeypatch.setattr(cudnn_sdpa.torch_ops, "call", call)
    s, h, d = 48, 4, 16
    q, k = torch.zeros(s, 1, h, d).permute(1, 2, 0, 3), torch.zeros(s, 1, 2, d).permute(1, 2, 0, 3)
    lse = torch.zeros(1, h, s)
    o, do = torch.randn(s, 1, h, d).permute(1, 2, 0, 3), torch.randn(s, 1, h, d).permute(1, 2, 0, 3)
    cudnn_sdpa.backward(do, q, k, k, None, lse, "causal", 1, 0.25, out=o)
    assert seen["grad_out"] is do and seen["out"] is o
    do_c = do.contiguous()
    cudnn_sdpa.backward(do_c, q, k, k, None, lse, "causal", 1, 0.25, out=o)
    assert seen["grad_out"].is_contiguous() and seen["out"].is_contiguous() and torch.equal(seen["out"], o)
    o_gaps, do_gaps = (torch.randn(1, 2 * h, s, d)[:, ::2] for _ in range(2))  # same strides, not dense
    cudnn_sdpa.backward(do_gaps, q, k, k, None, lse, "causal", 1, 0.25, out=o_gaps)
    assert seen["grad_out"].is_contiguous() and seen["out"].is_contiguous()


def test_cudnn_gate_asks_torch_and_restores_its_switch():
    """The gate evaluates torch's own test with cuDNN's runtime switch on, then restores the switch."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        q, k = torch.zeros(1, 4, 64, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
        assert cudnn_sdpa._torch_would_run_cudnn(q, k, k, True) is False  # CPU tensors: never cuDNN
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
