"""Check megatron-burst inside a real Megatron-LM checkout, on CPU, in about a minute.

    cd Megatron-LM && git checkout core_v0.16.1 && git apply /path/to/megatron-burst/patches/pretrain_gpt.patch
    pip install six regex pyyaml pydantic          # Megatron-LM's training-side imports
    PYTHONPATH=/path/to/Megatron-LM python /path/to/megatron-burst/examples/check_megatron_lm.py

It drives the patched ``pretrain_gpt.py``'s own pieces: Megatron-LM's ``parse_args`` and
``validate_args`` with our ``extra_args_provider``, its ``model_provider`` and ``gpt_builder``
through our ``wrap_gpt_builder``, our ``slice_batch`` and its ``loss_func``. It takes one forward and
backward of a small GPT for several flag sets and compares the loss and every gradient with an
unpatched-style run (CP = 1, no megatron-burst flags). Megatron-LM's training loop itself needs
CUDA; everything checked here runs on gloo. Exits 1 if a case differs.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from functools import partial

import torch
import torch.distributed as dist

from megatron_burst.bench.launch import run_local

SEQ, VOCAB, BATCH = 32, 128, 2
CASES = [  # (CP size, extra flags)
    (1, ["--fused-lm-loss"]),
    (2, ["--cp-layout", "striped", "--cp-algo", "burst", "--fused-lm-loss"]),
    (2, ["--cp-layout", "zigzag", "--cp-comm-type", "p2p"]),
    (2, ["--cp-layout", "striped", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--seq-selective-ckpt-ratio", "0.5"]),
]
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


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


def _rank(extra: list[str]) -> tuple:
    """One rank's step (run_local has initialized gloo): (model class, loss, full grads, cache hits)."""
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
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        args = arguments.parse_args(extra_args_provider=partial(burst_lm.extra_args_provider, chained=None))
        arguments.validate_args(args, {})
    args.padded_vocab_size = VOCAB
    set_args(args)
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    torch.manual_seed(1234)  # same initial weights at every CP size (CPU initialization)
    model = pretrain_gpt.model_provider(burst_lm.wrap_gpt_builder(pretrain_gpt.gpt_builder), True, True)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": (torch.rand(BATCH, SEQ, generator=g) > 0.2).float(),
             "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(), "attention_mask": None}
    local = burst_lm.slice_batch(batch, args)
    model.train()
    out = model(local["tokens"], local["position_ids"], None, labels=local["labels"], loss_mask=local["loss_mask"])
    loss_sum, num_tokens, _ = pretrain_gpt.loss_func(local["loss_mask"], out, model=model)
    totals = torch.stack([loss_sum.detach().float(), num_tokens.float()])
    dist.all_reduce(totals)
    (loss_sum / totals[1]).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone()
        dist.all_reduce(grad)  # CP ranks hold partial gradients of the same weights
        grads[name] = grad.numpy()
    caches = [layer.self_attention.core_attention.selective_cache for layer in model.decoder.layers]
    hits = sum(c.hits for c in caches if getattr(c, "hits", None) is not None)
    return type(model).__name__, (totals[0] / totals[1]).item(), grads, hits


def run_case(cp: int, extra: list[str]) -> tuple[str, float, dict, int]:
    """(model class, global loss, full gradients, rank 0's selective-checkpoint hits) of one step."""
    return run_local(cp, _rank, extra)[0]


def main() -> int:
    try:
        import pretrain_gpt  # noqa: F401
    except ImportError as exc:
        print(f"cannot import Megatron-LM's pretrain_gpt ({exc}): put a patched Megatron-LM checkout on "
              "PYTHONPATH and install its imports (see this file's docstring)")
        return 2
    ref_cls, ref_loss, ref_grads, _ = run_case(1, [])
    print(f"reference: CP=1, no megatron-burst flags ({ref_cls}): loss {ref_loss:.6f}")
    failed = False
    for cp, extra in CASES:
        cls, loss, grads, hits = run_case(cp, extra)
        grad_err = max(float(abs(grads[k] - ref_grads[k]).max() / max(abs(ref_grads[k]).max(), 1e-12))
                       for k in ref_grads)
        ok = abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss) and grad_err <= GRAD_RTOL
        ok = ok and (cls == "BurstGPTModel") == ("--fused-lm-loss" in extra)
        ok = ok and (hits > 0) == ("--seq-selective-ckpt-ratio" in extra)  # the store served the recompute
        failed |= not ok
        print(f"{'ok  ' if ok else 'FAIL'} CP={cp} {' '.join(extra)}: {cls}, loss {loss:.6f}, "
              f"max relative gradient difference {grad_err:.2e}" + (f", {hits} selective-checkpoint hits" if hits else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
