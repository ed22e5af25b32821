"""Validation of a cp_attention call: the names it accepts and the local checks that run before
any collective (so every rank raises the same ValueError, naming the value, without hanging).

:func:`validate` checks the tensors, algorithm, layout and format; :func:`check_pattern_call`
the calls with a sparse ``pattern`` (ring and burst only, causal, not THD or balanced).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst.algorithms import ulysses
from megatron_burst.masks.documents import THD
from megatron_burst.masks.dynamic import Dynamic
from megatron_burst.masks.layout import BALANCED, check_layout, check_local_len
from megatron_burst.masks.vertical_slash import VerticalSlash
from megatron_burst.topology import USPTopology, check_ulysses_size

__all__ = ["CP_ALGOS", "RING_BACKWARDS", "PATTERN_ALGOS", "QKV_FORMATS", "validate", "check_pattern_call"]

CP_ALGOS = ("ring", "burst", "auto", "allgather", "ulysses", "usp")
RING_BACKWARDS = ("ring", "burst", "auto")
PATTERN_ALGOS = ("ring", "burst", "auto")  # the algorithms a sparse pattern runs on ("auto": ring or burst)
QKV_FORMATS = ("sbhd", "bshd", "thd")  # "thd": [t, h, d], one packed sequence (sbhd with b = 1)


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world_size: int, algo: str, layout: str,
             qkv_format: str, stripe: int, dropout_p: float, attn_bias: Optional[torch.Tensor],
             ulysses_size: Optional[int] = None, ring_backward: str = "auto") -> None:
    """Raise ValueError for anything cp_attention cannot do. Local checks only: safe before collectives."""
    if algo not in CP_ALGOS:
        raise ValueError(f"unknown algo {algo!r}: choose one of {', '.join(CP_ALGOS)}")
    if ring_backward not in RING_BACKWARDS:
        raise ValueError(f"unknown ring_backward {ring_backward!r}: choose one of {', '.join(RING_BACKWARDS)}")
    if layout != THD:
        check_layout(layout, stripe)
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"unknown qkv_format {qkv_format!r}: choose one of {', '.join(QKV_FORMATS)}")
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: attention dropout is not supported under context "
                         "parallelism; set attention dropout to 0 (Megatron: --attention-dropout 0)")
    if attn_bias is not None:
        raise ValueError("attn_bias is not supported by cp_attention; remove the attention bias "
                         "(ALiBi/relative bias) or run without context parallelism")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {qkv_format} [.., .., heads, head_dim], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in sequence/batch dims "
                         f"(format {qkv_format})")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} != k head dim {k.shape[3]}")
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not divisible by key/value heads {hkv} (GQA needs hq % hkv == 0)")
    local_len = q.shape[0] if qkv_format == "sbhd" else q.shape[1]
    if layout != THD:
        check_local_len(local_len, world_size, layout, stripe)
    if algo == "usp" and ulysses_size is None:
        raise ValueError("algo='usp' needs ulysses_size=U (the Ulysses group size; Megatron: "
                         "--hierarchical-context-parallel-sizes U W/U)")
    if algo in ("ulysses", "usp"):
        U = world_size if algo == "ulysses" else ulysses_size
        check_ulysses_size(world_size, U)
        ulysses.check_heads(hq, hkv, U, algo)


def check_pattern_call(pattern: object, *, algo: str, layout: str, qkv_format: str, causal: bool, group=None
                       ) -> "VerticalSlash | Dynamic":
    """The local checks of a call with a sparse ``pattern`` that need no shapes (before any
    collective); returns the pattern, "dynamic" as ``Dynamic()``. Names what cannot run: other
    algorithms than ring/burst (auto picks one of them), non-causal attention, packed THD."""
    if isinstance(pattern, str) and pattern == "dynamic":
        pattern = Dynamic()
    if not isinstance(pattern, (VerticalSlash, Dynamic)):
        raise ValueError(f"pattern={pattern!r}: pass megatron_burst.VerticalSlash(vertical, slash), 'dynamic' or "
                         "megatron_burst.dynamic_pattern.Dynamic(p_v, p_s, last_q)")
    if algo not in PATTERN_ALGOS:
        raise ValueError(f"algo={algo!r}: sparse attention runs on the ring schedules, choose 'ring' or 'burst' "
                         "(or 'auto', which picks one of them)")
    if isinstance(group, USPTopology) and group.ulysses_size > 1:
        raise ValueError("a sparse pattern runs on ring and burst over the CP group (or a CPTopology), not over a "
                         "USPTopology's Ulysses groups")
    if not causal:
        raise ValueError("causal=False with a sparse pattern: a vertical-slash pattern is causal (query i sees keys "
                         "j <= i only); pass causal=True")
    if layout == THD or qkv_format == "thd":
        raise ValueError("a sparse pattern does not run on packed THD batches (layout/qkv_format 'thd'): pass the "
                         "documents as cu_seqlens with layout 'contiguous', 'zigzag' or 'striped'")
    if layout == BALANCED:  # sparse plans are built from the fixed layouts' positions (sparse_plan)
        raise ValueError("a sparse pattern does not run on layout 'balanced' (placed by documents): use layout "
                         "'zigzag', 'contiguous' or 'striped' with the documents as cu_seqlens")
    return pattern
