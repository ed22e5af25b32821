"""Megatron parity for the all-gather / Ulysses / USP family: --cp-comm-type a2a, allgather
(all_gather), a2a+p2p with --hierarchical-context-parallel-sizes, per-layer lists; a GPT trained
through the trainer at CP = 2 / 4 equals CP = 1 in loss and every gradient."""
import pytest

from harness import run_ranks
from megatron_burst.megatron.args import PER_LAYER, make_cp_options, resolve_cp_algo
from test_megatron_model import _assert_matches, construct_core_attention, loss_and_full_grads


@pytest.fixture(scope="module")
def reference():
    return run_ranks(1, loss_and_full_grads, 1, 1, seq=32)[0]


@pytest.mark.parametrize("comm,resolved", [("a2a", "ulysses"), ("allgather", "allgather"),
                                           ("all_gather", "allgather")])
def test_cp2_comm_types_equal_cp1(reference, comm, resolved):
    results = run_ranks(2, loss_and_full_grads, 1, 2, ["--cp-comm-type", comm], seq=32)
    for rank, res in enumerate(results):
        assert res["algo"] == resolved and res["resolved"] == [resolved] * 2, res
        _assert_matches(res, reference, f"CP=2 --cp-comm-type {comm} rank {rank}")


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_usp_2x2_gpt_equals_cp1(reference, layout):
    """The issue's criterion: --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 at CP=4."""
    results = run_ranks(4, loss_and_full_grads, 1, 4, ["--cp-comm-type", "a2a+p2p", "--cp-layout", layout,
                                                      "--hierarchical-context-parallel-sizes", "2", "2"], seq=32)
    for rank, res in enumerate(results):
        assert res["algo"] == "usp" and all(r.startswith("usp2/") for r in res["resolved"]), res["resolved"]
        _assert_matches(res, reference, f"CP=4 a2a+p2p 2x2 {layout} rank {rank}")


def test_cp4_ulysses_and_allgather_with_tp2():
    """TP=2 x CP=2: 2 query / 1 KV heads per TP rank; Ulysses repeats the KV head to the group."""
    ref = run_ranks(1, loss_and_full_grads, 1, 1, seq=32)[0]
    for algo in ("ulysses", "allgather"):
        for rank, res in enumerate(run_ranks(4, loss_and_full_grads, 2, 2, ["--cp-algo", algo], seq=32)):
            _assert_matches(res, ref, f"TP=2 x CP=2 {algo} rank {rank}")


@pytest.mark.parametrize("comm,want", [
    ("a2a", "ulysses"), ("allgather", "allgather"), ("all_gather", "allgather"), ("a2a+p2p", "usp"),
    (["a2a", "a2a"], "ulysses"), (["p2p", "a2a", "allgather"], PER_LAYER),
])
def test_comm_types_map_to_our_algorithms(comm, want):
    assert resolve_cp_algo(None, comm) == want


@pytest.mark.parametrize("kwargs,needle", [
    (dict(cp_algo="ring", cp_comm_type="a2a"), "conflicting algorithms: --cp-algo ring but --cp-comm-type a2a"),
    (dict(cp_comm_type="a2a+p2p"), "needs --hierarchical-context-parallel-sizes"),
    (dict(cp_comm_type="spiral"), "--cp-comm-type spiral is not a context-parallel communication type"),
    (dict(cp_comm_type=["p2p", "a2a"], cp_algo="burst"), "names an algorithm per layer"),
    (dict(cp_comm_type=["p2p", "ring2"]), "--cp-comm-type ring2"),
    (dict(cp_comm_type="a2a+p2p", hierarchical_cp_sizes=[2, 2, 2]), "give two sizes"),
])
def test_bad_comm_types_name_the_flag(kwargs, needle):
    with pytest.raises(ValueError) as info:
        make_cp_options(**kwargs)
    assert needle in str(info.value)


def test_usp_sizes_come_from_megatrons_flag():
    opts = make_cp_options(cp_comm_type="a2a+p2p", hierarchical_cp_sizes=[2, 4])
    assert (opts.algo, opts.ulysses_size) == ("usp", 2)


def test_trainer_validates_heads_and_sizes_before_starting():
    from test_megatron_args import _train_args
    from megatron_burst.train import validate_args

    cases = [
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "2",
          "--num-query-groups", "2", "--hidden-size", "32"], "2 query heads are not divisible by the Ulysses group "
         "size 4"),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "3",
          "1"], "must multiply to --context-parallel-size 4"),
        (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--recompute-granularity", "full",
          "--seq-selective-ckpt-ratio", "0.5"], "--seq-selective-ckpt-ratio 0.5 recomputes part of each sequence, "
         "which ulysses cannot"),
    ]
    for argv, needle in cases:
        with pytest.raises(ValueError) as info:
            validate_args(_train_args(argv), 4)
        assert needle in str(info.value), str(info.value)


def test_core_attention_per_layer_comm_type_and_missing_usp_groups():
    """Megatron passes each layer its own --cp-comm-type entry; usp without its groups is refused
    at construction (the groups are a collective made with the other process groups)."""
    assert run_ranks(2, construct_core_attention, 2, cp_comm_type="a2a") == ["ok", "ok"]
    assert run_ranks(2, construct_core_attention, 2, cp_comm_type="allgather") == ["ok", "ok"]
    msgs = run_ranks(4, construct_core_attention, 4, cp_comm_type="a2a+p2p", cp_ulysses_size=2)
    assert all("needs its 2-D process groups" in m for m in msgs), msgs


def test_per_layer_comm_types_through_the_trainer(reference):
    """Megatron's per-layer form: layer 1 Ulysses, layer 2 USP 2 x 2 (--hierarchical-context-parallel-sizes
    2 2) at CP = 4; equal to CP = 1."""
    results = run_ranks(4, loss_and_full_grads, 1, 4, ["--cp-comm-type", "a2a", "a2a+p2p",
                                                      "--hierarchical-context-parallel-sizes", "2", "2"], seq=32)
    for rank, res in enumerate(results):
        assert res["resolved"][0] == "ulysses" and res["resolved"][1].startswith("usp2/"), res["resolved"]
        _assert_matches(res, reference, f"CP=4 per-layer a2a, a2a+p2p rank {rank}")


def test_per_layer_list_must_match_the_layers():
    from test_megatron_args import _train_args
    from megatron_burst.train import validate_args

    with pytest.raises(ValueError, match="--cp-comm-type has 3 values but the model has --num-layers 1"):
        validate_args(_train_args(["--context-parallel-size", "2", "--cp-comm-type", "a2a", "p2p", "a2a"]), 2)
