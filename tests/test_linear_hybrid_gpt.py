"""Hybrid (LASP-2H) GPTs: at CP = 2 and 4 (every variant, layouts, TP x CP, LASP-1) the loss and
every parameter's gradient equal CP = 1's; megatron_burst.train builds and trains them from
--linear-attention-*, its CLI runs them, and the Megatron-LM glue builds the same model from the
same flags (MoE layers kept), with the layout bound like the softmax layers'."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HYBRID = ["--num-layers", "4", "--linear-attention-freq", "2"]


def train_steps(variant: str, steps: int = 3) -> dict:
    """Optimizer steps on one fixed batch through megatron_burst.train's functions."""
    from megatron_burst import train
    from megatron_burst.train.loop import attention_summary
    from test_megatron_model import VOCAB, fixed_batch, small_args

    args = small_args(HYBRID + ["--linear-attention-type", variant, "--train-iters", str(steps), "--lr", "1e-2"])
    opts, sizes = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)
    cpu = torch.device("cpu")
    train.seed_everything(args.seed, cpu)
    model = train.build_model(args, opts, sizes, groups, cpu)
    optimizer, _ = train.build_optimizer(args, model)
    losses, untouched = [], None
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        losses.append(train.loss_and_grads(model, [fixed_batch(24)], opts, groups, cpu).item())
        train.allreduce_grads(model, groups)
        train.clip_grads(model, args.clip_grad, groups)
        if untouched is None:
            untouched = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        optimizer.step()
    return {"losses": losses, "untouched": untouched, "summary": attention_summary(model, args, sizes),
            "layers": [type(layer.self_attention).__name__ for layer in model.decoder.layers]}


@pytest.mark.parametrize("variant", ["lightning", "gla"])
def test_hybrid_gpt_trains(variant):
    res = run_ranks(1, train_steps, variant)[0]
    assert res["layers"] == ["LinearSelfAttention", "SelfAttention"] * 2
    assert res["untouched"] == [], f"parameters without gradient: {res['untouched']}"
    assert all(math.isfinite(x) for x in res["losses"])
    assert res["losses"][-1] < res["losses"][0] - 0.05, res["losses"]
    assert res["summary"] == f"cp-algo burst; linear attention {variant} (lasp2) in layers 1,3 of 4"


# ----------------------------------------------------------------------------- CP > 1 equals CP = 1

def hybrid_loss_and_grads(tp: int, cp: int, variant: str, extra: list, seq: int) -> dict:
    """One forward/backward of the hybrid GPT (linear layers 1 and 3 of 4) at TP x CP: the global
    loss, every parameter's full gradient, and what each layer ran."""
    from test_megatron_model import build_and_step, full_grads

    loss, model, groups = build_and_step(tp, cp, HYBRID + ["--linear-attention-type", variant] + list(extra), seq)
    linear = [layer.self_attention for layer in model.decoder.layers
              if type(layer.self_attention).__name__ == "LinearSelfAttention"]
    return {"loss": loss, "grads": full_grads(model, groups),
            "linear": sorted({(a.options.layout, a.options.algo, a.cp_size) for a in linear})}


HYBRID_CP_CASES = [  # (variant, tp, cp, extra flags, seq)
    ("basic", 1, 2, ["--cp-layout", "zigzag"], 40),
    ("lightning", 1, 2, ["--cp-layout", "contiguous"], 40),
    ("retention", 1, 2, ["--cp-layout", "zigzag"], 40),
    ("gla", 1, 2, ["--cp-layout", "zigzag"], 40),
    ("lightning", 1, 4, ["--cp-layout", "zigzag"], 40),
    ("gla", 1, 4, ["--cp-layout", "zigzag", "--cp-algo", "ring"], 40),
    ("retention", 1, 4, ["--cp-layout", "zigzag", "--linear-cp-algo", "lasp1"], 40),
    ("gla", 1, 2, ["--cp-layout", "striped", "--cp-stripe", "64"], 256),
    ("lightning", 2, 2, ["--cp-layout", "zigzag"], 40),
]


@pytest.fixture(scope="module")
def hybrid_reference():
    cache = {}

    def get(variant: str, seq: int) -> dict:
        if (variant, seq) not in cache:
            cache[variant, seq] = run_ranks(1, hybrid_loss_and_grads, 1, 1, variant, [], seq)[0]
        return cache[variant, seq]
    return get


@pytest.mark.parametrize("variant,tp,cp,extra,seq", HYBRID_CP_CASES,
                         ids=[f"{c[0]}-tp{c[1]}-cp{c[2]}-{'-'.join(x.lstrip('-') for x in c[3])}" for c in HYBRID_CP_CASES])
def test_hybrid_gpt_under_cp_equals_cp1(hybrid_reference, variant, tp, cp, extra, seq):
    from test_megatron_model import _assert_matches

    ref = hybrid_reference(variant, seq)
    layout = extra[extra.index("--cp-layout") + 1]
    algo = extra[extra.index("--linear-cp-algo") + 1] if "--linear-cp-algo" in extra else "lasp2"
    for rank, res in enumerate(run_ranks(tp * cp, hybrid_loss_and_grads, tp, cp, variant, extra, seq)):
        assert res["linear"] == [(layout, algo, cp)], res["linear"]
        _assert_matches(res, ref, f"{variant} TP={tp} CP={cp} {' '.join(extra)} rank {rank}")


def test_cli_trains_a_hybrid_model_single_process(tmp_path):
    metrics = tmp_path / "metrics.json"
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--lr", "3e-3", "--train-iters", "2", "--linear-attention-type", "lightning",
            "--linear-attention-freq", "4", "--data-cache-path", str(tmp_path / "data"),
            "--corpus-max-bytes", str(64 * 1024), "--metrics-file", str(metrics)]
    proc = subprocess.run([sys.executable, "-m", "megatron_burst.train", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cp-algo burst; linear attention lightning (lasp2) in layers 1,2,3 of 4" in proc.stdout, proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.lstrip().startswith("iteration")]
    assert len(lines) == 2, proc.stdout
    data = json.loads(metrics.read_text())
    assert data["algo"] == "burst" and all(math.isfinite(m["lm_loss"]) for m in data["metrics"])
    # the run says which kernels its linear layers used (on CPU: our torch path)
    assert any("lasp2" in line.lower() or "linear" in line.lower() for line in data["kernels"]), data["kernels"]


def test_cli_refuses_linear_flags_before_starting(tmp_path):
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--lr", "3e-3", "--train-iters", "2", "--linear-attention-freq", "[1,0]"]
    proc = subprocess.run([sys.executable, "-m", "megatron_burst.train", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2
    assert "--linear-attention-freq [1, 0] has no linear layers to place" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- Megatron-LM glue

def build_via_megatron_lm(flag_set: str, variant: str) -> dict:
    """The patched gpt_builder (stand-in of Megatron-LM's) with --linear-attention-*, and, for the
    dense flag set, the trainer's model from the same flags and seed: one step's loss of each."""
    import megatron_lm_standin
    from megatron_burst import train
    from megatron_burst.megatron import megatron_lm
    from test_megatron_lm_glue import CUDA_ONLY_STEP, _megatron_lm_args
    from test_megatron_model import fixed_batch

    args, opts, groups = _megatron_lm_args(1, flag_set, HYBRID + ["--linear-attention-type", variant])
    cpu = torch.device("cpu")
    train.seed_everything(args.seed, cpu)
    model = megatron_lm.wrap_gpt_builder(megatron_lm_standin.gpt_builder)(args, True, True)
    out = {"cls": type(model).__name__,
           "layers": [type(layer.self_attention).__name__ for layer in model.decoder.layers],
           "mlps": [type(layer.mlp).__name__ for layer in model.decoder.layers],
           "params": [(n, tuple(p.shape)) for n, p in model.named_parameters()]}
    if flag_set not in CUDA_ONLY_STEP:
        out["loss"] = train.loss_and_grads(model, [fixed_batch(24)], opts, groups, cpu).item()
        sizes = train.validate_args(args, 1)[1]
        train.seed_everything(args.seed, cpu)
        ours = train.build_model(args, opts, sizes, groups, cpu)
        out["trainer_params"] = [(n, tuple(p.shape)) for n, p in ours.named_parameters()]
        out["trainer_loss"] = train.loss_and_grads(ours, [fixed_batch(24)], opts, groups, cpu).item()
    return out


def test_megatron_lm_builds_the_trainers_hybrid_model():
    res = run_ranks(1, build_via_megatron_lm, "dense", "retention")[0]
    assert res["cls"] == "BurstGPTModel"
    assert res["layers"] == ["LinearSelfAttention", "SelfAttention"] * 2
    assert res["params"] == res["trainer_params"]
    assert res["loss"] == pytest.approx(res["trainer_loss"], rel=1e-6)


def test_megatron_lm_hybrid_keeps_moe_layers():
    res = run_ranks(1, build_via_megatron_lm, "moe", "gla")[0]
    assert res["layers"] == ["LinearSelfAttention", "SelfAttention"] * 2
    assert res["mlps"] == ["MoELayer"] * 4
    assert any(".linear_low_rank.up.bias" in name for name, _ in res["params"])


def hybrid_layout_binding(spec_layout, model_layout: str) -> list:
    """megatron-core at CP = 2: an all-linear block whose spec leaves the layout unset follows
    BurstGPTModel's; one that fixes another is refused."""
    from megatron_burst import train
    from megatron_burst.megatron.model import BurstGPTModel
    from megatron_burst.specs import get_gpt_decoder_block_spec
    from test_megatron_model import VOCAB, small_args

    args = small_args(["--context-parallel-size", "2", "--num-layers", "2"])
    opts, sizes = train.validate_args(args, dist.get_world_size())
    groups = train.init_parallel(sizes)
    config = train.model_config(args, sizes, torch.device("cpu"))
    spec = get_gpt_decoder_block_spec(config, linear_attention="gla", cp_layout=spec_layout, use_te=False)
    try:
        model = BurstGPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=24,
                              pg_collection=groups.pg_collection, position_embedding_type="rope",
                              cp_layout=model_layout)
    except ValueError as exc:
        return [str(exc)]
    return [(layer.self_attention.options.layout, layer.self_attention.cp_size) for layer in model.decoder.layers]


def test_linear_layers_follow_the_models_layout_or_are_refused():
    assert run_ranks(2, hybrid_layout_binding, None, "contiguous")[0] == [("contiguous", 2)] * 2
    for res in run_ranks(2, hybrid_layout_binding, "zigzag", "contiguous"):
        assert "linear attention slices the sequence as cp_layout='zigzag'" in res[0], res
