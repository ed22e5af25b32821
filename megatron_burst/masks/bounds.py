"""Document boundaries as data: the one check every mask and placement applies to ``cu_seqlens``.

A boundary list is [0, b1, ..., S]: strictly increasing global token positions, document i being
[b_i, b_(i+1)). It arrives as an int32/int64 1-D tensor (Megatron's and flash-attn's convention) or
a sequence of ints; everything downstream takes the checked tuple of Python ints.
"""
from __future__ import annotations

import numbers
import operator
from typing import Optional

import torch

__all__ = ["checked_bounds"]


def checked_bounds(cu: object, seq_len: Optional[int], what: str) -> tuple[int, ...]:
    """One boundary list ``cu`` (int32/int64 1-D tensor or ints) as a tuple [0, ..., seq_len],
    strictly increasing; raises ValueError naming ``what`` otherwise. ``seq_len`` None: the
    sequence ends at the last boundary (a planner given boundaries alone)."""
    if isinstance(cu, torch.Tensor):
        if cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what} has dtype {cu.dtype}: document boundaries must be an int32 or int64 "
                             f"tensor, e.g. torch.tensor([0, ..., {seq_len}], dtype=torch.int32)")
        if cu.dim() != 1:
            raise ValueError(f"{what} has shape {tuple(cu.shape)}: pass a 1-D tensor [num_docs + 1] "
                             "(or one per sample in a list)")
        bounds = tuple(int(x) for x in cu.tolist())
    else:
        bounds = tuple(cu)
        # plain ints (the common case: lists from the data pipeline) need no per-element ABC check,
        # which cost the planner ~0.4 ms per 1000 documents
        if not set(map(type, bounds)) <= {int}:
            if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in bounds):
                raise ValueError(f"{what}={list(bounds)!r} must hold ints (global token positions)")
            bounds = tuple(int(x) for x in bounds)
    shown = list(bounds) if len(bounds) <= 12 else list(bounds[:5]) + ["..."] + list(bounds[-5:])
    if len(bounds) < 2:
        raise ValueError(f"{what}={shown} needs at least [0, {'S' if seq_len is None else seq_len}] (one document)")
    if bounds[0] != 0:
        raise ValueError(f"{what}={shown} starts at {bounds[0]}: the first boundary must be 0")
    if seq_len is not None and bounds[-1] != seq_len:
        raise ValueError(f"{what}={shown} ends at {bounds[-1]} but the global sequence has {seq_len} tokens "
                         f"(local length x CP size): the last boundary must be {seq_len}; pad the last "
                         "document or add a padding document")
    if not all(map(operator.lt, bounds, bounds[1:])):  # one C-level pass; the loop below only names the culprit
        for a, b in zip(bounds, bounds[1:]):
            if b <= a:
                raise ValueError(f"{what}={shown} is not strictly increasing ({a} then {b}): drop empty "
                                 "documents and sort the boundaries")
    return bounds
