"""Check megatron-burst inside a real Megatron-LM checkout, on CPU.

    cd Megatron-LM && git checkout core_v0.16.1 && git apply /path/to/megatron-burst/patches/pretrain_gpt.patch
    pip install six regex pyyaml pydantic          # Megatron-LM's training-side imports
    PYTHONPATH=/path/to/Megatron-LM python /path/to/megatron-burst/examples/check_megatron_lm.py [--quick]

Every check launches fresh gloo ranks that import Megatron-LM (about 10 s each on 2 cores): the full
list took 459 s on a quiet 2-core machine before the issue-M2 checks were added (which add 8
launches), and over 600 s under load. ``--quick`` runs one check of each kind and the issue-M2 ones
(13 launches; under 5 minutes on the 2-core machine with other jobs beside it).

It drives the patched ``pretrain_gpt.py``'s own pieces: Megatron-LM's ``parse_args`` and
``validate_args`` with our ``extra_args_provider``, its ``model_provider`` and ``gpt_builder``
(unpatched, and through the patch's ``wrap_model_provider``), our ``slice_batch`` and its
``loss_func``. Five kinds of checks, each printing one line:

* **same model**: for each flag set (dense, --qk-layernorm, MoE, MTP, --swiglu, --bf16, a user
  --spec with --cp-layout striped) the patched model at CP = 2 has exactly the unpatched CP = 1
  model's parameter names and shapes; with --cp-algo none it is the unpatched model itself
  (GPTModel with Megatron's DotProductAttention).
* **same training**: one forward and backward of the patched model at CP = 2 (and CP = 1 with the
  fused loss) against the patched model at CP = 1 without megatron-burst flags (loss and every
  gradient), where megatron.core can step on CPU. The reference is not the unpatched model
  because Megatron's own DotProductAttention and RotaryEmbedding need CUDA (its MoE router and MTP
  loss logging too); it has the unpatched parameters (checked above), and our attention at
  CP = 1 is plain softmax attention (tests/test_megatron_model.py).
* **hybrid model**: with --linear-attention-type (and Megatron-LM's own --linear-attention-freq)
  the patched builder makes the LASP-2H model, linear layers where the pattern says, and it trains
  a step at CP = 1; at CP = 2 (LASP-2 and LASP-1) it trains like CP = 1 ("same training").
* **trains**: the patched model takes a step at CP = 1 with an odd ``--seq-length`` (any length on
  one rank).
* **refused at startup**: flag sets megatron-burst cannot honour raise a ValueError naming the flag
  before anything is built (a refusal by Megatron-LM's own ``validate_args`` first is reported as such,
  and fails the check).

Megatron-LM's training loop itself needs CUDA; everything here runs on gloo. Exits 1 if a case fails.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron_burst.bench.launch import run_local

SEQ, VOCAB, BATCH = 32, 128, 2
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
USER_SPEC = ["--spec", "megatron_burst.specs", "gpt_layer_spec"]
# a heterogeneous model (Llama-Nemotron style): layer 1 full attention (GQA 2:1), layer 2 attention-free
HETEROGENEOUS_JSON = json.dumps({
    "hidden_act": "silu", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "tie_word_embeddings": True, "rope_theta": 10000, "rope_scaling": {"factor": 8.0},
    "block_configs": [
        {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
         "ffn": {"ffn_mult": 2.0, "no_op": False, "replace_with_linear": False}},
        {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
         "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}}]})
# the flags Megatron-LM requires to agree with such a config (Llama-3 style: SwiGLU, RMSNorm, GQA, RoPE scaling)
HETEROGENEOUS = ["--heterogeneous-layers-config-path", os.path.join(tempfile.gettempdir(), "burst_hetero.json"),
                 "--heterogeneous-layers-config-encoded-json", HETEROGENEOUS_JSON, "--swiglu", "--normalization",
                 "RMSNorm", "--group-query-attention", "--num-query-groups", "2", "--use-rope-scaling",
                 "--rope-scaling-factor", "8.0", "--rotary-base", "10000", "--use-rotary-position-embeddings"]
SAME_MODEL = [  # flag sets whose patched parameters must equal the unpatched model's
    [], ["--qk-layernorm"], MOE, ["--mtp-num-layers", "1"], ["--swiglu"], ["--bf16"], HETEROGENEOUS,
    USER_SPEC + ["--cp-layout", "striped"],
]
# LASP-2H: layers 1-3 Lightning-style linear attention, layer 4 softmax (the demo's hybrid)
LIGHTNING_3_1 = ["--num-layers", "4", "--linear-attention-type", "lightning", "--linear-attention-freq", "4"]
# Gated DeltaNet hybrid (Qwen3-Next style): layers 1 and 3 GDN, sized by Megatron-LM's own --linear-* flags
GDN_SIZES = ["--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "16", "--linear-value-head-dim", "16",
             "--linear-num-key-heads", "2", "--linear-num-value-heads", "4"]
GDN_1_1 = ["--num-layers", "4", "--linear-attention-type", "gated_delta_net",
           "--linear-attention-freq", "2"] + GDN_SIZES
SAME_TRAINING = [  # (CP size, flags): patched vs unpatched CP = 1 with the model-defining flags
    (1, ["--fused-lm-loss"]),
    (2, ["--cp-layout", "striped", "--cp-algo", "burst", "--fused-lm-loss"]),
    (2, ["--cp-layout", "zigzag", "--cp-comm-type", "p2p"]),
    (2, ["--cp-layout", "striped", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--seq-selective-ckpt-ratio", "0.5"]),
    (2, ["--qk-layernorm", "--cp-layout", "striped"]),
    (2, ["--swiglu", "--cp-algo", "ring"]),
    (2, USER_SPEC + ["--cp-layout", "striped"]),
    (2, ["--bf16", "--cp-layout", "striped", "--fused-lm-loss"]),
    (2, HETEROGENEOUS + ["--cp-layout", "striped"]),
    (2, LIGHTNING_3_1 + ["--cp-layout", "zigzag"]),
    (2, LIGHTNING_3_1 + ["--cp-layout", "zigzag", "--linear-cp-algo", "lasp1"]),
    (2, LIGHTNING_3_1 + ["--reset-attention-mask", "--cp-layout", "zigzag"]),  # documents in linear layers
    (2, ["--window-size", "8,0", "--window-attn-skip-freq", "2", "--cp-layout", "zigzag", "--cp-algo", "ring"]),
    (2, ["--sparse-attention", "vertical_slash", "--sparse-budget", "0.2", "0.2", "--sparse-last-q", "16",
         "--cp-layout", "striped", "--cp-stripe", "8", "--cp-algo", "burst"]),
    # the pattern composed with a sliding window, and with --reset-attention-mask documents
    (2, ["--sparse-attention", "vertical_slash", "--sparse-budget", "0.2", "0.2", "--sparse-last-q", "16",
         "--window-size", "8,0", "--cp-layout", "zigzag", "--cp-algo", "burst"]),
    (2, ["--sparse-attention", "vertical_slash", "--sparse-budget", "0.2", "0.2", "--sparse-last-q", "16",
         "--reset-attention-mask", "--cp-layout", "striped", "--cp-stripe", "8", "--cp-algo", "ring"]),
    # Megatron's TransformerLayer passes --cp-comm-type (default p2p) to the GDN layers under CP
    (2, GDN_1_1 + ["--cp-layout", "zigzag"]),
    # the balanced layout: EOD documents (one longer than a rank's share, so the plan splits it)
    # placed per batch; the CP = 1 reference has the same documents
    (4, ["--reset-attention-mask", "--cp-layout", "balanced", "--cp-algo", "burst"]),
    (2, ["--reset-attention-mask", "--cp-layout", "balanced", "--cp-algo", "ring"]),
    # linear layers in the balanced placement: a rank's runs are their segments (LASP-2)
    (2, LIGHTNING_3_1 + ["--reset-attention-mask", "--cp-layout", "balanced"]),
]
TRAINS = [  # (CP size, flags): the patched model takes a step (finite loss); any length at CP = 1
    (1, ["--seq-length", "31"]),
    (1, ["--seq-length", "31", "--cp-layout", "striped", "--cp-stripe", "4"]),
]
HYBRID = [  # (flags, the decoder layers' attention): CP = 1
    (["--num-layers", "4", "--linear-attention-type", "gla", "--linear-attention-freq", "([1]+[0])*2"],
     ["LinearSelfAttention", "SelfAttention"] * 2),
    (["--linear-attention-type", "retention", "--bf16"], ["LinearSelfAttention"] * 2),
]
REFUSED = [  # (CP size, flags, the flag the error must name)
    (2, ["--multi-latent-attention"], "--multi-latent-attention"),
    (2, ["--cp-algo", "none", "--cp-layout", "striped"], "--cp-algo none"),
    (2, ["--seq-selective-ckpt-ratio", "0.5", "--recompute-granularity", "selective", "--recompute-modules",
         "mlp"], "--recompute-modules"),
    (1, ["--cp-ring", "double"], "--cp-ring double"),
    (1, ["--linear-attention-type", "gla", "--experimental-attention-variant", "gated_delta_net",
         "--linear-attention-freq", "2"], "--experimental-attention-variant"),
    (2, ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"] + GDN_SIZES,
     "--linear-attention-type gated_delta_net"),
    (2, GDN_1_1 + ["--cp-comm-type", "a2a"], "--cp-comm-type a2a"),
    (2, ["--sparse-attention", "vertical_slash", "--sparse-last-q", "16", "--cp-algo", "allgather"],
     "--cp-algo allgather (use ring or burst)"),
    (2, LIGHTNING_3_1 + ["--cp-layout", "balanced", "--linear-cp-algo", "lasp1"], "--linear-cp-algo lasp1"),
]
# --quick: one check of each kind and the issue-M2 cases (the full list takes 8-10 minutes on 2 cores)
QUICK = {"same_model": [[]], "same_training": [(2, ["--cp-layout", "zigzag", "--cp-comm-type", "p2p"]),
                                               (2, GDN_1_1 + ["--cp-layout", "zigzag"]),
                                               SAME_TRAINING[-3], SAME_TRAINING[-1]],
         "trains": TRAINS[:1], "hybrid": [], "refused": [REFUSED[0], REFUSED[-4], REFUSED[-2], REFUSED[-1]]}
# flags that change the computation's precision: compared with a looser tolerance
LOSS_RTOL, GRAD_RTOL, BF16_LOSS_RTOL, BF16_GRAD_RTOL = 1e-5, 1e-4, 2e-2, 1e-1
# GDN's dt_bias / A_log gradients are sums whose terms cancel to ~1e-3 of their size: fp32 rounding
# alone moves them by ~1.4e-4 relative (tests/test_gated_delta_net.py compares in fp64 for that)
GDN_GRAD_RTOL = 1e-3
MODEL_FLAGS = ("--qk-layernorm", "--swiglu", "--bf16", "--spec", *MOE, *USER_SPEC[1:], *HETEROGENEOUS,
               "--num-layers", "--linear-attention-type", "--linear-attention-freq", *GDN_SIZES[::2],
               # masks: the CP = 1 reference attends under the same window / sparse pattern
               "--window-size", "--window-attn-skip-freq", "--sparse-attention", "--sparse-budget", "--sparse-last-q",
               "--reset-attention-mask")  # documents: the reference attends within the same ones
EOD = VOCAB - 1  # NullTokenizer-style end of document; drawn tokens stay below it when documents are on
EOD_COLUMNS = ((5, 9), (20,))  # per sample: documents [0, 6), [6, 10), [10, 32) and [0, 21), [21, 32)


def _megatron_argv(cp: int, world: int, extra: list[str]) -> list[str]:
    return ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(BATCH),
            "--global-batch-size", str(BATCH * world // cp), "--vocab-size", str(VOCAB),
            "--tokenizer-type", "NullTokenizer", "--position-embedding-type", "rope",
            "--use-cpu-initialization", "--transformer-impl", "local", "--init-method-std", "0.3",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "1e-4", "--train-iters", "1",
            "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
            "--no-persist-layer-norm", "--context-parallel-size", str(cp)] + extra


def _rank(extra: list[str], patched: bool, step: bool) -> dict:
    """One rank (run_local has initialized gloo): build the model (patched or not), optionally
    take one step. Returns the class, parameters, loss, full gradients, cache hits -- or the error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import arguments
    from megatron.training.global_vars import set_args

    from megatron_burst.megatron import megatron_lm as burst_lm
    from megatron_burst.megatron.cpu_compat import allow_checkpointing_without_cuda

    allow_checkpointing_without_cuda()  # Megatron's activation checkpoint saves the CUDA RNG state
    arguments.get_device_arch_version = lambda: 10  # validate_args asks CUDA for the GPU generation
    sys.argv = _megatron_argv(world, world, extra)
    provider_args = partial(burst_lm.extra_args_provider, chained=None)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
            args = arguments.parse_args(extra_args_provider=provider_args if patched else None)
            arguments.validate_args(args, {})
    except (AssertionError, ValueError) as exc:  # Megatron-LM's own checks, before ours
        return {"error": f"Megatron-LM's validate_args: {type(exc).__name__}: {exc}"}
    args.padded_vocab_size = VOCAB
    set_args(args)
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    torch.manual_seed(1234)  # same initial weights at every CP size (CPU initialization)
    provider = burst_lm.wrap_model_provider(pretrain_gpt.model_provider) if patched else pretrain_gpt.model_provider
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            model = provider(pretrain_gpt.gpt_builder, True, True)
    except ValueError as exc:
        return {"error": str(exc)}
    layers = [layer.self_attention for layer in model.decoder.layers]
    out = {"cls": type(model).__name__, "params": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
           "core": type(getattr(layers[0], "core_attention", None)).__name__,
           "layers": [type(attention).__name__ for attention in layers]}
    if not step:
        return out
    g = torch.Generator().manual_seed(0)
    seq = args.seq_length
    documents = bool(getattr(args, "reset_attention_mask", False))
    tokens = torch.randint(0, EOD if documents else VOCAB, (BATCH, seq + 1), generator=g)
    if documents:
        for row, columns in enumerate(EOD_COLUMNS):
            tokens[row, list(columns)] = EOD
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": (torch.rand(BATCH, seq, generator=g) > 0.2).float(),
             "position_ids": torch.arange(seq).expand(BATCH, seq).contiguous(), "attention_mask": None}
    # eod_token given: Megatron-LM's get_tokenizer() is not set up here (pretrain() would do it)
    local = burst_lm.slice_batch(batch, args, eod_token=EOD if documents else None) if patched else batch
    model.train()
    logits_or_loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                           loss_mask=local["loss_mask"], packed_seq_params=local.get("packed_seq_params"))
    loss_sum, num_tokens, _ = pretrain_gpt.loss_func(local["loss_mask"], logits_or_loss, model=model)
    totals = torch.stack([loss_sum.detach().float(), num_tokens.float()])
    dist.all_reduce(totals)
    (loss_sum / totals[1]).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().float().clone()
        dist.all_reduce(grad)  # CP ranks hold partial gradients of the same weights
        grads[name] = grad.numpy()
    from megatron_burst.activation_store import stores_of

    out.update(loss=(totals[0] / totals[1]).item(), grads=grads, hits=sum(c.hits for _, c in stores_of(model)))
    return out


def run(cp: int, extra: list[str], patched: bool = True, step: bool = True) -> dict:
    """Rank 0's result of one build (and step) on ``cp`` gloo ranks."""
    return run_local(cp, _rank, extra, patched, step)[0]


def _model_flags(extra: list[str]) -> list[str]:
    """The flags of ``extra`` that define the model (what the unpatched reference also gets)."""
    keep, out = False, []
    for flag in extra:
        if flag.startswith("--"):
            keep = flag in MODEL_FLAGS and flag != "--spec"
        if keep:
            out.append(flag)
    return out


def _show(flags: list[str]) -> str:
    """The flags as typed, the heterogeneous layer config abbreviated."""
    if HETEROGENEOUS_JSON in flags:  # the config and the flags it requires, abbreviated
        flags = ["--heterogeneous-layers-config <layer 1 GQA attention, layer 2 attention-free>"] + \
            [f for f in flags if f not in HETEROGENEOUS]
    return " ".join(flags)


def main(argv: Optional[list] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Check megatron-burst inside a patched Megatron-LM checkout (CPU)")
    parser.add_argument("--quick", action="store_true",
                        help="one check of each kind plus the issue-M2 and balanced-layout cases (13 launches, not ~60)")
    quick = parser.parse_args(argv).quick
    try:
        import pretrain_gpt  # noqa: F401
    except ImportError as exc:
        print(f"cannot import Megatron-LM's pretrain_gpt ({exc}): put a patched Megatron-LM checkout on "
              "PYTHONPATH and install its imports (see this file's docstring)")
        return 2
    with open(HETEROGENEOUS[1], "w") as f:  # Megatron-LM picks the heterogeneous spec by this path
        f.write(HETEROGENEOUS_JSON)
    failed = False

    def report(ok: bool, line: str) -> None:
        nonlocal failed
        failed |= not ok
        print(f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)

    same_model, same_training, trains, hybrid, refused = (
        (QUICK["same_model"], QUICK["same_training"], QUICK["trains"], QUICK["hybrid"], QUICK["refused"]) if quick
        else (SAME_MODEL, SAME_TRAINING, TRAINS, HYBRID, REFUSED))
    for extra in same_model:
        ref = run(1, [f for f in extra if f not in ("--cp-layout", "striped")], patched=False, step=False)
        got = run(2, extra, step=False)
        ok = "error" not in got and got["params"] == ref["params"] and got["core"] == "CPCoreAttention"
        report(ok, f"same model: CP=2 {_show(extra) or '(dense)'}: {len(ref['params'])} parameters "
                   f"{'equal' if ok else 'DIFFER from'} the unpatched model's ({got.get('error', got.get('core'))})")
    if not quick:
        ref = run(1, [], patched=False, step=False)
        got = run(1, ["--cp-algo", "none"], step=False)
        ok = (got.get("cls"), got.get("core"), got.get("params")) == ("GPTModel", "DotProductAttention", ref["params"])
        report(ok, f"same model: CP=1 --cp-algo none: {got.get('cls')} with {got.get('core')}, Megatron's own model")
    refs: dict = {}
    for cp, extra in same_training:
        key = tuple(_model_flags(extra))
        if key not in refs:
            refs[key] = run(1, list(key))
        ref = refs[key]
        got = run(cp, extra)
        if "error" in got:
            report(False, f"same training: CP={cp} {_show(extra)}: {got['error']}")
            continue
        grad_err = max(float(abs(got["grads"][k] - ref["grads"][k]).max() / max(abs(ref["grads"][k]).max(), 1e-12))
                       for k in ref["grads"])
        bf16 = "--bf16" in extra
        loss_tol, grad_tol = (BF16_LOSS_RTOL, BF16_GRAD_RTOL) if bf16 else (LOSS_RTOL, GRAD_RTOL)
        if "gated_delta_net" in extra:
            grad_tol = GDN_GRAD_RTOL
        ok = abs(got["loss"] - ref["loss"]) <= loss_tol * abs(ref["loss"]) and grad_err <= grad_tol
        ok = ok and (got["hits"] > 0) == ("--seq-selective-ckpt-ratio" in extra)  # the store served the recompute
        ok = ok and got["cls"] == "BurstGPTModel"
        report(ok, f"same training: CP={cp} {_show(extra)}: loss {got['loss']:.6f} (CP=1 reference "
                   f"{ref['loss']:.6f}), max relative gradient difference {grad_err:.2e}"
                   + (f", {got['hits']} selective-checkpoint hits" if got["hits"] else ""))
    for cp, extra in trains:
        got = run(cp, extra)
        ok = "error" not in got and got["cls"] == "BurstGPTModel" and torch.isfinite(torch.tensor(got["loss"])).item()
        report(ok, f"trains: CP={cp} {' '.join(extra)}: " + (got.get("error") or f"loss {got['loss']:.6f}"))
    for extra, layers in hybrid:
        got = run(1, extra)
        ok = "error" not in got and got["layers"] == layers and got["cls"] == "BurstGPTModel"
        ok = ok and torch.isfinite(torch.tensor(got["loss"])).item()
        report(ok, f"hybrid model: CP=1 {' '.join(extra)}: {got.get('error') or ', '.join(got['layers'])}, "
                   f"loss {got.get('loss', float('nan')):.6f}")
    for cp, extra, flag in refused:
        got = run(cp, extra, step=False)
        ok = "error" in got and flag in got["error"]
        report(ok, f"refused at startup: CP={cp} {' '.join(extra)}: " + (got.get("error") or "BUILT (not refused)"))
    for name, why in _e2e_flags():
        report(why is None, f"e2e flags: {name} (examples/e2e_gpt_1b.py, 1.17B at 16K): "
                            + (why or "accepted by Megatron-LM's parse_args and validate_args"))
    return 1 if failed else 0


def _e2e_flags() -> list:
    """(variant, None or the error) for each Megatron-LM variant of examples/e2e_gpt_1b.py: its flags
    pass Megatron-LM's parse_args and validate_args with our extra_args_provider, and the
    TransformerConfig Megatron-LM derives from them builds (after ``--te-free-fusions`` installs its
    kernels, as the patched model provider does; megatron.core refuses ``--rope-fusion`` without
    them), so the GPU run does not fail at startup on a flag. Nothing is built but the config."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import e2e_gpt_1b as e2e
    from megatron.training import arguments

    from megatron_burst.megatron import megatron_lm as burst_lm
    from megatron_burst.megatron import te_free

    arguments.get_device_arch_version = lambda: 9  # validate_args asks CUDA for the GPU generation (Hopper)
    out, saved = [], sys.argv
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        for name, extra in e2e.MLM_VARIANTS.items():
            sys.argv = ["pretrain_gpt.py"] + e2e.mlm_flags(e2e.FULL, tempfile.gettempdir()) + extra
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    args = arguments.parse_args(extra_args_provider=partial(burst_lm.extra_args_provider, chained=None))
                    arguments.validate_args(args, {})
                    if burst_lm.burst_options(args).te_free_fusions:
                        te_free.install()
                    arguments.core_transformer_config_from_args(args)
                out.append((name, None))
            except (AssertionError, ValueError, SystemExit) as exc:
                out.append((name, f"{type(exc).__name__}: {exc}"))
            finally:
                te_free.uninstall()
    finally:
        sys.argv = saved
    return out


if __name__ == "__main__":
    sys.exit(main())
