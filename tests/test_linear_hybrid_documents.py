"""Hybrid GPTs (linear + softmax layers) with --reset-attention-mask: the linear layers take the
batch's documents as the softmax layers do.

* At CP = 1 every document is its own sequence: the packed batch's per-token losses equal those
  of each document run alone (every variant and Gated DeltaNet, whose conv1d must not read the
  previous document either).
* At CP = 2 (the trainer's path: every variant; zigzag, contiguous, striped; LASP-1) and through
  the patched pretrain_gpt.py's pieces (megatron_lm.slice_batch, the stand-in gpt_builder), the
  loss and every gradient equal CP = 1's.
* Megatron-LM's flags no longer refuse --reset-attention-mask with --linear-attention-type.
* Packed THD batches (PackedSeqParams qkv_format "thd") and the balanced layout: at CP = 2 and 3 the
  hybrids equal CP = 1 (every variant family, Gated DeltaNet's conv halo over runs shorter than its window).
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_megatron_documents import EOD
from test_megatron_documents import eod_batch as documents_batch
from test_megatron_model import VOCAB
HYBRID = ["--num-layers", "4", "--linear-attention-freq", "2", "--reset-attention-mask", "--reset-position-ids"]
# EOD positions per sample (a document ends after each). 40 tokens at CP = 2: zigzag segments are
# [0, 10) [10, 20) [20, 30) [30, 40), contiguous [0, 20) [20, 40). Sample 0: documents start at 3
# (inside a segment), 10 (on a segment start), 11 (after the single-token document [10, 11)) and
# 27; sample 1: [0, 36) spans every rank. 256 tokens, 64-token stripes: the same shapes, scaled.
EODS = {40: ((2, 9, 10, 26), (35,)), 256: ((2, 63, 64, 150), (200,))}


def eod_batch(seq: int) -> Dict[str, torch.Tensor]:
    return documents_batch(seq, eod_columns=EODS[seq], seed=17)


def _build(cp: int, variant: str, extra: List[str], seq: int, fp64: bool):
    """The hybrid GPT at CP = ``cp`` through the trainer's functions (fp64 parameters for Gated
    DeltaNet: see tests/test_gated_delta_net.py). Returns (args, opts, groups, model)."""
    from megatron.core import parallel_state

    from megatron_burst import train
    from megatron_burst.train import setup
    from test_megatron_model import small_args

    parallel_state.destroy_model_parallel()  # several models per task
    args = small_args(HYBRID + ["--linear-attention-type", variant, "--context-parallel-size", str(cp),
                                "--seq-length", str(seq)] + list(extra))
    opts, sizes = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    cpu = torch.device("cpu")
    fp32_config = setup.model_config

    def fp64_config(*a, **k):
        config = fp32_config(*a, **k)
        config.params_dtype = torch.float64
        return config

    if fp64:
        setup.model_config = fp64_config
        torch.set_default_dtype(torch.float64)
    try:
        train.seed_everything(args.seed, cpu)
        model = train.build_model(args, opts, sizes, groups, cpu)
    finally:
        setup.model_config = fp32_config
    return args, opts, groups, model


def thd_hybrid_batch() -> Dict[str, torch.Tensor]:
    """One packed sample (PackedSeqParams qkv_format 'thd', as Megatron-LM's SFT data): sequences of 7,
    20 and 1 real tokens padded to 12, 24 and 12 (multiples of 2 x CP for CP = 2 and 3). At CP = 3 a
    sequence's chunks are 2 or 4 tokens, shorter than Gated DeltaNet's conv window for the short ones:
    their halo comes from several runs back."""
    g = torch.Generator().manual_seed(23)
    real, padded = [7, 20, 1], [12, 24, 12]
    T = sum(padded)
    tokens = torch.randint(0, EOD, (1, T + 1), generator=g)
    loss_mask, pos = torch.zeros(1, T), torch.zeros(1, T, dtype=torch.long)
    start = 0
    for n, p in zip(real, padded):
        loss_mask[0, start:start + n] = 1.0
        pos[0, start:start + p] = torch.arange(p)
        start += p
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": pos, "cu_seqlens": torch.tensor([0, 7, 27, 28], dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor([0, 12, 36, 48], dtype=torch.int32),
            "max_seqlen": torch.tensor([24], dtype=torch.int32)}


THD_SEQ = 48


def trainer_steps(cp: int, cases: list) -> list:
    """One forward/backward per case (variant, extra flags, seq) of the hybrid GPT on eod_batch (seq
    "thd": thd_hybrid_batch) through megatron_burst.train's loss_and_grads with the documents: loss
    and every gradient."""
    from megatron_burst import train
    from test_megatron_model import full_grads

    out = []
    for variant, extra, seq in cases:
        fp64 = variant == "gated_delta_net"
        thd = seq == "thd"
        batch, eod = (thd_hybrid_batch(), None) if thd else (eod_batch(seq), EOD)
        try:
            _, opts, groups, model = _build(cp, variant, extra, THD_SEQ if thd else seq, fp64)
            loss = train.loss_and_grads(model, [batch], opts, groups, torch.device("cpu"), eod_token=eod)
            train.allreduce_grads(model, groups)
        finally:
            torch.set_default_dtype(torch.float32)
        linear = [layer.self_attention for layer in model.decoder.layers if hasattr(layer.self_attention, "options")]
        out.append({"loss": loss.item(), "grads": full_grads(model, groups),
                    "linear": sorted({(type(a).__name__, a.options.layout, a.cp_size) for a in linear})})
    return out


def separate_documents(variant: str) -> dict:
    """CP = 1: per-token losses of eod_batch(40) with its documents, of the same batch without
    them, and of every document run alone (its own sequence from position 0)."""
    from megatron_burst.megatron.packed import document_boundaries, document_seq_params

    fp64 = variant == "gated_delta_net"
    try:
        _, _, _, model = _build(1, variant, [], 40, fp64)
        batch = eod_batch(40)
        run = lambda tokens, pos, labels, params=None: model(  # noqa: E731
            tokens, pos, None, labels=labels, packed_seq_params=params).detach()
        packed = run(batch["tokens"], batch["position_ids"], batch["labels"],
                     document_seq_params(batch["tokens"], EOD))
        plain = run(batch["tokens"], batch["position_ids"], batch["labels"])
        alone = torch.empty_like(packed)
        for row, bounds in enumerate(document_boundaries(batch["tokens"], EOD)):
            for a, c in zip(bounds, bounds[1:]):
                alone[row, a:c] = run(batch["tokens"][row:row + 1, a:c], torch.arange(c - a)[None],
                                      batch["labels"][row:row + 1, a:c])[0]
    finally:
        torch.set_default_dtype(torch.float32)
    return {"packed": packed, "plain": plain, "alone": alone,
            "layers": [type(layer.self_attention).__name__ for layer in model.decoder.layers]}


VARIANTS = ["basic", "lightning", "retention", "gla", "gated_delta_net"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_documents_are_separate_sequences_at_cp1(variant):
    res = run_ranks(1, separate_documents, variant)[0]
    assert res["layers"][0] in ("LinearSelfAttention", "CPGatedDeltaNet") and res["layers"][1] == "SelfAttention"
    scale = res["alone"].abs().max().item()
    err = (res["packed"] - res["alone"]).abs().max().item()
    assert err <= 1e-5 * scale, f"{variant}: packed vs documents alone {err:.2e}"
    assert (res["plain"] - res["alone"]).abs().max().item() > 1e-3 * scale  # the documents matter


# (variant, extra flags, seq): every variant in zigzag, the other layouts and LASP-1 once each
CP2_CASES = [
    ("basic", ["--cp-layout", "zigzag"], 40),
    ("lightning", ["--cp-layout", "contiguous"], 40),
    ("retention", ["--cp-layout", "zigzag", "--linear-cp-algo", "lasp1"], 40),
    ("gla", ["--cp-layout", "zigzag"], 40),
    ("gated_delta_net", ["--cp-layout", "zigzag"], 40),
    ("gated_delta_net", ["--cp-layout", "contiguous"], 40),
    ("gla", ["--cp-layout", "striped", "--cp-stripe", "64"], 256),
    # the balanced plan: most documents whole on one rank, the one spanning every rank split
    ("gla", ["--cp-layout", "balanced"], 40),
    ("gated_delta_net", ["--cp-layout", "balanced"], 40),
]


def test_reset_attention_mask_hybrids_at_cp2_equal_cp1():
    from test_megatron_model import _assert_matches

    refs = run_ranks(1, trainer_steps, 1, [(v, [], seq) for v, _, seq in CP2_CASES])[0]
    failures = []
    for rank, results in enumerate(run_ranks(2, trainer_steps, 2, CP2_CASES)):
        for (variant, extra, seq), res, ref in zip(CP2_CASES, results, refs):
            layout = extra[extra.index("--cp-layout") + 1]
            assert [x[1:] for x in res["linear"]] == [(layout, 2)], res["linear"]
            try:
                _assert_matches(res, ref, f"{variant} CP=2 {' '.join(extra)} rank {rank}")
            except AssertionError as exc:
                failures.append(str(exc).splitlines()[0])
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- Megatron-LM glue

def megatron_lm_doc_step(cp: int, variant: str, layout: str, thd: bool = False) -> dict:
    """One step through the patched pretrain_gpt.py's pieces with --reset-attention-mask:
    wrap_gpt_builder around the stand-in builder, megatron_lm.slice_batch with the EOD token (``thd``:
    megatron_lm.slice_thd_batch of a packed batch, as the patch slices SFT data; its
    packed_seq_params handed to the model as the patch does), the per-token loss, CP all-reduce."""
    import megatron_lm_standin
    from megatron.core import parallel_state

    from megatron_burst import train
    from megatron_burst.megatron import megatron_lm
    from test_megatron_lm_glue import MEGATRON_LM_DEFAULTS, _megatron_lm_args
    from test_megatron_model import full_grads

    parallel_state.destroy_model_parallel()
    flags = MEGATRON_LM_DEFAULTS + HYBRID + ["--linear-attention-type", variant, "--seq-length",
                                             str(THD_SEQ if thd else 40), "--cp-layout", layout]
    args, _, groups = _megatron_lm_args(cp, "dense", flags)
    megatron_lm.check_args(args)  # the startup checks accept the combination
    cpu = torch.device("cpu")
    train.seed_everything(args.seed, cpu)
    model = megatron_lm.wrap_gpt_builder(megatron_lm_standin.gpt_builder)(args, True, True)
    if thd:
        batch = thd_hybrid_batch()
        local, params = megatron_lm.slice_thd_batch(
            {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}, batch["cu_seqlens"],
            batch["cu_seqlens_padded"], batch["max_seqlen"], args)
    else:
        local = megatron_lm.slice_batch(eod_batch(40), args, eod_token=EOD)
        params = local.pop("packed_seq_params")
    losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"], packed_seq_params=params)
    mask = local["loss_mask"]
    sums = torch.stack([(losses.double() * mask.double()).sum(), mask.double().sum()]).detach()
    dist.all_reduce(sums, group=groups.dp_cp)
    ((losses.double() * mask.double()).sum() / sums[1]).backward()
    train.allreduce_grads(model, groups)
    return {"loss": (sums[0] / sums[1]).item(), "grads": full_grads(model, groups),
            "layers": [type(layer.self_attention).__name__ for layer in model.decoder.layers]}


@pytest.mark.parametrize("variant,layout,thd", [("gla", "zigzag", False), ("gated_delta_net", "zigzag", False),
                                                ("gated_delta_net", "zigzag", True), ("gla", "balanced", True)])
def test_reset_attention_mask_through_the_megatron_lm_patch(variant, layout, thd):
    """EOD documents, and packed THD batches (slice_thd_batch: TransformerEngine's partitioning, or the
    balanced plan under --cp-layout balanced), through the patch's pieces at CP = 2 equal CP = 1."""
    from test_megatron_model import _assert_matches

    ref = run_ranks(1, megatron_lm_doc_step, 1, variant, layout, thd)[0]
    assert ref["layers"][1] == "SelfAttention" and ref["layers"][0] != "SelfAttention"
    for rank, res in enumerate(run_ranks(2, megatron_lm_doc_step, 2, variant, layout, thd)):
        _assert_matches(res, ref, f"Megatron-LM {variant} CP=2 {layout}{' THD' if thd else ''} rank {rank}")


@pytest.mark.parametrize("variant", ["gla", "gated_delta_net"])
def test_megatron_lm_flags_accept_reset_attention_mask(variant):
    from megatron_burst.megatron import megatron_lm
    from test_megatron_lm_glue import _megatron_lm_flags

    megatron_lm.check_args(_megatron_lm_flags(reset_attention_mask=True, linear_attention_type=variant))


# packed THD batches: the linear layers run in TransformerEngine's partitioning, as the softmax layers
THD_CASES = [("basic", [], "thd"), ("gla", [], "thd"), ("gated_delta_net", [], "thd"),
             ("retention", ["--cp-layout", "balanced"], "thd")]  # a THD batch placed by the balanced plan


@pytest.mark.parametrize("cp", [2, 3])
def test_packed_thd_hybrids_equal_cp1(cp):
    from test_megatron_model import _assert_matches

    refs = run_ranks(1, trainer_steps, 1, THD_CASES)[0]
    failures = []
    for rank, results in enumerate(run_ranks(cp, trainer_steps, cp, THD_CASES)):
        for (variant, extra, _), res, ref in zip(THD_CASES, results, refs):
            try:
                _assert_matches(res, ref, f"{variant} THD CP={cp} {' '.join(extra)} rank {rank}")
            except AssertionError as exc:
                failures.append(str(exc).splitlines()[0])
    assert not failures, "\n".join(failures)
