"""Where this package's Triton kernels can run in this process: on CUDA, or on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is first imported; CI tests use it)."""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

AVAILABLE = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable() -> Optional[str]:
    """Why a Triton kernel cannot run here (None: it can, on CUDA or under the interpreter)."""
    if not AVAILABLE:
        return "triton is not installed (pip install triton)"
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device"
    return None
