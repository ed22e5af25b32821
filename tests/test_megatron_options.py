"""Options as data (issue K, part 2): the flag boundary resolves the flags once into a CPOptions and
the layers get it through the layer spec (``cp_options``); process groups come from Megatron's
``pg_collection`` (``cp``, ``hcp``) where Megatron makes them, from megatron-burst's registry only
where it does not (the double ring's node groups, USP across nodes, ``auto``'s candidates)."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks


def _flags(argv, **attrs):
    from megatron_burst.megatron.flags import add_args

    args = add_args(argparse.ArgumentParser()).parse_args(argv)
    for key, value in attrs.items():
        setattr(args, key, value)
    return args


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                             use_cpu_initialization=True, **kw)


def _core(spec_params, config=None, layer=1):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_burst.megatron.attention import CPCoreAttention

    return CPCoreAttention(config or _config(), layer, AttnMaskType.causal, "self", **spec_params)


def test_flag_boundary_builds_one_options_object():
    from megatron_burst.megatron.from_args import options_from_args
    from megatron_burst.megatron.options import BurstOptions, CPOptions

    args = _flags(["--cp-layout", "striped", "--cp-stripe", "4", "--sparse-attention", "vertical_slash",
                   "--sparse-last-q", "8", "--fused-lm-loss"], seq_length=64, context_parallel_size=2)
    options = options_from_args(args)
    assert isinstance(options, BurstOptions) and isinstance(options.cp, CPOptions)
    assert (options.cp.algo, options.cp.layout, options.cp.stripe) == ("burst", "striped", 4)
    assert options.cp.sparse == (0.9, 0.9, 8, "offsets") and options.cp.requested_algo is None
    assert options.linear is None and options.fused_lm_loss and not options.stock_attention
    per_layer = options_from_args(_flags([], cp_comm_type=["p2p", "a2a"], num_layers=2)).cp
    assert per_layer.algo == "per-layer" and per_layer.layer_comm_types == ("p2p", "a2a")


def test_cp_options_reach_the_attention_through_the_spec():
    from megatron_burst.megatron.options import make_cp_options
    from megatron_burst.specs import get_gpt_layer_spec, swap_core_attention

    opts = make_cp_options("ring", "striped", 2, sparse=(0.5, 0.5, 4))
    spec = get_gpt_layer_spec(cp_options=opts, use_te=False)
    params = spec.submodules.self_attention.submodules.core_attention.params
    assert params["cp_options"] is opts
    attention = _core(params)
    assert (attention.options.algo, attention.options.layout, attention.options.stripe) == ("ring", "striped", 2)
    assert attention._layout_fixed and attention.sparse is not None and attention.options.sparse == (0.5, 0.5, 4)
    # a spec that fixes another layout than the flags is refused, naming both
    with pytest.raises(ValueError, match="cp_layout='zigzag' but --cp-layout is 'striped'"):
        _core(dict(params, cp_layout="zigzag", cp_stripe=None))
    # an algorithm the user typed binds; one resolved by default leaves the spec free
    with pytest.raises(ValueError, match="cp_algo='burst' but --cp-algo is 'ring'"):
        _core(dict(params, cp_algo="burst"))
    free = make_cp_options(None, "striped", 2)
    assert _core(dict(cp_options=free, cp_algo="ring")).options.algo == "ring"
    with pytest.raises(TypeError, match="cp_options must be"):
        swap_core_attention(spec, cp_options={"algo": "ring"})


def test_per_layer_comm_types_and_ulysses_size_come_from_options_or_config():
    from megatron_burst.megatron.options import make_cp_options

    opts = make_cp_options(cp_comm_type=["a2a", "allgather"])
    assert [_core(dict(cp_options=opts), layer=n).options.algo for n in (1, 2)] == ["ulysses", "allgather"]
    # usp's all-to-all size: Megatron's config carries --hierarchical-context-parallel-sizes
    attention = _core(dict(cp_algo="usp"), config=_config(hierarchical_context_parallel_sizes=[2, 1]))
    assert attention.options.ulysses_size == 2


# ------------------------------------------------------------------ process groups from pg_collection

def usp_groups_through_the_trainer(hierarchical: bool, extra: list) -> dict:
    """The trainer at CP = 4 with a2a+p2p 2 x 2: where each layer's USP groups come from."""
    from megatron_burst import train
    from megatron_burst.topology import registered_usp_topology
    from test_megatron_model import VOCAB, small_args

    args = small_args(["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--seq-length", "32",
                       "--hierarchical-context-parallel-sizes", "2", "2"] + extra)
    opts, sizes = train.validate_args(args, dist.get_world_size())
    if not hierarchical:
        sizes = type(sizes)(**{**sizes.__dict__, "hierarchical_cp": None})
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    model = train.build_model(args, opts, sizes, groups, torch.device("cpu"))
    hcp = getattr(groups.pg_collection, "hcp", None)
    targets = [layer.self_attention.core_attention.cp_target for layer in model.decoder.layers]
    return {"hcp": None if hcp is None else [dist.get_process_group_ranks(g) for g in hcp],
            "from_hcp": [hcp is not None and t.ulysses_group is hcp[0] and t.ring.group is hcp[1] for t in targets],
            "a2a": [dist.get_process_group_ranks(t.ulysses_group) for t in targets],
            "ring": [dist.get_process_group_ranks(t.ring.group) for t in targets],
            "registered": registered_usp_topology(groups.cp, 2) is not None}


def test_usp_takes_megatrons_hierarchical_cp_groups():
    """Megatron's layout: [the 2 consecutive CP ranks, the 2 ranks at stride 2]. With them in
    pg_collection.hcp and the ring across the all-to-all groups inside one node, every layer runs
    on them and nothing is registered; without them, the groups setup_cp_topology builds
    (registered) have the same ranks."""
    one_node = ["--cp-ranks-per-node", "4"]
    with_hcp = run_ranks(4, usp_groups_through_the_trainer, True, one_node)
    without = run_ranks(4, usp_groups_through_the_trainer, False, one_node)
    for rank, (res, ref) in enumerate(zip(with_hcp, without)):
        a2a, ring = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert res["hcp"] == [a2a, ring], res["hcp"]
        assert res["from_hcp"] == [True, True] and not res["registered"], res
        assert ref["hcp"] is None and ref["from_hcp"] == [False, False] and ref["registered"], ref
        assert res["a2a"] == ref["a2a"] == [a2a] * 2 and res["ring"] == ref["ring"] == [ring] * 2


def test_usp_ring_across_nodes_uses_the_built_groups():
    """The hierarchical sizes' first entry is also the CP ranks per node (README, --cp-ranks-per-node):
    the ring across the all-to-all groups then spans nodes, a double ring with separate activation and
    gradient communicators that Megatron does not make -- built by setup_cp_topology, registered."""
    for rank, res in enumerate(run_ranks(4, usp_groups_through_the_trainer, True, [])):
        assert res["hcp"] is not None and res["from_hcp"] == [False, False] and res["registered"], res
        assert res["a2a"] == [[rank - rank % 2, rank - rank % 2 + 1]] * 2


# ------------------------------------------------------------------ the Megatron-LM builder passes them all

def sparse_through_the_patch() -> list:
    """--sparse-attention under the patch's builder (no Megatron-LM global args in this process):
    the pattern reaches every softmax layer inside cp_options."""
    import megatron_lm_standin
    from megatron_burst.megatron import megatron_lm
    from test_megatron_lm_glue import _megatron_lm_args

    args, _, _ = _megatron_lm_args(1, "dense", ["--sparse-attention", "vertical_slash", "--sparse-last-q", "8",
                                                "--cp-layout", "striped", "--cp-stripe", "2"])
    model = megatron_lm.wrap_gpt_builder(megatron_lm_standin.gpt_builder)(args, True, True)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    return [(c.sparse is not None, c.options.sparse, c.options.layout, c.options.stripe) for c in cores]


def test_megatron_lm_builder_passes_the_sparse_pattern():
    """The attention used to find --sparse-attention only in Megatron-LM's global args."""
    assert run_ranks(1, sparse_through_the_patch)[0] == [(True, (0.9, 0.9, 8, "offsets"), "striped", 2)] * 2


def test_usp_on_megatrons_groups_trains_like_cp1():
    """The GPT at CP = 4 (a2a+p2p 2 x 2 on pg_collection.hcp, one node) equals CP = 1 in loss and
    every gradient."""
    from test_megatron_model import _assert_matches, loss_and_full_grads

    reference = run_ranks(1, loss_and_full_grads, 1, 1, seq=32)[0]
    argv = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2", "--cp-ranks-per-node", "4"]
    for rank, res in enumerate(run_ranks(4, loss_and_full_grads, 1, 4, argv, seq=32)):
        assert res["algo"] == "usp" and all(r.startswith("usp2/") for r in res["resolved"]), res["resolved"]
        _assert_matches(res, reference, f"CP=4 a2a+p2p 2x2 on pg_collection.hcp rank {rank}")
