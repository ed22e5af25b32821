"""``python -m megatron_burst.train`` / ``torchrun ... -m megatron_burst.train``: see
:mod:`megatron_burst.train` (``--help`` lists every flag)."""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_burst.train.args import build_parser, validate_args
from megatron_burst.train.loop import run
from megatron_burst.world import exit_rank, free_port


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Join torchrun's world (or make a world of one), train, and end the process.

    Bad flags exit with status 2 before any process group exists. The process ends through
    :func:`megatron_burst.world.exit_rank` (status 0 after a final barrier, 1 if training
    raised), which skips gloo's teardown: it can abort a finished rank (see that module).
    """
    if "RANK" not in os.environ:  # plain `python -m megatron_burst.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    parser = build_parser()
    args = parser.parse_args(argv)
    # Validate flags before creating the world, so a bad combination fails fast on every rank.
    try:
        validate_args(argparse.Namespace(**vars(args)), int(os.environ["WORLD_SIZE"]))
    except ValueError as exc:
        parser.error(str(exc))
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if int(os.environ["RANK"]) != 0:
        warnings.filterwarnings("ignore")  # as Megatron-LM: one copy of library warnings
    dist.init_process_group(backend)
    try:
        run(argv)
    except Exception:
        traceback.print_exc()
        exit_rank(1)
    exit_rank(0)


if __name__ == "__main__":
    main(sys.argv[1:])
