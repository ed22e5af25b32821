"""Cap Triton's autotuning search (fla's kernels: dozens of launch configs each, every one compiled
and timed on first use -- minutes per process on a fresh GPU machine).

:func:`limit_autotune` makes every ``triton.autotune`` kernel in this process try at most ``n`` of its
configs: the ones with the fewest pipeline stages, then warps (the least shared memory first, so
that with n >= 2 a config that does not fit on the device is never the only one). Any config
computes the same function, so correctness checks may cap it freely (tests/gpu does, at 2); a
benchmark that caps it runs fla's own kernels and ours on the same capped choice, and records the cap
beside its timings (``bench linear --gpu --autotune-configs N``).
"""
from __future__ import annotations

__all__ = ["limit_autotune"]


def limit_autotune(n: int) -> bool:
    """Cap every Triton autotuner of this process at ``n`` configs (n <= 0: no cap). Idempotent; a
    later call changes the cap. Returns False where triton is not importable (nothing to cap)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    full = getattr(Autotuner.prune_configs, "uncapped", Autotuner.prune_configs)
    if n <= 0:
        Autotuner.prune_configs = full
        return True

    def prune_configs(self, kwargs):
        configs = full(self, kwargs)
        return sorted(configs, key=lambda c: (c.num_stages or 0, c.num_warps or 0))[:n]

    prune_configs.uncapped = full
    Autotuner.prune_configs = prune_configs
    return True
