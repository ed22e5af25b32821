"""``--te-free-fusions`` on CUDA (megatron_burst.fusions; ``make gpu-test``, a few seconds): the
Triton RoPE kernel passes its self-check and is what runs, and its forward and backward errors
against an fp32 computation are no worse than megatron.core's own unfused bf16 RoPE (sbhd from a
fused QKV projection, and packed THD at CP = 2); torch's fused Adam follows the foreach AdamW
megatron.core falls back to; the foreach gradient norm and scale equal megatron.core's loops.

Bar for RoPE: relative Frobenius error against the fp32 result of the same bf16 inputs at most
``BOUND`` x megatron.core's unfused bf16 path's + ``FLOOR`` (ours rounds once, theirs after each op,
so ours should come out below). The CPU dry run skips these (the kernel's CPU coverage is
tests/test_fused_rope.py under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from gpu.common import ON_CPU
from megatron_burst.fusions import rope
from megatron_burst.fusions.optimizer import FusedTorchAdam, multi_tensor_l2norm, multi_tensor_scale

BOUND = 1.0
FLOOR = 1e-6
DEV = torch.device("cuda", 0) if not ON_CPU else torch.device("cpu")

pytestmark = pytest.mark.skipif(ON_CPU, reason="the fused RoPE kernel and torch's fused Adam run on CUDA here "
                                "(CPU: tests/test_fused_rope.py, tests/test_te_free_fusions.py)")

rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")


def _freqs(S: int, R: int) -> torch.Tensor:
    """Megatron's RotaryEmbedding table [S, 1, 1, R] (base 10000, non-interleaved), fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32, device=DEV) / R))
    f = torch.outer(torch.arange(S, dtype=torch.float32, device=DEV), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _fwd_bwd(fn, t: torch.Tensor, dy: torch.Tensor):
    x = t.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("S,H,R", [(4096, 16, 128), (1999, 8, 64)])
def test_rope_kernel_runs_and_is_no_worse_than_megatrons_unfused(S, H, R):
    D = 128
    g = torch.Generator(device=DEV).manual_seed(0)
    qkv = torch.randn(S, 1, H, 3 * D, device=DEV, dtype=torch.bfloat16, generator=g)
    q = qkv[..., :D]  # a strided view, as Megatron's QKV split hands it over
    dy = torch.randn(S, 1, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    freqs = _freqs(S, R)
    assert rope.describe(DEV, torch.bfloat16).endswith(rope.KERNEL_NAME)
    ref = _fwd_bwd(lambda x: rope.rope_reference(x.float(), freqs), q.float(), dy.float())
    ours = _fwd_bwd(lambda x: rope.apply_rope(x, freqs), q, dy)
    theirs = _fwd_bwd(lambda x: rope_utils._apply_rotary_pos_emb_bshd(x, freqs), q, dy)
    for name, a, b, r in zip(("out", "dq"), ours, theirs, ref):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape
        assert _rel(a, r) <= BOUND * _rel(b, r) + FLOOR, (name, _rel(a, r), _rel(b, r))


def test_rope_thd_at_cp2_matches_megatron():
    class Group:  # megatron.core's THD path asks its CP group for size and rank only
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return 2

        def rank(self):
            return self._rank

    cu = torch.tensor([0, 1024, 1536, 4096], dtype=torch.int32, device=DEV)  # global, each divisible by 4
    # a table longer than the batch: megatron.core's THD path then maps positions per sequence from 0
    # (its other mode, a table of exactly cu[-1] rows, offsets them; TE's fused THD, and ours, do not)
    freqs = _freqs(8192, 128)
    for cp_rank in (0, 1):
        t = torch.randn(2048, 8, 128, device=DEV, dtype=torch.float32)
        ours = rope.apply_rope_thd(t, cu, freqs, cp_size=2, cp_rank=cp_rank)
        theirs = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=Group(cp_rank))
        assert (ours - theirs).abs().max().item() <= 1e-5


def test_fused_adam_follows_the_foreach_adamw():
    g = torch.Generator(device=DEV).manual_seed(1)
    shapes = [(1024, 512), (4096,), (37, 3)]
    params = [torch.randn(s, device=DEV, generator=g) for s in shapes]
    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    a = FusedTorchAdam(ours, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, adam_w_mode=True)
    b = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    for _ in range(4):
        grads = [torch.randn(s, device=DEV, generator=g) for s in shapes]
        for x, y, gr in zip(ours, theirs, grads):
            x.grad, y.grad = gr.clone(), gr.clone()
        a.step()
        b.step()
    for x, y in zip(ours, theirs):
        assert (x - y).abs().max().item() <= 1e-6


def test_foreach_norm_and_scale_equal_megatrons_loops():
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    g = torch.Generator(device=DEV).manual_seed(2)
    tensors = [torch.randn(s, device=DEV, generator=g) for s in [(2048, 64), (999,), (3, 5, 7)]]
    noop = torch.zeros(1, dtype=torch.int, device=DEV)
    ours, _ = multi_tensor_l2norm(2048 * 32, noop, [tensors], False)
    theirs, _ = local_multi_tensor_l2_norm(2048 * 32, noop, [tensors], False)
    assert ours.device == tensors[0].device
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    out_ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    out_theirs = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    multi_tensor_scale(0, noop, [tensors, out_ours], 0.37)
    local_multi_tensor_scale(0, noop, [tensors, out_theirs], 0.37)
    assert all(a.equal(b) for a, b in zip(out_ours, out_theirs))
