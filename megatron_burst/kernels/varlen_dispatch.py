"""The "positions" kernel on CUDA: torch's varlen flash op for the blocks it computes exactly,
the Triton masked kernel for the rest, decided per block on the host.

Why (measured on an H100, bf16, 32K tokens, GQA 32/8, d=128, forward + backward, with torch's
``torch.nn.attention.varlen.varlen_attn``, which calls the same ops, against this package's paths
before this kernel existed): 64 packed documents 4.6 ms vs 29.9 ms (one cuDNN call per document);
sliding window 1024: 9.0 vs 13.3 ms and 4096: 25.0 vs 30.4 ms (the Triton kernel). This adapter
itself is not timed on a GPU yet. The Triton kernel remains for what the op cannot express (striped
or zigzag positions inside a document, alignments that differ between documents; see
:func:`megatron_burst.kernels.cuda_varlen.block_plan`).

It is one kernel of :mod:`megatron_burst.kernels.choice` (``varlen_or_triton``, the first CUDA
candidate for "positions"): available and supported only where both parts are, and self-checked as
one. The self-check's "positions" cases include blocks of both routes (documents + window and a
contiguous offset block for the varlen op, striped positions for Triton), so each part is checked
against the fp32 reference on the device before any block runs. The route of a block depends only
on its (cached) mask data, shapes and dtypes: the same on every rank and every step.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from megatron_burst.kernels import cuda_varlen, triton_masked
from megatron_burst.kernels.rows import row_dot

NAME = "varlen_or_triton"
KINDS = ("positions",)
# the backward reads the final output (out=) when given: the varlen op reads O; Triton gets D = rowsum(dO * O)
TAKES_OUT = True


def unavailable() -> Optional[str]:
    """Why this kernel cannot run here (None: both parts can)."""
    for part in (cuda_varlen, triton_masked):
        why = part.unavailable()
        if why is not None:
            return f"{part.__name__.rsplit('.', 1)[-1]}: {why}"
    return None


def supports(dtype: torch.dtype, head_dim: int, kind: str) -> Optional[str]:
    """Why (dtype, head dim, kind) is out of reach of either part (None: both take it)."""
    for part in (cuda_varlen, triton_masked):
        why = part.supports(dtype, head_dim, kind)
        if why is not None:
            return f"{part.__name__.rsplit('.', 1)[-1]}: {why}"
    return None


def route(q: torch.Tensor, k: torch.Tensor, positions: Optional[tuple]) -> ModuleType:
    """The part that runs this block: cuda_varlen where it is exact (host-side test, cached per
    block), else triton_masked."""
    return cuda_varlen if cuda_varlen.supports_block(q, k, positions) else triton_masked


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "positions", block: int = 1,
            scale: float = 1.0, positions: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, hq, sq, d] (q's dtype from the varlen op, fp32 from Triton), lse [b, hq, sq] fp32)."""
    return route(q, k, positions).forward(q, k, v, kind, block, scale, positions=positions)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: Optional[torch.Tensor],
             lse: torch.Tensor, kind: str = "positions", block: int = 1, scale: float = 1.0,
             positions: Optional[tuple] = None, out: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [b, hq, sq, d], dk, dv [b, hkv, sk, d]); D [b, hq, sq] or the final output ``out``
    [b, hq, sq, d] (at least one: callers told TAKES_OUT may pass D=None with out)."""
    part = route(q, k, positions)
    if part is cuda_varlen:
        return cuda_varlen.backward(dout, q, k, v, D, lse, kind, block, scale, positions=positions, out=out)
    if D is None:
        if out is None:
            raise ValueError("varlen_or_triton.backward needs D or the final output (out=)")
        D = row_dot(dout, out)  # the Triton kernel reads D; the caller handed the output instead
    return triton_masked.backward(dout, q, k, v, D, lse, kind, block, scale, positions=positions)
