"""What every linear-attention-family op shares: which global segments a rank holds in a layout,
and the local checks on q, k, v and the layout that run before any collective."""
from __future__ import annotations

import torch

from megatron_burst.masks.documents import THD
from megatron_burst.masks.layout import BALANCED, LAYOUTS, check_layout, check_local_len
from megatron_burst.linear.chunked import CHUNK

MIN_STRIPE = CHUNK  # block-striped segments shorter than a chunk would make the state exchange dominate


def segment_order(layout: str, world_size: int, rank: int, per_rank: int) -> tuple[int, ...]:
    """Global indices of ``rank``'s segments, in its local (increasing) order."""
    if layout == "contiguous":
        return (rank,)
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return tuple(j * world_size + rank for j in range(per_rank))


def segments_per_rank(layout: str, local_len: int, stripe: int) -> int:
    """How many runs of consecutive global positions a rank holds: 1, 2, or one per stripe."""
    return {"contiguous": 1, "zigzag": 2}.get(layout) or local_len // stripe


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int, layout: str, stripe: int,
              qkv_format: str) -> tuple[int, int, int, int]:
    """Raise ValueError unless q, k [s, b, h, dk] and v [s, b, h, dv] (or bshd) fit ``layout`` on
    ``world_size`` ranks. Returns (s, b, h, dk). Local checks only. The data-derived layouts ("thd",
    "balanced": :mod:`megatron_burst.linear.runs`) are checked with their documents, not here."""
    derived = layout in (THD, BALANCED)
    if not derived:
        check_layout(layout, stripe)
    if layout not in LAYOUTS and not derived:
        raise ValueError(f"layout {layout!r} is not supported by linear attention: choose one of "
                         f"{', '.join(LAYOUTS + (THD, BALANCED))}")
    if layout == "striped" and stripe < MIN_STRIPE:
        raise ValueError(f"layout='striped' with stripe={stripe}: linear attention needs stripes of at least "
                         f"{MIN_STRIPE} tokens (a state is exchanged per stripe); use layout='zigzag' (balanced "
                         f"for causal masks) or stripe >= {MIN_STRIPE}")
    if qkv_format not in ("sbhd", "bshd"):
        raise ValueError(f"unknown qkv_format {qkv_format!r}: choose sbhd or bshd")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {qkv_format}, got shape {tuple(t.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must match q {tuple(q.shape)} in tokens, batch and heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    s, b, h, dk = q.shape if qkv_format == "sbhd" else (q.shape[1], q.shape[0], q.shape[2], q.shape[3])
    if not derived:
        check_local_len(s, world_size, layout, stripe)
    return s, b, h, dk
