"""Every environment variable megatron-burst reads: documented overrides, read here and nowhere else.

Options reach the engine as data (API arguments, the Megatron flags' options objects); these
variables only override a default, for measuring or for a job that cannot change its code. Each is
read when its accessor is called (so a change takes effect at the next decision that reads it), is
validated here, and is listed in the README's "Environment variables" table
(``tests/test_env.py`` checks both: no other module reads a ``MEGATRON_BURST_*`` variable, and the
table documents every name in :data:`VARIABLES`).

Launcher variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``TRITON_INTERPRET``) belong to
torchrun and Triton and are read where they are used.
"""
from __future__ import annotations

import os
from typing import Optional

VARIABLES = {
    "MEGATRON_BURST_KERNEL": "a local attention kernel for every mask kind it covers",
    "MEGATRON_BURST_SPARSE_KERNEL": "the kernel of vertical-slash tiles (torch | triton)",
    "MEGATRON_BURST_LINEAR_KERNEL": "the linear family's local kernels (torch | fla)",
    "MEGATRON_BURST_ALLOW_SLOW_KERNELS": "1: a failed self-check warns and falls back; 0: a CUDA block without "
                                         "a fused kernel is an error",
    "MEGATRON_BURST_TRANSPORT": "direct | host_staged | host_staged_cpu",
    "MEGATRON_BURST_SPARSE_TILE": "rows and columns of a sparse tile (default 64)",
    "MEGATRON_BURST_SPARSE_COLUMNS": "exact | tiles: the key columns a sparse tile gathers",
    "MEGATRON_BURST_SPARSE_DENSE_COLUMN": "fraction splitting tile columns from gathered rows",
    "MEGATRON_BURST_SPARSE_RUNS": "1 | 0: shared slash runs as dense blocks (default: on CUDA) or sparse tiles",
    "MEGATRON_BURST_GPU_TESTS_ON_CPU": "1: run tests/gpu as its CPU dry run",
}


def _get(name: str) -> Optional[str]:
    """The variable's value with surrounding blanks removed; None when unset or empty."""
    assert name in VARIABLES, name  # every variable read is documented above
    value = os.environ.get(name, "").strip()
    return value or None


def kernel() -> Optional[str]:
    """``MEGATRON_BURST_KERNEL``: a local attention kernel name to force (checked by the kernel policy)."""
    return _get("MEGATRON_BURST_KERNEL")


def sparse_kernel() -> Optional[str]:
    """``MEGATRON_BURST_SPARSE_KERNEL``: the vertical-slash tile kernel to force."""
    return _get("MEGATRON_BURST_SPARSE_KERNEL")


def linear_kernel() -> Optional[str]:
    """``MEGATRON_BURST_LINEAR_KERNEL``: the linear family's kernel to force."""
    return _get("MEGATRON_BURST_LINEAR_KERNEL")


def allow_slow_kernels() -> Optional[bool]:
    """``MEGATRON_BURST_ALLOW_SLOW_KERNELS``: True (``1``: warn and fall back after a failed self-check),
    False (``0``: a CUDA block without a fused kernel is an error) or None (unset: failed self-checks raise)."""
    value = _get("MEGATRON_BURST_ALLOW_SLOW_KERNELS")
    if value not in (None, "0", "1"):
        raise ValueError(f"MEGATRON_BURST_ALLOW_SLOW_KERNELS={value!r}: use 1 (warn and fall back) or 0 "
                         "(a CUDA block without a fused kernel is an error); unset: failed self-checks raise")
    return None if value is None else value == "1"


def transport() -> Optional[str]:
    """``MEGATRON_BURST_TRANSPORT``: the transport name (validated by megatron_burst.comm), None when unset."""
    return _get("MEGATRON_BURST_TRANSPORT")


def sparse_tile(default: int = 64) -> int:
    """``MEGATRON_BURST_SPARSE_TILE``: rows and columns of the block-sparse kernel's tiles."""
    value = _get("MEGATRON_BURST_SPARSE_TILE")
    if value is None:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MEGATRON_BURST_SPARSE_TILE={value!r}: a positive number of tokens, e.g. 64")
    return int(value)


def sparse_columns(default: str = "exact") -> str:
    """``MEGATRON_BURST_SPARSE_COLUMNS``: ``exact`` or ``tiles`` (checked where it is used)."""
    return _get("MEGATRON_BURST_SPARSE_COLUMNS") or default


def sparse_dense_column() -> Optional[str]:
    """``MEGATRON_BURST_SPARSE_DENSE_COLUMN``: the dense-column threshold as written (parsed where used)."""
    return _get("MEGATRON_BURST_SPARSE_DENSE_COLUMN")


def sparse_runs() -> Optional[bool]:
    """``MEGATRON_BURST_SPARSE_RUNS``: ``1`` / ``0`` forces a vertical-slash pattern's shared slash
    runs into dense blocks or keeps them in the sparse tiles on every device; unset: by device."""
    value = _get("MEGATRON_BURST_SPARSE_RUNS")
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"MEGATRON_BURST_SPARSE_RUNS={value!r}: 1 (runs as dense blocks) or 0 (sparse tiles)")
    return value == "1"


def gpu_tests_on_cpu() -> bool:
    """``MEGATRON_BURST_GPU_TESTS_ON_CPU=1``: ``tests/gpu`` runs as its CPU dry run."""
    return _get("MEGATRON_BURST_GPU_TESTS_ON_CPU") == "1"
