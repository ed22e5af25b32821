"""The trainer's data: tokenizer, dataset (megatron.core's GPTDataset via :mod:`megatron_burst.data`)
and this rank's microbatches of an iteration."""
from __future__ import annotations

import argparse
import os
from typing import Optional, Dict, List

import torch

from megatron_burst.train.args import ParallelSizes


def build_tokenizer(args: argparse.Namespace):
    """--tokenizer-type's tokenizer (megatron_burst.data's ByteTokenizer or NullTokenizer)."""
    from megatron_burst.data import ByteTokenizer, NullTokenizer

    return NullTokenizer(args.vocab_size) if args.tokenizer_type == "NullTokenizer" else ByteTokenizer()


def build_dataset(args: argparse.Namespace, tokenizer, num_samples: Optional[int] = None):
    """GPTDataset over --data-path, the built-in corpus, or MockGPTDataset, with ``num_samples``
    samples (default: --train-iters x --global-batch-size)."""
    from megatron_burst import data

    data_path = args.data_path
    if not data_path and not args.mock_data:
        if args.tokenizer_type != "ByteTokenizer":
            raise ValueError("the built-in corpus is byte-tokenized: use --tokenizer-type "
                             "ByteTokenizer or pass --data-path")
        kwargs = {} if args.corpus_max_bytes is None else {"max_bytes": args.corpus_max_bytes}
        data_path = [data.default_corpus(args.data_cache_path, **kwargs)]
    return data.build_train_dataset(
        data_path=data_path, mock=args.mock_data, seq_length=args.seq_length,
        num_samples=num_samples or args.train_iters * args.global_batch_size, seed=args.seed, tokenizer=tokenizer,
        split=args.split, cache_path=os.path.join(args.data_cache_path, "index"),
        reset_position_ids=getattr(args, "reset_position_ids", False))


def microbatches(dataset, consumed_samples: int, args: argparse.Namespace, sizes: ParallelSizes, dp_rank: int
                 ) -> List[Dict[str, torch.Tensor]]:
    """This DP rank's microbatches of the global batch that starts after ``consumed_samples``
    samples, as Megatron's pretraining sampler deals them: the global batch is consecutive
    samples; microbatch m of DP rank r holds samples base + m * mbs * dp + r * mbs + [0, mbs).
    (Counting samples, not iterations, keeps a resumed run on its data when the global batch
    size changes.)"""
    from megatron_burst.data import collate

    mbs = args.micro_batch_size
    base = consumed_samples
    out = []
    for m in range(sizes.num_microbatches):
        start = base + m * mbs * sizes.dp + dp_rank * mbs
        out.append(collate([dataset[i] for i in range(start, start + mbs)]))
    return out

