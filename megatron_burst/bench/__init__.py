"""Benchmarks (not tests): ``python -m megatron_burst.bench {attention,kernels} --help``."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence


def apply_defaults(args: argparse.Namespace, argv: Optional[Sequence[str]], defaults: dict) -> set:
    """Set ``defaults`` (e.g. a ``--smoke`` run's tiny sizes) on ``args`` for every option the
    command line did not give; returns the given option names (``--head-dim`` -> ``head_dim``)."""
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or []) if a.startswith("--")}
    for key, value in defaults.items():
        if key not in given:
            setattr(args, key, value)
    return given
