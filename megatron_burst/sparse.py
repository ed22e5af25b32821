"""Public alias of megatron_burst.masks.vertical_slash (vertical-slash sparse patterns and their
tile plans; with ``imbalance`` = megatron_burst.masks.imbalance.pattern_imbalance and ``pair_work``),
plus :func:`sparse_cp_attention`, the one thing this module defines: a thin wrapper over
``megatron_burst.cp_attention(..., pattern=...)``.

The attention is :func:`megatron_burst.cp_attention` with ``pattern=``: a :class:`VerticalSlash`
(static), ``"dynamic"`` or a :class:`megatron_burst.masks.dynamic.Dynamic` (MTraining's
Algorithm 1, estimated from this call's q and k). The pattern is part of the validated call, like
documents (``cu_seqlens``) and a sliding window (``window``), and composes with both: the visible
set is pattern AND causal AND same document AND window (see
:mod:`megatron_burst.masks.vertical_slash`). Ring and burst run it (``auto`` picks one of them),
flat or double ring, every layout except packed THD and balanced.

:func:`sparse_cp_attention` keeps MTraining's defaults (block-striped layout, stripe 64, burst):
``sparse_cp_attention(q, k, v, pattern, **kw)`` is ``cp_attention(q, k, v, pattern=pattern,
layout="striped", stripe=64, algo="burst", **kw)``; it adds nothing else. Patch module attributes
on megatron_burst.masks.vertical_slash, not on this alias.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst.algorithms import cp_attention
from megatron_burst.masks import vertical_slash as _vertical_slash
from megatron_burst.masks.imbalance import pair_work  # noqa: F401
from megatron_burst.masks.imbalance import pattern_imbalance as imbalance  # noqa: F401
from megatron_burst.masks.vertical_slash import *  # noqa: F401,F403  re-exports exactly its __all__

__all__ = ["sparse_cp_attention"] + _vertical_slash.__all__ + ["imbalance", "pair_work"]


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
    :class:`megatron_burst.masks.dynamic.Dynamic` (budgets p_v, p_s, last_q) estimates MTraining's
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
