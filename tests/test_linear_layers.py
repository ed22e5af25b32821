"""Linear-attention layers (issue D1): each variant equals a hand-written reference of its paper's
math (forward and every gradient) at CP = 1, TP = 2 equals TP = 1, the hybrid block puts linear and
softmax layers where --linear-attention-freq says, and the flags parse and refuse like Megatron-LM.

CP > 1 equivalence is in test_linear_hybrid_gpt.py.
"""
from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_ranks

VARIANTS = ["basic", "lightning", "retention", "gla"]
S, B, HIDDEN, HEADS, GROUPS, D = 13, 2, 32, 4, 2, 8  # odd sequence length; GQA 4 query / 2 key-value heads
NUM_LAYERS, LAYER_NUMBER = 3, 2  # the layer sits in the middle of the stack (Lightning's layer factor 0.5)
TOL = 2e-5  # relative, fp32


# ----------------------------------------------------------------------------- the hand references

def recurrence(q, k, v, log_decay, scale):
    """o_t = scale * q_t S_t, S_t = exp(g_t) * S_{t-1} + k_t^T v_t, token by token. q, k [s, b, h, dk],
    v [s, b, h, dv], log_decay [s, b, h, dk] (or None)."""
    s, b, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for t in range(s):
        if log_decay is not None:
            state = torch.exp(log_decay[t])[..., None] * state
        state = state + k[t][..., :, None] * v[t][..., None, :]
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[t], state))
    return torch.stack(out)


def rope_rows(s: int, d: int) -> torch.Tensor:
    """RoPE rows [s, 1, 1, d] as Megatron's RotaryEmbedding builds them (base 10000, not interleaved)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def rotate(x, rows):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * rows.cos() + rotated * rows.sin()


def head_norm(o, weight, bias, eps):
    if bias is not None:  # LayerNorm per head (RetNet's GroupNorm), else RMSNorm per head
        o = o - o.mean(-1, keepdim=True)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight
    return o + bias if bias is not None else o


def reference_layer(variant: str, p: dict, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The variant's layer written out from its paper (see linear_variants' docstring), reading
    the weights by Megatron's fused-qkv layout: per key/value group [its query heads, its gate heads
    (retention, gla), one key head, one value head]."""
    groups = HEADS if variant == "lightning" else GROUPS  # TNL shares no key/value heads
    per_group = HEADS // groups
    gate_width = per_group * D if variant in ("retention", "gla") else 0
    mixed = (x @ p["linear_qkv.weight"].T + p["linear_qkv.bias"]).view(S, B, groups, -1)
    q, gate, k, v = torch.split(mixed, [per_group * D, gate_width, D, D], dim=-1)
    q, gate = q.reshape(S, B, HEADS, D), gate.reshape(S, B, HEADS, gate_width // per_group)
    k, v = k.repeat_interleave(per_group, 2), v.repeat_interleave(per_group, 2)  # head i reads group i // r
    low_rank = None
    if "linear_low_rank.down.weight" in p:
        low_rank = x @ p["linear_low_rank.down.weight"].T @ p["linear_low_rank.up.weight"].T
        low_rank = low_rank + p.get("linear_low_rank.up.bias", 0.0)
    scale, log_decay = D ** -0.5, None
    if variant == "basic":  # Katharopoulos et al.: phi(x) = elu(x) + 1
        q, k = F.elu(q) + 1, F.elu(k) + 1
    elif variant == "lightning":  # TNL: SiLU on q, k, v; lambda_h = exp(-slope_h (1 - l/(L-1) + 1e-5)); no scale
        q, k, v, scale = F.silu(q), F.silu(k), F.silu(v), 1.0
        slopes = torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8])  # ALiBi, 4 heads
        log_decay = -slopes * (1 - (LAYER_NUMBER - 1) / (NUM_LAYERS - 1) + 1e-5)
    elif variant == "retention":  # RetNet: gamma_h = 1 - 2^(-5-h), rotated q and k
        q, k = rotate(q, rows), rotate(k, rows)
        log_decay = torch.log(1 - 2.0 ** (-5.0 - torch.arange(HEADS, dtype=torch.float64))).float()
    else:  # GLA: alpha = sigmoid(x W1 W2 + b)^(1/16) per key channel, shared by a group's heads
        log_decay = (F.logsigmoid(low_rank) / 16).view(S, B, groups, D).repeat_interleave(per_group, 2)
    if log_decay is not None and log_decay.dim() == 1:  # per head, constant over tokens
        log_decay = log_decay.view(1, 1, HEADS, 1).expand(S, B, HEADS, D)
    o = recurrence(q, k, v, log_decay, scale)
    o = head_norm(o, p["out_norm.weight"], p.get("out_norm.bias"), 1e-5)
    if variant in ("retention", "gla"):
        o = o * F.silu(gate)
    elif variant == "lightning":
        o = o * torch.sigmoid(low_rank).view(S, B, HEADS, D)
    return o.reshape(S, B, HEADS * D) @ p["linear_proj.weight"].T


# ----------------------------------------------------------------------------- rank-side bodies

def _layer_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
              kv_channels=D, use_cpu_initialization=True, init_method_std=0.3, add_bias_linear=True,
              apply_rope_fusion=False, attention_dropout=0.0)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _build_layer(variant: str, tp: int = 1, mask: str = "causal"):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron_burst.specs import linear_attention_spec

    ps.initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
    torch.manual_seed(0)
    spec = linear_attention_spec(variant, use_te=False)
    spec.params["attn_mask_type"] = AttnMaskType[mask]
    return build_module(spec, config=_layer_config(tensor_model_parallel_size=tp), layer_number=LAYER_NUMBER,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def layer_vs_reference(variant: str) -> dict:
    """The layer and reference_layer on the same weights (norm weights, norm and gate biases
    perturbed from their 1/0 init): output, bias and every gradient."""
    layer = _build_layer(variant)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.startswith("out_norm") or name.endswith("bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=g) + (1.0 if name.endswith("weight") else 0.0))
    x = torch.randn(S, B, HIDDEN, generator=g, requires_grad=True)
    probe = torch.randn(S, B, HIDDEN, generator=g)
    rows = rope_rows(S, D)
    out, bias = layer(x, None, rotary_pos_emb=rows)
    (out * probe).sum().backward()

    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    ref = reference_layer(variant, params, x_ref, rows)
    (ref * probe).sum().backward()

    def rel(a, b):
        scale = b.abs().max().item()
        assert scale > 0, "reference is zero: the comparison would be vacuous"
        return (a - b).abs().max().item() / scale

    errors = {"out": rel(out.detach(), ref.detach()), "x.grad": rel(x.grad, x_ref.grad)}
    errors.update({f"{n}.grad": rel(p.grad, params[n].grad) for n, p in layer.named_parameters()
                   if n != "linear_proj.bias"})  # the returned bias: added by the caller
    return {"errors": errors, "bias_is_proj_bias": torch.equal(bias, layer.linear_proj.bias),
            "shapes": {n: tuple(p.shape) for n, p in layer.named_parameters()}}


def bidirectional_basic() -> float:
    """attn_mask_type no_mask: o_t = scale * phi(q_t) sum_j phi(k_j)^T v_j over every token."""
    layer = _build_layer("basic", mask="no_mask")
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(2))
    out, _ = layer(x, None)
    p = {n: t.detach() for n, t in layer.named_parameters()}
    mixed = (x @ p["linear_qkv.weight"].T + p["linear_qkv.bias"]).view(S, B, GROUPS, -1)
    q, k, v = torch.split(mixed, [2 * D, D, D], dim=-1)
    q, k, v = F.elu(q.reshape(S, B, HEADS, D)) + 1, F.elu(k) + 1, v
    state = torch.einsum("sbgk,sbgv->bgkv", k, v).repeat_interleave(2, 1)
    o = head_norm(D ** -0.5 * torch.einsum("sbhk,bhkv->sbhv", q, state), p["out_norm.weight"], None, 1e-5)
    ref = o.reshape(S, B, -1) @ p["linear_proj.weight"].T
    return ((out - ref).abs().max() / ref.abs().max()).item()


def construct_layer(variant: str, tp: int = 1, mask: str = "causal", config: dict = None) -> str:
    """Build the layer (on TP ranks): 'ok' or the ValueError's text."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_burst.megatron.linear_attention import LinearSelfAttention
    from megatron_burst.specs import linear_attention_spec

    ps.initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
    spec = linear_attention_spec(variant)
    try:
        LinearSelfAttention(_layer_config(tensor_model_parallel_size=tp, **(config or {})), spec.submodules, 1,
                            AttnMaskType[mask], pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                            linear_attention=variant)
    except ValueError as exc:
        return str(exc)
    return "ok"


def decay_stays_fp32() -> dict:
    layer = _build_layer("retention").bfloat16()
    return {"dtype": str(layer.log_decay.dtype), "weight": str(layer.linear_qkv.weight.dtype),
            "last": layer.log_decay[-1].item()}


def sharded_norm_at_tp2() -> dict:
    """Distributed checkpointing: the per-head norm is sharded by head over TP ranks."""
    layer = _build_layer("retention", tp=2)
    entry = layer.sharded_state_dict(prefix="attn.")["attn.out_norm.weight"]
    return {"global": tuple(entry.global_shape), "local": tuple(entry.local_shape), "offset": entry.global_offset}


def hybrid_loss_and_grads(tp: int, variant: str, freq: str = "2") -> dict:
    """The tiny GQA GPT of the model tests with 4 layers, linear where --linear-attention-freq says."""
    from test_megatron_model import build_and_step, full_grads

    loss, model, groups = build_and_step(tp, 1, ["--num-layers", "4", "--linear-attention-type", variant,
                                                 "--linear-attention-freq", freq])
    return {"loss": loss, "grads": full_grads(model, groups),
            "layers": [type(layer.self_attention).__name__ for layer in model.decoder.layers]}


# ----------------------------------------------------------------------------- layer tests

@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_equals_its_papers_math_forward_and_gradients(variant):
    res = run_ranks(1, layer_vs_reference, variant)[0]
    bad = {name: err for name, err in res["errors"].items() if not err <= TOL}
    assert not bad, f"{variant}: relative errors above {TOL}: {bad}"
    assert res["bias_is_proj_bias"]
    qkv_rows = {"basic": GROUPS * (2 * D + 2 * D), "lightning": HEADS * 3 * D,  # no shared heads, no fused gate
                "retention": GROUPS * (4 * D + 2 * D), "gla": GROUPS * (4 * D + 2 * D)}[variant]
    assert res["shapes"]["linear_qkv.weight"] == (qkv_rows, HIDDEN)
    assert res["shapes"]["out_norm.weight"] == (HEADS, D)
    low_rank = {"lightning": [(D, HIDDEN), (HEADS * D, D)], "gla": [(16, HIDDEN), (GROUPS * D, 16)]}.get(variant)
    assert [res["shapes"][n] for n in ("linear_low_rank.down.weight", "linear_low_rank.up.weight")
            if n in res["shapes"]] == (low_rank or [])
    assert ("linear_low_rank.up.bias" in res["shapes"]) == (variant == "gla")  # GLA's b_alpha; TNL's gate has none


def test_the_reference_sees_a_wrong_decay():
    """Guard that the comparison can fail: Lightning without its layer factor misses by far."""
    from megatron_burst.megatron import linear_variants

    assert linear_variants.lightning_log_decay(4, LAYER_NUMBER - 1, NUM_LAYERS)[0].item() == pytest.approx(
        -0.25 * (0.5 + 1e-5))
    assert linear_variants.lightning_log_decay(4, 0, 1)[0].item() == pytest.approx(-0.25 * (1 + 1e-5))
    assert linear_variants.alibi_slopes(6) == pytest.approx([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])
    q = torch.randn(20, 1, 1, 4)
    with_factor = recurrence(q, q, q, torch.full((20, 1, 1, 4), -0.25 * 0.5), 1.0)
    without = recurrence(q, q, q, torch.full((20, 1, 1, 4), -0.25), 1.0)
    assert (with_factor - without).abs().max() > 1e-2


def test_bidirectional_basic_attends_to_every_token():
    assert run_ranks(1, bidirectional_basic)[0] < TOL


@pytest.mark.parametrize("variant,tp,mask,config,needle", [
    ("lightning", 1, "no_mask", None, "'no_mask' (bidirectional) for variants without a decay"),
    ("basic", 1, "padding", None, "attn_mask_type=padding"),
    ("gla", 2, "causal", {"num_attention_heads": 2, "num_query_groups": 1, "kv_channels": 16},
     "cannot be split over 2 tensor-parallel ranks"),
    ("basic", 1, "causal", {"context_parallel_size": 2}, "config.context_parallel_size=2"),
])
def test_layer_refuses_at_construction(variant, tp, mask, config, needle):
    for msg in run_ranks(tp, construct_layer, variant, tp, mask, config):
        assert needle in msg, msg


def test_lightning_ignores_query_groups_and_accepts_them_under_tp():
    """TNL shares no key/value heads: --num-query-groups 1 (for the softmax layers) is fine at TP = 2."""
    assert run_ranks(2, construct_layer, "lightning", 2, "causal", {"num_query_groups": 1}) == ["ok", "ok"]


def test_decays_stay_fp32_under_bf16_casts():
    """Megatron-LM's Float16Module casts the whole model; RetNet's log(1 - 2^-8) must not become bf16."""
    res = run_ranks(1, decay_stays_fp32)[0]
    assert res["dtype"] == "torch.float32" and res["weight"] == "torch.bfloat16"
    assert res["last"] == pytest.approx(math.log(1 - 2.0 ** -8), rel=1e-6)


def test_head_norm_is_sharded_by_head_for_distributed_checkpoints():
    for rank, res in enumerate(run_ranks(2, sharded_norm_at_tp2)):
        assert res["global"] == (HEADS, D) and res["local"] == (HEADS // 2, D)
        assert res["offset"] == (rank * HEADS // 2, 0)


# ----------------------------------------------------------------------------- TP and the hybrid GPT

@pytest.fixture(scope="module")
def tp1():
    return {v: run_ranks(1, hybrid_loss_and_grads, 1, v)[0] for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_equals_tp1(tp1, variant):
    """TP = 2 splits 4 query / 2 key-value heads, the low-rank projections and the per-head norms."""
    from test_megatron_model import _assert_matches

    assert tp1[variant]["layers"] == ["LinearSelfAttention", "SelfAttention"] * 2
    for rank, res in enumerate(run_ranks(2, hybrid_loss_and_grads, 2, variant)):
        assert res["layers"] == tp1[variant]["layers"]
        _assert_matches(res, tp1[variant], f"{variant} TP=2 rank {rank}")


# ----------------------------------------------------------------------------- the block spec

def _config(num_layers=4, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                             use_cpu_initialization=True, **kw)


def _attention_of(block):
    return ["linear" if layer.submodules.self_attention.module.__name__ == "LinearSelfAttention" else
            layer.submodules.self_attention.submodules.core_attention.module.__name__ for layer in block.layer_specs]


@pytest.mark.parametrize("freq,want", [
    (2, ["linear", "CPCoreAttention"] * 2),
    (4, ["linear"] * 3 + ["CPCoreAttention"]),
    (1, ["CPCoreAttention"] * 4),
    ([1, 0, 0, 1], ["linear", "CPCoreAttention", "CPCoreAttention", "linear"]),
    (None, ["linear"] * 4),
])
def test_block_spec_pattern(freq, want):
    from megatron_burst.specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(_config(), linear_attention="retention", linear_attention_freq=freq,
                                       use_te=False)
    assert _attention_of(block) == want
    linear = [layer.submodules.self_attention for layer in block.layer_specs
              if layer.submodules.self_attention.module.__name__ == "LinearSelfAttention"]
    assert all(spec.params["linear_attention"] == "retention" and spec.params["cp_layout"] == "zigzag"
               for spec in linear)
    softmax = [layer.submodules.self_attention.submodules.core_attention for layer in block.layer_specs
               if layer.submodules.self_attention.module.__name__ == "SelfAttention"]
    assert all(spec.params["cp_algo"] == "burst" and spec.params["cp_layout"] == "zigzag" for spec in softmax)


def test_block_spec_reads_config_freq_and_keeps_megatrons_mlps():
    """None takes config.linear_attention_freq (Megatron-LM puts its flag there); MoE layers stay MoE."""
    from megatron_burst.specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(_config(linear_attention_freq=2, num_moe_experts=4, moe_layer_freq=[1, 0, 1, 0]),
                                       linear_attention="gla", use_te=False)
    assert _attention_of(block) == ["linear", "CPCoreAttention"] * 2
    assert [layer.submodules.mlp.module.__name__ for layer in block.layer_specs] == ["MoELayer", "MLP"] * 2
    with pytest.raises(ValueError, match="linear_attention_freq=4 but config.linear_attention_freq=2"):
        get_gpt_decoder_block_spec(_config(linear_attention_freq=2), linear_attention_freq=4, use_te=False)


@pytest.mark.parametrize("kwargs,needle", [
    ({"linear_attention": "mamba"}, "linear_attention='mamba' is not a linear-attention variant"),
    ({"linear_attention_freq": [1, 0]}, "has 2 entries but the model has --num-layers 4"),
    ({"linear_attention_freq": [1, 2, 0, 1]}, "entries must be 0 (softmax) or 1 (linear)"),
    ({"linear_attention_freq": 0}, "N must be >= 1"),
    ({"linear_cp_algo": "ring"}, "linear_cp_algo='ring'"),
    ({"cp_layout": "diagonal"}, "cp_layout='diagonal'"),
])
def test_block_spec_refusals(kwargs, needle):
    from megatron_burst.specs import get_gpt_decoder_block_spec

    with pytest.raises(ValueError) as info:
        get_gpt_decoder_block_spec(_config(), use_te=False, **kwargs)
    assert needle in str(info.value)


def test_linear_layers_cannot_replace_mla():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_burst.specs import hybrid_block_spec

    with pytest.raises(ValueError, match="MLASelfAttention.*cannot replace"):
        hybrid_block_spec(get_gpt_layer_local_spec(multi_latent_attention=True), _config(), [1, 0, 1, 0],
                          linear_attention="gla")


# ----------------------------------------------------------------------------- flags

def _parse(argv, parser=None):
    from megatron_burst.megatron.args import add_args

    return add_args(parser or argparse.ArgumentParser()).parse_args(argv)


def test_flags_parse_like_megatron_lm(capsys):
    args = _parse([])
    assert (args.linear_attention_type, args.linear_attention_freq, args.linear_cp_algo) == (None, None, "lasp2")
    args = _parse(["--linear-attention-type", "gla", "--linear-attention-freq", "([1]*3+[0]*1)*2",
                   "--linear-cp-algo", "lasp1"])
    assert (args.linear_attention_type, args.linear_cp_algo) == ("gla", "lasp1")
    assert args.linear_attention_freq == [1, 1, 1, 0, 1, 1, 1, 0]
    assert _parse(["--linear-attention-freq", "4"]).linear_attention_freq == 4
    with pytest.raises(SystemExit):
        _parse(["--linear-attention-type", "mamba"])
    assert "invalid choice: 'mamba'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a list expression, not arbitrary Python
        _parse(["--linear-attention-freq", "[__import__('os').getpid()]"])


def test_megatron_lms_own_freq_flag_is_kept():
    """Megatron-LM defines --linear-attention-freq; as its extra_args_provider we must not add it again."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--linear-attention-freq", type=int, default=None, help="Megatron-LM's")
    args = _parse(["--linear-attention-freq", "3", "--linear-attention-type", "basic"], parser)
    assert args.linear_attention_freq == 3


def _train_args(argv):
    from megatron_burst.train import build_parser

    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "256",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2"]
    return build_parser().parse_args(base + argv)


@pytest.mark.parametrize("argv,world,needle", [
    (["--linear-attention-freq", "2"], 1, "--linear-attention-freq 2 has no linear layers to place"),
    (["--linear-attention-type", "gla", "--linear-attention-freq", "[1,0]"], 1,
     "--linear-attention-freq has 2 entries but the model has --num-layers 4"),
    (["--linear-attention-type", "retention", "--position-embedding-type", "learned_absolute"], 1,
     "pass --position-embedding-type rope"),
    (["--linear-attention-type", "basic", "--num-attention-heads", "8", "--num-query-groups", "2",  # nccl: past
      "--tensor-model-parallel-size", "4", "--distributed-backend", "nccl"], 4,  # the softmax layers' CPU check
     "shares key/value heads over --num-query-groups 2"),
    (["--linear-attention-type", "lightning", "--num-attention-heads", "6", "--hidden-size", "36",
      "--kv-channels", "4", "--tensor-model-parallel-size", "3"], 3, "low-rank projection has 4 outputs"),
    (["--linear-attention-type", "gla", "--context-parallel-size", "2", "--cp-layout", "striped",
      "--cp-stripe", "8"], 2, "--cp-layout striped with --cp-stripe 8"),
    (["--linear-attention-type", "gla", "--cp-algo", "none"], 1, "--cp-algo none"),
])
def test_train_flag_refusals(argv, world, needle):
    from megatron_burst.train import validate_args

    with pytest.raises(ValueError) as info:
        validate_args(_train_args(argv), world)
    assert needle in str(info.value)


def test_train_flags_accept_a_stripe_of_64_and_the_cp1_default():
    from megatron_burst.train import validate_args

    validate_args(_train_args(["--linear-attention-type", "gla", "--context-parallel-size", "2",
                               "--cp-layout", "striped", "--cp-stripe", "64"]), 2)
    validate_args(_train_args(["--linear-attention-type", "gla", "--cp-layout", "striped"]), 1)


@pytest.mark.parametrize("attrs,needle", [
    ({"linear_attention_type": "gla", "experimental_attention_variant": "gated_delta_net"},
     "--experimental-attention-variant gated_delta_net"),
    ({"linear_attention_type": "gla", "cp_algo": "none"}, "--cp-algo none"),
    ({"linear_attention_freq": 4}, "--linear-attention-freq 4 has no linear layers"),
    ({"linear_attention_type": "gla", "linear_attention_freq": [1, 0, 1]}, "has 3 entries"),
    ({"linear_attention_type": "basic", "group_query_attention": True, "num_query_groups": 3},
     "--num-query-groups 3"),
])
def test_megatron_lm_startup_refusals(attrs, needle):
    from megatron_burst.megatron import megatron_lm

    args = _parse([])
    args.seq_length, args.context_parallel_size, args.tensor_model_parallel_size = 256, 2, 2
    args.num_layers, args.hidden_size, args.num_attention_heads, args.kv_channels = 4, 64, 4, 16
    args.position_embedding_type = "rope"
    for key, value in attrs.items():
        setattr(args, key, value)
    with pytest.raises(ValueError) as info:
        megatron_lm.check_args(args)
    assert needle in str(info.value)


def test_megatron_lm_gated_delta_net_keeps_its_freq():
    """--linear-attention-freq with Megatron's own --experimental-attention-variant is Megatron's business."""
    from megatron_burst.megatron import megatron_lm

    args = _parse([])
    args.seq_length, args.context_parallel_size, args.num_layers = 256, 1, 4
    args.experimental_attention_variant, args.linear_attention_freq = "gated_delta_net", 4
    megatron_lm.check_args(args)
