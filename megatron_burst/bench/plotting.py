"""The benchmarks' one way to draw: matplotlib is optional (``pip install megatron-burst[bench]``)."""
from __future__ import annotations

import os
from typing import Any, Optional


def pyplot() -> Optional[Any]:
    """matplotlib.pyplot on the file-only Agg backend, or None (saying so) if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    return plt


def save(fig: Any, path: str) -> None:
    """Write ``fig`` to ``path`` (creating its folder) and say where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
