"""Triton kernels for one token chunk of the fused LM-head + cross-entropy (GPU; CPU via interpreter).

Layout: a chunk's logits live transposed, ``buf[v, t]`` ([V_local, T] fp32, contiguous), so a tile
of vocabulary rows is a contiguous slice and both gradient matmuls read ``buf`` without copies.

* :func:`logits_stats` -- the forward tile loop: one program per block of tokens walks the local
  vocabulary in tiles, computes each logits tile with ``tl.dot`` (fp32 accumulation), writes it to
  ``buf`` and keeps a running max / sum-exp (online log-sum-exp, fp32) and the target logit, so
  the statistics cost no extra pass over the chunk's logits.
* :func:`softmax_grad` -- one elementwise pass: ``G = w * (exp(z - M) / S - onehot)`` in the
  matmul dtype; the two gradient matmuls then run in torch (cuBLAS).

The kernel source lives in :mod:`megatron_burst.loss._triton_src`; triton is imported only when
a kernel is first used, so the torch path never needs it.

Interpreter: Triton decides at decoration time whether a function is compiled or interpreted, and
its own library functions (``tl.zeros``, ...) are decorated when triton is first imported -- so
``TRITON_INTERPRET=1`` must be set before the process imports triton (megatron.core imports it).
The tests therefore run the interpreted kernels in a fresh subprocess. Our kernels are wrapped on
first use, so this module itself may be imported before the variable is set.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

AVAILABLE = importlib.util.find_spec("triton") is not None

# Tile sizes. GPU values are a plain starting point (no GPU was available to tune them); the
# interpreter is slow per program, but small tiles keep its numpy temporaries small.
GPU_BLOCKS = {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_D": 64}
INTERPRET_BLOCKS = {"BLOCK_T": 16, "BLOCK_V": 16, "BLOCK_D": 16}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_jitted: dict[bool, tuple[Any, Any]] = {}


def _kernels() -> tuple[Any, Any]:
    if not AVAILABLE:
        raise RuntimeError("impl='triton' needs the triton package: pip install triton")
    import triton

    from megatron_burst.loss import _triton_src

    mode = interpreting()
    if mode not in _jitted:
        _jitted[mode] = (triton.jit(_triton_src.logits_stats_kernel), triton.jit(_triton_src.softmax_grad_kernel))
    return _jitted[mode]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks() -> dict[str, int]:
    return INTERPRET_BLOCKS if interpreting() else GPU_BLOCKS


def check_device(t: torch.Tensor) -> None:
    """Raise unless the kernels can run on ``t``'s device."""
    if not AVAILABLE:
        raise ValueError("impl='triton' needs the triton package (pip install triton); use impl='torch'")
    if not t.is_cuda and not interpreting():
        raise ValueError(f"impl='triton' needs CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 to run "
                         "the kernels in Triton's CPU interpreter, or use impl='torch'")


def logits_stats(h: torch.Tensor, weight: torch.Tensor, tgt: torch.Tensor, buf: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write the chunk's logits ``buf[v, t] = w_v . h_t`` (fp32) and return per-token local stats.

    h: [T, d], weight: [V_local, d] (same dtype, rows contiguous), tgt: [T] int64 local target row
    or -1, buf: [V_local, T] fp32 contiguous. Returns (max, sum exp(z - max), target logit or 0),
    each [T] fp32, over this rank's vocabulary only.
    """
    stats_kernel, _ = _kernels()
    h, weight = h.contiguous(), weight.contiguous()
    T, d = h.shape
    V = weight.shape[0]
    out = torch.empty(3, T, dtype=torch.float32, device=h.device)
    b = _blocks()
    # fp32 must not drop to tf32 on the GPU (Megatron's fp32 GEMMs do not either).
    precision = "ieee" if h.dtype == torch.float32 else "tf32"
    # Triton 3.9's interpreter returns garbage from tl.dot on bf16 operands (it multiplies the raw
    # bits); there the tiles are widened to fp32 first -- exact, since bf16 -> fp32 is exact and
    # bf16 x bf16 products are exact in fp32, as in the GPU's bf16 MMA with fp32 accumulation.
    upcast = interpreting() and h.dtype != torch.float32
    if upcast:
        precision = "ieee"
    stats_kernel[(_cdiv(T, b["BLOCK_T"]),)](
        h, weight, buf, tgt, out[0], out[1], out[2], T, V, d, h.stride(0), weight.stride(0), buf.stride(0),
        BLOCK_T=b["BLOCK_T"], BLOCK_V=b["BLOCK_V"], BLOCK_D=b["BLOCK_D"], PRECISION=precision,
        UPCAST=upcast)
    return out[0], out[1], out[2]


def softmax_grad(buf: torch.Tensor, tgt: torch.Tensor, m: torch.Tensor, s: torch.Tensor, wts: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """``out[v, t] = wts[t] * (exp(buf[v, t] - m[t]) / s[t] - [v == tgt[t]])`` in out's dtype.

    buf: [V_local, T] fp32 raw logits; tgt: [T] int64 (-1: target not on this rank); m, s, wts:
    [T] fp32; out: [V_local, T] (may be ``buf`` itself for fp32). Returns out.
    """
    _, grad_kernel = _kernels()
    V, T = buf.shape
    b = _blocks()
    grid = (_cdiv(V, b["BLOCK_V"]), _cdiv(T, b["BLOCK_T"]))
    grad_kernel[grid](buf, out, tgt, m.contiguous(), s.contiguous(), wts.contiguous(), T, V,
                      buf.stride(0), out.stride(0), BLOCK_T=b["BLOCK_T"], BLOCK_V=b["BLOCK_V"])
    return out
