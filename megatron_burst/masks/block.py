"""A block pair's visible region as data: :class:`BlockMask`, the rectangle of a (local q block,
local kv block) pair that the kernels compute, with the mask inside it.

Every mask of the package ends here: the layouts' causal/full masks
(:func:`megatron_burst.masks.layout.block_mask`), documents and windows (``positions``
rectangles, :mod:`megatron_burst.masks.documents`, :mod:`megatron_burst.masks.window`) and
vertical-slash plans (``sparse`` and ``gather`` blocks, :mod:`megatron_burst.masks.vertical_slash`).

Invariants: coordinates are local rows and columns of the pair (rectangle [q_start, q_stop) x
[kv_start, kv_stop)); rows outside the rectangle receive nothing from the block; a rectangle's
operations (:meth:`BlockMask.clip_rows`, :meth:`BlockMask.shifted`, :meth:`BlockMask.restrict_kv`)
return masks that see a subset of the same (query, key) pairs, moved but never widened.
This module imports nothing else from the package.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["BlockMask", "HeadBands", "positions_visibility", "split_block_causal"]


@dataclass(frozen=True, eq=False)
class HeadBands:
    """Per-query-head bands of a ``positions`` block (a sparse pattern's slash runs, which differ
    between heads): head h sees kv_pos in [q_pos - left, q_pos + right] with (left, right) =
    ``bounds[h]`` ([h, 2] int64 on the CPU, both bounded; left + right < 0: the head sees nothing).
    ``keys`` (optional, [h, columns] bool on the CPU): head h sees only the block's columns marked
    for it (a pattern's vertical lines, gathered for all heads, each head seeing its own).
    ``holes`` (optional, [h, n, 2] int64 on the CPU): offsets q_pos - kv_pos in [lo, hi] that head h
    does not see although its band covers them (a pattern's slash runs, which other blocks hold);
    a hole with lo > hi is none (padding for heads with fewer).
    :attr:`envelope` = (max left, max right) bounds every head's band (host-side trimming reads it).
    Deliberately not a tuple: a kernel that unpacks ``left, right = band`` fails on it rather than
    running the envelope; the kernels that take it (reference, tiled, cpu_flash, triton_masked)
    check for it."""

    bounds: torch.Tensor
    keys: Optional[torch.Tensor] = None
    holes: Optional[torch.Tensor] = None

    def columns(self, start: int, stop: int) -> "HeadBands":
        """The same bands over the block's columns [start, stop) (``keys`` sliced)."""
        return self if self.keys is None else HeadBands(self.bounds, self.keys[:, start:stop], self.holes)

    @property
    def envelope(self) -> tuple[int, int]:
        left, right = self.bounds.max(0).values.tolist()
        return int(left), int(right)

    @property
    def heads(self) -> int:
        return self.bounds.shape[0]


@dataclass(frozen=True)
class BlockMask:
    """What part of a (local q block, local kv block) pair is visible.

    kind:
      * ``empty``: nothing visible, skip the block.
      * ``full``: q rows [q_start, q_stop) see kv rows [kv_start, kv_stop) entirely.
      * ``causal``: inside that rectangle, row i sees column j iff i - q_start >= j - kv_start.
      * ``block_causal``: inside the rectangle, row i sees column j iff
        (i - q_start) // block >= (j - kv_start) // block.
      * ``positions``: inside the rectangle, row i sees column j iff
        q_pos[i'] - left <= kv_pos[j'] <= q_pos[i'] + right with ``band`` = (left, right) (global
        token positions, both increasing; i' = i - q_start, j' = j - kv_start; a None bound is
        unbounded; the default (None, 0) is causal, a sliding window narrows it) and, when
        document ids are given, q_doc[i'] == kv_doc[j']. Either pair may be None (no position
        condition / one document). Document masks produce it (see
        :mod:`megatron_burst.masks.documents`): for one document whose causal pattern is none of the
        above (e.g. striped with an offset), or for a run of small adjacent documents merged into
        one kernel call. Rows may see nothing (output 0, lse -inf): a vertical-slash pattern's
        slash runs (``band`` = (hi, -lo): keys at offsets lo..hi) leave early rows empty.
      * ``sparse``: per-head block-sparse visibility (vertical-slash patterns): ``plan`` lists the
        64-row query tiles, their visible 64-column key tiles and per-head masks
        (megatron_burst.masks.vertical_slash); rows may see nothing (output 0, lse -inf).
      * ``gather``: per-row gathered keys (the scattered part of a sparse plan): ``plan`` is a
        megatron_burst.masks.vertical_slash.SparseRows for rows [q_start, q_stop); rows may see nothing.
    Rows outside [q_start, q_stop) receive nothing from this block.

    ``kv_index`` (a LongTensor of local kv rows, increasing; ``positions`` blocks of vertical-slash
    patterns only): the block's columns are those rows of the kv block, gathered
    (:meth:`kv_of`), and [kv_start, kv_stop) = [0, len(kv_index)) indexes them; their gradients
    scatter back (:meth:`add_kv_grad`). A pattern's vertical lines are such a gathered set.
    """

    kind: str
    q_start: int = 0
    q_stop: int = 0
    kv_start: int = 0
    kv_stop: int = 0
    block: int = 1
    # ``positions`` only: LongTensors [q_stop - q_start] and [kv_stop - kv_start] (CPU)
    q_pos: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    kv_pos: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    q_doc: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    kv_doc: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    # ``sparse``: the block-sparse plan (tuple of megatron_burst.masks.vertical_slash.SparseTile); ``gather``: a SparseRows
    plan: Optional[tuple] = field(default=None, compare=False, repr=False)
    # ``positions`` only: (left, right) bounds of kv_pos - q_pos (see kind), or per query head (HeadBands)
    band: "tuple | HeadBands" = (None, 0)
    # gathered columns (see above): local kv rows on the device of the kv block, or None (a slice)
    kv_index: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    @property
    def mask_data(self) -> tuple:
        """(q_pos, kv_pos, q_doc, kv_doc, band) of a ``positions`` block (see :func:`positions_visibility`)."""
        return self.q_pos, self.kv_pos, self.q_doc, self.kv_doc, self.band

    @property
    def q_slice(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def kv_slice(self) -> slice:
        return slice(self.kv_start, self.kv_stop)

    def kv_of(self, x: torch.Tensor) -> torch.Tensor:
        """The block's columns of a kv tensor [b, h, m, d]: rows kv_slice, or the gathered kv_index rows."""
        if self.kv_index is None:
            return x[:, :, self.kv_slice]
        return x.index_select(2, self.kv_index.to(x.device))

    def add_kv_grad(self, dst: torch.Tensor, grad: torch.Tensor) -> None:
        """dst [b, h, m, d] += the block's kv gradient ``grad`` [b, h, kv_rows, d] at its columns."""
        if self.kv_index is None:
            dst[:, :, self.kv_slice] += grad
        else:
            dst.index_add_(2, self.kv_index.to(dst.device), grad.to(dst.dtype))

    def clip_rows(self, rows: int) -> "BlockMask":
        """The same block restricted to q rows [0, rows) (columns no row there sees are dropped too)."""
        if self.kind == "empty" or rows >= self.q_stop:
            return self
        if rows <= self.q_start:
            return BlockMask("empty")
        height = rows - self.q_start
        if self.kind == "causal":  # rows [0, h) of a causal rectangle see columns [0, h): stays square
            kv_stop = min(self.kv_stop, self.kv_start + height)
        elif self.kind == "block_causal":
            kv_stop = min(self.kv_stop, self.kv_start + ((height - 1) // self.block + 1) * self.block)
        elif self.kind == "positions":  # the last kept row's position and document bound the columns
            seen = self.kv_stop - self.kv_start
            right = self.band.envelope[1] if isinstance(self.band, HeadBands) else self.band[1]
            if self.q_pos is not None and right is not None:
                last = self.q_pos[height - 1:height] + right
                seen = min(seen, int(torch.searchsorted(self.kv_pos, last, right=True)[0]))
            if self.q_doc is not None:
                seen = min(seen, int(torch.searchsorted(self.kv_doc, self.q_doc[height - 1:height], right=True)[0]))
            cut = lambda t, m: None if t is None else t[:m]  # noqa: E731
            band = self.band.columns(0, seen) if isinstance(self.band, HeadBands) else self.band
            return BlockMask("positions", self.q_start, rows, self.kv_start, self.kv_start + seen, 1,
                             cut(self.q_pos, height), cut(self.kv_pos, seen), cut(self.q_doc, height),
                             cut(self.kv_doc, seen), band=band,
                             kv_index=None if self.kv_index is None else self.kv_index[:seen])
        else:
            kv_stop = self.kv_stop
        return BlockMask(self.kind, self.q_start, rows, self.kv_start, kv_stop, self.block)

    def shifted(self, q_offset: int, kv_offset: int) -> "BlockMask":
        """The same region placed at (q_offset, kv_offset) inside a larger block (a block of blocks);
        a ``positions`` block keeps its per-row/column data (it is relative to the rectangle)."""
        if self.kind == "empty":
            return self
        if self.kv_index is not None:  # the columns are the gathered rows: move them, not the range
            return dataclasses.replace(self, q_start=self.q_start + q_offset, q_stop=self.q_stop + q_offset,
                                       kv_index=self.kv_index + kv_offset)
        return dataclasses.replace(self, q_start=self.q_start + q_offset, q_stop=self.q_stop + q_offset,
                                   kv_start=self.kv_start + kv_offset, kv_stop=self.kv_stop + kv_offset)

    def restrict_kv(self, kv_start: int, kv_stop: int) -> "BlockMask":
        """The same region restricted to kv rows [kv_start, kv_stop) (a piece of the kv block).

        A causal rectangle keeps its diagonal: cutting off leading columns moves its first visible
        row down by as many rows (for block_causal, ``kv_start`` must sit on a stripe boundary).
        """
        if self.kind == "empty":
            return self
        if self.kind == "positions":  # its rows may see nothing of a piece: document masks are not cut
            raise ValueError("restrict_kv does not cut 'positions' blocks (document masks): gather them whole")
        lo, hi = max(self.kv_start, kv_start), min(self.kv_stop, kv_stop)
        if lo >= hi:
            return BlockMask("empty")
        q_start = self.q_start
        if self.kind != "full":
            if self.kind == "block_causal" and (lo - self.kv_start) % self.block:
                raise ValueError(f"restrict_kv({kv_start}, {kv_stop}) cuts a stripe of {self.block}")
            q_start += lo - self.kv_start
        if q_start >= self.q_stop:
            return BlockMask("empty")
        return BlockMask(self.kind, q_start, self.q_stop, lo, hi, self.block)

    def dense(self, q_len: int, kv_len: int) -> torch.Tensor:
        """Boolean [q_len, kv_len] visibility matrix (tests and fallback kernels); [h, q_len, kv_len]
        for a ``positions`` block with per-head bands."""
        heads = (self.band.heads,) if isinstance(self.band, HeadBands) and self.kind == "positions" else ()
        m = torch.zeros(*heads, q_len, kv_len, dtype=torch.bool)
        if self.kind == "empty":
            return m
        rows = torch.arange(self.q_stop - self.q_start)[:, None]
        cols = torch.arange(self.kv_stop - self.kv_start)[None, :]
        if self.kind == "full":
            sub = torch.ones(rows.shape[0], cols.shape[1], dtype=torch.bool)
        elif self.kind == "causal":
            sub = rows >= cols
        elif self.kind == "positions":
            sub = positions_visibility(*self.mask_data, rows.shape[0], cols.shape[1])
        else:
            sub = rows // self.block >= cols // self.block
        if self.kv_index is not None:
            m[..., self.q_slice, :] = m[..., self.q_slice, :].index_copy(-1, self.kv_index.cpu(), sub)
        else:
            m[..., self.q_slice, self.kv_slice] = sub
        return m


def positions_visibility(q_pos: Optional[torch.Tensor], kv_pos: Optional[torch.Tensor], q_doc: Optional[torch.Tensor],
                         kv_doc: Optional[torch.Tensor], band: tuple, sq: int, sk: int,
                         device: Optional[torch.device] = None) -> torch.Tensor:
    """Boolean [sq, sk] visibility of a ``positions`` block: q_pos - left <= kv_pos <= q_pos + right
    with band = (left, right) (if positions are given; a None bound is unbounded) and
    q_doc == kv_doc (if given), from the (already sliced) per-row and per-column vectors; [h, sq, sk]
    when the band is per head (:class:`HeadBands`)."""
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if isinstance(band, HeadBands):
        diff = q_pos.to(device)[:, None] - kv_pos.to(device)[None, :]
        bounds = band.bounds.to(device)
        vis = (diff >= -bounds[:, 1, None, None]) & (diff <= bounds[:, 0, None, None])
        if band.keys is not None:
            vis &= band.keys.to(device)[:, None, :]
        if band.holes is not None:
            for hole in band.holes.to(device).unbind(1):  # [h, 2]: one hole of every head
                lo, hi = hole[:, 0, None, None], hole[:, 1, None, None]
                vis &= (diff < lo) | (diff > hi)
    elif q_pos is not None:
        left, right = band
        diff = q_pos.to(device)[:, None] - kv_pos.to(device)[None, :]  # q_pos - kv_pos
        if right is not None:
            vis &= diff >= -right
        if left is not None:
            vis &= diff <= left
    if q_doc is not None:
        vis &= kv_doc.to(device)[None, :] == q_doc.to(device)[:, None]
    return vis


def split_block_causal(mask: BlockMask) -> list[BlockMask]:
    """A ``block_causal`` rectangle as one ``causal`` rectangle and the rest of its diagonal stripes.

    In rectangle offsets, block-causal (i // b >= j // b) is causal (i >= j) plus, inside each
    diagonal stripe square, the pairs above its diagonal (i < j, i // b == j // b). The first part is
    a ``causal`` block of the same rectangle (one fused dense call: cuDNN / flash on CUDA, any
    shape, top-left aligned); the second a ``positions`` block (positions = offsets, documents =
    stripes, band (-1, None): columns after the row, same stripe) of b (b - 1) / 2 pairs per stripe
    -- the Triton masked kernel walks only the diagonal tiles. Each visible pair is in exactly one
    part; their outputs merge as any blocks of a pair do (each stripe's last row sees nothing in the
    second part: out 0, lse -inf). Why: on a GPU nearly every pair then runs in one cuDNN call
    instead of a Triton tile-mask kernel (~1.7x slower per pair on an H100). Other kinds, and
    block 1 (block-causal is causal), come back as they are.
    """
    if mask.kind != "block_causal":
        return [mask]
    causal = BlockMask("causal", mask.q_start, mask.q_stop, mask.kv_start, mask.kv_stop)
    rows, cols = mask.q_stop - mask.q_start, mask.kv_stop - mask.kv_start
    if mask.block == 1 or rows == 0 or cols == 0:
        return [causal]
    q_pos, kv_pos, q_doc, kv_doc = _stripe_vectors(rows, cols, mask.block)
    upper = BlockMask("positions", mask.q_start, mask.q_stop, mask.kv_start, mask.kv_stop, 1, q_pos, kv_pos, q_doc,
                      kv_doc, band=(-1, None))
    return [causal, upper]


@functools.lru_cache(maxsize=64)
def _stripe_vectors(rows: int, cols: int, block: int) -> tuple[torch.Tensor, ...]:
    """(q_pos, kv_pos, q_doc, kv_doc) of :func:`split_block_causal`'s second part: offsets and stripe
    ids (CPU LongTensors). Cached: the same objects every step, so kernels' per-block caches hit."""
    q_pos, kv_pos = torch.arange(rows), torch.arange(cols)
    return q_pos, kv_pos, q_pos // block, kv_pos // block
