"""Row-wise helpers of the attention backward shared by the engine and the kernels (a leaf module:
kernels import it without importing the kernels package)."""
from __future__ import annotations

import torch

__all__ = ["row_dot", "unit_last"]


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is unit-stride (or has at most one element), else a contiguous
    copy: what the fused kernels and torch's ops need of q, k, v and dO; any other strides are read
    as they are."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def row_dot(a: torch.Tensor, b: torch.Tensor, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """rowsum(a * b) over the last dim, accumulated in fp32 (fp64 for fp64): [..., n, d] x2 -> [..., n].

    D = rowsum(dO * O) of the attention backward. Computed over chunks of rows, so at most one
    chunk of the fp32 copies exists at a time (not two full fp32 copies of dO and O); any strides.
    """
    acc_dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    out = torch.empty(a.shape[:-1], dtype=acc_dtype, device=a.device)
    n, d = a.shape[-2], a.shape[-1]
    per_row = max(1, a.numel() // max(n, 1))
    rows = max(1, chunk_elems // per_row)
    for i in range(0, n, rows):
        sl = slice(i, min(i + rows, n))
        out[..., sl] = (a[..., sl, :].to(acc_dtype) * b[..., sl, :].to(acc_dtype)).sum(-1)
    return out
