"""impl="auto" of fused_linear_cross_entropy: the fast path after a self-check that fails loudly, the
MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 opt-out, the log line, and the fast path's default chunk.

These run in-process on CPU with the CPU counted as a fast-path device and the Triton kernel
replaced by a torch emulation of its contract (correct, wrong, or raising): triton is already
imported here without its interpreter, and what is under test is the choice, not the kernel. The
real kernel runs the same self-check under TRITON_INTERPRET=1 in test_fused_loss.py
(test_triton_kernels_under_interpreter, case "auto").
"""
from __future__ import annotations

import logging

import pytest
import torch

import fused_loss_cases as cases
from harness import run_ranks
from megatron_burst.kernels.choice import KernelSelfCheckError, SlowKernelWarning
from megatron_burst.loss import choice, fast, fused_linear_cross_entropy, reference_linear_cross_entropy, triton_kernels
from megatron_burst.loss.config import _AGREED_CHUNKS, _agreed_chunk


def emulated_ce_rows(z, tgt, stats, *, grad=None, wts=None, compute_stats=True, subtract_target=True, col0=0):
    """The contract of triton_kernels.ce_rows in plain torch (subtract_target=False: a wrong kernel
    that forgets the one-hot term of the gradient)."""
    tgt = tgt - col0
    if compute_stats:
        m = z.max(dim=1).values
        stats[0] = m
        stats[1] = torch.exp(z - m[:, None]).sum(dim=1)
        here = (tgt >= 0) & (tgt < z.shape[1])
        stats[2] = torch.where(here, z.gather(1, torch.where(here, tgt, 0)[:, None])[:, 0], 0.0)
    if grad is not None:
        g = torch.exp(z - stats[0][:, None]) * (wts / stats[1])[:, None]
        if subtract_target:
            hit = (tgt >= 0) & (tgt < z.shape[1])
            rows = torch.arange(z.shape[0])[hit]
            g[rows, tgt[hit]] -= wts[hit]
        grad.copy_(g)


@pytest.fixture
def cpu_is_fast(monkeypatch):
    """CPU counts as a fast-path device; the choice's memory (verdicts, log, warnings) starts empty
    and is restored afterwards; no environment override of the kernel policy."""
    monkeypatch.setattr(choice, "FAST_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(choice, "_VERDICTS", {})
    monkeypatch.setattr(choice, "_LOGGED", {})
    monkeypatch.setattr(choice, "_WARNED", set())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # impl="triton" accepts CPU tensors (the emulation runs)
    for var in ("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "MEGATRON_BURST_KERNEL"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _problem():
    hidden, weight, labels, mask = cases.make_inputs(6, 2, 8, 20, 4, torch.float32)
    return cases.leaf(hidden), cases.leaf(weight), labels, mask


def _grads(fn, h, w, labels, mask, **kw):
    loss = fn(h, w, labels, **kw)
    ((loss * mask).sum() / mask.sum()).backward()
    return loss.detach(), h.grad, w.grad


def test_self_check_raises_with_the_original_exception(cpu_is_fast):
    calls = {"n": 0}

    def broken(*a, **k):
        calls["n"] += 1
        raise RuntimeError("injected kernel failure")

    cpu_is_fast.setattr(triton_kernels, "ce_rows", broken)
    h, w, labels, mask = _problem()
    with pytest.raises(choice.LossSelfCheckError) as info:
        fused_linear_cross_entropy(h, w, labels, loss_mask=mask)
    err = info.value
    msg = str(err)
    assert isinstance(err, KernelSelfCheckError)  # catchable like the attention kernels' self-checks
    assert "'triton'" in msg and "on cpu / torch.float32" in msg and "raised in its self-check" in msg
    assert "RuntimeError: injected kernel failure" in msg and "MEGATRON_BURST_ALLOW_SLOW_KERNELS=1" in msg
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == "injected kernel failure"
    n = calls["n"]
    with pytest.raises(choice.LossSelfCheckError) as again:  # remembered: not checked a second time
        fused_linear_cross_entropy(h, w, labels, loss_mask=mask)
    assert again.value is err and calls["n"] == n


def test_self_check_names_the_mismatch(cpu_is_fast):
    def wrong(*a, **k):
        emulated_ce_rows(*a, subtract_target=False, **k)

    cpu_is_fast.setattr(triton_kernels, "ce_rows", wrong)
    h, w, labels, mask = _problem()
    with pytest.raises(choice.LossSelfCheckError) as info:
        fused_linear_cross_entropy(h, w, labels, loss_mask=mask)
    msg = str(info.value)
    assert "failed its self-check (scaled backward" in msg and "on cpu / torch.float32" in msg
    assert "d hidden is off the fp32 reference by" in msg and "allowed" in msg
    assert info.value.__cause__ is None


def test_self_check_covers_the_vocabulary_pass(cpu_is_fast):
    """A kernel wrong only where the vocabulary pass calls it (tiles after the first, whose target
    columns the kernel shifts: weight_grad="backward") fails the self-check too, naming that mode:
    the lean path never runs unchecked."""
    def wrong_in_the_pass(*a, col0=0, **k):  # forgets the shift
        emulated_ce_rows(*a, **k)

    cpu_is_fast.setattr(triton_kernels, "ce_rows", wrong_in_the_pass)
    h, w, labels, mask = _problem()
    with pytest.raises(choice.LossSelfCheckError) as info:
        fused_linear_cross_entropy(h, w, labels, loss_mask=mask)
    msg = str(info.value)
    assert "failed its self-check (scaled backward, weight_grad='backward'" in msg, msg
    assert "d weight is off the fp32 reference by" in msg, msg


def test_allow_slow_kernels_falls_back_to_torch_with_a_warning(cpu_is_fast, caplog):
    cpu_is_fast.setattr(triton_kernels, "ce_rows", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad launch")))
    cpu_is_fast.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "1")
    h, w, labels, mask = _problem()
    caplog.set_level(logging.INFO, logger="megatron_burst.loss")
    with pytest.warns(SlowKernelWarning, match=r"ValueError: bad launch.*the torch path runs instead"):
        got = _grads(fused_linear_cross_entropy, h, w, labels, mask, loss_mask=mask)
    assert "fused LM loss on cpu / float32: torch" in caplog.text
    h2, w2 = cases.leaf(h), cases.leaf(w)
    want = _grads(fused_linear_cross_entropy, h2, w2, labels, mask, loss_mask=mask, impl="torch")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_auto_runs_the_fast_path_after_a_passing_self_check(cpu_is_fast, caplog):
    cpu_is_fast.setattr(triton_kernels, "ce_rows", emulated_ce_rows)
    walks = {"n": 0}
    orig = fast.chunked_forward

    def counting(*a, **k):
        walks["n"] += 1
        return orig(*a, **k)

    cpu_is_fast.setattr(fast, "chunked_forward", counting)
    caplog.set_level(logging.INFO, logger="megatron_burst.loss")
    h, w, labels, mask = _problem()
    got = _grads(fused_linear_cross_entropy, h, w, labels, mask, loss_mask=mask)
    assert choice._VERDICTS == {("cpu", torch.float32): True}
    assert walks["n"] == 5  # the self-check's four calls (two weight_grad modes, far logits) and this one
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_burst.loss"]
    assert lines == ["megatron-burst: fused LM loss on cpu / float32: triton (cuBLAS GEMMs + one fused Triton "
                     "softmax-gradient pass per token chunk)"]
    h2, w2 = cases.leaf(h), cases.leaf(w)
    want = _grads(reference_linear_cross_entropy, h2, w2, labels, mask)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    _grads(fused_linear_cross_entropy, cases.leaf(h), cases.leaf(w), labels, mask, loss_mask=mask)
    assert walks["n"] == 6 and len(caplog.records) == 1  # logged once


def test_self_check_does_not_count_as_a_backward_of_the_caller(cpu_is_fast):
    from megatron_burst.loss import backward_paths

    cpu_is_fast.setattr(triton_kernels, "ce_rows", emulated_ce_rows)
    before = dict(backward_paths)
    h, w, labels, mask = _problem()
    _grads(fused_linear_cross_entropy, h, w, labels, mask, loss_mask=mask)
    assert {k: backward_paths[k] - before.get(k, 0) for k in ("scaled", "recompute")} == {"scaled": 1,
                                                                                         "recompute": 0}


def test_auto_on_cpu_runs_torch_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(choice, "_LOGGED", {})
    caplog.set_level(logging.INFO, logger="megatron_burst.loss")
    h, w, labels, mask = _problem()
    fused_linear_cross_entropy(h, w, labels, loss_mask=mask)
    assert "fused LM loss on cpu / float32: torch (GEMMs + torch elementwise passes)" in caplog.text


def test_fast_default_chunk_is_bytes_bounded():
    cpu = torch.device("cpu")
    bf16, f32 = torch.bfloat16, torch.float32
    # 1 GiB of fp32 logits + bf16 gradient per chunk, >= 1024 tokens, multiples of 512, <= N
    assert fast.default_token_chunk(16384, 131072, 4096, bf16, cpu) == 1024
    assert fast.default_token_chunk(16384, 65536, 4096, bf16, cpu) == 2560  # TP = 2
    assert fast.default_token_chunk(16384, 32768, 4096, bf16, cpu) == 5120
    assert fast.default_token_chunk(16384, 131072, 4096, f32, cpu) == 2048  # G overwrites fp32 logits
    assert fast.default_token_chunk(16384, 262144, 4096, bf16, cpu) == 1024  # the GEMM-efficiency floor
    assert fast.default_token_chunk(300, 131072, 4096, bf16, cpu) == 300


def test_fast_default_chunk_fits_free_memory(monkeypatch):
    """On CUDA the chunk plus D and A must fit in half of the free memory (here mocked: 4 GiB free,
    1 GiB cached by torch's allocator): (5 GiB / 2 - 128 MiB of D - 2 GiB of A) / 768 KiB per token
    = 512 tokens; with 70 GiB free, the 1 GiB bound (1024 tokens)."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)
    cuda = torch.device("cuda", 0)
    assert fast.default_token_chunk(16384, 131072, 4096, torch.bfloat16, cuda) == 512
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    assert fast.default_token_chunk(16384, 131072, 4096, torch.bfloat16, cuda) == 1024


def agreed_chunk_case():
    import torch.distributed as dist

    _AGREED_CHUNKS.clear()
    mine = 1024 if dist.get_rank() == 0 else 512
    first = _agreed_chunk(mine, dist.group.WORLD, ("shape",), torch.device("cpu"))
    again = _agreed_chunk(4096, dist.group.WORLD, ("shape",), torch.device("cpu"))  # cached: no collective
    return first, again


def test_tp_ranks_agree_on_the_default_chunk():
    """The chunk count fixes the number of collectives, so TP ranks take the smallest default."""
    assert run_ranks(2, agreed_chunk_case) == [(512, 512), (512, 512)]
