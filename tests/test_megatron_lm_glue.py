"""The Megatron-LM patch never changes the model silently (issue M).

Driven through ``wrap_gpt_builder`` around a stand-in of Megatron-LM's gpt_builder
(tests/megatron_lm_standin.py: the same megatron.core spec functions chosen by the same flags):

* Megatron builds its own spec from its flags; only the core attention becomes ours, so parameter
  names and shapes equal the unpatched model's for every flag set (dense, qk-layernorm, MoE, MTP,
  a user --spec), at CP = 1 and CP = 2 -- and the patched model trains like CP = 1.
* ``--cp-algo none`` gives back Megatron's model untouched.
* A layer spec whose options disagree with the flags or the model is refused at construction.
* What cannot be honoured is refused at startup, naming the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

# Megatron-LM flag sets, as the attributes its parsed args carry (and the config they imply)
FLAG_SETS = {
    "dense": ({}, {}),
    "qk_layernorm": ({"qk_layernorm": True}, {"qk_layernorm": True}),
    "moe": ({"num_experts": 4}, {"num_moe_experts": 4, "moe_router_topk": 2}),
    "mtp": ({"mtp_num_layers": 1}, {"mtp_num_layers": 1}),
    "user_spec": ({"spec": ["megatron_burst.specs", "gpt_layer_spec"]}, {}),
}
CUDA_ONLY_STEP = ("moe", "mtp")


def _megatron_lm_args(cp: int, flag_set: str, extra: Optional[list] = None):
    """Megatron-LM-shaped parsed args for the tiny GPT of the model tests, on initialized groups."""
    from megatron_burst import train
    from test_megatron_model import VOCAB, small_args

    args = small_args(["--context-parallel-size", str(cp)] + list(extra or []))
    opts, sizes = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    attrs, config_overrides = FLAG_SETS[flag_set]
    for name, default in (("spec", None), ("num_experts", None), ("moe_grouped_gemm", False),
                          ("qk_layernorm", False), ("multi_latent_attention", False), ("mtp_num_layers", None)):
        setattr(args, name, attrs.get(name, default))
    cpu = torch.device("cpu")
    args.make_config = lambda: dataclasses.replace(train.model_config(args, sizes, cpu), **config_overrides)
    return args, opts, groups


def build_both(cp: int, flag_set: str, plain: bool) -> dict:
    """The patched model (and, at CP = 1, the unpatched one): parameter names/shapes, core
    attention classes, and one training step's loss."""
    import megatron_lm_standin
    from megatron_burst import train
    from megatron_burst.megatron import megatron_lm
    from test_megatron_model import fixed_batch

    args, opts, groups = _megatron_lm_args(cp, flag_set)
    cpu = torch.device("cpu")
    out = {}
    if plain:
        train.seed_everything(args.seed, cpu)
        model = megatron_lm_standin.gpt_builder(args, True, True)
        out["plain_params"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    train.seed_everything(args.seed, cpu)
    model = megatron_lm.wrap_gpt_builder(megatron_lm_standin.gpt_builder)(args, True, True)
    out["params"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    out["core"] = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("core_attention")})
    out["n_core"] = sum(1 for n, _ in model.named_modules() if n.endswith("core_attention"))
    out["cls"] = type(model).__name__
    # megatron.core's MoE router moves its weight to CUDA in every forward, and MTP logs its loss
    # into a CUDA tensor: those build on CPU (and their parameters are compared) but cannot step
    if flag_set not in CUDA_ONLY_STEP:
        out["loss"] = train.loss_and_grads(model, [fixed_batch(24)], opts, groups, cpu).item()
    return out


@pytest.fixture(scope="module")
def unpatched():
    return {name: run_ranks(1, build_both, 1, name, True)[0] for name in FLAG_SETS}


@pytest.mark.parametrize("flag_set", list(FLAG_SETS))
def test_patched_model_has_the_unpatched_parameters(unpatched, flag_set):
    ref = unpatched[flag_set]
    assert ref["params"] == ref["plain_params"], f"{flag_set}: the patch changed the parameters at CP=1"
    assert ref["core"] == ["CPCoreAttention"]
    expected_layers = 2 + (1 if flag_set == "mtp" else 0)  # the MTP layer has attention too
    assert ref["n_core"] == expected_layers
    for rank, res in enumerate(run_ranks(2, build_both, 2, flag_set, False)):
        assert res["params"] == ref["plain_params"], f"{flag_set}: CP=2 rank {rank} parameters differ"
        assert res["core"] == ["CPCoreAttention"] and res["cls"] == "BurstGPTModel"
        if flag_set not in CUDA_ONLY_STEP:
            assert abs(res["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (flag_set, res["loss"], ref["loss"])


def build_opt_out() -> dict:
    import megatron_lm_standin
    from megatron_burst.megatron import megatron_lm

    args, _, _ = _megatron_lm_args(1, "dense", ["--cp-algo", "none"])
    model = megatron_lm.wrap_gpt_builder(megatron_lm_standin.gpt_builder)(args, True, True)
    return {"cls": type(model).__name__, "core": type(model.decoder.layers[0].self_attention.core_attention).__name__,
            "rope": type(model.rotary_pos_emb).__name__}


def test_cp_algo_none_keeps_megatrons_attention():
    res = run_ranks(1, build_opt_out)[0]
    assert res == {"cls": "GPTModel", "core": "DotProductAttention", "rope": "RotaryEmbedding"}


def _spec_module_disagreeing_layout():
    """A user spec that fixes cp_layout='zigzag' (what get_gpt_layer_spec used to default to)."""
    from megatron_burst.specs import get_gpt_layer_spec

    return get_gpt_layer_spec(cp_layout="zigzag", use_te=False)


zigzag_spec = None  # filled on first use by build_with_user_spec (module attribute for --spec)


def build_with_user_spec(layout: str) -> str:
    """A --spec fixing cp_layout=zigzag, with --cp-layout ``layout`` slicing the batches."""
    global zigzag_spec
    import megatron_lm_standin
    from megatron_burst.megatron import megatron_lm

    zigzag_spec = _spec_module_disagreeing_layout()
    args, _, _ = _megatron_lm_args(2, "dense", ["--cp-layout", layout])
    args.spec = ["test_megatron_lm_glue", "zigzag_spec"]
    try:
        megatron_lm.wrap_gpt_builder(megatron_lm_standin.gpt_builder)(args, True, True)
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_user_spec_disagreeing_with_the_flags_is_refused():
    """Used to build silently: attention in zigzag, batches and RoPE in striped (loss 7.57 vs 7.26)."""
    for msg in run_ranks(2, build_with_user_spec, "striped"):
        assert "cp_layout='zigzag'" in msg and "'striped'" in msg, msg
    assert run_ranks(2, build_with_user_spec, "zigzag") == ["ok", "ok"]


def model_layout_binding(spec_layout: Optional[str], model_layout: str) -> str:
    """megatron-core: BurstGPTModel(cp_layout=...) with a spec that leaves the layout unset (it
    follows the model) or fixes another (refused)."""
    from megatron_burst import train
    from megatron_burst.megatron.model import BurstGPTModel
    from megatron_burst.specs import get_gpt_layer_spec
    from test_megatron_model import VOCAB, small_args

    args = small_args(["--context-parallel-size", "2"])
    opts, sizes = train.validate_args(args, dist.get_world_size())
    groups = train.init_parallel(sizes)
    spec = get_gpt_layer_spec(cp_layout=spec_layout, use_te=False)
    try:
        model = BurstGPTModel(config=train.model_config(args, sizes, torch.device("cpu")), transformer_layer_spec=spec,
                              vocab_size=VOCAB, max_sequence_length=24, pg_collection=groups.pg_collection,
                              position_embedding_type="rope", cp_layout=model_layout)
    except ValueError as exc:
        return str(exc)
    return model.decoder.layers[0].self_attention.core_attention.options.layout


def test_spec_layout_follows_the_model_or_is_refused():
    assert run_ranks(2, model_layout_binding, None, "striped") == ["striped", "striped"]
    for msg in run_ranks(2, model_layout_binding, "zigzag", "striped"):
        assert "cp_layout='zigzag'" in msg and "'striped'" in msg, msg


@pytest.mark.parametrize("attrs,needle", [
    ({"fused_lm_loss": True, "fp16": True}, "--fp16"),
    ({"use_legacy_models": True}, "--use-legacy-models"),
    ({"seq_selective_ckpt_ratio": 0.5, "recompute_granularity": "selective", "recompute_modules": ["mlp"]},
     "--recompute-modules"),
    ({"seq_selective_ckpt_ratio": 0.5, "recompute_granularity": None}, "needs activation recompute"),
    ({"cp_algo": "none", "cp_layout": "striped"}, "--cp-algo none"),
    ({"cp_algo": "none", "seq_selective_ckpt_ratio": 0.5, "recompute_granularity": "full"}, "--cp-algo none"),
])
def test_startup_refusals_name_the_flag(attrs, needle):
    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.args import add_args

    args = add_args(argparse.ArgumentParser()).parse_args([])
    args.seq_length, args.context_parallel_size, args.tensor_model_parallel_size = 32, 2, 1
    for key, value in attrs.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        megatron_lm.check_args(args)


def test_odd_sequence_length_at_cp1_is_accepted():
    """The patch used to reject --seq-length 33 at CP = 1 (zigzag's 2 x CP divisibility)."""
    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.args import add_args

    args = add_args(argparse.ArgumentParser()).parse_args([])
    args.seq_length, args.context_parallel_size = 33, 1
    assert megatron_lm.check_args(args).layout == "zigzag"
    args.context_parallel_size = 2
    with pytest.raises(ValueError, match="--seq-length 33"):
        megatron_lm.check_args(args)


def test_swap_refuses_attention_it_cannot_replace():
    """Only Megatron's softmax core attentions are replaced; anything else in a core_attention
    slot (an experimental attention variant, kitchen, a custom module) is refused by name."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_burst.specs import count_core_attention, swap_core_attention

    class SparseAttention(torch.nn.Module):
        pass

    spec = get_gpt_layer_local_spec()
    assert count_core_attention(swap_core_attention(spec)) == 1
    assert count_core_attention(spec) == 0  # the input spec is left as it was
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SparseAttention)
    with pytest.raises(ValueError, match="SparseAttention.*--cp-algo none"):
        swap_core_attention(spec)
    with pytest.raises(ValueError, match="--multi-latent-attention"):
        swap_core_attention(get_gpt_layer_local_spec(multi_latent_attention=True))


def test_modelopt_builder_is_refused(monkeypatch):
    """ModelOpt's builder replaces the GPT builder inside model_provider, which would drop our
    attention silently: the wrapped provider refuses it (unless --cp-algo none)."""
    import sys
    import types

    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.args import add_args

    args = add_args(argparse.ArgumentParser()).parse_args([])
    args.modelopt_enabled = True
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    called = []
    provider = megatron_lm.wrap_model_provider(lambda *a, **k: called.append(a) or "model")
    with pytest.raises(ValueError, match="--modelopt-enabled"):
        provider(lambda *a, **k: None, True, True)
    args.cp_algo = "none"
    assert provider(lambda *a, **k: None, True, True) == "model" and called


# ------------------------------------------------------------ issue M2: tried as a Megatron-LM user would

# What Megatron-LM's TransformerLayer passes every attention module under CP by default (its
# --cp-comm-type defaults to p2p): the stand-in's config carries it the same way.
MEGATRON_LM_DEFAULTS = ["--cp-comm-type", "p2p"]
GDN_HYBRID = ["--num-layers", "4", "--linear-attention-type", "gated_delta_net", "--linear-attention-freq", "2"]


def megatron_lm_step(cp: int, extra: list, seq: int) -> dict:
    """One step through the patched pretrain_gpt.py's pieces: ``wrap_gpt_builder`` around the
    stand-in builder, ``megatron_lm.slice_batch`` (the patch's batch slicing), the per-token loss
    pretrain_gpt's loss_func computes, gradients all-reduced over CP. Returns the loss, every full
    gradient and the decoder's attention modules."""
    import megatron_lm_standin
    from megatron_burst import train
    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.gated_delta_net import CPGatedDeltaNet
    from test_megatron_model import fixed_batch, full_grads

    args, _, groups = _megatron_lm_args(cp, "dense", MEGATRON_LM_DEFAULTS + ["--seq-length", str(seq)] + extra)
    cpu = torch.device("cpu")
    train.seed_everything(args.seed, cpu)
    model = megatron_lm.wrap_gpt_builder(megatron_lm_standin.gpt_builder)(args, True, True)
    local = megatron_lm.slice_batch(fixed_batch(seq), args)
    model.train()
    losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
    mask = local["loss_mask"]
    sums = torch.stack([(losses.double() * mask.double()).sum(), mask.double().sum()]).detach()
    dist.all_reduce(sums, group=groups.dp_cp)
    ((losses.double() * mask.double()).sum() / sums[1]).backward()
    train.allreduce_grads(model, groups)
    attention = [layer.self_attention for layer in model.decoder.layers]
    return {"loss": (sums[0] / sums[1]).item(), "grads": full_grads(model, groups), "tokens": local["tokens"].shape[1],
            "layers": [type(a).__name__ for a in attention],
            "gdn_comm": sorted({(getattr(a, "cp_comm_type", None), getattr(a, "cp_exchange", None))
                                for a in attention if isinstance(a, CPGatedDeltaNet)})}


def test_gated_delta_net_under_megatron_lm_at_cp2_equals_cp1():
    """Used to crash: Megatron's TransformerLayer passes cp_comm_type to every attention module
    under CP, and CPGatedDeltaNet.__init__ did not take it (TypeError). Now the GDN layers take
    Megatron's default p2p (running their map all-gather), and the hybrid at CP = 2 equals CP = 1."""
    from test_megatron_model import _assert_matches

    ref = run_ranks(1, megatron_lm_step, 1, GDN_HYBRID, 24)[0]
    assert ref["layers"] == ["CPGatedDeltaNet", "SelfAttention"] * 2
    for layout in ("zigzag", "contiguous"):
        for rank, res in enumerate(run_ranks(2, megatron_lm_step, 2, GDN_HYBRID + ["--cp-layout", layout], 24)):
            assert res["gdn_comm"] == [("p2p", "allgather")], res["gdn_comm"]
            _assert_matches(res, ref, f"GDN under Megatron-LM CP=2 {layout} rank {rank}")


@pytest.mark.parametrize("extra", [[], GDN_HYBRID], ids=["dense", "gdn-hybrid"])
def test_odd_sequence_length_trains_at_cp1_through_the_patch(extra):
    """Used to fail at the first step: megatron_lm.slice_batch refused --seq-length 31 at CP = 1
    ("not divisible by 2, which layout='zigzag' needs with world_size=1"). One rank holds any length."""
    import math

    res = run_ranks(1, megatron_lm_step, 1, extra, 31)[0]
    assert res["tokens"] == 31 and math.isfinite(res["loss"]), res["loss"]


def _megatron_lm_flags(**attrs):
    from megatron_burst.megatron.args import add_args

    args = add_args(argparse.ArgumentParser()).parse_args([])
    args.seq_length, args.context_parallel_size, args.tensor_model_parallel_size = 32, 2, 1
    args.num_layers, args.num_attention_heads, args.hidden_size = 4, 4, 32
    for key, value in attrs.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("attrs,needles", [
    ({"experimental_attention_variant": "gated_delta_net", "linear_attention_freq": 2},
     ["--experimental-attention-variant gated_delta_net", "--linear-attention-type gated_delta_net"]),
    ({"hierarchical_context_parallel_sizes": [2, 2]},
     ["--hierarchical-context-parallel-sizes 2 2", "must multiply to --context-parallel-size 2"]),
    ({"reset_attention_mask": True, "sparse_attention": "vertical_slash", "sparse_last_q": 8, "cp_algo": "allgather"},
     ["--sparse-attention", "--cp-algo allgather (use ring or burst)"]),
    ({"linear_attention_type": "gated_delta_net", "cp_comm_type": "a2a"}, ["layer 1 (gated_delta_net)", "a2a"]),
    ({"linear_attention_type": "gated_delta_net", "linear_attention_freq": 2,
      "cp_comm_type": ["p2p", "a2a", "a2a", "p2p"]},
     ["layer 3 (gated_delta_net)", "--cp-comm-type a2a"]),
])
def test_trial_combinations_are_refused_at_startup(attrs, needles):
    """What the engine cannot run is refused by check_args (before any collective), naming the flags."""
    from megatron_burst.megatron import megatron_lm

    with pytest.raises(ValueError) as err:
        megatron_lm.check_args(_megatron_lm_flags(**attrs))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_sparse_with_a_window_and_documents_passes_check_args():
    """--sparse-attention with --window-size and --reset-attention-mask documents used to be refused
    ("drop --window-size 8,0"; "drop --reset-attention-mask"): the engine intersects the pattern
    with both, so check_args accepts them and keeps the pattern. What sparse attention cannot run
    on is still named, without "use ring or burst" when burst is already chosen."""
    from megatron_burst.megatron import megatron_lm

    args = _megatron_lm_flags(sparse_attention="vertical_slash", sparse_last_q=8, window_size=(8, 0), cp_algo="burst",
                              reset_attention_mask=True)
    assert megatron_lm.check_args(args).sparse == (0.9, 0.9, 8, "offsets")
    args.attention_dropout = 0.1
    with pytest.raises(ValueError) as err:
        megatron_lm.check_args(args)
    assert "--attention-dropout 0.1 (pass 0)" in str(err.value) and "ring or burst)" not in str(err.value)
    args.attention_dropout, args.cp_algo = 0.0, "allgather"
    with pytest.raises(ValueError, match=r"--cp-algo allgather \(use ring or burst\)"):
        megatron_lm.check_args(args)


def test_wrapped_provider_refuses_before_megatrons_model_provider(monkeypatch):
    """--experimental-attention-variant gated_delta_net at CP = 2 used to reach Megatron's own
    TransformerConfig assertion ("Gated delta net does not support context parallel"): the wrapped
    model_provider now runs check_args before Megatron's model_provider builds anything."""
    import sys
    import types

    from megatron_burst.megatron import megatron_lm

    args = _megatron_lm_flags(experimental_attention_variant="gated_delta_net", linear_attention_freq=2)
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    called = []
    provider = megatron_lm.wrap_model_provider(lambda *a, **k: called.append(a) or "model")
    with pytest.raises(ValueError, match="--linear-attention-type gated_delta_net"):
        provider(lambda *a, **k: None, True, True)
    assert not called
