"""Documents through a Megatron-Core GPT step (the trainer's own functions): --reset-attention-mask
/ --reset-position-ids [b, s] batches and packed THD batches (PackedSeqParams) at CP = 2 equal
CP = 1 in loss and in every parameter's gradient, and the documents do change the result."""
from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch

from harness import run_ranks
from test_megatron_model import VOCAB, full_grads, small_args

EOD = VOCAB - 1  # drawn tokens stay below it, so EODs are only where a test puts them
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def eod_batch(seq: int = 24, reset_position_ids: bool = True, eod_columns: tuple = ((2, 3, 14), (10,)),
              seed: int = 11) -> Dict[str, torch.Tensor]:
    """Two samples with an EOD (end of a document) after each position of ``eod_columns``; by default
    documents of 3, 1, 11 and 9 tokens (the 1-token one shorter than any rank's share, the 11-token
    one spanning ranks), and of 11 and 13. Position ids reset after each EOD like Megatron's
    get_ltor_masks_and_position_ids (``reset_position_ids``)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD, (2, seq + 1), generator=g)
    for row, cols in enumerate(eod_columns):
        tokens[row, list(cols)] = EOD
    data = tokens[:, :-1].contiguous()
    pos = torch.arange(seq).repeat(2, 1)
    if reset_position_ids:
        for row in range(2):
            start = 0
            for i in range(seq):
                pos[row, i] = i - start
                if data[row, i] == EOD:
                    start = i + 1
    return {"tokens": data, "labels": tokens[:, 1:].contiguous(),
            "loss_mask": (torch.rand(2, seq, generator=g) > 0.2).float(), "position_ids": pos}


def thd_batch(cp_max: int = 2) -> Dict[str, torch.Tensor]:
    """One packed sample of sequences with 3, 8 and 5 real tokens, padded to multiples of
    2 x cp_max (4, 8, 8): cu_seqlens, cu_seqlens_padded and max_seqlen as Megatron-LM's SFT data."""
    g = torch.Generator().manual_seed(5)
    real, padded = [3, 8, 5], [4, 8, 8]
    T = sum(padded)
    tokens = torch.randint(0, EOD, (1, T + 1), generator=g)
    loss_mask = torch.zeros(1, T)
    pos = torch.zeros(1, T, dtype=torch.long)
    start = 0
    for n, p in zip(real, padded):
        loss_mask[0, start:start + n] = 1.0
        pos[0, start:start + p] = torch.arange(p)
        start += p
    cu = torch.tensor([0, 3, 11, 16], dtype=torch.int32)
    cu_pad = torch.tensor([0, 4, 12, 20], dtype=torch.int32)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": pos, "cu_seqlens": cu, "cu_seqlens_padded": cu_pad,
            "max_seqlen": torch.tensor([8], dtype=torch.int32)}


def gpt_step(cp: int, batch: Dict[str, torch.Tensor], eod: Optional[int], extra: Optional[List[str]] = None,
             seq: int = 24) -> dict:
    """One forward/backward of the tiny GPT at CP = ``cp`` through the trainer's functions."""
    from megatron_burst import train

    args = small_args(["--context-parallel-size", str(cp), "--seq-length", str(seq)] + list(extra or []))
    opts, sizes = train.validate_args(args, torch.distributed.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    device = torch.device("cpu")
    train.seed_everything(args.seed, device)
    model = train.build_model(args, opts, sizes, groups, device)
    loss = train.loss_and_grads(model, [batch], opts, groups, device, eod_token=eod)
    train.allreduce_grads(model, groups)
    caches = [layer.self_attention.core_attention.selective_cache for layer in model.decoder.layers]
    return {"loss": loss.item(), "grads": full_grads(model, groups),
            "selective_hits": sum(c.hits for c in caches if c is not None)}


def _compare(a: dict, b: dict) -> None:
    assert abs(a["loss"] - b["loss"]) <= LOSS_TOL * abs(b["loss"]), (a["loss"], b["loss"])
    for name, g in b["grads"].items():
        err = (a["grads"][name] - g).abs().max().item()
        assert err <= GRAD_TOL * max(g.abs().max().item(), 1e-6), f"{name}: {err:.2e}"


@pytest.fixture(scope="module")
def reset_reference():
    return run_ranks(1, gpt_step, 1, eod_batch(), EOD, ["--reset-attention-mask", "--reset-position-ids"])[0]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("algo", ["burst", "ring"])
def test_reset_attention_mask_cp2_equals_cp1(reset_reference, algo, layout):
    flags = ["--reset-attention-mask", "--reset-position-ids", "--cp-algo", algo, "--cp-layout", layout]
    for res in run_ranks(2, gpt_step, 2, eod_batch(), EOD, flags):
        _compare(res, reset_reference)


def test_documents_change_the_step(reset_reference):
    """Without the documents (same batch, same position ids) the loss differs: the test above can fail."""
    plain = run_ranks(1, gpt_step, 1, eod_batch(), None, ["--reset-position-ids"])[0]
    assert abs(plain["loss"] - reset_reference["loss"]) > 1e-3 * abs(reset_reference["loss"])


@pytest.fixture(scope="module")
def thd_reference():
    return run_ranks(1, gpt_step, 1, thd_batch(), None, [], 20)[0]


@pytest.mark.parametrize("algo", ["burst", "ring"])
def test_packed_thd_cp2_equals_cp1(thd_reference, algo):
    """PackedSeqParams (qkv_format thd, cu_seqlens_padded): TransformerEngine's per-sequence zigzag
    at CP = 2, Megatron's own THD RoPE, our attention in layout 'thd'."""
    for res in run_ranks(2, gpt_step, 2, thd_batch(), None, ["--cp-algo", algo], 20):
        _compare(res, thd_reference)


def test_packed_thd_sequences_are_separate(thd_reference):
    """The same tokens as one unpacked sequence give another loss: the packing is honoured."""
    batch = {k: v for k, v in thd_batch().items() if k not in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")}
    plain = run_ranks(1, gpt_step, 1, batch, None, [], 20)[0]
    assert abs(plain["loss"] - thd_reference["loss"]) > 1e-3 * abs(thd_reference["loss"])


def test_eod_documents_match_megatrons_dense_mask_and_positions():
    """Our boundaries from the EOD tokens give exactly the mask Megatron's dataset builds for
    --reset-attention-mask, and the batch's reset position ids are Megatron's."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_burst.masks.documents import dense_document_mask
    from megatron_burst.megatron.packed import document_boundaries

    batch = eod_batch()
    for row, bounds in enumerate(document_boundaries(batch["tokens"], EOD)):
        mask, _, pos = _get_ltor_masks_and_position_ids(batch["tokens"][row], EOD, True, True, False, True)
        assert torch.equal(~mask[0], dense_document_mask(bounds, 24)), row  # Megatron: True = hidden
        assert torch.equal(pos, batch["position_ids"][row])
    assert document_boundaries(batch["tokens"], EOD) == [[0, 3, 4, 15, 24], [0, 11, 24]]


def _glue_slice(cp_algo: str):
    """Megatron-LM's get_batch through the patch's calls: slice_batch with --reset-attention-mask
    (a dense mask in the batch, as Megatron-LM's dataset gives it) and slice_thd_batch."""
    import argparse

    from megatron.core import parallel_state as ps

    from megatron_burst.megatron import megatron_lm
    from megatron_burst.megatron.args import add_args

    ps.initialize_model_parallel(1, 1, context_parallel_size=2, create_gloo_process_groups=False)
    args = add_args(argparse.ArgumentParser()).parse_args(["--cp-algo", cp_algo, "--cp-layout", "striped"])
    args.seq_length, args.context_parallel_size, args.tensor_model_parallel_size = 24, 2, 1
    args.reset_attention_mask = True
    batch = eod_batch()
    batch["attention_mask"] = torch.ones(2, 1, 24, 24, dtype=torch.bool)  # whatever it says is not read
    out = megatron_lm.slice_batch(dict(batch), args, eod_token=EOD)
    params = out.pop("packed_seq_params")
    thd = thd_batch()
    thd_local, thd_params = megatron_lm.slice_thd_batch(
        {k: thd[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}, thd["cu_seqlens"],
        thd["cu_seqlens_padded"], thd["max_seqlen"], args)
    return (list(out), out["attention_mask"], out["tokens"], params.qkv_format, params.cu_seqlens_q.tolist(),
            params.max_seqlen_q, thd_local["position_ids"], thd_params.qkv_format)


def test_megatron_lm_glue_hands_documents_to_the_model():
    from megatron_burst.masks.layout import layout_indices, thd_indices

    batch, thd = eod_batch(), thd_batch()
    for rank, (keys, mask, tokens, fmt, cu, max_seqlen, thd_pos, thd_fmt) in enumerate(
            run_ranks(2, _glue_slice, "burst")):
        assert keys == ["tokens", "labels", "loss_mask", "position_ids", "attention_mask"]  # order kept
        assert mask is None and fmt == "sbhd" and max_seqlen == 24
        assert cu == [0, 3, 4, 15, 24, 35, 48]  # sample 1's documents offset by 24
        assert torch.equal(tokens, batch["tokens"][:, layout_indices(24, rank, 2, "striped")])
        assert thd_fmt == "thd" and torch.equal(thd_pos[0], thd["position_ids"][0, thd_indices([0, 4, 12, 20], rank, 2)])


@pytest.mark.parametrize("packed", [False, True])
def test_documents_under_sequence_level_selective_checkpointing(reset_reference, thd_reference, packed):
    """--recompute-granularity full with --seq-selective-ckpt-ratio 0.5: the recompute computes the
    earlier rows with the same documents; loss and grads still equal CP = 1 without recompute."""
    recompute = ["--recompute-granularity", "full", "--seq-selective-ckpt-ratio", "0.5"]
    if packed:
        results, ref = run_ranks(2, gpt_step, 2, thd_batch(), None, recompute, 20), thd_reference
    else:
        flags = ["--reset-attention-mask", "--reset-position-ids", "--cp-layout", "striped"] + recompute
        results, ref = run_ranks(2, gpt_step, 2, eod_batch(), EOD, flags), reset_reference
    for res in results:
        assert res["selective_hits"] == 2  # both layers' recomputes took their stored rows
        _compare(res, ref)


def _train_run(argv: List[str]) -> List[dict]:
    from megatron_burst import train

    return train.run(argv)


def test_trainer_flags_run_at_cp2_like_cp1(tmp_path):
    """python -m megatron_burst.train --reset-attention-mask --reset-position-ids on indexed data of
    short documents (5 to 40 bytes, EOD after each, so every 64-token sample holds several): two
    iterations at CP = 2 log CP = 1's losses, and the documents change the losses."""
    import random

    from megatron_burst.data import build_byte_dataset

    rng = random.Random(0)
    docs = [bytes(rng.randrange(97, 123) for _ in range(rng.randrange(5, 41))) for _ in range(300)]
    build_byte_dataset(docs, str(tmp_path / "short_docs"))
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "3e-3",
            "--train-iters", "2", "--data-cache-path", str(tmp_path / "data"), "--data-path",
            str(tmp_path / "short_docs"), "--init-method-std", "0.3", "--reset-position-ids"]
    plain = run_ranks(1, _train_run, argv)[0]
    cp1 = run_ranks(1, _train_run, argv + ["--reset-attention-mask"])[0]
    cp2 = run_ranks(2, _train_run, argv + ["--reset-attention-mask", "--context-parallel-size", "2",
                                           "--cp-layout", "striped"])[0]
    for a, b in zip(cp2, cp1):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-4 * abs(b["lm_loss"]), (a, b)
    assert abs(plain[0]["lm_loss"] - cp1[0]["lm_loss"]) > 1e-4 * abs(cp1[0]["lm_loss"])  # beyond the tolerance above
