"""The trainer's flags: Megatron-LM's names plus megatron-burst's, and their validation.

Every flag is listed, with its default, by ``python -m megatron_burst.train --help``; this module
defines the Megatron-LM-named ones, :func:`megatron_burst.add_args` ours.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_burst.megatron.flags import add_args
from megatron_burst.megatron.from_args import cp_options_from_args, linear_options_from_args
from megatron_burst.megatron.options import CPOptions
from megatron_burst.megatron.validate import check_cp_dropout

USAGE_EXAMPLE = """\
example (4 CPU ranks, CP = 4):
  torchrun --nproc-per-node 4 -m megatron_burst.train --context-parallel-size 4 \\
      --cp-algo burst --cp-layout striped --num-layers 2 --hidden-size 64 \\
      --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 --global-batch-size 8 \\
      --lr 1e-3 --train-iters 20
"""


# Megatron-LM's --distributed-timeout-minutes default: how long a collective waits for its peers
DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES = 10


class _OneRankParser(argparse.ArgumentParser):
    """Under torchrun every rank parses the flags: print a usage error once (rank 0), exit 2 on all."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def _window_type(text: str) -> tuple[int, int]:
    """'4096,0' or '(4096,0)' -> (4096, 0) (Megatron-LM's tuple_type for --window-size)."""
    try:
        window = tuple(int(x) for x in text.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-size {text!r}: give LEFT,RIGHT ints, e.g. 4096,0") from None
    if len(window) != 2:
        raise argparse.ArgumentTypeError(f"--window-size {text!r}: give two ints LEFT,RIGHT, e.g. 4096,0")
    return window


def _skip_freq_type(text: str):
    """'4' -> 4 (every 4th layer full attention); '1,1,0' or '[1,1,0]' -> [1, 1, 0] (one per layer)."""
    try:
        parts = [int(x) for x in text.strip("[]()").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-attn-skip-freq {text!r}: an int N or a 0/1 list "
                                         "like 1,1,1,0") from None
    return parts[0] if len(parts) == 1 and "," not in text and "[" not in text else parts


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM-named flags used by this trainer, plus megatron-burst's (every flag has help)."""
    p = _OneRankParser(
        prog="python -m megatron_burst.train", allow_abbrev=False, epilog=USAGE_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a GPT with megatron-burst context parallelism, built from megatron-core "
                    "parts only. Run under torchrun for several ranks, or plainly for one.")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="model width")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 * hidden size)")
    g.add_argument("--num-attention-heads", type=int, required=True, help="query heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="KV heads for grouped-query attention (default: = attention heads)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="accepted for Megatron-LM compatibility; --num-query-groups decides")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim (default hidden / heads)")
    g.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", default="rope",
                   choices=["rope", "learned_absolute", "none"],
                   help="default rope (Megatron-LM's default is learned_absolute)")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (default 10000)")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of the head dim RoPE rotates (default 1.0)")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                   help="default LayerNorm")
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP instead of GELU")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no biases in linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer weight (default: tied to the word embedding)")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal weight initialization (default 0.02)")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="default 0.0 (Megatron-LM: 0.1); dropout breaks CP = 1 equivalence")
    g.add_argument("--window-size", type=_window_type, default=None, metavar="LEFT,RIGHT",
                   help="sliding-window attention as Megatron's --window-size: query i sees keys i-LEFT ... i "
                        "(causal; RIGHT is 0 there); -1 = unbounded. Default: full attention")
    g.add_argument("--window-attn-skip-freq", type=_skip_freq_type, default=None, metavar="N|0,1,...",
                   help="with --window-size: every N-th layer keeps full attention, or one 0/1 per layer "
                        "(1 = sliding window), as Megatron-Core's window_attn_skip_freq")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="default 0.0 (Megatron-LM: 0.1); must be 0 with CP > 1")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP size (default 128)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (default 1)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP size (default 1); the data-parallel size is world / (TP x CP)")
    g.add_argument("--cp-comm-type", type=str, nargs="+", default=None,
                   help="Megatron's name for the CP algorithm: p2p (ring), a2a (ulysses), allgather / "
                        "all_gather, a2a+p2p (usp, with --hierarchical-context-parallel-sizes); or one of "
                        "ours (see --cp-algo). Megatron's per-layer form: one value per layer")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs=2, default=None, metavar=("A2A", "P2P"),
                   help="Megatron's a2a+p2p sizes: all-to-all (Ulysses) groups of A2A consecutive CP ranks, a "
                        "ring over the P2P groups (A2A x P2P = CP); A2A is also taken as CP ranks per node "
                        "unless --cp-ranks-per-node is given")
    g.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"],
                   help="default nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES,
                   metavar="MINUTES",
                   help="Megatron-LM's flag: every process group is created with this timeout, so a collective "
                        "a stalled or dead peer never joins ends the job with an error after it instead of "
                        f"hanging (default {DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES:g}, as Megatron-LM; a superset of "
                        "Megatron-LM's int: fractions such as 0.5 are accepted)")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True, help="samples per microbatch")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration (default micro batch size * data-parallel size)")
    g.add_argument("--train-iters", type=int, required=True, help="iterations to train")
    g.add_argument("--lr", type=float, required=True, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate floor (default 0)")
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine"],
                   help="default linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="linear warmup from 0 (default 0: none)")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay, not applied to biases and norms (default 0.01)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="default 0.9")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="default 0.999")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="default 1e-8")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient L2 norm to this (default 1.0; 0 disables)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seed of weights, dropout and data order (default 1234)")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recompute (Megatron's): 'selective' recomputes core attention")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="with --recompute-granularity full (default uniform)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with --recompute-granularity full (default 1)")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefix(es), Megatron-LM style ('w1 p1 w2 p2' blends). "
                        "Default: the built-in stdlib byte corpus")
    g.add_argument("--mock-data", action="store_true", help="megatron.core's MockGPTDataset")
    g.add_argument("--split", default="100,0,0",
                   help="train,valid,test weights of --data-path (default 100,0,0)")
    g.add_argument("--data-cache-path", default="data_cache",
                   help="where the built-in corpus and GPTDataset index caches go (default data_cache)")
    g.add_argument("--corpus-max-bytes", type=int, default=None,
                   help="size cap of the built-in corpus (default 4 MiB)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="documents: attention stops at EOD tokens (Megatron's flag; the attention gets the document "
                        "boundaries, never a dense mask)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each EOD (Megatron's flag; RoPE is relative, so within documents "
                        "it is unchanged)")
    g.add_argument("--tokenizer-type", default="ByteTokenizer",
                   choices=["ByteTokenizer", "NullTokenizer"], help="default ByteTokenizer")
    g.add_argument("--vocab-size", type=int, default=None, help="for --tokenizer-type NullTokenizer")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=1, help="log every N iterations (default 1)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="count gradient elements that are exactly zero (after clipping) each iteration: "
                        "'number of zeros' in the log, num_zeros in --metrics-file")
    g.add_argument("--metrics-file", default=None,
                   help="write per-iteration metrics as JSON here (rank 0)")
    g.add_argument("--save", default=None, help="checkpoint directory to save to")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (and at the end) when --save is given")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--no-save-rng", action="store_false", dest="save_rng",
                   help="do not save the RNG states in checkpoints")
    g.add_argument("--no-load-rng", action="store_false", dest="load_rng",
                   help="do not restore the saved RNG states when loading a checkpoint")
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, take the learning-rate schedule (--lr, --min-lr, --lr-warmup-iters, "
                        "--lr-decay-iters, --lr-decay-style) from this run's flags instead of the checkpoint")
    g.add_argument("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on --load, keep the checkpoint's learning-rate schedule. Without either flag a "
                        "schedule flag that differs from the checkpoint's is an error, as in Megatron-LM")
    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true",
                   help="Megatron-LM's --bf16: bf16 parameters and activations, fp32 gradient accumulation and "
                        "all-reduce (megatron.core's DistributedDataParallel, grad_reduce_in_fp32) and fp32 main "
                        "parameters in megatron.core's optimizer (get_megatron_optimizer); default fp32")
    g = p.add_argument_group("Megatron-LM flags this trainer refuses (use Megatron-LM with the patch)")
    for flag in _REFUSED_MEGATRON_FLAGS:
        g.add_argument(flag, action="store_true", help=f"refused: {_REFUSED_MEGATRON_FLAGS[flag]}")
    add_args(p)
    return p


# Megatron-LM flags users bring along that this trainer (fp32 or --bf16, no SP) does not implement:
# accepted by the parser (so the answer is a pointer, once, not argparse's "unrecognized arguments" per rank)
_MEGATRON_LM_ROUTE = ("run Megatron-LM's pretrain_gpt.py with patches/pretrain_gpt.patch (README: Using it with "
                      "Megatron-LM), where megatron-burst's flags work alongside it")
_REFUSED_MEGATRON_FLAGS = {
    "--fp16": "megatron_burst.train trains in fp32 or, with --bf16, in bf16 with fp32 main parameters; fp16 "
              "needs a loss scaler, which it does not implement: use --bf16, or " + _MEGATRON_LM_ROUTE,
    "--sequence-parallel": "megatron_burst.train trains in fp32 or bf16 without sequence parallelism; for it, "
                           + _MEGATRON_LM_ROUTE,
}


def _cuda_training(args: argparse.Namespace) -> bool:
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return backend == "nccl"


@dataclass
class ParallelSizes:
    """Parallel sizes derived from the flags and the world size (before any process group exists)."""

    world_size: int
    tp: int
    cp: int
    dp: int
    num_microbatches: int  # per iteration, on every data-parallel rank
    # --hierarchical-context-parallel-sizes (A2A, P2P): init_parallel makes Megatron's hierarchical
    # CP groups for them (pg_collection.hcp)
    hierarchical_cp: Optional[tuple] = None


def validate_args(args: argparse.Namespace, world_size: int) -> tuple[CPOptions, ParallelSizes]:
    """Fill defaults and check every flag combination; raise ValueError naming flag and fix."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "tensor_model_parallel_size", "context_parallel_size", "log_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if world_size % (tp * cp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                         f"{tp} x --context-parallel-size {cp}: launch a multiple of {tp * cp} ranks")
    dp = world_size // (tp * cp)
    timeout = getattr(args, "distributed_timeout_minutes", DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES)
    if not timeout > 0:  # also NaN
        raise ValueError(f"--distributed-timeout-minutes {timeout} must be > 0 (minutes a collective waits for "
                         f"its peers; default {DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES})")
    heads = args.num_attention_heads
    args.num_query_groups = args.num_query_groups or heads
    if heads % args.num_query_groups:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by --num-query-groups "
                         f"{args.num_query_groups}")
    if heads % tp:
        raise ValueError(f"--num-attention-heads {heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if args.num_query_groups % tp and tp % args.num_query_groups:
        raise ValueError(f"--num-query-groups {args.num_query_groups} and --tensor-model-parallel-size "
                         f"{tp}: one must divide the other")
    if args.kv_channels is None:
        if args.hidden_size % heads:
            raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by "
                             f"--num-attention-heads {heads}: set --kv-channels")
        args.kv_channels = args.hidden_size // heads
    if args.ffn_hidden_size is None:  # Megatron-LM's rule: SwiGLU's two input projections get 2/3 of 4h,
        # rounded down to a multiple of 64, so the MLP keeps about the parameters of a 4h GELU MLP
        args.ffn_hidden_size = (int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} < --seq-length "
                         f"{args.seq_length}")
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    check_cp_dropout(args.attention_dropout, cp)
    for flag, route in _REFUSED_MEGATRON_FLAGS.items():
        if getattr(args, flag.lstrip("-").replace("-", "_"), False):
            raise ValueError(f"{flag}: {route}")
    if args.num_query_groups < tp and not _cuda_training(args):
        raise ValueError(f"--num-query-groups {args.num_query_groups} below --tensor-model-parallel-size {tp} "
                         "needs Megatron's KV-head all-gather, which runs on CUDA only: use at least as many "
                         "query groups as TP ranks on CPU")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive: "
                         "take this run's schedule flags or the checkpoint's, not both")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.data_path and args.mock_data:
        raise ValueError("--data-path and --mock-data are exclusive")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be < --lr-decay-iters "
                         f"{args.lr_decay_iters}")
    if args.save_interval is not None and args.save_interval < 1:
        raise ValueError(f"--save-interval {args.save_interval} must be >= 1")
    comm = args.cp_comm_type
    if isinstance(comm, list):  # Megatron-LM's nargs="+": one value, or one per layer
        if len(comm) not in (1, args.num_layers):
            raise ValueError(f"--cp-comm-type has {len(comm)} values but the model has --num-layers "
                             f"{args.num_layers}: give one value, or one per layer")
        args.cp_comm_type = comm[0] if len(set(comm)) == 1 else list(comm)
    opts = cp_options_from_args(args)  # checks --seq-length against the layout and CP size
    linear_options_from_args(args, opts, args.num_query_groups)  # --linear-attention-* against the model
    hierarchical = getattr(args, "hierarchical_context_parallel_sizes", None)
    return opts, ParallelSizes(world_size, tp, cp, dp,
                               args.global_batch_size // (args.micro_batch_size * dp),
                               tuple(int(x) for x in hierarchical) if hierarchical and cp > 1 else None)
