"""Megatron-Core's GatedDeltaNet with context parallelism (CPGatedDeltaNet): at CP = 1 it equals
Megatron's own class on the same weights (state dicts interchangeable), and a GDN hybrid GPT at
CP = 2, 3, 4 (every layout) equals CP = 1 in the loss and every parameter's gradient."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

GDN = ["--num-layers", "4", "--linear-attention-freq", "2", "--linear-attention-type", "gated_delta_net"]
FP32_TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def megatron_vs_ours(seq: int) -> dict:
    """Our layer and Megatron's GatedDeltaNet (its torch path: deterministic_mode's
    torch_chunk_gated_delta_rule and nn.Conv1d; fla's missing l2norm supplied by our torch one;
    CUDA-only device lookups pointed at the CPU) with one state dict: outputs and gradients."""
    import megatron.core.ssm.gated_delta_net as mgdn
    from megatron.core.transformer.spec_utils import build_module

    from megatron_burst import train
    from megatron_burst.megatron.gated_delta_net import CPGatedDeltaNet, l2norm
    from megatron_burst.specs import gated_delta_net_spec
    from megatron_burst.train.setup import model_config
    from test_megatron_model import small_args

    torch._dynamo.config.disable = True  # Megatron's _apply_gated_norm is torch.compile'd: run it eagerly
    args = small_args(GDN + ["--seq-length", str(seq), "--swiglu", "--normalization", "RMSNorm"])
    opts, sizes = train.validate_args(args, dist.get_world_size())
    groups = train.init_parallel(sizes)
    cpu = torch.device("cpu")
    train.seed_everything(args.seed, cpu)
    config = model_config(args, sizes, cpu)
    spec = gated_delta_net_spec(use_te=False, rms_norm=True)
    ours = build_module(spec, config=config, layer_number=1, pg_collection=groups.pg_collection)
    theirs_config = copy.copy(config)
    theirs_config.perform_initialization = False
    theirs_config.deterministic_mode = True
    patched = dict(HAVE_FLA=True, l2norm=l2norm)
    saved = {name: getattr(mgdn, name, None) for name in patched}
    current_device = torch.cuda.current_device
    try:
        for name, value in patched.items():
            setattr(mgdn, name, value)
        torch.cuda.current_device = lambda: "cpu"
        theirs = mgdn.GatedDeltaNet(theirs_config, spec.submodules, layer_number=1,
                                    pg_collection=groups.pg_collection)
    finally:
        torch.cuda.current_device = current_device
    missing = theirs.load_state_dict(ours.state_dict(), strict=True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(seq, 2, config.hidden_size, generator=g)
    dout = torch.randn(seq, 2, config.hidden_size, generator=g)
    res = {"ours_is_megatrons": isinstance(ours, mgdn.GatedDeltaNet) and type(ours) is CPGatedDeltaNet,
           "keys": sorted(ours.state_dict()), "missing": list(missing.missing_keys) + list(missing.unexpected_keys)}
    outs, grads = [], []
    for layer in (ours, theirs):
        xin = x.clone().requires_grad_()
        out, bias = layer(xin, None)
        out.backward(dout)
        outs.append(out.detach())
        grads.append({"x": xin.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    try:
        for name, value in saved.items():
            setattr(mgdn, name, value)
    finally:
        torch._dynamo.config.disable = False
    res["out"] = _rel(outs[0], outs[1])
    res["grads"] = {n: _rel(grads[0][n], grads[1][n]) for n in grads[1]}
    return res


@pytest.mark.parametrize("seq", [24, 150])
def test_cp1_layer_equals_megatrons_gated_delta_net(seq):
    """150 tokens: two full 64-token chunks and a partial one in both implementations."""
    res = run_ranks(1, megatron_vs_ours, seq)[0]
    assert res["ours_is_megatrons"] and res["missing"] == []
    assert {"in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "out_norm.weight", "out_proj.weight"} <= \
        set(res["keys"]), res["keys"]
    assert res["out"] <= FP32_TOL, res["out"]
    assert set(res["grads"]) == {"x", "in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "out_norm.weight",
                                 "out_proj.weight"}
    for name, err in res["grads"].items():
        assert err <= 1e-4, f"{name}: {err:.2e}"


# ----------------------------------------------------------------------------- CP > 1 equals CP = 1

def gdn_loss_and_grads(tp: int, cp: int, extra: list, seq: int) -> dict:
    """One forward/backward of the GDN hybrid GPT (GDN layers 1 and 3 of 4) at TP x CP in fp64
    parameters: in fp32 the dt_bias and A_log gradients are sums over every token whose terms
    cancel to ~1e-3 of their size, so fp32 rounding alone moves them by ~1e-4 of their value
    (measured: 1.4e-4 at CP = 2 and 4, 5e-6 in fp64, where every other gradient sits too)."""
    from megatron_burst.megatron.gated_delta_net import CPGatedDeltaNet
    from megatron_burst.train import setup
    from test_megatron_model import build_and_step, full_grads

    fp32_config = setup.model_config

    def fp64_config(*args, **kwargs):
        config = fp32_config(*args, **kwargs)
        config.params_dtype = torch.float64
        return config

    setup.model_config = fp64_config
    torch.set_default_dtype(torch.float64)
    try:
        loss, model, groups = build_and_step(tp, cp, GDN + list(extra), seq)
    finally:
        setup.model_config = fp32_config
        torch.set_default_dtype(torch.float32)
    layers = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    gdn = [layer.self_attention for layer in model.decoder.layers
           if isinstance(layer.self_attention, CPGatedDeltaNet)]
    grads = full_grads(model, groups)
    return {"loss": loss, "grads": grads, "layers": layers, "gdn": sorted({(a.options.layout, a.cp_size) for a in gdn}),
            "dtypes": sorted({str(g.dtype) for g in grads.values()})}


GDN_CP_CASES = [  # (tp, cp, extra flags, seq)
    (1, 2, ["--cp-layout", "zigzag"], 40),
    (1, 2, ["--cp-layout", "contiguous"], 40),
    (1, 3, ["--cp-layout", "zigzag"], 42),
    (1, 4, ["--cp-layout", "zigzag"], 40),
    (1, 4, ["--cp-layout", "contiguous", "--cp-algo", "ring"], 40),
    (1, 2, ["--cp-layout", "striped", "--cp-stripe", "64"], 256),
    (2, 2, ["--cp-layout", "zigzag"], 40),
]


@pytest.fixture(scope="module")
def gdn_reference():
    cache = {}

    def get(tp: int, seq: int) -> dict:
        if (tp, seq) not in cache:
            cache[tp, seq] = run_ranks(tp, gdn_loss_and_grads, tp, 1, [], seq)
        return cache[tp, seq]
    return get


@pytest.mark.parametrize("tp,cp,extra,seq", GDN_CP_CASES,
                         ids=[f"tp{c[0]}-cp{c[1]}-{'-'.join(x.lstrip('-') for x in c[2])}" for c in GDN_CP_CASES])
def test_gdn_hybrid_gpt_under_cp_equals_cp1(gdn_reference, tp, cp, extra, seq):
    from test_megatron_model import _assert_matches

    # TP = 2 against TP = 2, CP = 1: Megatron's in_proj rows under TP are each rank's
    # [q, k, v, z, beta, alpha] heads (its sharded_state_dict remaps them), not a contiguous slice
    # of the TP = 1 weight that CPU initialization shards, so TP = 1 is another model. Compared per
    # TP rank (Megatron orders TP fastest): out_norm's weight is shared by the heads of one TP rank
    # and, as in Megatron's class, its gradient is that rank's heads' only (no TP all-reduce).
    refs = gdn_reference(tp, seq)
    ref = refs[0]
    assert ref["layers"] == ["CPGatedDeltaNet", "SelfAttention"] * 2 and ref["dtypes"] == ["torch.float64"]
    layout = extra[extra.index("--cp-layout") + 1]
    for rank, res in enumerate(run_ranks(tp * cp, gdn_loss_and_grads, tp, cp, extra, seq)):
        assert res["gdn"] == [(layout, cp)], res["gdn"]
        _assert_matches(res, refs[rank % tp], f"GDN TP={tp} CP={cp} {' '.join(extra)} rank {rank}")


def test_flags_and_spec_for_gated_delta_net():
    """--linear-attention-type gated_delta_net: a pattern of GDN layers, its one exchange (no LASP-1),
    stripes of a chunk; the spec helper builds CPGatedDeltaNet where the pattern says."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_burst.megatron.args import linear_options_from_args
    from megatron_burst.megatron.gated_delta_net import CPGatedDeltaNet
    from megatron_burst.specs import get_gpt_decoder_block_spec
    from megatron_burst.train import validate_args
    from test_megatron_model import small_args

    args = small_args(GDN)
    opts, _ = validate_args(args, 1)
    linear = linear_options_from_args(args, opts, args.num_query_groups)
    assert (linear.type, linear.pattern) == ("gated_delta_net", (1, 0, 1, 0))
    with pytest.raises(ValueError, match="gated_delta_net always exchanges"):
        validate_args(small_args(GDN + ["--linear-cp-algo", "lasp1"]), 1)
    with pytest.raises(ValueError, match="--cp-stripe 64"):
        validate_args(small_args(GDN + ["--context-parallel-size", "2", "--cp-layout", "striped", "--cp-stripe", "8",
                                      "--seq-length", "32"]),
                      2)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8)
    block = get_gpt_decoder_block_spec(config, linear_attention="gated_delta_net", linear_attention_freq=4,
                                       use_te=False)
    kinds = [layer.submodules.self_attention.module.__name__ for layer in block.layer_specs]
    assert kinds == ["CPGatedDeltaNet"] * 3 + ["SelfAttention"]
    assert block.layer_specs[0].submodules.self_attention.module is CPGatedDeltaNet


# ----------------------------------------------------------------------------- Megatron's cp_comm_type

def build_gdn_layer(cp: int, **kwargs) -> str:
    """CPGatedDeltaNet built the way Megatron's TransformerLayer builds it under CP (cp_comm_type
    passed by keyword): its (cp_comm_type, exchange), or the error."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_burst import train
    from megatron_burst.specs import gated_delta_net_spec
    from test_megatron_model import small_args

    args = small_args(GDN + ["--context-parallel-size", str(cp)])
    opts, sizes = train.validate_args(args, dist.get_world_size())
    groups = train.init_parallel(sizes)
    config = train.model_config(args, sizes, torch.device("cpu"))
    layer_comm = kwargs.pop("cp_layer_comm_types", None)
    spec = gated_delta_net_spec(use_te=False, **({"cp_layer_comm_types": layer_comm} if layer_comm else {}))
    try:
        layer = build_module(spec, config=config, layer_number=kwargs.pop("layer_number", 1),
                             pg_collection=groups.pg_collection, **kwargs)
    except ValueError as exc:
        return str(exc)
    return f"{getattr(layer, 'cp_comm_type', None)}:{getattr(layer, 'cp_exchange', None)}"


def test_gdn_layer_takes_megatrons_cp_comm_type():
    """Megatron's TransformerLayer passes cp_comm_type to every attention module under CP; the
    GDN layer used to raise TypeError on it. The ring and all-gather types run its map all-gather;
    head all-to-alls are refused naming the layer and the value; per-layer lists pick the entry."""
    for comm in ("p2p", "allgather", "all_gather", "ring", "burst", "auto"):
        assert run_ranks(2, build_gdn_layer, 2, cp_comm_type=comm) == [f"{comm}:allgather"] * 2
    for comm, algo in (("a2a", "ulysses"), ("a2a+p2p", "usp")):
        for msg in run_ranks(2, build_gdn_layer, 2, cp_comm_type=comm, layer_number=3):
            assert f"layer 3 (gated_delta_net): --cp-comm-type {comm}" in msg and algo in msg, msg
    msg = run_ranks(2, build_gdn_layer, 2, cp_comm_type="spiral")[0]
    assert "--cp-comm-type spiral is not a context-parallel communication type" in msg
    lists = ("p2p", "a2a", "allgather", "a2a")
    assert run_ranks(2, build_gdn_layer, 2, cp_layer_comm_types=lists, layer_number=3) == ["allgather:allgather"] * 2
    assert "layer 2 (gated_delta_net)" in run_ranks(2, build_gdn_layer, 2, cp_layer_comm_types=lists, layer_number=2)[0]
    assert run_ranks(1, build_gdn_layer, 1) == ["None:None"]  # one rank: no exchange, nothing passed
