"""Train a GPT with megatron-burst context parallelism, built from megatron-core parts only.

    torchrun --nproc-per-node 4 -m megatron_burst.train --context-parallel-size 4 \\
        --cp-algo burst --cp-layout striped --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 \\
        --lr 1e-3 --train-iters 20

Flags: Megatron-LM's names (``--num-layers``, ``--tensor-model-parallel-size``, ``--data-path``
...) plus ours (:func:`megatron_burst.add_args`). ``python -m megatron_burst.train --help`` lists
every flag with its default; they are defined in :mod:`megatron_burst.train.args` and
:mod:`megatron_burst.megatron.flags`.

The model is megatron.core's GPTModel (:class:`~megatron_burst.megatron.model.BurstGPTModel`) with
:mod:`megatron_burst.specs`, data is megatron.core's GPTDataset over an indexed dataset (default:
the built-in stdlib byte corpus, :mod:`megatron_burst.data`), the optimizer torch's AdamW under
megatron.core's OptimizerParamScheduler. gloo on CPU, nccl on GPU. ``--bf16`` trains with
megatron.core's mixed precision as Megatron-LM sets it up: a bf16 model in Float16Module and
DistributedDataParallel (fp32 gradient buffers and all-reduce) and get_megatron_optimizer's
Float16OptimizerWithFloat16Params (fp32 main parameters), see :mod:`megatron_burst.train.mixed_precision`.

The loss is the per-token mean over the whole global batch (every microbatch, DP and CP rank),
so a run at any CP size follows the CP = 1 trajectory up to float rounding. Checkpoints hold
full (CP-independent) parameters per TP rank and the RNG states: they resume at any CP and DP size.

Modules, in the order a run uses them:
  args           flags and validate_args -> (CPOptions, ParallelSizes), before any collective
  setup          process groups (megatron.core.parallel_state), seeding, model and optimizer
  data           tokenizer, GPTDataset, this rank's microbatches of an iteration
  step           loss_and_grads, allreduce_grads, clip_grads, count_zero_grads (fp32)
  mixed_precision  --bf16: megatron.core's Float16Module + DDP + mixed-precision optimizer
  checkpointing  save_checkpoint / load_checkpoint (Megatron-LM's legacy layout)
  loop           run: one training run on an initialized torch.distributed world
  __main__       main: joins torchrun's world (or a world of one), runs, ends the process
"""
from megatron_burst.train.args import ParallelSizes, build_parser, validate_args
from megatron_burst.train.checkpointing import (CKPT_TRACKER, get_rng_state, load_checkpoint,
                                                save_checkpoint, set_rng_state)
from megatron_burst.train.data import build_dataset, build_tokenizer, microbatches
from megatron_burst.train.loop import run
from megatron_burst.train.setup import (Groups, build_model, build_optimizer, gpt_model_kwargs,
                                        init_parallel, model_config, padded_vocab_size,
                                        print_rank_0, seed_everything)
from megatron_burst.train.step import allreduce_grads, clip_grads, count_zero_grads, loss_and_grads


def __getattr__(name):
    # Not imported eagerly: `python -m megatron_burst.train` runs __main__ after importing this
    # package, and runpy warns when __main__ is already in sys.modules by then.
    if name == "main":
        from megatron_burst.train.__main__ import main
        return main
    raise AttributeError(f"module 'megatron_burst.train' has no attribute {name!r}")


__all__ = ["ParallelSizes", "build_parser", "validate_args", "Groups", "init_parallel",
           "seed_everything", "padded_vocab_size", "model_config", "gpt_model_kwargs", "build_model",
           "build_optimizer", "print_rank_0", "build_tokenizer", "build_dataset", "microbatches",
           "loss_and_grads", "allreduce_grads", "clip_grads", "count_zero_grads", "CKPT_TRACKER", "save_checkpoint",
           "load_checkpoint", "get_rng_state", "set_rng_state", "run", "main"]
