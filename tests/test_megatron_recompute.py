"""Megatron GPT with megatron-burst under activation recompute (sequence-level selective
checkpointing) and on a double ring: same loss and gradients as CP = 1 without recompute."""
from typing import List, Optional

import pytest

from harness import run_ranks
from test_megatron_model import VOCAB, _assert_matches, build_and_step, fixed_batch, full_grads, small_args


def gpt_step(tp: int, cp: int, extra: Optional[List[str]] = None, seq: int = 24) -> dict:
    """One forward/backward of the tiny GPT; also reports what the attention modules did."""
    from megatron_burst.topology import CPTopology

    loss, model, groups = build_and_step(tp, cp, extra, seq)
    attns = [layer.self_attention.core_attention for layer in model.decoder.layers]
    caches = [a.selective_cache for a in attns if a.selective_cache is not None]
    target = attns[0].cp_target
    return {"loss": loss, "grads": full_grads(model, groups),
            "hits": [c.hits for c in caches], "left": [len(c) for c in caches],
            "nodes": target.num_nodes if isinstance(target, CPTopology) else 1}


def gpt_step_with_detours(layout: str) -> dict:
    """Iteration 1: a training forward whose backward never comes, then end_iteration. Iteration 2:
    forward, an evaluation forward (eval mode, no grad) in between, backward, end_iteration."""
    import torch
    import torch.distributed as dist

    import megatron_burst
    from megatron_burst import train
    from megatron_burst.activation_store import end_iteration, stores_of

    args = small_args(["--context-parallel-size", "2", "--cp-layout", layout, "--recompute-granularity", "full",
                       "--seq-selective-ckpt-ratio", "0.5"])
    opts, topo = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(topo)
    train.seed_everything(args.seed, torch.device("cpu"))
    model = train.build_model(args, opts, topo, groups, torch.device("cpu"))
    paths = [path for path, _ in stores_of(model)]
    stores = [layer.self_attention.core_attention.selective_cache for layer in model.decoder.layers]

    def forward(seed):
        b = megatron_burst.get_batch_on_this_cp_rank(fixed_batch(24, seed=seed), layout=opts.layout,
                                                     cp_group=groups.cp, stripe=opts.stripe)
        return model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"]), b

    forward(11)  # backward skipped
    left_skipped = [len(s) for s in stores]
    dropped = end_iteration(model)
    losses, b = forward(7)  # the reference's batch
    model.eval()
    with torch.no_grad():
        forward(12)
    model.train()
    num_tokens = b["loss_mask"].sum().to(torch.float64)
    dist.all_reduce(num_tokens, group=groups.dp_cp)
    loss = (losses.float() * b["loss_mask"].float()).sum() / num_tokens.float()
    loss.backward()
    total = loss.detach().to(torch.float64)
    dist.all_reduce(total, group=groups.dp_cp)
    train.allreduce_grads(model, groups)
    return {"loss": total.item(), "grads": full_grads(model, groups), "paths": paths, "left_skipped": left_skipped,
            "dropped": dropped, "hits": [s.hits for s in stores], "misses": [s.misses for s in stores],
            "released": end_iteration(model), "left": [len(s) for s in stores]}


def scoring_passes_store_nothing(granularity: str) -> dict:
    """No-grad forwards in training mode (a scoring pass) run Megatron's checkpoint forward, but no
    recompute follows them: they must not fill the store (64 passes used to leave 64 entries)."""
    import torch
    import torch.distributed as dist

    import megatron_burst
    from megatron_burst import train

    args = small_args(["--context-parallel-size", "2", "--cp-layout", "striped", "--recompute-granularity",
                       granularity, "--seq-selective-ckpt-ratio", "0.5"])
    opts, topo = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(topo)
    train.seed_everything(args.seed, torch.device("cpu"))
    model = train.build_model(args, opts, topo, groups, torch.device("cpu"))
    stores = [layer.self_attention.core_attention.selective_cache for layer in model.decoder.layers]
    b = megatron_burst.get_batch_on_this_cp_rank(fixed_batch(24), layout="striped", cp_group=groups.cp)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"])
    after_scoring = [len(s) for s in stores]
    model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"]).sum().backward()
    return {"after_scoring": after_scoring, "hits": [s.hits for s in stores], "left": [len(s) for s in stores]}


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_scoring_pass_in_training_mode_stores_nothing(granularity):
    for res in run_ranks(2, scoring_passes_store_nothing, granularity):
        assert res["after_scoring"] == [0, 0]
        assert res["hits"] == [1, 1] and res["left"] == [0, 0]  # the training pass still stored and hit


@pytest.fixture(scope="module")
def reference():
    return run_ranks(1, gpt_step, 1, 1)[0]


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_selective_checkpointing_equals_no_recompute(reference, layout, granularity):
    results = run_ranks(2, gpt_step, 1, 2, ["--cp-layout", layout, "--recompute-granularity", granularity,
                                            "--seq-selective-ckpt-ratio", "0.5"])
    for rank, res in enumerate(results):
        _assert_matches(res, reference, f"CP=2 {layout} {granularity} recompute rank {rank}")
        assert res["hits"] == [1, 1], res["hits"]  # each layer's recompute used its stored half
        assert res["left"] == [0, 0]  # and nothing stays behind


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_skipped_backward_and_eval_step_leave_the_recompute_exact(reference, layout):
    for rank, res in enumerate(run_ranks(2, gpt_step_with_detours, layout)):
        assert res["paths"] == [f"decoder.layers.{i}.self_attention.core_attention.selective_cache" for i in (0, 1)]
        assert res["left_skipped"] == [1, 1] and res["dropped"] == 2  # the skipped backward's entries, released
        _assert_matches(res, reference, f"CP=2 {layout} after a skipped backward and an eval step, rank {rank}")
        assert res["hits"] == [1, 1] and res["misses"] == [0, 0]  # the recompute was served its own entries
        assert res["released"] == 0 and res["left"] == [0, 0]


def test_plain_recompute_still_exact(reference):
    for res in run_ranks(2, gpt_step, 1, 2, ["--recompute-granularity", "full"]):
        _assert_matches(res, reference, "CP=2 full recompute without selective checkpointing")
        assert res["hits"] == []


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_double_ring_through_megatron_flags(reference, algo):
    results = run_ranks(4, gpt_step, 1, 4, ["--cp-algo", algo, "--cp-ring", "double", "--cp-ranks-per-node", "2"])
    for rank, res in enumerate(results):
        assert res["nodes"] == 2
        _assert_matches(res, reference, f"CP=4 as 2 nodes x 2, {algo}, rank {rank}")


def test_ranks_per_node_from_the_launcher(monkeypatch):
    from megatron_burst.megatron.args import default_cp_ranks_per_node

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_cp_ranks_per_node(cp_size=16, tp_size=2) == 4  # TP fastest: 4 CP ranks per node
    assert default_cp_ranks_per_node(cp_size=2, tp_size=2) == 2  # the CP group fits in a node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="--cp-ranks-per-node"):
        default_cp_ranks_per_node(cp_size=8, tp_size=1)  # 6 ranks per node cannot split 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert default_cp_ranks_per_node(cp_size=4, tp_size=1) == 4


def test_flag_errors():
    from megatron_burst.megatron.args import cp_options_from_args

    with pytest.raises(ValueError, match="needs activation recompute"):
        cp_options_from_args(small_args(["--seq-selective-ckpt-ratio", "0.5"]))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        cp_options_from_args(small_args(["--seq-selective-ckpt-ratio", "1.5", "--recompute-granularity", "full"]))
    opts = cp_options_from_args(small_args(["--cp-ring", "double", "--cp-ranks-per-node", "2",
                                            "--context-parallel-size", "4"]))
    assert (opts.ring, opts.ranks_per_node) == ("double", 2)
