"""Sliding windows as data (Megatron's ``window_size``): validation, and a block pair's
rectangles intersected with the window.

A window (left, right) lets query i see keys i-left ... i+right (i-left ... i when causal), a None
bound unbounded (:data:`Window`; :func:`check_window` maps Megatron's -1 to None and a window
unbounded on both sides to None, no window). :func:`window_blocks` intersects any list of
rectangles (the layout's mask, or documents') with the window, so every kept row of every
rectangle sees at least one key. Imports only :mod:`megatron_burst.masks.block`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_burst.masks.block import BlockMask

__all__ = ["Window", "check_window", "window_blocks"]

Window = Optional[tuple[Optional[int], Optional[int]]]  # (left, right); None = unbounded


def check_window(window: object) -> Window:
    """Validate a sliding window (Megatron's ``window_size``): (left, right) ints >= 0, -1 (or None)
    meaning unbounded; returns it with None for unbounded, or None for no window at all."""
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window={window!r} must be a pair (left, right), e.g. (4096, 0) for causal sliding-window "
                         "attention (query i sees keys i-left ... i); -1 means unbounded")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None or (isinstance(w, int) and not isinstance(w, bool) and w == -1):
            out.append(None)
        elif isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            out.append(int(w))
        else:
            raise ValueError(f"window={tuple(window)!r}: {side}={w!r} must be an int >= 0, or -1 for unbounded")
    return None if out == [None, None] else (out[0], out[1])


def window_blocks(masks: Sequence[BlockMask], q_pos: torch.Tensor, kv_pos: torch.Tensor, window: Window,
                  causal: bool) -> list[BlockMask]:
    """``masks`` (rectangles of queries at ``q_pos`` x keys at ``kv_pos``, increasing global
    positions) intersected with the sliding window: row i also needs
    q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right (right is 0 when causal).

    A rectangle wholly inside the window is kept; one wholly outside is dropped; any other becomes
    ``positions`` rectangles with the band, one per run of rows that see something (each row's
    visible columns form one interval, so every kept row sees at least one column).
    """
    if window is None:
        return list(masks)
    left, right = window[0], (0 if causal else window[1])
    out: list[BlockMask] = []
    for m in masks:
        if m.kind == "empty":
            continue
        qp, kp = q_pos[m.q_slice], kv_pos[m.kv_slice]
        q_lo, q_hi, k_lo, k_hi = int(qp[0]), int(qp[-1]), int(kp[0]), int(kp[-1])
        if (left is not None and k_hi < q_lo - left) or (right is not None and k_lo > q_hi + right):
            continue  # no pair of the rectangle is in the window
        if (left is None or k_lo >= q_hi - left) and (right is None or k_hi <= q_lo + right):
            out.append(m)  # every pair is: the rectangle's own mask decides
            continue
        m_len = kp.numel()
        lo = torch.zeros_like(qp) if left is None else torch.searchsorted(kp, qp - left)
        hi = torch.full_like(qp, m_len) if right is None else torch.searchsorted(kp, qp + right, right=True)
        if causal:
            hi = torch.minimum(hi, torch.searchsorted(kp, qp, right=True))
        q_doc, kv_doc = (m.q_doc, m.kv_doc) if m.kind == "positions" else (None, None)
        if q_doc is not None:
            lo = torch.maximum(lo, torch.searchsorted(kv_doc, q_doc))
            hi = torch.minimum(hi, torch.searchsorted(kv_doc, q_doc, right=True))
        sees = (lo < hi).tolist()
        lo, hi = lo.tolist(), hi.tolist()
        band = (left, right)
        a = 0
        while a < len(sees):
            if not sees[a]:
                a += 1
                continue
            b = a
            while b < len(sees) and sees[b]:
                b += 1
            ka, kb = lo[a], hi[b - 1]
            cut = lambda t, x, y: None if t is None else t[x:y]  # noqa: E731
            out.append(BlockMask("positions", m.q_start + a, m.q_start + b, m.kv_start + ka, m.kv_start + kb, 1,
                                 qp[a:b], kp[ka:kb], cut(q_doc, a, b), cut(kv_doc, ka, kb), band=band))
            a = b
    return out
