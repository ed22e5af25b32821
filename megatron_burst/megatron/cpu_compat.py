"""Megatron-Core on a CPU-only torch: the few places that assume CUDA, made conditional.

Megatron's activation checkpointing (``tensor_parallel.checkpoint``, used by
``--recompute-granularity``) saves and restores the CUDA RNG state around the recompute; a torch
built without CUDA raises there. :func:`allow_checkpointing_without_cuda` makes those two helpers
no-ops when CUDA is unavailable (the CPU RNG state is still saved and restored by Megatron).
It changes nothing on a machine with CUDA.
"""
from __future__ import annotations

import torch


def allow_checkpointing_without_cuda() -> bool:
    """Patch Megatron's CUDA RNG get/set to no-ops on CUDA-less torch; returns True if patched."""
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as tp_random

    if getattr(tp_random, "_megatron_burst_cpu_rng", False):
        return True
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._megatron_burst_cpu_rng = True
    return True
