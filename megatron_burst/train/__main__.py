"""``python -m megatron_burst.train`` / ``torchrun ... -m megatron_burst.train``: see
:mod:`megatron_burst.train` (``--help`` lists every flag)."""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_burst.train.args import build_parser, validate_args
from megatron_burst.train.loop import run
from megatron_burst.world import exit_rank


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Join torchrun's world (or make a world of one), train, and end the process.

    Bad flags exit with status 2 before any process group exists. Every process group has the
    timeout --distributed-timeout-minutes: a collective a stalled or dead peer never joins raises
    after it, and the rank says so, naming the flag. The process ends through
    :func:`megatron_burst.world.exit_rank` (status 0 after a final barrier, 1 if training
    raised), which skips gloo's teardown: it can abort a finished rank (see that module).
    """
    # plain `python -m megatron_burst.train`: a world of one, its store in this process (no port to
    # pick, so none another process can take between picking and binding it)
    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
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
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    try:
        if alone:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        run(argv)
    except Exception as exc:
        traceback.print_exc()
        if _is_timeout(exc):
            print(f"megatron-burst train: rank {os.environ['RANK']}: a collective did not complete within "
                  f"--distributed-timeout-minutes {args.distributed_timeout_minutes:g} ({_seconds(timeout)}): a peer "
                  "rank stalled or died; ending the job (raise --distributed-timeout-minutes if a step legitimately "
                  "waits that long)", file=sys.stderr, flush=True)
        exit_rank(1)
    exit_rank(0)


def _seconds(timeout: timedelta) -> str:
    seconds = timeout.total_seconds()
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.0f} min"


def _is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective or rendezvous that ran out of time: gloo's
    "Timed out waiting ...", NCCL's watchdog and the store raise different types, all saying so."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


if __name__ == "__main__":
    main(sys.argv[1:])
