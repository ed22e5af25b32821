"""Flags -> options -> layer spec wiring, and the errors bad combinations raise (no ranks needed)."""
from __future__ import annotations

import argparse

import pytest

from megatron_burst.megatron.args import (CPOptions, add_args, cp_options_from_args, make_cp_options,
                                          resolve_cp_algo)


def _parse(argv):
    return add_args(argparse.ArgumentParser()).parse_args(argv)


def test_add_args_defaults_and_choices(capsys):
    args = _parse([])
    assert (args.cp_algo, args.cp_layout, args.cp_stripe) == (None, "zigzag", 1)
    args = _parse(["--cp-algo", "ring", "--cp-layout", "striped", "--cp-stripe", "4"])
    assert (args.cp_algo, args.cp_layout, args.cp_stripe) == ("ring", "striped", 4)
    with pytest.raises(SystemExit):
        _parse(["--cp-algo", "p2p"])
    assert "invalid choice: 'p2p'" in capsys.readouterr().err


def test_add_args_returns_parser_for_megatron_lm():
    parser = argparse.ArgumentParser()
    assert add_args(parser) is parser  # Megatron-LM's extra_args_provider contract


@pytest.mark.parametrize("cp_algo,comm,want", [
    (None, None, "burst"),
    ("ring", None, "ring"),
    (None, "burst", "burst"),
    (None, "auto", "auto"),
    ("burst", "burst", "burst"),
    (None, "p2p", "ring"),        # Transformer Engine's p2p is a ring exchange
    ("burst", "p2p", "burst"),    # ... but p2p is also Megatron-LM's default: --cp-algo wins
    (None, ["burst", "burst"], "burst"),
    ("auto", ["p2p"], "auto"),
])
def test_resolve_cp_algo(cp_algo, comm, want):
    assert resolve_cp_algo(cp_algo, comm) == want


@pytest.mark.parametrize("cp_algo,comm,needle", [
    ("ring", "burst", "conflicting algorithms: --cp-algo ring but --cp-comm-type burst"),
    # a2a / allgather / a2a+p2p now select ulysses / allgather / usp (tests/test_megatron_cp_family.py)
    (None, "spiral", "--cp-comm-type spiral is not a context-parallel communication type"),
    ("ring", "allgather", "conflicting algorithms: --cp-algo ring but --cp-comm-type allgather"),
    (None, "p2p2", "use one of p2p, a2a, allgather, all_gather, a2a+p2p (Megatron's) or ring, burst, auto"),
    ("burst", ["p2p", "a2a"], "names an algorithm per layer"),
    ("sequoia", None, "cp_algo='sequoia' is not a megatron-burst algorithm"),
])
def test_resolve_cp_algo_errors(cp_algo, comm, needle):
    with pytest.raises(ValueError) as info:
        resolve_cp_algo(cp_algo, comm)
    assert needle in str(info.value)


def test_cp_options_check_seq_length_against_layout():
    args = _parse(["--cp-layout", "zigzag"])
    args.seq_length, args.context_parallel_size = 20, 4
    with pytest.raises(ValueError, match=r"--seq-length 20 .* not divisible by 8"):
        cp_options_from_args(args)
    args.seq_length = 24
    assert cp_options_from_args(args) == CPOptions("burst", "zigzag", 1)
    args = _parse(["--cp-layout", "striped", "--cp-stripe", "4", "--cp-algo", "ring"])
    args.seq_length, args.context_parallel_size = 24, 4
    with pytest.raises(ValueError, match="not divisible by 16"):
        cp_options_from_args(args)


def test_stripe_only_with_striped_layout():
    with pytest.raises(ValueError, match="--cp-stripe"):
        make_cp_options("burst", "zigzag", 2)
    with pytest.raises(ValueError, match="stripe=0"):
        make_cp_options("burst", "striped", 0)


def test_spec_wiring():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_burst.megatron.attention import BurstCoreAttention
    from megatron_burst.specs import get_gpt_layer_spec

    spec = get_gpt_layer_spec(cp_algo="ring", cp_layout="striped", cp_stripe=2, use_te=False,
                              cp_ring="double", cp_ranks_per_node=4, seq_selective_ckpt_ratio=0.5,
                              normalization="RMSNorm", qk_layernorm=True)
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is BurstCoreAttention
    assert core.params == {"cp_algo": "ring", "cp_layout": "striped", "cp_stripe": 2, "cp_ring": "double",
                           "cp_ranks_per_node": 4, "seq_selective_ckpt_ratio": 0.5}
    with pytest.raises(ValueError, match="--cp-ring"):
        get_gpt_layer_spec(cp_ring="triple", use_te=False)
    # more_options reach Megatron's spec builder (qk_layernorm turns IdentityOp into a norm)
    assert spec.submodules.self_attention.submodules.q_layernorm is not IdentityOp
    plain = get_gpt_layer_spec(use_te=False)
    assert plain.submodules.self_attention.submodules.q_layernorm is IdentityOp
    # unset options follow the flags / the model at construction (issue M: one source of truth)
    assert plain.submodules.self_attention.submodules.core_attention.params["cp_algo"] is None
    assert plain.submodules.self_attention.submodules.core_attention.params["cp_layout"] is None
    # Megatron-LM's `--spec megatron_burst.specs gpt_layer_spec` goes through import_module
    module_level = import_module(("megatron_burst.specs", "gpt_layer_spec"))
    assert isinstance(module_level, ModuleSpec)
    params = module_level.submodules.self_attention.submodules.core_attention.params
    assert params == {"cp_algo": None, "cp_layout": None, "cp_stripe": None, "cp_ring": None,
                      "cp_ranks_per_node": None, "seq_selective_ckpt_ratio": None}


@pytest.mark.parametrize("kwargs,needle", [
    ({"cp_algo": "p2p"}, "cp_algo='p2p'"),
    ({"cp_layout": "rows"}, "cp_layout='rows'"),
    ({"multi_latent_attention": True}, "multi_latent_attention"),
])
def test_spec_rejects_bad_options(kwargs, needle):
    from megatron_burst.specs import get_gpt_layer_spec

    with pytest.raises(ValueError, match=needle):
        get_gpt_layer_spec(use_te=False, **kwargs)


def _train_args(argv):
    from megatron_burst.train import build_parser

    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2"]
    return build_parser().parse_args(base + argv)


@pytest.mark.parametrize("argv,world,needle", [
    (["--context-parallel-size", "3"], 4, "world size 4 is not divisible by --tensor-model-parallel-size 1 x "
                                         "--context-parallel-size 3"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, "pass --attention-dropout 0.0"),
    (["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by --micro-batch-size 2 x "
                                      "data-parallel size 2"),
    (["--num-query-groups", "3"], 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--tensor-model-parallel-size", "8"], 8, "not divisible by --tensor-model-parallel-size 8"),
    (["--context-parallel-size", "4", "--cp-layout", "zigzag", "--seq-length", "36"], 4,
     "--seq-length 36 with --context-parallel-size 4 and --cp-layout zigzag"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2, "--cp-comm-type a2a+p2p (--cp-algo usp) needs"),
    (["--tokenizer-type", "NullTokenizer"], 1, "needs --vocab-size"),
    (["--lr-warmup-iters", "5"], 1, "--lr-warmup-iters 5 must be < --lr-decay-iters 2"),
])
def test_train_flag_validation(argv, world, needle):
    from megatron_burst.train import validate_args

    with pytest.raises(ValueError) as info:
        validate_args(_train_args(argv), world)
    assert needle in str(info.value)


def test_train_flags_resolve():
    from megatron_burst.train import validate_args

    args = _train_args(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                        "--cp-layout", "striped", "--cp-comm-type", "ring", "--global-batch-size", "8"])
    opts, sizes = validate_args(args, 8)
    assert opts == CPOptions("ring", "striped", 1)
    assert (sizes.tp, sizes.cp, sizes.dp, sizes.num_microbatches) == (2, 2, 2, 2)
    assert (args.kv_channels, args.ffn_hidden_size, args.num_query_groups) == (8, 128, 4)


def test_swiglu_ffn_size_follows_megatron_lm():
    """Megatron-LM: with --swiglu and no --ffn-hidden-size, int(4h * 2/3 / 64) * 64 (it was 4h)."""
    from megatron_burst.train import validate_args

    for hidden, want in ((32, 64), (128, 320), (4096, 10880)):
        args = _train_args(["--hidden-size", str(hidden), "--swiglu"])
        validate_args(args, 1)
        assert args.ffn_hidden_size == want, (hidden, args.ffn_hidden_size)
    args = _train_args(["--swiglu", "--ffn-hidden-size", "100"])
    validate_args(args, 1)
    assert args.ffn_hidden_size == 100
    args = _train_args([])
    validate_args(args, 1)
    assert args.ffn_hidden_size == 128  # 4h without --swiglu


@pytest.mark.parametrize("flag", ["--fp16", "--sequence-parallel"])
def test_unsupported_megatron_flags_point_to_megatron_lm(flag):
    from megatron_burst.train import validate_args

    args = _train_args([flag])  # parsed (not "unrecognized arguments"), then refused with the route
    with pytest.raises(ValueError, match=f"{flag}: megatron_burst.train trains in fp32.*pretrain_gpt.py"):
        validate_args(args, 1)


def test_fewer_kv_groups_than_tp_ranks_is_refused_on_cpu():
    """Megatron's KV-head all-gather allocates on CUDA: on CPU it crashed in the first forward."""
    from megatron_burst.train import validate_args

    args = _train_args(["--num-query-groups", "1", "--tensor-model-parallel-size", "2",
                        "--distributed-backend", "gloo"])
    with pytest.raises(ValueError, match="--num-query-groups 1 below --tensor-model-parallel-size 2"):
        validate_args(args, 2)


def test_usage_errors_print_once_under_torchrun():
    """Every rank parses the flags; only rank 0 prints the error, all exit 2."""
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "megatron_burst.train", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3",
            "--train-iters", "1", "--fp16"]
    outs = {}
    for rank in ("0", "1"):
        env = {**os.environ, "RANK": rank, "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        outs[rank] = (proc.returncode, proc.stderr)
    assert outs["0"][0] == 2 and "--fp16: megatron_burst.train trains in fp32" in outs["0"][1]
    assert outs["1"] == (2, "")
