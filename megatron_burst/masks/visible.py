"""The dense visible set of a block pair: the layout's causal/full mask, documents and a sliding
window, intersected (what the engine's ``CPConfig.blocks`` asks for when there is no sparse pattern,
and the pair filter of a sparse one).

:func:`visible_blocks` returns (batch slice, rectangle) pairs, [] meaning skip the pair. Without
documents and window it is the layout's one :func:`~megatron_burst.masks.layout.block_mask` (the
fast path); with documents one list per group of samples sharing boundaries
(:func:`~megatron_burst.masks.documents.layout_document_blocks`); with a window those rectangles cut
by :func:`~megatron_burst.masks.window.window_blocks`. Results are cached per pair and mask.
"""
from __future__ import annotations

import functools
from typing import Optional

from megatron_burst.masks import documents as document_masks  # MERGE_ROWS read per call (patchable there)
from megatron_burst.masks.block import BlockMask
from megatron_burst.masks.documents import Documents, Partition, layout_document_blocks, rank_positions
from megatron_burst.masks.layout import block_mask
from megatron_burst.masks.window import Window, window_blocks

__all__ = ["visible_blocks"]


@functools.lru_cache(maxsize=4096)
def _windowed_blocks(bounds: Optional[tuple[int, ...]], layout: str, q_rank: int, kv_rank: int, world_size: int,
                     local_len: int, causal: bool, stripe: int, partition: Optional[Partition],
                     window: Window, merge: tuple) -> tuple[BlockMask, ...]:
    """The rectangles of a block pair under documents ``bounds`` (None: the layout's one mask) and
    ``window`` (cached: the same pairs come back every step and layer)."""
    if bounds is None:
        masks = [block_mask(layout, q_rank, kv_rank, world_size, local_len, causal, stripe)]
    else:
        masks = list(layout_document_blocks(bounds, layout, q_rank, kv_rank, world_size, local_len, causal, stripe,
                                            partition, *merge))
    q_pos = rank_positions(layout, q_rank, world_size, local_len, stripe, partition)
    kv_pos = rank_positions(layout, kv_rank, world_size, local_len, stripe, partition)
    return tuple(window_blocks(masks, q_pos, kv_pos, window, causal))


def visible_blocks(documents: Optional[Documents], layout: str, q_rank: int, kv_rank: int, world_size: int,
                   local_len: int, causal: bool, stripe: int = 1, q_rows: Optional[int] = None,
                   window: Window = None, merge: Optional[tuple] = None) -> list[tuple[slice, BlockMask]]:
    """Every (batch slice, visible rectangle) of a block pair; [] means skip the pair.

    Without documents: the layout's one causal/full :func:`~megatron_burst.masks.layout.block_mask` for
    all samples (the unchanged fast path). ``q_rows`` keeps only local query rows [0, q_rows)
    (sequence-level selective checkpointing's recompute). ``window`` (left, right) intersects
    everything with a sliding window (:func:`window_blocks`). ``merge``: (merge_rows, run_rows) of
    :func:`~megatron_burst.masks.documents.document_blocks`, by the device
    (:func:`~megatron_burst.masks.documents.merge_rows_for`; None: MERGE_ROWS, runs of any length).
    """
    merge = (document_masks.MERGE_ROWS, None) if merge is None else tuple(merge)
    if documents is None and window is None:
        mask = block_mask(layout, q_rank, kv_rank, world_size, local_len, causal, stripe)
        if q_rows is not None:
            mask = mask.clip_rows(q_rows)
        return [] if mask.kind == "empty" else [(slice(None), mask)]
    groups = documents.groups if documents is not None else ((0, None, None),)
    partition = documents.partition if documents is not None else None
    out = []
    for first, end, bounds in groups:
        batch = slice(first, end)
        if window is None:
            masks = layout_document_blocks(bounds, layout, q_rank, kv_rank, world_size, local_len, causal, stripe,
                                           partition, *merge)
        else:
            masks = _windowed_blocks(bounds, layout, q_rank, kv_rank, world_size, local_len, causal, stripe,
                                     partition, window, merge)
        for mask in masks:
            if q_rows is not None:
                mask = mask.clip_rows(q_rows)
            if mask.kind != "empty":
                out.append((batch, mask))
    return out
