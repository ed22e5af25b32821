"""--cp-layout balanced through a Megatron-Core GPT step (issue L, deliverable 4).

The batch slicing plans each batch once from its documents (EOD documents of every sample, planned
on their union; a packed THD batch's sequences), cuts every entry to this rank's plan rows, and
hands the plan to every layer and to RoPE in ``packed_seq_params``. Loss and every parameter's
gradient at CP = 4 and 3 equal CP = 1; the refusals name their flags."""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import pytest
import torch

from harness import run_ranks
from test_megatron_documents import EOD, _compare, eod_batch, gpt_step, thd_batch
from test_megatron_model import VOCAB, full_grads, small_args

RESET = ["--reset-attention-mask", "--reset-position-ids"]
BALANCED = ["--cp-layout", "balanced"]


def long_document_batch(seq: int = 24) -> Dict[str, torch.Tensor]:
    """Two samples: documents of 2, 1, 17 and 4 tokens (the 17-token one longer than any rank's
    share at CP >= 2, so the plan splits it), and of 9 and 15. Position ids reset after each EOD."""
    return eod_batch(seq, eod_columns=((1, 2, 19), (8,)), seed=3)


def balanced_gpt_step(cp: int, batch: Dict[str, torch.Tensor], eod: Optional[int], extra: List[str],
                      seq: int = 24) -> dict:
    """gpt_step under --cp-layout balanced, recording which Documents each layer's attention got."""
    from megatron_burst.megatron import attention

    seen = []
    real_prepare = attention.prepare

    def recording_prepare(*args, **kwargs):
        seen.append((kwargs["layout"], kwargs["cu_seqlens"]))
        return real_prepare(*args, **kwargs)

    attention.prepare = recording_prepare
    try:
        result = gpt_step(cp, batch, eod, extra, seq)
    finally:
        attention.prepare = real_prepare
    result["layouts"] = sorted({layout for layout, _ in seen})
    result["documents_objects"] = len({id(docs) for _, docs in seen})
    result["calls"] = len(seen)
    result["plan_ranks_per_node"] = sorted({docs.plan.ranks_per_node for _, docs in seen})
    return result


def _check_against(results: list, reference: dict) -> None:
    for res in results:
        assert res["layouts"] == ["balanced"] and res["calls"] == 2  # both layers, balanced
        assert res["documents_objects"] == 1  # one Documents (one plan) for every layer: nothing re-planned
        _compare(res, reference)


@pytest.fixture(scope="module")
def reset_reference():
    return run_ranks(1, gpt_step, 1, long_document_batch(), EOD, RESET)[0]


@pytest.mark.parametrize("cp,algo", [(4, "burst"), (3, "ring")])
def test_balanced_documents_cp_equals_cp1(reset_reference, cp, algo):
    results = run_ranks(cp, balanced_gpt_step, cp, long_document_batch(), EOD, RESET + BALANCED + ["--cp-algo", algo])
    _check_against(results, reset_reference)


@pytest.mark.parametrize("algo", ["burst", "ring"])
def test_balanced_on_two_nodes_cp4_equals_cp1(reset_reference, algo):
    """CP = 4 as 2 nodes x 2 (--cp-ranks-per-node, the flag the layers' topology takes): the batch
    slicing plans for the same nodes as the layers (placed node-aware), the direct pass runs in the
    plan's member order, and the step equals CP = 1."""
    flags = RESET + BALANCED + ["--cp-algo", algo, "--cp-ranks-per-node", "2"]
    results = run_ranks(4, balanced_gpt_step, 4, long_document_batch(), EOD, flags)
    _check_against(results, reset_reference)
    assert all(res["plan_ranks_per_node"] == [2] for res in results), [res["plan_ranks_per_node"] for res in results]


def test_balanced_without_documents_is_one_document_split_over_all_ranks():
    """No --reset-attention-mask: every sample is the document [0, S]; CP = 2 equals plain CP = 1."""
    batch = long_document_batch()
    reference = run_ranks(1, gpt_step, 1, batch, None, [])[0]
    _check_against(run_ranks(2, balanced_gpt_step, 2, batch, None, BALANCED), reference)


def test_balanced_packed_thd_cp4_equals_cp1():
    """A packed THD batch (3, 8, 5 real tokens in slots of 4, 8, 8) at CP = 4 under balanced: sliced
    by the plan of its sequences (padding tails as documents), RoPE at global positions, equals
    CP = 1's THD step (Megatron's per-sequence RoPE)."""
    reference = run_ranks(1, gpt_step, 1, thd_batch(), None, [], 20)[0]
    _check_against(run_ranks(4, balanced_gpt_step, 4, thd_batch(), None, BALANCED, 20), reference)


def _rope_rows(cp: int) -> dict:
    """This rank's RoPE rows under balanced vs the full table's rows at the plan's global positions."""
    from megatron_burst import train
    from megatron_burst.megatron.batch import get_batch_on_this_cp_rank
    from megatron_burst.megatron.packed import balanced_documents_of

    args = small_args(["--context-parallel-size", str(cp)] + RESET + BALANCED)
    opts, sizes = train.validate_args(args, torch.distributed.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    model = train.build_model(args, opts, sizes, groups, torch.device("cpu"))
    local = get_batch_on_this_cp_rank(long_document_batch(), "balanced", groups.cp, eod_token=EOD)
    documents = balanced_documents_of(local["packed_seq_params"])
    rope = model.rotary_pos_emb
    with rope.placed_by(documents.plan):
        rows = rope(24)
    full = rope._rows(24, 0, None)
    rank = torch.distributed.get_rank(groups.cp)
    positions = documents.plan.indices(rank)
    out = {"rows_match": torch.equal(rows, full[positions]), "positions": positions,
           "tokens_match": torch.equal(local["tokens"], long_document_batch()["tokens"][:, positions])}
    try:
        rope(24)
    except ValueError as exc:
        out["outside_forward"] = str(exc)
    try:  # a batch sliced in another layout reaches the balanced model: refused, not run in the wrong layout
        zigzag = get_batch_on_this_cp_rank(long_document_batch(), "zigzag", groups.cp, eod_token=EOD)
        model(zigzag["tokens"], zigzag["position_ids"], None, labels=zigzag["labels"],
              packed_seq_params=zigzag["packed_seq_params"])
    except ValueError as exc:
        out["wrong_slicing"] = str(exc)
    return out


def test_rope_rows_are_the_plans_global_positions():
    from megatron_burst.masks.documents import balanced_documents
    from megatron_burst.megatron.packed import document_boundaries

    plan = balanced_documents(document_boundaries(long_document_batch()["tokens"], EOD), 24, 2, 4).plan
    assert len(set(plan.owner()[3:20].tolist())) > 1  # the 17-token document [3, 20) is split over ranks
    results = run_ranks(4, _rope_rows, 4)
    for rank, res in enumerate(results):
        assert res["rows_match"] and res["tokens_match"], rank
        assert torch.equal(res["positions"], plan.indices(rank))
        assert "outside a forward" in res["outside_forward"]
        assert "needs the batch's plan" in res["wrong_slicing"]


# --------------------------------------------------------------------------------------- the flags

def _options(argv: List[str], **attrs):
    from megatron_burst.megatron.from_args import options_from_args
    from megatron_burst.train import build_parser

    args = build_parser().parse_args(["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                                      "--seq-length", "24", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
                                     + argv)
    for key, value in attrs.items():
        setattr(args, key, value)
    return options_from_args(args)


def test_flags_accept_balanced():
    from megatron_burst.megatron.flags import add_args

    parsed = add_args(argparse.ArgumentParser()).parse_args(["--cp-layout", "balanced"])
    assert parsed.cp_layout == "balanced"
    opts = _options(BALANCED + ["--context-parallel-size", "4"]).cp
    assert (opts.layout, opts.algo) == ("balanced", "burst")


@pytest.mark.parametrize("kind", ["lightning", "gated_delta_net"])
def test_balanced_takes_linear_layers(kind):
    """LASP-2 and Gated DeltaNet run in the balanced placement (tests/test_linear_hybrid_documents.py);
    LASP-1 is refused at the flags, naming them."""
    flags = BALANCED + ["--context-parallel-size", "2", "--linear-attention-type", kind, "--linear-attention-freq", "2"]
    assert _options(flags).cp.layout == "balanced"
    if kind != "gated_delta_net":
        with pytest.raises(ValueError) as err:
            _options(flags + ["--linear-cp-algo", "lasp1"])
        message = str(err.value)
        assert "--linear-cp-algo lasp2" in message and "layers 1, 3" in message and "lightning" in message


def test_balanced_refusals_name_the_flag():
    with pytest.raises(ValueError, match="--sparse-attention vertical_slash"):
        _options(BALANCED + ["--sparse-attention", "vertical_slash", "--sparse-last-q", "8"])
    with pytest.raises(ValueError, match="not divisible by 5"):
        _options(BALANCED + ["--context-parallel-size", "5"])
    with pytest.raises(ValueError, match="drop --cp-layout balanced"):
        _options(BALANCED + ["--cp-algo", "none"])


def test_thd_balanced_needs_a_total_divisible_by_cp():
    from megatron_burst.megatron.packed import _balanced_thd_batch

    batch = {k: thd_batch()[k][:, :18] for k in ("tokens", "labels")}
    with pytest.raises(ValueError, match="not divisible by the CP size 4"):
        _balanced_thd_batch(batch, torch.tensor([0, 3, 11, 16], dtype=torch.int32),
                            torch.tensor([0, 4, 12, 18], dtype=torch.int32), 0, 4, 4)


def _glue_slice() -> tuple:
    """Megatron-LM's get_batch through the patch's calls under --cp-layout balanced: slice_batch with
    --reset-attention-mask (a dense mask in the batch, as Megatron-LM's dataset gives it) and
    slice_thd_batch."""
    from megatron.core import parallel_state as ps

    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.flags import add_args
    from megatron_burst.megatron.packed import balanced_documents_of

    ps.initialize_model_parallel(1, 1, context_parallel_size=2, create_gloo_process_groups=False)
    args = add_args(argparse.ArgumentParser()).parse_args(BALANCED)
    args.seq_length, args.context_parallel_size, args.tensor_model_parallel_size = 24, 2, 1
    args.reset_attention_mask = True
    batch = long_document_batch()
    batch["attention_mask"] = torch.ones(2, 1, 24, 24, dtype=torch.bool)  # superseded by the documents
    out = megatron_lm.slice_batch(dict(batch), args, eod_token=EOD)
    params = out.pop("packed_seq_params")
    thd = thd_batch()
    thd_local, thd_params = megatron_lm.slice_thd_batch(
        {k: thd[k] for k in ("tokens", "position_ids")}, thd["cu_seqlens"], thd["cu_seqlens_padded"],
        thd["max_seqlen"], args)
    return (list(out), out["attention_mask"], out["tokens"], balanced_documents_of(params).plan,
            thd_local["position_ids"], thd_params.qkv_format, balanced_documents_of(thd_params))


def test_megatron_lm_glue_slices_by_the_plan():
    from megatron_burst.masks.documents import balanced_documents

    batch, thd = long_document_batch(), thd_batch()
    thd_documents = balanced_documents([0, 3, 4, 12, 17, 20], 20, 1, 2)  # padding tails are documents
    for rank, (keys, mask, tokens, plan, thd_pos, thd_fmt, thd_docs) in enumerate(run_ranks(2, _glue_slice)):
        assert keys == ["tokens", "labels", "loss_mask", "position_ids", "attention_mask"] and mask is None
        assert torch.equal(tokens, batch["tokens"][:, plan.indices(rank)])
        assert thd_fmt == "sbhd" and thd_docs.groups == thd_documents.groups
        assert torch.equal(thd_pos[0], thd["position_ids"][0, thd_documents.plan.indices(rank)])


def test_megatron_lm_refuses_balanced_with_middle_pipeline_stages():
    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.flags import add_args

    args = add_args(argparse.ArgumentParser()).parse_args(BALANCED)
    args.pipeline_model_parallel_size = 4
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 4"):
        megatron_lm.burst_options(args)


@pytest.mark.parametrize("pp,vpp", [(4, None), (2, 2)])
def test_megatron_lm_refuses_documents_with_middle_pipeline_stages(pp, vpp):
    """--reset-attention-mask under any layout: middle pipeline stages get no packed_seq_params from
    Megatron-LM's get_batch, so they would attend across documents; refused naming the flags. Two
    stages without virtual ones keep documents on every stage and pass."""
    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.flags import add_args

    args = add_args(argparse.ArgumentParser()).parse_args(["--cp-layout", "zigzag"])
    args.reset_attention_mask = True
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = pp, vpp
    with pytest.raises(ValueError, match=f"--reset-attention-mask with --pipeline-model-parallel-size {pp}"):
        megatron_lm.burst_options(args)
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 2, None
    megatron_lm.burst_options(args)
