"""``--te-free-fusions`` (megatron_burst.megatron.te_free, megatron_burst.fusions.optimizer): what
megatron.core runs unfused without TransformerEngine and apex, replaced by fused kernels of the
same math.

* FusedTorchAdam: torch's fused Adam built with apex's FusedAdam constructor; AdamW mode equals
  torch's AdamW and L2 mode torch's Adam over several steps with large lr and decay (so that a
  swapped mode shows), param groups with Megatron's extra keys.
* multi_tensor_l2norm / multi_tensor_scale against the float64 norm and megatron.core's own local
  fallbacks (bitwise for the scale).
* install(): replaces exactly megatron.core's TE/apex-free fallbacks (not what TE or apex would
  provide), is idempotent, uninstall() restores; with it, ``TransformerConfig(apply_rope_fusion=True)``
  is accepted without TE (megatron.core refuses it otherwise).
* The trainer with the flag: fp32 and bf16 (megatron.core's Float16Optimizer, clip_grads, copies)
  follow the unfused run; the optimizer inside is FusedTorchAdam.
* The Megatron-LM glue installs the fusions before Megatron's model_provider runs.
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
import types

import pytest
import torch

from harness import run_ranks
from megatron_burst.fusions.optimizer import FusedTorchAdam, multi_tensor_l2norm, multi_tensor_scale
from megatron_burst.megatron import te_free

TE_FREE = importlib.import_module("megatron.core.optimizer").USING_PYTORCH_OPTIMIZER
needs_te_free = pytest.mark.skipif(not TE_FREE, reason="TransformerEngine or apex is installed here: "
                                   "megatron.core has no TE-free fallbacks to replace")


@pytest.fixture
def installed():
    lines = te_free.install()
    try:
        yield lines
    finally:
        te_free.uninstall()


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]
    return params, grads


def _run(opt_cls, mode_kwargs, seed=0):
    params, grads = _params(seed)
    groups = [{"params": params[:2], "wd_mult": 1.0, "is_expert_parallel": False},
              {"params": params[2:], "wd_mult": 0.0, "weight_decay": 0.0}]
    opt = opt_cls(groups, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.2, **mode_kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_equals_torch_adam(adam_w_mode):
    ours, opt = _run(FusedTorchAdam, {"adam_w_mode": adam_w_mode})
    reference_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref, _ = _run(reference_cls, {"foreach": False})
    other, _ = _run(torch.optim.Adam if adam_w_mode else torch.optim.AdamW, {"foreach": False})
    for a, b, c in zip(ours, ref, other):
        assert (a - b).abs().max() <= 1e-6
    # the two decay modes differ by far more than the tolerance: a swapped mode would fail above
    assert max(float((a - c).abs().max()) for a, c in zip(ours, other)) > 1e-3
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 5  # torch's state
    assert all(g["fused"] for g in opt.param_groups)
    assert isinstance(opt, torch.optim.Adam)  # megatron.core's distributed optimizer checks this


def test_fused_adam_refuses_what_it_does_not_do():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match="master_weights.*precision-aware"):
        FusedTorchAdam(p, master_weights=True)
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedTorchAdam(p, bias_correction=False)


def test_multi_tensor_l2norm_is_the_norm_of_everything():
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, generator=g) * (i + 1) for i, s in enumerate([(5, 3), (17,), (2, 2, 2)])]
    total, per = multi_tensor_l2norm(2048 * 32, torch.zeros(1, dtype=torch.int), [tensors], True)
    expect = math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))
    assert total.shape == (1,) and total.dtype == torch.float32
    assert float(total) == pytest.approx(expect, rel=1e-6)
    assert per.tolist() == pytest.approx([float(t.double().norm()) for t in tensors], rel=1e-6)
    assert multi_tensor_l2norm(0, None, [tensors], False)[1] is None


def test_multi_tensor_scale_equals_megatron_local_fallback():
    from megatron.core.utils import local_multi_tensor_scale

    g = torch.Generator().manual_seed(2)
    src = [torch.randn(s, generator=g) for s in [(6, 3), (11,)]]
    for scale, dtype in ((1.0, torch.bfloat16), (0.37, torch.bfloat16), (2.5, torch.float32)):
        ours = [torch.empty_like(s, dtype=dtype) for s in src]
        theirs = [torch.empty_like(s, dtype=dtype) for s in src]
        multi_tensor_scale(0, None, [src, ours], scale)
        local_multi_tensor_scale(0, None, [src, theirs], scale)
        assert all(a.equal(b) for a, b in zip(ours, theirs)), (scale, dtype)
    inplace, theirs = [s.clone() for s in src], [s.clone() for s in src]
    multi_tensor_scale(0, None, [inplace, inplace], 0.3)
    local_multi_tensor_scale(0, None, [theirs, theirs], 0.3)
    assert all(a.equal(b) for a, b in zip(inplace, theirs))
    with pytest.raises(ValueError, match="some destinations are their sources"):
        multi_tensor_scale(0, None, [src, [src[0], theirs[1]]], 0.5)


@needs_te_free
def test_install_replaces_the_fallbacks_and_uninstall_restores():
    rope = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    opt = importlib.import_module("megatron.core.optimizer")
    opt_mod = importlib.import_module("megatron.core.optimizer.optimizer")
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    before = (rope.fused_apply_rotary_pos_emb, rope.fused_apply_rotary_pos_emb_thd, opt.Adam,
              opt.USING_PYTORCH_OPTIMIZER, opt_mod.multi_tensor_scale_impl, clip.l2_norm_impl,
              clip.multi_tensor_scale_impl)
    assert before[0] is None and before[1] is None and before[2] is torch.optim.AdamW and before[3]
    try:
        lines = te_free.install()
        assert rope.fused_apply_rotary_pos_emb is te_free.fused_apply_rotary_pos_emb
        assert rope.fused_apply_rotary_pos_emb_thd is te_free.fused_apply_rotary_pos_emb_thd
        assert opt.Adam is FusedTorchAdam and opt.USING_PYTORCH_OPTIMIZER is False
        assert opt_mod.multi_tensor_scale_impl is multi_tensor_scale
        assert clip.multi_tensor_scale_impl is multi_tensor_scale and clip.l2_norm_impl is multi_tensor_l2norm
        assert len(lines) == 6 and not any("left as it is" in line for line in lines), lines
        assert te_free.install()[2].startswith("Adam: torch's fused Adam")  # idempotent
    finally:
        te_free.uninstall()
    after = (rope.fused_apply_rotary_pos_emb, rope.fused_apply_rotary_pos_emb_thd, opt.Adam,
             opt.USING_PYTORCH_OPTIMIZER, opt_mod.multi_tensor_scale_impl, clip.l2_norm_impl,
             clip.multi_tensor_scale_impl)
    assert all(a is b for a, b in zip(before, after))


@needs_te_free
def test_install_leaves_what_te_or_apex_would_provide(monkeypatch):
    """An attribute that is not megatron.core's TE-free fallback (here: a stand-in for apex's
    multi_tensor_l2norm) is left alone and reported."""
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")

    def apex_l2norm(*args):  # stand-in
        raise AssertionError("not called")

    monkeypatch.setattr(clip, "l2_norm_impl", apex_l2norm)
    try:
        lines = te_free.install()
        assert clip.l2_norm_impl is apex_l2norm
        assert any(line.startswith("clip_grads.l2_norm_impl: left as it is") and "apex_l2norm" in line
                   for line in lines), lines
    finally:
        te_free.uninstall()


@needs_te_free
def test_rope_fusion_config_is_accepted_after_install():
    """megatron.core refuses apply_rope_fusion without TE's fused RoPE; with ours installed it builds."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True)
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        TransformerConfig(**kwargs)
    try:
        te_free.install()
        assert TransformerConfig(**kwargs).apply_rope_fusion
    finally:
        te_free.uninstall()


# ------------------------------------------------------------------ the trainer with the flag

def _train_argv(tmp, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "3e-3",
            "--weight-decay", "0.1", "--train-iters", "4", "--log-interval", "1", "--data-cache-path",
            str(tmp / "data"), "--corpus-max-bytes", str(64 * 1024), *extra]


def train_and_report(argv):
    """megatron_burst.train.run in a pool worker: metrics, the inner optimizer's class name and
    megatron.core's clip_grads.l2_norm_impl during the run; the fusions are uninstalled afterwards
    (the worker runs other tests later)."""
    from unittest import mock

    from megatron_burst.train import loop

    seen = {}
    build = loop.build_optimizer

    def spy(args, model, device=None):
        optimizer, scheduler = build(args, model, device)
        inner = getattr(optimizer, "optimizer", optimizer)
        clip = importlib.import_module("megatron.core.optimizer.clip_grads")
        seen.update(optimizer=type(inner).__name__, l2norm=clip.l2_norm_impl.__module__)
        return optimizer, scheduler

    real_rope = te_free.fused_apply_rotary_pos_emb
    calls = []

    def counted_rope(*args, **kwargs):
        calls.append(1)
        return real_rope(*args, **kwargs)

    try:  # install() puts te_free's module attribute into megatron.core: the counting wrapper
        with mock.patch.object(loop, "build_optimizer", spy), mock.patch.object(te_free, "fused_apply_rotary_pos_emb",
                                                                                counted_rope):
            metrics = loop.run(argv)
    finally:
        te_free.uninstall()
    seen["rope_calls"] = len(calls)
    return metrics, seen


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_with_fusions_follows_the_unfused_run(tmp_path, precision):
    """fp32: the same run to float rounding (RoPE is the same fp32 math; fused and foreach Adam
    agree to ~1e-7). bf16: within one bf16 ulp per iteration (the fused RoPE rounds once, the
    unfused one after every op), through megatron.core's Float16Optimizer, clip_grads and copies."""
    extra = ["--bf16"] if precision == "bf16" else []
    plain, seen_plain = run_ranks(1, train_and_report, _train_argv(tmp_path, *extra))[0]
    fused, seen = run_ranks(1, train_and_report, _train_argv(tmp_path, *extra, "--te-free-fusions"))[0]
    assert seen["optimizer"] == "FusedTorchAdam" and seen_plain["optimizer"] == "AdamW"
    # the attention layers took megatron.core's fused-RoPE branch, which is ours: q and k, 2 layers,
    # 4 iterations (the unfused run never calls it)
    assert seen["rope_calls"] == 2 * 2 * 4 and seen_plain["rope_calls"] == 0
    if precision == "bf16":
        assert seen["l2norm"] == "megatron_burst.fusions.optimizer"
    rel = 2.0 ** -8 if precision == "bf16" else 1e-5
    for a, b in zip(plain, fused):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=rel), (a, b)
        if precision == "bf16":
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel), (a, b)
    assert plain[-1]["lm_loss"] < plain[0]["lm_loss"]


# ------------------------------------------------------------------ the Megatron-LM glue

@needs_te_free
def test_megatron_lm_provider_installs_before_model_provider(monkeypatch):
    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.args import add_args

    args = add_args(argparse.ArgumentParser()).parse_args(["--te-free-fusions"])
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    rope = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    seen = []

    def model_provider(builder, pre, post, vp_stage=None, config=None, pg_collection=None):
        seen.append(rope.fused_apply_rotary_pos_emb)
        return "model"

    try:
        assert megatron_lm.wrap_model_provider(model_provider)(lambda *a, **k: None, True, True) == "model"
        assert seen == [te_free.fused_apply_rotary_pos_emb]
    finally:
        te_free.uninstall()
    args.te_free_fusions = False
    seen.clear()
    megatron_lm.wrap_model_provider(model_provider)(lambda *a, **k: None, True, True)
    assert seen == [None]


@needs_te_free
def test_unfused_paths_are_named_at_start_up_on_cuda_only():
    """Without the flag, a CUDA machine lacking TE and apex is told what runs unfused and which flag
    changes it; on CPU nothing is said (not the cost there), nor once the fusions are installed."""
    line = te_free.unfused_here(torch.device("cuda", 0))
    assert line and "--te-free-fusions" in line and "foreach AdamW" in line and "--no-rope-fusion" in line
    assert te_free.unfused_here(torch.device("cpu")) is None
    try:
        te_free.install()
        assert te_free.unfused_here(torch.device("cuda", 0)) is None
    finally:
        te_free.uninstall()
