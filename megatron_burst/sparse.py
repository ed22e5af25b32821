"""Vertical-slash sparse attention under context parallelism (MTraining): the public face.

The attention is :func:`megatron_burst.cp_attention` with ``pattern=``: a
:class:`VerticalSlash` (static), ``"dynamic"`` or a
:class:`megatron_burst.dynamic_pattern.Dynamic` (MTraining's Algorithm 1, estimated from this
call's q and k). The pattern is part of the validated call, like documents (``cu_seqlens``) and
a sliding window (``window``), and composes with both: the visible set is pattern AND causal AND
same document AND window (see :mod:`megatron_burst.sparse_plan`). Ring and burst run it (``auto``
picks one of them), flat or double ring, every layout except packed THD.

:func:`sparse_cp_attention` is the older entry point, kept as a thin wrapper with its own
defaults (block-striped layout, stripe 64, burst): ``sparse_cp_attention(q, k, v, pattern, **kw)``
is ``cp_attention(q, k, v, pattern=pattern, layout="striped", stripe=64, algo="burst", **kw)``.

The patterns and plans (data) live in :mod:`megatron_burst.sparse_plan`, below the kernels and
the algorithms that read them; this module re-exports them, so ``megatron_burst.sparse.plan_pair``
and the rest keep working.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst.algorithms import cp_attention
from megatron_burst.sparse_plan import (COLUMNS, CPU_DENSE_COLUMN, LONG_RUN, PLAN_CHUNK, PLAN_MASKS, TILE,
                                        PackedTiles, SparseRows, SparseTile, TilePlan, VerticalSlash, as_packed,
                                        column_counts, dense_column_for, imbalance, key_floor, pack_bits,
                                        pair_work, pattern_blocks, plan_pair, plan_tiles, unpack_bits)

__all__ = ["sparse_cp_attention", "COLUMNS", "CPU_DENSE_COLUMN", "LONG_RUN", "PLAN_CHUNK", "PLAN_MASKS", "TILE",
           "PackedTiles", "SparseRows", "SparseTile", "TilePlan", "VerticalSlash", "as_packed", "column_counts",
           "dense_column_for", "imbalance", "key_floor", "pack_bits", "pair_work", "pattern_blocks", "plan_pair",
           "plan_tiles", "unpack_bits"]


def sparse_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern, *, group=None,
                        layout: str = "striped", stripe: int = 64, algo: str = "burst", ring: Optional[str] = None,
                        softmax_scale: Optional[float] = None, qkv_format: str = "sbhd",
                        cu_seqlens=None, window: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Context-parallel causal attention restricted to a vertical-slash ``pattern`` (exact): a thin
    wrapper of ``cp_attention(q, k, v, pattern=pattern, ...)`` with MTraining's defaults.

    q [s, b, hq, d], k/v [s, b, hkv, d] ("sbhd"; or [b, s, h, d] "bshd") hold this rank's s tokens
    in ``layout``'s order (block-striped by default: stripes of ``stripe`` tokens dealt round-robin,
    MTraining's balanced sparse ring). ``pattern`` lines are global positions over S = s x CP size.
    ``algo``: "ring" or "burst" backward ("auto": the cost model picks one); ``ring``: "flat" or
    "double" (group a CPTopology). ``pattern`` "dynamic" or a
    :class:`megatron_burst.dynamic_pattern.Dynamic` (budgets p_v, p_s, last_q) estimates MTraining's
    dynamic pattern from this call's q and k first (identical on every rank; not differentiated
    through). ``cu_seqlens`` and ``window`` intersect the pattern with documents and a sliding
    window, as in :func:`megatron_burst.cp_attention`.
    Returns this rank's output like q; differentiable. Block pairs, query tiles and key columns
    with no visible pair skip compute; the ring carries every block (the bytes of dense attention),
    except under a window, where it stops where the window's dense mask does.
    """
    if qkv_format not in ("sbhd", "bshd"):
        raise ValueError(f"qkv_format={qkv_format!r}: sparse_cp_attention takes 'sbhd' or 'bshd'")
    return cp_attention(q, k, v, pattern=pattern, group=group, algo=algo, layout=layout, stripe=stripe, ring=ring,
                        softmax_scale=softmax_scale, qkv_format=qkv_format, causal=True, cu_seqlens=cu_seqlens,
                        window=window)
