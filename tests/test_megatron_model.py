"""Megatron-Core GPTModel with megatron-burst's spec: CP (and TP x CP) runs equal CP = 1 in loss
and in every parameter's gradient, for every layout; the core attention module on its own."""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

VOCAB = 96  # divisible by TP 2 without padding, so TP=1 and TP=2 models have the same shapes
LAYOUT_CASES = [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)]
LOSS_TOL = 1e-5  # relative, fp32
GRAD_TOL = 1e-4  # max |dg| relative to the parameter's max |g|, fp32


# ----------------------------------------------------------------------------- rank-side bodies

def small_args(extra: Optional[List[str]] = None) -> argparse.Namespace:
    """Parsed megatron_burst.train flags for a tiny GQA GPT (head dim 8, 4 query / 2 kv heads)."""
    from megatron_burst.train import build_parser

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--seq-length", "24", "--micro-batch-size", "2",
            "--lr", "1e-3", "--train-iters", "1",
            # A large init makes attention peaky, so a wrong position or mask shows in the loss
            # (at std 0.02 a 24-token toy model is nearly position-blind).
            "--init-method-std", "0.3"] + list(extra or [])
    return build_parser().parse_args(argv)


def fixed_batch(seq: int, b: int = 2, seed: int = 7) -> Dict[str, torch.Tensor]:
    """The same full-sequence batch on every rank, with some loss tokens masked out."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, seq + 1), generator=g)
    loss_mask = (torch.rand(b, seq, generator=g) > 0.2).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask, "position_ids": torch.arange(seq).expand(b, seq).contiguous()}


def _full_grad(param: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """The unsharded gradient: TP shards concatenated along their partition dim."""
    grad = param.grad.detach()
    if not getattr(param, "tensor_model_parallel", False) or dist.get_world_size(tp_group) == 1:
        return grad.clone()
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, grad.contiguous(), group=tp_group)
    return torch.cat(parts, dim=param.partition_dim)


def build_and_step(tp: int, cp: int, extra: Optional[List[str]] = None, seq: int = 24):
    """The tiny GPT at TP x CP: one forward/backward of fixed_batch through the trainer's own
    functions, gradients all-reduced. Returns (global loss, model, process groups)."""
    from megatron_burst import train

    args = small_args(["--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
                       "--seq-length", str(seq)] + list(extra or []))
    opts, sizes = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    device = torch.device("cpu")
    train.seed_everything(args.seed, device)
    model = train.build_model(args, opts, sizes, groups, device)
    loss = train.loss_and_grads(model, [fixed_batch(seq)], opts, groups, device)
    train.allreduce_grads(model, groups)
    return loss.item(), model, groups


def full_grads(model, groups) -> Dict[str, torch.Tensor]:
    return {name: _full_grad(p, groups.tp) for name, p in model.named_parameters()}


def loss_and_full_grads(tp: int, cp: int, extra: Optional[List[str]] = None, seq: int = 24) -> dict:
    """The global loss and every parameter's full gradient of one step (see build_and_step)."""
    loss, model, groups = build_and_step(tp, cp, extra, seq)
    attn = model.decoder.layers[0].self_attention.core_attention
    return {"loss": loss, "grads": full_grads(model, groups), "algo": attn.options.algo,
            "resolved": [layer.self_attention.core_attention.resolved_algo for layer in model.decoder.layers],
            "layout": attn.options.layout, "rope": type(getattr(model, "rotary_pos_emb", None)).__name__}


def core_attention_vs_softmax(dropout: float = 0.0, training: bool = False) -> dict:
    """BurstCoreAttention on one rank vs plain causal softmax attention (GQA 4:2)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_burst.megatron.attention import BurstCoreAttention

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            attention_dropout=dropout, use_cpu_initialization=True)
    attn = BurstCoreAttention(cfg, 1, AttnMaskType.causal, "self", cp_algo="ring", cp_layout="striped")
    attn.train(training)
    g = torch.Generator().manual_seed(3)
    s, b, d = 12, 2, 8
    q, k, v = (torch.randn(s, b, h, d, generator=g) for h in (4, 2, 2))
    out = attn(q, k, v, None)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), vv).reshape(s, b, -1)
    return {"shape": tuple(out.shape), "max_err": (out - ref).abs().max().item()}


def construct_core_attention(cp: int, mask: str = "causal", attention_type: str = "self",
                             config: Optional[dict] = None, **kwargs) -> str:
    """Build BurstCoreAttention under initialize_model_parallel(1, 1, cp): 'ok' or the error."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_burst.megatron.attention import BurstCoreAttention

    ps.initialize_model_parallel(1, 1, context_parallel_size=cp, create_gloo_process_groups=False)
    cfg_kwargs = {"attention_dropout": 0.0, **(config or {})}  # TransformerConfig's default is 0.1
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            context_parallel_size=cp, use_cpu_initialization=True, **cfg_kwargs)
    try:
        BurstCoreAttention(cfg, 1, AttnMaskType[mask], attention_type, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "ok"


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def reference():
    """CP = 1, TP = 1 on one rank (rope and learned absolute positions)."""
    return {
        "rope": run_ranks(1, loss_and_full_grads, 1, 1)[0],
        "learned_absolute": run_ranks(1, loss_and_full_grads, 1, 1,
                                      ["--position-embedding-type", "learned_absolute"])[0],
    }


def _assert_matches(result: dict, ref: dict, what: str) -> None:
    assert abs(result["loss"] - ref["loss"]) <= LOSS_TOL * abs(ref["loss"]), \
        f"{what}: loss {result['loss']!r} != CP=1 {ref['loss']!r}"
    assert result["grads"].keys() == ref["grads"].keys()
    for name, g_ref in ref["grads"].items():
        g = result["grads"][name]
        assert g.shape == g_ref.shape, f"{what}: {name} grad shape {tuple(g.shape)} != {tuple(g_ref.shape)}"
        err = (g - g_ref).abs().max().item()
        scale = g_ref.abs().max().item()
        assert scale > 0, f"{name}: reference gradient is zero, the comparison would be vacuous"
        assert err <= GRAD_TOL * scale, f"{what}: {name} grad error {err:.2e} > {GRAD_TOL:.0e} x {scale:.2e}"


@pytest.mark.parametrize("layout,stripe", LAYOUT_CASES)
def test_cp2_equals_cp1(reference, layout, stripe):
    results = run_ranks(2, loss_and_full_grads, 1, 2,
                        ["--cp-layout", layout, "--cp-stripe", str(stripe), "--cp-algo", "burst"])
    for rank, res in enumerate(results):
        assert (res["algo"], res["layout"], res["rope"]) == ("burst", layout, "LayoutRotaryEmbedding")
        _assert_matches(res, reference["rope"], f"CP=2 {layout}/{stripe} rank {rank}")


@pytest.mark.parametrize("algo", ["ring", "burst", "auto"])
@pytest.mark.parametrize("layout,stripe", LAYOUT_CASES[:3])
def test_tp2_cp2_equals_cp1(reference, layout, stripe, algo):
    """TP = 2 splits the 4 query / 2 KV heads to 2 / 1 per rank (GQA 2:1 under CP)."""
    results = run_ranks(4, loss_and_full_grads, 2, 2, ["--cp-layout", layout, "--cp-algo", algo])
    for rank, res in enumerate(results):
        # auto: fp32 GQA 2:1 sends fewer backward bytes with ring (burst would carry 2x the heads)
        assert res["resolved"] == [algo if algo != "auto" else "ring"] * 2, res["resolved"]
        _assert_matches(res, reference["rope"], f"TP=2 x CP=2 {layout} {algo} rank {rank}")


@pytest.mark.parametrize("query_groups,resolved", [(2, "ring"), (4, "burst")])
def test_cp4_auto_and_cp_comm_type_path(query_groups, resolved):
    """The algorithm chosen through Megatron's --cp-comm-type reaches the attention modules, and
    auto resolves per the cost model: ring for GQA 2:1, burst for multi-head attention."""
    extra = ["--num-query-groups", str(query_groups)]
    results = run_ranks(4, loss_and_full_grads, 1, 4, ["--cp-layout", "striped", "--cp-comm-type", "auto"] + extra,
                        seq=32)
    ref = run_ranks(1, loss_and_full_grads, 1, 1, extra, seq=32)[0]
    for rank, res in enumerate(results):
        assert res["algo"] == "auto" and res["resolved"] == [resolved, resolved], res["resolved"]
        _assert_matches(res, ref, f"CP=4 striped auto rank {rank}")


def test_learned_absolute_positions_follow_layout(reference):
    results = run_ranks(2, loss_and_full_grads, 1, 2,
                        ["--cp-layout", "striped", "--position-embedding-type", "learned_absolute"])
    for rank, res in enumerate(results):
        _assert_matches(res, reference["learned_absolute"], f"CP=2 striped learned_absolute rank {rank}")


def test_megatron_zigzag_rope_would_be_wrong_for_striped(reference):
    """Guard that the equivalence tests can fail: a striped batch with zigzag-sliced RoPE
    (what stock Megatron does) misses the loss and gradient tolerances by far."""
    results = run_ranks(2, _striped_batch_zigzag_rope)
    ref = reference["rope"]
    print("wrong-RoPE relative loss error", abs(results[0]["loss"] - ref["loss"]) / abs(ref["loss"]))
    assert abs(results[0]["loss"] - ref["loss"]) > 100 * LOSS_TOL * abs(ref["loss"])
    with pytest.raises(AssertionError, match="grad error"):
        _assert_matches({"loss": ref["loss"], "grads": results[0]["grads"]}, ref, "wrong RoPE")


def _striped_batch_zigzag_rope() -> dict:
    from megatron_burst import train

    args = small_args(["--context-parallel-size", "2", "--cp-layout", "striped"])
    opts, sizes = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    train.seed_everything(args.seed, torch.device("cpu"))
    model = train.build_model(args, opts, sizes, groups, torch.device("cpu"))
    model.rotary_pos_emb.layout = "zigzag"  # RoPE rows no longer match the tokens' positions
    loss = train.loss_and_grads(model, [fixed_batch(24)], opts, groups, torch.device("cpu"))
    train.allreduce_grads(model, groups)
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_core_attention_matches_softmax_at_cp1():
    res = run_ranks(1, core_attention_vs_softmax)[0]
    assert res["shape"] == (12, 2, 32)
    assert res["max_err"] < 1e-5


def test_core_attention_dropout_at_cp1_uses_local_path():
    """Dropout > 0 is honoured at CP = 1 (outputs differ from the no-dropout result in training,
    and equal it in eval)."""
    train_mode = run_ranks(1, core_attention_vs_softmax, 0.5, True)[0]
    eval_mode = run_ranks(1, core_attention_vs_softmax, 0.5, False)[0]
    assert train_mode["max_err"] > 1e-2
    assert eval_mode["max_err"] < 1e-5


@pytest.mark.parametrize("kwargs,needle", [
    ({"config": {"attention_dropout": 0.1}}, "--attention-dropout 0.0"),
    ({"attention_dropout": 0.2}, "attention dropout 0.2"),
    ({"mask": "padding"}, "attn_mask_type=padding"),
    ({"mask": "arbitrary"}, "attn_mask_type=arbitrary"),
    ({"attention_type": "cross"}, "self-attention only"),
    ({"cp_comm_type": "a2a+p2p"}, "--cp-comm-type a2a+p2p (--cp-algo usp) needs --hierarchical"),
    ({"cp_comm_type": "ring", "cp_algo": "burst"}, "conflicting"),
    ({"cp_layout": "diagonal"}, "cp_layout='diagonal'"),
    ({"cp_layout": "zigzag", "cp_stripe": 2}, "--cp-stripe"),
    ({"config": {"window_size": (-2, 0)}}, "window_size=(-2, 0)"),
])
def test_core_attention_rejects_at_construction(kwargs, needle):
    msgs = run_ranks(2, construct_core_attention, 2, **kwargs)
    for msg in msgs:
        assert msg != "ok", f"{kwargs} was accepted"
        assert needle in msg, msg


@pytest.fixture(scope="module")
def window_reference():
    """CP = 1 with sliding windows on layer 1 only (every 2nd layer full): (3, 0) and (9, 0)."""
    return {w: run_ranks(1, loss_and_full_grads, 1, 1, ["--window-size", w, "--window-attn-skip-freq", "2"])[0]
            for w in ("3,0", "9,0")}


@pytest.mark.parametrize("layout,stripe", [("zigzag", 1), ("striped", 2)])
@pytest.mark.parametrize("window", ["3,0", "9,0"])
def test_window_size_gpt_cp2_equals_cp1(reference, window_reference, layout, stripe, window):
    """--window-size (a window shorter than and longer than a rank's 12 tokens) reaches our
    attention: CP = 2 equals CP = 1 in loss and every gradient, and the window changes the loss."""
    ref = window_reference[window]
    assert abs(ref["loss"] - reference["rope"]["loss"]) > 1e-4 * abs(ref["loss"])  # the window is applied
    results = run_ranks(2, loss_and_full_grads, 1, 2, ["--cp-layout", layout, "--cp-stripe", str(stripe),
                                                       "--window-size", window, "--window-attn-skip-freq", "2"])
    for rank, res in enumerate(results):
        _assert_matches(res, ref, f"CP=2 {layout}/{stripe} window {window} rank {rank}")


SPARSE_FLAGS = ["--sparse-attention", "vertical_slash", "--sparse-budget", "0.5", "0.5", "--sparse-last-q", "8"]


@pytest.mark.parametrize("layout,stripe,algo", [("zigzag", 1, "burst"), ("striped", 2, "ring")])
def test_sparse_attention_gpt_cp2_equals_cp1(layout, stripe, algo):
    """--sparse-attention vertical_slash (MTraining's dynamic pattern, estimated per step from the
    last 8 queries; 128 tokens: two 64-offset slash pools) through the trainer: CP = 2 equals CP = 1
    in loss and every gradient, and the pattern changes the loss against dense attention."""
    ref = run_ranks(1, loss_and_full_grads, 1, 1, SPARSE_FLAGS + ["--cp-algo", algo], 128)[0]
    dense = run_ranks(1, loss_and_full_grads, 1, 1, ["--cp-algo", algo], 128)[0]
    assert abs(ref["loss"] - dense["loss"]) > 1e-4 * abs(ref["loss"])
    results = run_ranks(2, loss_and_full_grads, 1, 2, SPARSE_FLAGS + ["--cp-layout", layout, "--cp-stripe",
                                                                     str(stripe), "--cp-algo", algo], 128)
    for rank, res in enumerate(results):
        assert res["resolved"] == [f"{algo} sparse"] * 2
        _assert_matches(res, ref, f"sparse CP=2 {layout}/{stripe} {algo} rank {rank}")


def test_sparse_attention_refuses_what_it_cannot_do():
    msg = run_ranks(2, construct_core_attention, 2, cp_algo="allgather", cp_sparse=(0.9, 0.9, 8))[0]
    assert "--sparse-attention vertical_slash runs on the ring/burst schedules alone: drop --cp-algo allgather" in msg
    msg = run_ranks(2, construct_core_attention, 2, cp_sparse=(1.5, 0.9, 8))[0]
    assert "p_v=1.5" in msg
    msg = run_ranks(2, construct_core_attention, 2, "no_mask", cp_algo="burst", cp_sparse=(0.9, 0.9, 8))[0]
    assert "drop attn_mask_type=no_mask (the pattern is causal" in msg and "ring or burst)" not in msg, msg
    # a sliding window composes with the pattern (the engine intersects them): accepted
    assert run_ranks(2, construct_core_attention, 2, cp_algo="burst", cp_sparse=(0.9, 0.9, 8),
                     config={"window_size": (8, 0)}) == ["ok", "ok"]


def test_layer_window_follows_megatron_core():
    from types import SimpleNamespace

    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_burst.megatron.attention import layer_window

    for freq in (None, 2, 3, [1, 0, 1, 1]):
        cfg = SimpleNamespace(window_size=(5, 0), window_attn_skip_freq=freq)
        for layer in range(1, 5):
            expect = (5, 0) if is_layer_window_attention((5, 0), freq, layer) else None
            assert layer_window(cfg, layer) == expect, (freq, layer)
    assert layer_window(SimpleNamespace(window_size=None, window_attn_skip_freq=2), 1) is None
    # CP = 1 takes the dropout path, which has no window: refused at construction
    msg = run_ranks(1, construct_core_attention, 1, config={"window_size": (4, 0), "attention_dropout": 0.1})[0]
    assert "window_size=(4, 0) with attention dropout" in msg, msg


def test_core_attention_accepts_supported_settings():
    assert run_ranks(2, construct_core_attention, 2, cp_comm_type="p2p") == ["ok", "ok"]
    assert run_ranks(2, construct_core_attention, 2, mask="no_mask", cp_algo="auto") == ["ok", "ok"]
    assert run_ranks(1, construct_core_attention, 1, config={"attention_dropout": 0.1}) == ["ok"]


def banner_summary(extra: List[str]) -> str:
    """The trainer banner's attention summary for the tiny GPT at CP = 4."""
    from megatron_burst import train
    from megatron_burst.train.loop import attention_summary

    args = small_args(["--context-parallel-size", "4", "--seq-length", "32"] + extra)
    opts, sizes = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    model = train.build_model(args, opts, sizes, groups, torch.device("cpu"))
    return attention_summary(model, args, sizes)


def test_trainer_banner_names_what_auto_resolved_to_and_the_ring():
    assert run_ranks(4, banner_summary, ["--cp-algo", "auto"])[0] == "cp-algo auto -> ring backward, ring flat"
    assert (run_ranks(4, banner_summary, ["--cp-algo", "auto", "--num-query-groups", "4", "--cp-ranks-per-node",
                                         "2"])[0] == "cp-algo auto -> burst backward, ring double (2 nodes x 2)")
    assert run_ranks(4, banner_summary, ["--cp-algo", "burst"])[0] == "cp-algo burst, ring flat"
