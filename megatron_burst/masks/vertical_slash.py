"""Vertical-slash sparse patterns and their plans (MTraining's pattern): data, below the kernels
and the algorithms that read it.

A :class:`VerticalSlash` pattern gives every query head h a set of vertical lines (global key
indices) and slash lines (diagonal offsets >= 0): query i sees key j <= i iff j is a vertical line
of h or i - j is a slash offset of h. The pattern is data, like document masks and windows:
:func:`pattern_blocks` turns a (q rank, kv rank) block pair into a plan (:func:`plan_pair`, built
from the lines: no queries x keys matrix) of two parts -- for every 64-row query tile, the key
columns many of its cells see (vertical lines, a band) with the per-head visibility there
(:class:`PackedTiles`, computed as tiles by :mod:`megatron_burst.kernels.block_sparse` or its
Triton twin on CUDA); and the scattered rest (isolated slashes, :class:`SparseRows`), gathered row
by row by :mod:`megatron_burst.kernels.row_gather`. Which columns go where is
:func:`dense_column_for` the device: on CPU the scattered pairs are gathered, on CUDA every visible
column is a tile column. A pair with nothing visible is skipped like a causal block in the future.

**Composition with documents and windows.** A pattern is causal (j <= i), so packed documents
(``cu_seqlens``) and a sliding window (``window=(left, right)``) only add a lower bound on the key
position each query may see: its document's start and i - left (:func:`key_floor`, non-decreasing
in i). The visible set is pattern AND causal AND same document AND window; the planner applies
the floor everywhere it looks (the counts, the tiles' bitmasks, the gathered pairs), so the plan
is exactly that intersection, and a pair the dense document/window mask leaves empty is skipped
without planning.

Patterns, plans and their tables live on one device, the pattern's (the engine moves a pattern to
q's device once, :meth:`VerticalSlash.to`). The planner works on whole tensors there: per block
pair it reads a handful of sizes back to the host (a constant number of synchronisations, however
many tiles the pair has) and builds the plan in the packed form the kernels read.

A query that sees no key at all (no vertical line before it and no slash through it) gets output
0 and zero gradients (FlashAttention's convention for fully masked rows).

:func:`megatron_burst.masks.imbalance.pattern_imbalance` measures how evenly a pattern's work
spreads over ranks and ring steps (MTraining's worker- and step-level imbalance degrees).

This module imports only masks (:mod:`~megatron_burst.masks.block`, ``layout``, ``documents``,
``window`` and ``visible``); the attention itself is ``megatron_burst.cp_attention(...,
pattern=...)`` (and the :func:`megatron_burst.sparse.sparse_cp_attention` wrapper).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from megatron_burst import env
from megatron_burst.masks.block import BlockMask, HeadBands
from megatron_burst.masks.documents import Documents, document_ids
from megatron_burst.masks.layout import layout_indices_on
from megatron_burst.masks.visible import visible_blocks
from megatron_burst.masks.window import Window

__all__ = ["TILE", "COLUMNS", "CPU_DENSE_COLUMN", "LONG_RUN", "PLAN_CHUNK", "PLAN_MASKS", "MAX_RUN_BLOCKS",
           "dense_column_for", "runs_apart_for", "SharedRuns", "offset_gaps", "run_blocks", "head_run_blocks", "head_line_blocks",
           "dense_runs_per_head",
           "VerticalSlash", "pack_bits",
           "unpack_bits", "SparseTile", "TilePlan", "PackedTiles", "as_packed", "SparseRows", "key_floor", "plan_pair", "column_counts", "plan_tiles", "pattern_blocks"]

# rows and columns of the block-sparse kernel's tiles ($MEGATRON_BURST_SPARSE_TILE overrides, for measuring)
TILE = env.sparse_tile(64)
# key columns a query tile gathers: "exact" (the columns some row and head of the tile sees: a
# vertical line costs one column, not a 64-wide tile; 1.9x faster than "tiles" at 16K tokens,
# 93.5 % sparse, see bench sparse) or "tiles" (whole 64-column tiles with any visible pair)
COLUMNS = env.sparse_columns("exact")
# On CPU a key column goes to the tile matmul when at least this fraction of the tile's (head, row)
# cells see it, else its visible pairs are gathered row by row (kernels/row_gather.py). Measured on
# CPU (16K tokens, W = 4, fwd + bwd): a gathered pair costs ~16x a tile score (680 vs 41 ns), so
# 1/16 is the break-even: an isolated slash (1/64 of a tile's cells per column) is gathered,
# vertical lines and a dense band stay in the matmul. See dense_column_for.
CPU_DENSE_COLUMN = 0.0625
# $MEGATRON_BURST_SPARSE_DENSE_COLUMN overrides the threshold on every device (for measuring)
_DENSE_COLUMN_OVERRIDE = env.sparse_dense_column()
# slash runs at least this long are counted per column by binary search instead of pair by pair
LONG_RUN = 16
# elements of the planner's largest temporaries (positions, masks of a chunk of tiles): 16M
PLAN_CHUNK = 1 << 24
# a pattern keeps the plans of this many masks (document boundaries x window): documents change
# every batch, so a static pattern must not keep every batch's plans
PLAN_MASKS = 4


# Slash runs as dense blocks. A pattern whose query heads share one set of lines, with at most
# MAX_RUN_BLOCKS runs of consecutive slash offsets (MTraining picks slash offsets in pools of 64:
# its patterns are a local band and a few pools), runs as "positions" blocks instead of sparse
# tiles: one block per run [lo, hi] (every key at offset lo..hi: band (hi, -lo)) and one over the
# gathered vertical keys at the other offsets, the runs cut out as holes (a pair on both a vertical
# line and a run is the run's). Why: an isolated diagonal is 1/64 of the tile columns it adds to a 64-row query tile,
# and the block-sparse kernel gathers columns one by one; a band is a dense rectangle edge for
# the fused masked kernels (torch's varlen flash with a window, or Triton). MEGATRON_BURST_SPARSE_RUNS
# overrides the device rule (runs_apart_for) for measuring and for CPU tests of the GPU's plans.
MAX_RUN_BLOCKS = 16
_RUNS_OVERRIDE = env.sparse_runs()


def runs_apart_for(device: torch.device) -> bool:
    """Whether patterns planned on ``device`` put shared slash runs in dense blocks (see
    MAX_RUN_BLOCKS): on CUDA yes; on CPU no (its gathered-pairs plan is measured there);
    $MEGATRON_BURST_SPARSE_RUNS overrides both."""
    if _RUNS_OVERRIDE is not None:
        return _RUNS_OVERRIDE
    return torch.device(device).type == "cuda"


def dense_column_for(device: torch.device) -> float:
    """The split between a plan's two parts on ``device`` (:func:`plan_pair`'s default
    ``dense_column``): on CPU CPU_DENSE_COLUMN (scattered pairs are gathered row by row, measured
    faster there); elsewhere 0, every visible column in the tiles (on CUDA the Triton tile kernel
    runs every sparse block; the row gathers are plain torch). $MEGATRON_BURST_SPARSE_DENSE_COLUMN
    overrides both."""
    if _DENSE_COLUMN_OVERRIDE is not None:
        return float(_DENSE_COLUMN_OVERRIDE)
    return CPU_DENSE_COLUMN if torch.device(device).type == "cpu" else 0.0


@dataclass(frozen=True)
class SharedRuns:
    """A pattern whose query heads all have the same lines, as dense pieces (see MAX_RUN_BLOCKS):
    ``vertical`` [nv] the distinct vertical key positions, increasing (CPU int64); ``runs`` the
    maximal runs of consecutive slash offsets, ((lo, hi), ...) increasing."""

    vertical: torch.Tensor
    runs: tuple

    def gaps(self) -> tuple:
        """The offsets >= 0 outside every run, as ((lo, hi), ...) with hi None for the last, unbounded one."""
        return offset_gaps(self.runs, None)


def offset_gaps(runs: Sequence[tuple[int, int]], last: Optional[int]) -> tuple:
    """The offsets >= 0 outside the increasing, disjoint runs ((lo, hi), ...), as ((lo, hi), ...); the
    last gap ends at ``last`` (None: unbounded)."""
    out, lo = [], 0
    for a, b in runs:
        if a > lo:
            out.append((lo, a - 1))
        lo = b + 1
    out.append((lo, last))
    return tuple(out)


@dataclass(eq=False)  # hashed by identity: plans are cached per pattern object
class VerticalSlash:
    """vertical: int tensor [h, kv] of global key indices; slash: int tensor [h, ks] of diagonal
    offsets >= 0 (h = query heads; under GQA each query head has its own lines). Query i of head
    h sees key j <= i iff j in vertical[h] or i - j in slash[h]. Repeated entries are harmless.
    Both on one device, the pattern's (:attr:`device`): its tables and plans are built there."""

    vertical: torch.Tensor
    slash: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.vertical.device

    def to(self, device: torch.device) -> "VerticalSlash":
        """This pattern on ``device``: itself when its lines are there, else a copy made once and
        kept (so its plans are built once too)."""
        device = torch.device(device)
        if self.vertical.device == device and self.slash.device == device:
            return self
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            copies[device] = VerticalSlash(self.vertical.to(device), self.slash.to(device))
        return copies[device]

    def check(self, seq_len: int, heads: int) -> None:
        """Raise ValueError unless the pattern fits ``heads`` query heads over ``seq_len`` tokens
        (one read-back of the lines' extremes)."""
        lines = (("vertical", self.vertical), ("slash", self.slash))
        for name, t in lines:
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 2:
                raise ValueError(f"VerticalSlash.{name} must be an int32/int64 tensor [heads, lines], got "
                                 f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
            if t.shape[0] != heads:
                raise ValueError(f"VerticalSlash.{name} has {t.shape[0]} heads but q has {heads} query heads: "
                                 "give one row of lines per query head")
        if self.slash.device != self.vertical.device:
            raise ValueError(f"VerticalSlash.vertical is on {self.vertical.device} but slash on {self.slash.device}: "
                             "give both on one device")
        present = [(name, t) for name, t in lines if t.numel()]
        if present:
            ends = torch.stack([e for _, t in present for e in (t.min().long(), t.max().long())]).tolist()
            for i, (name, _) in enumerate(present):
                lo, hi = ends[2 * i], ends[2 * i + 1]
                if lo < 0 or hi >= seq_len:
                    raise ValueError(f"VerticalSlash.{name} holds values in [{lo}, {hi}], outside "
                                     f"[0, {seq_len}) for a global sequence of {seq_len} tokens")

    def lookup(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_vertical [h, seq_len] bool, is_slash [h, seq_len] uint8) tables on the pattern's device
        (cached; uint8 for torch.gather, ~6x faster on CPU than indexing a bool table)."""
        is_v, is_s, _, _ = self._tables(seq_len)
        return is_v, is_s

    def diagonal_table(self, seq_len: int, long_runs_only: bool = False, short_only: bool = False) -> torch.Tensor:
        """[2 seq_len, h] uint8 on the pattern's device (cached): row seq_len + o holds, per head,
        whether o is a slash offset (``long_runs_only``: an offset of a run of at least LONG_RUN,
        :meth:`slash_runs`); rows below seq_len (a query before its key) hold 0. The planner looks
        up query q and key j at row q - j + seq_len: an int32 index, no clamp, the heads in one row."""
        if short_only:  # the offsets of runs shorter than LONG_RUN (long runs in dense blocks)
            cached = self.__dict__.setdefault("_short_diagonal", {})
            if seq_len not in cached:
                _, _, diagonal, long_diagonal = self._tables(seq_len)
                cached.clear()
                cached[seq_len] = diagonal & (1 - long_diagonal)
            return cached[seq_len]
        return self._tables(seq_len)[3 if long_runs_only else 2]

    def _tables(self, seq_len: int) -> tuple[torch.Tensor, ...]:
        """(is_vertical, is_slash, diagonal, diagonal of the long runs), built once per seq_len."""
        cached = self.__dict__.get("_lookup")
        if cached is None or cached[0] != seq_len:
            h, device = self.vertical.shape[0], self.device
            is_v = torch.zeros(h, seq_len, dtype=torch.bool, device=device)
            is_s = torch.zeros(h, seq_len, dtype=torch.uint8, device=device)
            is_v.scatter_(1, self.vertical.long(), True)
            is_s.scatter_(1, self.slash.long(), 1)
            diagonal = torch.zeros(2 * seq_len, h, dtype=torch.uint8, device=device)
            diagonal[seq_len:] = is_s.t()
            _, _, long_head, lo, hi = self.slash_runs()  # runs as +1 at lo, -1 after hi, summed up
            edges = torch.zeros(seq_len + 1, h, dtype=torch.int32, device=device)
            ones = torch.ones(lo.numel(), dtype=torch.int32, device=device)
            edges.index_put_((lo, long_head), ones, accumulate=True)
            edges.index_put_((hi + 1, long_head), -ones, accumulate=True)
            long_diagonal = torch.zeros(2 * seq_len, h, dtype=torch.uint8, device=device)
            long_diagonal[seq_len:] = edges[:seq_len].cumsum(0) > 0
            cached = (seq_len, is_v, is_s, diagonal, long_diagonal)
            self._lookup = cached
        return cached[1:]

    def shared_runs(self, seq_len: int) -> Optional[SharedRuns]:
        """The pattern as :class:`SharedRuns` when every query head has the same lines and the slash
        offsets form at most MAX_RUN_BLOCKS runs; else None (cached per seq_len; one read-back)."""
        cached = self.__dict__.setdefault("_shared", {})
        if seq_len not in cached:
            is_v, is_s = self.lookup(seq_len)
            s0 = is_s[0].bool()
            starts = s0.clone()
            starts[1:] &= ~s0[:-1]
            ends = s0.clone()
            ends[:-1] &= ~s0[1:]
            same, n_runs = torch.stack([(is_v == is_v[:1]).all() & (is_s == is_s[:1]).all(), starts.sum()]).tolist()
            result = None
            if same and n_runs <= MAX_RUN_BLOCKS:
                lo, hi = starts.nonzero().squeeze(1).tolist(), ends.nonzero().squeeze(1).tolist()
                result = SharedRuns(is_v[0].nonzero().squeeze(1).cpu(), tuple(zip(lo, hi)))
            cached[seq_len] = result
        return cached[seq_len]

    def slash_runs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slash offsets as runs of consecutive distinct offsets, on the pattern's device (cached):
        (short_head [n], short_offset [n]) every offset of a run shorter than LONG_RUN with its head,
        and (long_head [m], long_lo [m], long_hi [m]) the runs [lo, hi] of at least LONG_RUN offsets."""
        cached = self.__dict__.get("_runs")
        if cached is not None:
            return cached
        h, ks = self.slash.shape
        device = self.device
        off = self.slash.long().sort(1).values.reshape(-1)  # [h * ks], sorted per head
        at_head_start = torch.arange(h * ks, device=device) % ks == 0
        new = torch.ones(h * ks, dtype=torch.bool, device=device)  # first of equal offsets
        new[1:] = off[1:] != off[:-1]
        new |= at_head_start
        start = new.clone()  # first offset of a run of consecutive ones (runs never span heads)
        start[1:] &= off[1:] != off[:-1] + 1
        start |= at_head_start
        run = start.cumsum(0) - 1  # the run of every entry
        length = torch.zeros(h * ks, dtype=torch.long, device=device).index_add_(0, run, new.long())
        long_entry = length[run] >= LONG_RUN
        short = new & ~long_entry
        first_long = start & long_entry
        n_short, *per_head = torch.cat([short.sum()[None], first_long.view(h, ks).sum(1)]).tolist()
        s_idx = torch.nonzero_static(short, size=n_short).squeeze(1)
        l_idx = torch.nonzero_static(first_long, size=sum(per_head)).squeeze(1)  # ordered by head
        lo = off[l_idx]
        cached = (s_idx // ks, off[s_idx], l_idx // ks, lo, lo + length[run[l_idx]] - 1)
        self._runs = cached
        self._long_runs_per_head = per_head
        return cached

    def long_runs_per_head(self) -> list[int]:
        """How many long runs (:meth:`slash_runs`) each head has (host ints, cached)."""
        self.slash_runs()
        return self._long_runs_per_head

    def visibility(self, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [h, len(q_pos), len(kv_pos)]: which query sees which key, per head (on the pattern's device)."""
        is_v, is_s = self.lookup(seq_len)
        q_pos, kv_pos = q_pos.to(self.device), kv_pos.to(self.device)
        return _visible(is_v, is_s, q_pos[:, None], kv_pos[None, :])

    def dense(self, seq_len: int) -> torch.Tensor:
        """Boolean [h, seq_len, seq_len] visibility (the definition tests check against)."""
        pos = torch.arange(seq_len, device=self.device)
        return self.visibility(seq_len, pos, pos)


def _visible(is_v: torch.Tensor, is_s: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """Boolean [h, *shape]: whether query position q_pos sees key position kv_pos in each head, for
    broadcastable position tensors of broadcast shape ``shape`` (the pattern's lookup tables).
    Positions must lie in [0, seq_len); a query before its key sees nothing."""
    h = is_s.shape[0]
    diff = q_pos - kv_pos
    shape = diff.shape
    on_slash = torch.gather(is_s, 1, diff.clamp_min(0).reshape(1, -1).expand(h, -1)).view(h, *shape)
    on_vertical = is_v.index_select(1, kv_pos.reshape(-1)).view(h, *kv_pos.shape)
    return (diff >= 0) & (on_vertical | on_slash.bool())


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool [..., n] -> int32 [..., ceil(n / 32)]: column c at bit c % 32 of word c // 32 (bit 31 is
    the sign bit: two's complement, as the kernels read it). A few whole-tensor ops (weighted sums
    of each 16-bit half; no per-bit loop: the planner packs a chunk of tiles per call)."""
    n = mask.shape[-1]
    words = -(-n // 32)
    if n % 32:
        mask = torch.nn.functional.pad(mask, (0, words * 32 - n))
    halves = mask.reshape(*mask.shape[:-1], words, 2, 16).to(torch.int32)
    weights = torch.ones(16, dtype=torch.int32, device=mask.device).bitwise_left_shift_(
        torch.arange(16, dtype=torch.int32, device=mask.device))
    half = (halves * weights).sum(-1, dtype=torch.int32)  # [..., words, 2], each < 2**16: no overflow
    # the high half shifted into bits 16..31 (bit 31 wraps to the sign, as two's complement wants)
    return half[..., 0] | (half[..., 1] << 16)


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """Int32 [..., w] -> bool [..., n] (n <= 32 w), the inverse of :func:`pack_bits`."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[..., None] >> shifts) & 1  # an arithmetic shift: the sign bit does not reach bit 0
    return bits.view(*words.shape[:-1], words.shape[-1] * 32)[..., :n].bool()


@dataclass(frozen=True)
class SparseTile:
    """One query tile written out: rows [q0, q1), the key columns ``cols`` it gathers (LongTensor,
    local key indices) and the visibility ``vis`` [h, q1-q0, len(cols)] bool. Hand-written plans
    (tests) are tuples of them, converted once by :meth:`PackedTiles.from_tiles`; iterating a
    PackedTiles yields them."""

    q0: int
    q1: int
    cols: torch.Tensor
    vis: torch.Tensor


class TilePlan(tuple):
    """Hand-written tiles (a tuple of SparseTile) that can carry the packed forms the kernels convert
    them to once, so those live as long as the tiles."""


@dataclass(frozen=True, eq=False)
class PackedTiles:
    """The tile part of a block pair's plan, as flat tensors on one device: what :func:`plan_pair`
    builds and both tile kernels read (kernels/block_sparse.py, kernels/triton_block_sparse.py).

    T tiles. Tile t covers local query rows [q0[t], q1[t]) (at most ``max_rows``; tiles' rows are
    disjoint and increase with t) and gathers the local key columns
    ``cols[col_start[t]:col_end[t]]`` (at most ``max_cols``). Its visibility is a bitmask: in head
    h, row q0[t] + r sees the tile's c-th column iff bit c % 32 of the int32 word
    ``vis[vis_start[t] + h * vis_head[t] + r * vis_words[t] + c // 32]`` is set
    (``vis_words[t]`` >= ceil(columns / 32) words per (head, row)).

    * q0, q1 [T] int32; col_start [T] (or [T + 1], the running sum of hand-written tiles) and
      col_end [T] int64; cols [N] int32;
    * vis_start, vis_head [T] int64; vis_words [T] int32; vis [M] int32;
    * heads: the query heads of the visibility; rows: q must have at least this many rows (the
      last q1); keys: k must have at least this many rows (a bound on the largest column + 1);
    * words: the words per row when every tile's visibility has the planner's uniform layout
      ([T, heads, max_rows, words], tile t from word t * heads * max_rows * words), else None.

    The planner lays out every tile alike: columns packed tile after tile (col_start = running
    sum), visibility [T, heads, max_rows, words]. Host-side sizes are plain ints, so a kernel needs
    no read-back to use the plan. Caches of derived forms (another device, rows clipped, the
    torch kernel's padded batch) are kept on the object and die with it.
    """

    q0: torch.Tensor
    q1: torch.Tensor
    col_start: torch.Tensor
    col_end: torch.Tensor
    cols: torch.Tensor
    vis_start: torch.Tensor
    vis_head: torch.Tensor
    vis_words: torch.Tensor
    vis: torch.Tensor
    heads: int
    max_rows: int
    max_cols: int
    rows: int
    keys: int
    words: Optional[int] = None

    _TENSORS = ("q0", "q1", "col_start", "col_end", "cols", "vis_start", "vis_head", "vis_words", "vis")

    @property
    def tiles(self) -> int:
        return self.q0.numel()

    @property
    def device(self) -> torch.device:
        return self.q0.device

    @property
    def block_m(self) -> int:
        """Tile rows padded to a power of two, at least 16 (the Triton kernels' BLOCK_M)."""
        return max(16, 1 << max(0, self.max_rows - 1).bit_length())

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self._TENSORS)

    def __len__(self) -> int:
        return self.tiles

    def __bool__(self) -> bool:
        return self.tiles > 0

    def to(self, device: torch.device) -> "PackedTiles":
        """These tiles on ``device`` (itself when already there; a copy made once otherwise)."""
        device = torch.device(device)
        if self.device == device:
            return self
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            copies[device] = PackedTiles(*(getattr(self, n).to(device) for n in self._TENSORS), self.heads,
                                         self.max_rows, self.max_cols, self.rows, self.keys, self.words)
        return copies[device]

    def first_rows(self, q_rows: int) -> "PackedTiles":
        """These tiles limited to rows < q_rows (tiles starting there dropped; cached per q_rows;
        one read-back)."""
        if q_rows >= self.rows:
            return self
        clipped = self.__dict__.setdefault("_clipped", {})
        if q_rows not in clipped:
            bound = torch.full((1,), q_rows, dtype=self.q0.dtype, device=self.device)
            keep = int(torch.searchsorted(self.q0, bound)[0])  # tiles starting before q_rows
            cut = lambda t: t[:keep]  # noqa: E731
            clipped[q_rows] = PackedTiles(cut(self.q0), cut(self.q1).clamp(max=q_rows), cut(self.col_start),
                                          cut(self.col_end), self.cols, cut(self.vis_start), cut(self.vis_head),
                                          cut(self.vis_words), self.vis, self.heads, self.max_rows, self.max_cols,
                                          min(self.rows, q_rows), self.keys, self.words)
        return clipped[q_rows]

    def __iter__(self) -> Iterator[SparseTile]:
        """The tiles written out as SparseTile (reads every tile back: for tests and inspection)."""
        q0, q1 = self.q0.tolist(), self.q1.tolist()
        c0, c1 = self.col_start[:self.tiles].tolist(), self.col_end.tolist()
        v0, vh, vw = self.vis_start.tolist(), self.vis_head.tolist(), self.vis_words.tolist()
        for t in range(self.tiles):
            rows, nc = q1[t] - q0[t], c1[t] - c0[t]
            at = (v0[t] + torch.arange(self.heads, device=self.device)[:, None, None] * vh[t]
                  + torch.arange(rows, device=self.device)[None, :, None] * vw[t]
                  + torch.arange(vw[t], device=self.device)[None, None, :])
            yield SparseTile(q0[t], q1[t], self.cols[c0[t]:c1[t]].long(), unpack_bits(self.vis[at], nc))

    @classmethod
    def from_tiles(cls, tiles: Sequence[SparseTile], heads: int, device: torch.device) -> "PackedTiles":
        """Hand-written tiles packed tile after tile on ``device`` (a host loop over the tiles).

        Raises ValueError if a tile's visibility is not [heads, q1 - q0, len(cols)], tiles' rows
        overlap or an index is negative (the kernels index memory by them unchecked).
        """
        device = torch.device(device)
        ordered = sorted(tiles, key=lambda t: t.q0)
        q0, q1, counts, words, masks = [], [], [], [], []
        end = 0
        for i, t in enumerate(ordered):
            rows, nc = t.q1 - t.q0, t.cols.numel()
            if tuple(t.vis.shape) != (heads, rows, nc):
                raise ValueError(f"sparse plan tile {i} (rows [{t.q0}, {t.q1}), {nc} columns) has visibility "
                                 f"{tuple(t.vis.shape)}; expected [{heads}, {rows}, {nc}] for {heads} query heads")
            if t.q0 < end:
                raise ValueError(f"sparse plan tiles overlap at row {t.q0}: the kernel writes each tile's rows once")
            if t.q0 < 0 or (nc and int(t.cols.min()) < 0):
                raise ValueError(f"sparse plan tile {i} has rows [{t.q0}, {t.q1}) and a column "
                                 f"{int(t.cols.min()) if nc else None}: indices must be >= 0")
            end = max(end, t.q1)
            q0.append(t.q0)
            q1.append(t.q1)
            counts.append(nc)
            m = pack_bits(t.vis.to(device=device, dtype=torch.bool))
            words.append(m.shape[-1])
            masks.append(m.reshape(-1))
        as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        col_start = torch.cat([zero, as_tensor(counts, torch.int64).cumsum(0)])
        vis_start = torch.cat([zero, as_tensor([m.numel() for m in masks], torch.int64).cumsum(0)])[:-1]
        cols = (torch.cat([t.cols.to(device=device, dtype=torch.int32) for t in ordered]) if ordered
                else torch.zeros(0, dtype=torch.int32, device=device))
        vis = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.int32, device=device)
        return cls(as_tensor(q0, torch.int32), as_tensor(q1, torch.int32), col_start, col_start[1:], cols, vis_start,
                   as_tensor([(b - a) * w for a, b, w in zip(q0, q1, words)], torch.int64),
                   as_tensor(words, torch.int32), vis, heads, max((b - a for a, b in zip(q0, q1)), default=0),
                   max(counts, default=0), max(q1, default=0), int(cols.max()) + 1 if cols.numel() else 0)


def as_packed(plan, heads: int, device: torch.device) -> PackedTiles:
    """``plan`` as PackedTiles on ``device`` for ``heads`` query heads: a PackedTiles itself (moved
    once if elsewhere); hand-written tiles converted (once per device for a TilePlan, cached on it)."""
    device = torch.device(device)
    if isinstance(plan, PackedTiles):
        if plan.heads != heads:
            raise ValueError(f"sparse plan has visibility for {plan.heads} query heads but q has {heads}")
        return plan.to(device)
    if not hasattr(plan, "__dict__"):
        return PackedTiles.from_tiles(plan, heads, device)
    store = plan.__dict__.setdefault("_packed", {})
    if device not in store or store[device].heads != heads:
        store[device] = PackedTiles.from_tiles(plan, heads, device)
    return store[device]


@dataclass(frozen=True)
class SparseRows:
    """A group of the row-gathered part of a block-sparse plan (kernels/row_gather.py): local
    query rows ``rows`` [R] (increasing), idx [h, R, n] the local key indices each row gathers
    (padding: 0) and valid [h, R, n] which of them are visible; on the plan's device. A plan's rows
    are grouped by how many keys they gather (rounded up to a power of two), so little is padded."""

    rows: torch.Tensor
    idx: torch.Tensor
    valid: torch.Tensor

    def first(self, q_rows: int) -> Optional["SparseRows"]:
        """This group limited to rows < q_rows (None if none is left; one read-back)."""
        keep = int((self.rows < q_rows).sum())
        if keep == self.rows.numel():
            return self
        return SparseRows(self.rows[:keep], self.idx[:, :keep], self.valid[:, :keep]) if keep else None


def key_floor(q_pos: torch.Tensor, cu_seqlens: Optional[Sequence[int]] = None, window: Window = None
              ) -> Optional[torch.Tensor]:
    """The smallest key position each query at ``q_pos`` may see besides the (causal) pattern: the
    start of its document (``cu_seqlens``, global boundaries [0, ..., S] as host ints) and
    q - left (``window`` = (left, right), Megatron's meaning; right is moot under causality).
    LongTensor like ``q_pos`` (on its device, no read-back; at most q_pos itself), non-decreasing
    where q_pos increases; None when neither condition narrows anything."""
    left = None if window is None else window[0]
    multi_doc = cu_seqlens is not None and len(cu_seqlens) > 2
    if not multi_doc and left is None:
        return None
    q_pos = q_pos.long()
    floor = torch.zeros_like(q_pos)
    if multi_doc:
        starts = torch.tensor(list(cu_seqlens[:-1]), dtype=torch.long, device=q_pos.device)
        floor = starts[torch.searchsorted(starts, q_pos, right=True) - 1]
    if left is not None:
        floor = torch.maximum(floor, q_pos - left)
    return floor


def plan_pair(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor,
              tile: Optional[int] = None, columns: Optional[str] = None, dense_column: Optional[float] = None,
              *, cu_seqlens: Optional[Sequence[int]] = None, window: Window = None, dense_apart: bool = False
              ) -> tuple[PackedTiles, tuple[SparseRows, ...]]:
    """The sparse plan of queries at ``q_pos`` x keys at ``kv_pos``: (tiles, row groups), on the
    pattern's device.

    ``cu_seqlens`` (document boundaries, host ints) and ``window`` ((left, right)) intersect the
    pattern with documents and a sliding window (:func:`key_floor`): the plan holds exactly the
    pairs the pattern, causality, the documents and the window all allow.

    Query tiles of ``tile`` (default TILE) rows; in each, the key columns that at least
    ``dense_column`` (default :func:`dense_column_for` the device) of the tile's (head, row)
    cells see go to the tile kernel (``columns``, default COLUMNS: those "exact" columns, or the
    whole "tiles" of ``tile`` columns holding them); the other visible pairs are gathered row by
    row (row groups; empty when there are none). ``dense_column=0`` puts every visible column in
    the tiles. Every visible pair lands in exactly one of the two parts; tiles without a tile
    column are left out of the tile part.

    Whole-tensor work on the device: the per-(tile, column) counts (:func:`column_counts`), one
    read-back of the parts' sizes, then the packed tiles and the gathered pairs written at those
    sizes, and one read-back of the row groups' sizes (a constant number of synchronisations,
    whatever the number of tiles; one more when the gathered slash pairs come in several chunks).

    ``dense_apart``: the plan holds only the pairs of the short slash offsets (runs < LONG_RUN) that
    are not on one of the head's vertical lines (:func:`head_run_blocks` and :func:`head_line_blocks`
    run the long runs and the lines as dense blocks), every visible column in the tiles
    (``dense_column`` 0).
    """
    tile = tile or TILE
    columns = columns or COLUMNS
    threshold = dense_column_for(pattern.device) if dense_column is None else dense_column
    if dense_apart:
        threshold = 0.0
    pair = _Pair.of(pattern, seq_len, q_pos, kv_pos, tile, cu_seqlens, window, dense_apart)
    device, T, sk, h = pair.device, pair.T, pair.sk, pair.h
    if not pair.nq or not sk:
        return PackedTiles.from_tiles((), h, device), ()
    tile_ids = torch.arange(T, device=device)
    rows_in = (pair.nq - tile_ids * tile).clamp(max=tile)  # [T] rows of each tile (the last may be short)
    by_lines, by_short = pair.counts()
    count = by_lines + by_short  # [T, sk] cells of a tile seeing a column
    seen = count > 0
    dense = seen & (count >= threshold * h * rows_in[:, None])
    if columns != "exact":  # whole column tiles holding a dense column
        blocks = torch.nn.functional.pad(dense, (0, (-sk) % tile)).view(T, -1, tile).any(-1)
        dense = blocks.repeat_interleave(tile, 1)[:, :sk]
    gathered = seen & ~dense  # after widening: a column is in the tiles or gathered, never both
    n_cols = dense.sum(1)  # [T] tile columns of each tile
    has_cols = n_cols > 0
    by_lines_gathered = gathered & (by_lines > 0)  # gathered entries holding pairs of lines / long runs
    # the one read-back of both parts' sizes
    sizes = torch.stack([has_cols.sum(), n_cols.max(), n_cols.sum(), torch.where(has_cols, tile_ids, -1).max(),
                         torch.where(dense.any(0), torch.arange(sk, device=device), -1).max(),
                         torch.where(gathered, by_short, 0).sum(), by_lines_gathered.sum(),
                         torch.where(gathered, by_lines, 0).sum()]).tolist()
    T_sel, C, N, last_tile, last_key, n_short_pairs, n_line_entries, n_line_pairs = sizes
    tiles = pair.pack_tiles(dense, has_cols, n_cols, rows_in, T_sel, C, N,
                            rows=min(pair.nq, (last_tile + 1) * tile), keys=last_key + 1)
    triples = [pair.short_pairs(gathered, n_short_pairs),
               pair.line_pairs(by_lines_gathered, n_line_entries, n_line_pairs)]
    return tiles, _row_groups(torch.cat(triples), h, pair.nq)


@dataclass
class _Pair:
    """What the planner derives once for queries at ``q_pos`` x keys at ``kv_pos`` (T query tiles
    of ``tile`` rows, sk keys), on the pattern's device. Positions and lookups are int32 (half the
    memory traffic of int64); flat indices into [heads, 2 seq_len] and [T, sk + 1] tables are
    ``index`` (int32 while they fit)."""

    pattern: VerticalSlash
    seq_len: int
    tile: int
    q_pos: torch.Tensor  # [nq] int64
    kv_pos: torch.Tensor  # [sk] int64
    q32: torch.Tensor  # [nq] int32
    kv32: torch.Tensor  # [sk] int32
    on_line: torch.Tensor  # [h, sk] bool: key c is a vertical line of head h
    q_shift: torch.Tensor  # [T, tile] int32: each tile's query positions + seq_len (past the last query: seq_len - 1)
    index: torch.dtype  # of flat table indices
    # documents and window (key_floor): [nq] int32, the smallest key position each query may see,
    # and [T, tile] the same per tile row (past the last query: seq_len, above every key); None: no floor
    floor32: Optional[torch.Tensor] = None
    floor_tiles: Optional[torch.Tensor] = None
    # the long slash runs (>= LONG_RUN offsets) and the vertical lines run elsewhere as dense blocks
    # (head_run_blocks, head_line_blocks): the plan holds the short offsets' pairs off the head's lines
    dense_apart: bool = False

    @classmethod
    def of(cls, pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor, tile: int,
           cu_seqlens: Optional[Sequence[int]] = None, window: Window = None,
           dense_apart: bool = False) -> "_Pair":
        device = pattern.device
        q_pos, kv_pos = q_pos.to(device).long(), kv_pos.to(device).long()
        nq = q_pos.numel()
        T = -(-nq // tile)
        q32 = q_pos.int()
        q_shift = torch.nn.functional.pad(q32 + seq_len, (0, T * tile - nq), value=seq_len - 1).view(T, tile)
        h, sk = pattern.vertical.shape[0], kv_pos.numel()
        index = torch.int32 if max(h * 2 * seq_len, T * (sk + 1)) < 2 ** 31 else torch.int64
        floor = key_floor(q_pos, cu_seqlens, window)
        floor32 = floor_tiles = None
        if floor is not None:
            floor32 = floor.int()
            floor_tiles = torch.nn.functional.pad(floor32, (0, T * tile - nq), value=seq_len).view(T, tile)
        return cls(pattern, seq_len, tile, q_pos, kv_pos, q32, kv_pos.int(),
                   pattern.lookup(seq_len)[0].index_select(1, kv_pos), q_shift, index, floor32, floor_tiles,
                   dense_apart)

    @property
    def device(self) -> torch.device:
        return self.q_pos.device

    @property
    def nq(self) -> int:
        return self.q_pos.numel()

    @property
    def sk(self) -> int:
        return self.kv_pos.numel()

    @property
    def h(self) -> int:
        return self.on_line.shape[0]

    @property
    def T(self) -> int:
        return self.q_shift.shape[0]

    def _short_columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pair-by-pair lookup of the short-run slash offsets (:meth:`VerticalSlash.slash_runs`):
        (column [h * 2 seq_len] int32, at h * 2 seq_len + seq_len + j the local column + 1 of key
        position j, 0 when this block does not hold it or it is a vertical line of h (that pair
        counts as the line's); base [offsets], the index h * 2 seq_len + seq_len - o of offset o
        of head h, so that query q's key sits at base + q; head [offsets]; tile_of [nq], each
        query's tile as an offset into a [T, sk + 1] table)."""
        cached = self.__dict__.get("_short")
        if cached is None:
            S, sk, device = self.seq_len, self.sk, self.device
            short_head, short_offset, _, _, _ = self.pattern.slash_runs()
            column = torch.zeros(self.h, 2 * S, dtype=torch.int32, device=device)
            column[:, S:].index_copy_(1, self.kv_pos, torch.where(
                self.on_line, 0, torch.arange(1, sk + 1, dtype=torch.int32, device=device)))
            base = (short_head * (2 * S) + S - short_offset).to(self.index)
            tile_of = (torch.arange(self.nq, dtype=self.index, device=device) // self.tile) * (sk + 1)
            cached = self._short = (column.view(-1), base, short_head, tile_of)
        return cached

    def _offset_chunks(self):
        """Chunks of the short-run offsets: (slice, keys [offsets, nq] as local column + 1, or 0;
        0 too where the key lies below the query's floor, :func:`key_floor`)."""
        column, base, _, _ = self._short_columns()
        step = max(1, PLAN_CHUNK // max(1, 4 * self.nq))
        reach = None if self.floor32 is None else self.q32 - self.floor32  # [nq] the largest offset a query may use
        offset = self.pattern.slash_runs()[1].int() if reach is not None else None
        for a in range(0, base.numel(), step):
            sl = slice(a, a + step)
            keys = column.index_select(0, (self.q32[None, :] + base[sl, None]).view(-1)).view(-1, self.nq)
            if reach is not None:
                keys = keys.masked_fill(offset[sl, None] > reach[None, :], 0)
            yield sl, keys

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(by_lines, by_short) [T, sk] int32: how many (head, row) cells of each tile see each key
        through a vertical line or a slash run of at least LONG_RUN offsets (by_lines), and through
        the other slash offsets (by_short); slash pairs on one of the head's vertical lines count
        once, as the line's. No read-back.

        A vertical line's column is seen by the tile's rows at or after it; a long run [a, b] of
        head h makes query q see the keys with q - b <= kv_pos <= q - a: a range of the keys in
        increasing position order (two binary searches per query and run), added to a difference
        table [heads, T, sk + 1] that a cumulative sum turns into counts; short-run offsets are
        counted pair by pair.
        """
        T, sk, tile, device = self.T, self.sk, self.tile, self.device
        order = torch.argsort(self.kv32, stable=True)  # keys by position
        kv_sorted = self.kv32[order]
        on_line = self.on_line[:, order]
        query_row = (torch.arange(self.nq, device=device) // tile) * (sk + 1)  # each query's tile in [T, sk + 1]
        one = torch.ones(1, dtype=torch.int32, device=device)

        def add_ranges(table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, base: torch.Tensor) -> None:
            """table [.., T, sk + 1] += 1 on columns [start, end) of each query's row (``base`` + its tile)."""
            flat, n = table.view(-1), start.numel()
            flat.index_add_(0, (base + start).view(-1), one.expand(n))
            flat.index_add_(0, (base + end).view(-1), -one.expand(n))

        # each query's first key at or above its floor (documents, window): keys [first, ...) it may see
        first = (torch.zeros_like(self.q32) if self.floor32 is None
                 else torch.searchsorted(kv_sorted, self.floor32, out_int32=True))
        after = torch.zeros(T, sk + 1, dtype=torch.int32, device=device)  # queries at or after each key
        add_ranges(after, first, torch.searchsorted(kv_sorted, self.q32, right=True, out_int32=True), query_row)
        lines = torch.zeros_like(on_line[0]) if self.dense_apart else on_line.sum(0, dtype=torch.int32)
        by_lines = after.cumsum(1, dtype=torch.int32)[:, :sk] * lines
        _, _, long_head, long_lo, long_hi = self.pattern.slash_runs()
        per_head = [0] * self.h if self.dense_apart else self.pattern.long_runs_per_head()
        heads = max(1, PLAN_CHUNK // max(1, 2 * T * (sk + 1)))
        run0 = 0
        for h0 in range(0, self.h, heads):  # chunks of heads, each with its runs (runs are ordered by head)
            h1 = min(h0 + heads, self.h)
            run1 = run0 + sum(per_head[h0:h1])
            if run1 > run0:
                lo, hi = long_lo[run0:run1, None].int(), long_hi[run0:run1, None].int()
                head = long_head[run0:run1, None] - h0
                inside = torch.zeros(h1 - h0, T, sk + 1, dtype=torch.int32, device=device)
                start = torch.searchsorted(kv_sorted, self.q32[None, :] - hi, out_int32=True)
                end = torch.searchsorted(kv_sorted, self.q32[None, :] - lo, right=True, out_int32=True)
                if self.floor32 is not None:  # keys below the floor: not seen (an empty range stays empty)
                    start = torch.minimum(torch.maximum(start, first[None, :]), end)
                add_ranges(inside, start, end, head * (T * (sk + 1)) + query_row)
                counted = inside.cumsum(2, dtype=torch.int32)[..., :sk].masked_fill_(on_line[h0:h1, None, :], 0)
                by_lines += counted.sum(0, dtype=torch.int32)
            run0 = run1
        by_lines = torch.empty_like(by_lines).index_copy_(1, order, by_lines)  # back to the keys' order
        # column 0 of every tile collects the pairs whose key is not counted here
        by_short = torch.zeros(T, sk + 1, dtype=torch.int32, device=device)
        _, _, _, tile_of = self._short_columns()
        for _, keys in self._offset_chunks():
            by_short.view(-1).index_add_(0, (keys + tile_of).view(-1), one.expand(keys.numel()))
        return by_lines, by_short[:, 1:].contiguous()

    def pack_tiles(self, dense: torch.Tensor, has_cols: torch.Tensor, n_cols: torch.Tensor, rows_in: torch.Tensor,
                   T_sel: int, C: int, N: int, rows: int, keys: int) -> PackedTiles:
        """The PackedTiles of the tiles with tile columns (``has_cols`` [T]; ``dense`` [T, sk] their
        columns, ``n_cols`` [T] how many): T_sel tiles, at most C columns each, N in all (host
        ints), visibility [T_sel, h, R, words] with R = min(tile, nq)."""
        device, h, tile, S = self.device, self.h, self.tile, self.seq_len
        R = min(tile, self.nq)
        words = -(-C // 32)
        picked = torch.nonzero_static(has_cols, size=T_sel).squeeze(1)  # [T_sel] tile indices, increasing
        q0 = picked * tile
        q1 = q0 + rows_in[picked]
        col_end = n_cols[picked].cumsum(0)
        col_start = col_end - n_cols[picked]
        cols = torch.nonzero_static(dense[picked], size=N)[:, 1]  # tile after tile, increasing inside a tile
        vis = torch.zeros(T_sel, h, R, words, dtype=torch.int32, device=device)
        if N:
            diagonal = self.pattern.diagonal_table(S, short_only=self.dense_apart)
            step = max(1, PLAN_CHUNK // max(1, h * R * C))
            for a in range(0, T_sel, step):  # chunks of tiles: the [tiles, R, C, h] masks stay bounded
                b = min(a + step, T_sel)
                slot = col_start[a:b, None] + torch.arange(C, device=device)  # [t, C]
                col = cols[slot.clamp(max=N - 1)]
                x = self.q_shift[picked[a:b], :R, None] - self.kv32[col][:, None, :]  # [t, R, C]: q - j + S
                seen = diagonal.index_select(0, x.view(-1)).view(*x.shape, h).view(torch.bool)
                if self.dense_apart:  # a line's pairs are all the dense blocks', short offsets' on it too
                    seen &= ~self.on_line[:, col].permute(1, 2, 0)[:, None]
                else:
                    seen |= self.on_line[:, col].permute(1, 2, 0)[:, None] & (x >= S)[..., None]
                seen &= (slot < col_end[a:b, None])[:, None, :, None]
                if self.floor_tiles is not None:  # documents, window
                    seen &= (self.kv32[col][:, None, :] >= self.floor_tiles[picked[a:b], :R, None])[..., None]
                vis[a:b] = pack_bits(seen.permute(0, 3, 1, 2))
        per_tile = h * R * words
        return PackedTiles(q0.int(), q1.int(), col_start, col_end, cols.int(),
                           torch.arange(T_sel, device=device) * per_tile,
                           torch.full((T_sel,), R * words, dtype=torch.int64, device=device),
                           torch.full((T_sel,), words, dtype=torch.int32, device=device), vis.view(-1),
                           h, R, C, rows, keys, words)

    def short_pairs(self, gathered: torch.Tensor, n_pairs: int) -> torch.Tensor:
        """The (head, local row, local column) triples [n_pairs, 3] of the short-run slash pairs in
        the (tile, column) entries ``gathered`` [T, sk] (n_pairs of them: by_short there), pair by
        pair from the offsets (one more read-back when they come in several chunks)."""
        if not n_pairs:
            return torch.zeros(0, 3, dtype=torch.long, device=self.device)
        _, _, head, tile_of = self._short_columns()
        # [T, sk + 1]: column 0 stands for keys not counted here
        take = torch.nn.functional.pad(gathered, (1, 0)).view(-1)
        masks = [(sl, keys, take.index_select(0, (keys + tile_of).view(-1)).view(keys.shape))
                 for sl, keys in self._offset_chunks()]
        sizes = [n_pairs] if len(masks) == 1 else torch.stack([m.sum() for _, _, m in masks]).tolist()
        found = []
        for (sl, keys, mask), size in zip(masks, sizes):
            hit = torch.nonzero_static(mask, size=size)  # (offset in the chunk, query)
            found.append(torch.stack([head[sl][hit[:, 0]], hit[:, 1], keys[hit[:, 0], hit[:, 1]].long() - 1], 1))
        return torch.cat(found)

    def line_pairs(self, entries_mask: torch.Tensor, n_entries: int, n_pairs: int) -> torch.Tensor:
        """The (head, local row, local column) triples [n_pairs, 3] seen through a vertical line or a
        long slash run in the (tile, column) entries ``entries_mask`` [T, sk] (n_entries of them),
        every cell of those entries looked up."""
        if not n_pairs:
            return torch.zeros(0, 3, dtype=torch.long, device=self.device)
        h, S = self.h, self.seq_len
        R = min(self.tile, self.nq)
        diagonal = self.pattern.diagonal_table(S, long_runs_only=True)
        entries = torch.nonzero_static(entries_mask, size=n_entries)  # [n_entries, 2] (tile, column)
        tiles, cols = entries[:, 0], entries[:, 1]
        x = self.q_shift[:, :R].index_select(0, tiles) - self.kv32.index_select(0, cols)[:, None]  # [e, R]: q - j + S
        seen = diagonal.index_select(0, x.view(-1)).view(*x.shape, h).view(torch.bool)
        seen |= self.on_line.index_select(1, cols).t()[:, None, :] & (x >= S)[..., None]
        if self.floor_tiles is not None:  # documents, window
            seen &= (self.kv32.index_select(0, cols)[:, None]
                     >= self.floor_tiles[:, :R].index_select(0, tiles))[..., None]
        hit = torch.nonzero_static(seen, size=n_pairs)  # (entry, row in tile, head)
        return torch.stack([hit[:, 2], tiles[hit[:, 0]] * self.tile + hit[:, 1], cols[hit[:, 0]]], 1)


def column_counts(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor, tile: int,
                  *, cu_seqlens: Optional[Sequence[int]] = None, window: Window = None) -> torch.Tensor:
    """[tiles, sk] int32: how many (head, row) cells of each ``tile``-row query tile see each key,
    from the pattern's lines (no [queries x keys] matrix), on the pattern's device, without a
    read-back: a vertical line's column is seen by the tile's rows at or after it; a run of
    LONG_RUN or more consecutive slash offsets [a, b] makes query q see the keys with
    q - b <= kv_pos <= q - a (a range of the keys by position, added to a difference table); the
    offsets of shorter runs are counted pair by pair. Slash pairs on one of the head's vertical
    lines count once, as the line's. ``cu_seqlens`` / ``window``: only keys at or above each
    query's :func:`key_floor` count (the ranges start there)."""
    by_lines, by_short = _Pair.of(pattern, seq_len, q_pos, kv_pos, tile, cu_seqlens, window).counts()
    return by_lines + by_short


def _row_groups(nz: torch.Tensor, heads: int, n_rows: int) -> tuple[SparseRows, ...]:
    """Row groups of the visible (head, row, col) triples ``nz`` [p, 3] (one read-back of the groups' sizes)."""
    if nz.numel() == 0:
        return ()
    device = nz.device
    cell = nz[:, 0] * n_rows + nz[:, 1]
    order = torch.argsort(cell, stable=True)
    nz, cell = nz[order], cell[order]
    per_cell = torch.zeros(heads * n_rows, dtype=torch.long, device=device).index_add_(0, cell, torch.ones_like(cell))
    slot = torch.arange(cell.numel(), device=device) - (per_cell.cumsum(0) - per_cell)[cell]  # rank in its cell
    per_row = per_cell.view(heads, n_rows).amax(0)
    # rows grouped by their key count rounded up to a power of two 2^e: a few groups (each a
    # handful of kernel calls), at most 2x padding; rows gathering nothing go last (e = 64)
    exponent = torch.where(per_row > 0, torch.ceil(torch.log2(per_row.clamp_min(1).double())).long(), 64)
    by_bucket = torch.argsort(exponent, stable=True)  # rows increasing inside a bucket
    sizes = torch.zeros(66, dtype=torch.long, device=device).index_add_(0, exponent, torch.ones_like(exponent))
    sizes[65] = per_row.max()
    sizes = sizes.tolist()
    n_max = sizes[65]
    idx = torch.zeros(heads, n_rows, n_max, dtype=torch.long, device=device)
    valid = torch.zeros(heads, n_rows, n_max, dtype=torch.bool, device=device)
    idx[nz[:, 0], nz[:, 1], slot] = nz[:, 2]
    valid[nz[:, 0], nz[:, 1], slot] = True
    groups, start = [], 0
    for e in range(64):
        if sizes[e]:
            rows = by_bucket[start:start + sizes[e]]
            n = min(1 << e, n_max)
            groups.append(SparseRows(rows, idx[:, rows, :n].contiguous(), valid[:, rows, :n].contiguous()))
            start += sizes[e]
    return tuple(groups)


def plan_tiles(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor,
               tile: Optional[int] = None, columns: Optional[str] = None) -> PackedTiles:
    """The block-sparse plan with every visible column in the tiles (no row-gathered part):
    query tiles of ``tile`` (default TILE) rows that see anything, each with the key columns it
    gathers (``columns``, default COLUMNS: "exact" or whole "tiles" of ``tile`` columns)."""
    return plan_pair(pattern, seq_len, q_pos, kv_pos, tile, columns, dense_column=0.0)[0]


def _mask_cache(pattern: VerticalSlash, documents: Optional[Documents], window: Window) -> dict:
    """The pattern's cache of plans and blocks under one mask (documents x window), the PLAN_MASKS
    most recent masks kept (a dynamic pattern's plans go with the pattern)."""
    masks = pattern.__dict__.setdefault("_masks", OrderedDict())
    key = (None if documents is None else (documents.groups, documents.partition),
           None if window is None else window[0])  # causal: only the left bound matters
    if key in masks:
        masks.move_to_end(key)
    else:
        masks[key] = {"plans": {}, "blocks": {}}
        while len(masks) > PLAN_MASKS:
            masks.popitem(last=False)
    return masks[key]


def _pair_plan(pattern: VerticalSlash, layout: str, q_rank: int, kv_rank: int, world_size: int, local_len: int,
               stripe: int, bounds: Optional[tuple[int, ...]] = None, window: Window = None,
               plans: Optional[dict] = None, dense_apart: bool = False
               ) -> tuple[PackedTiles, tuple[SparseRows, ...]]:
    """The plan of a block pair under document boundaries ``bounds`` and ``window``, on the
    pattern's device, kept in ``plans`` (the mask's cache on the pattern)."""
    plans = _mask_cache(pattern, None, window)["plans"] if plans is None else plans
    key = (layout, q_rank, kv_rank, world_size, local_len, stripe, bounds, dense_apart)
    if key not in plans:
        seq_len = local_len * world_size
        q_pos = layout_indices_on(seq_len, q_rank, world_size, layout, stripe, pattern.device)
        kv_pos = layout_indices_on(seq_len, kv_rank, world_size, layout, stripe, pattern.device)
        plans[key] = plan_pair(pattern, seq_len, q_pos, kv_pos, cu_seqlens=bounds, window=window,
                               dense_apart=dense_apart)
    return plans[key]


def _doc_ids(cu_seqlens: Optional[Sequence[int]], q_pos: torch.Tensor, kv_pos: torch.Tensor) -> tuple:
    """(q_doc, kv_doc) document ids of the positions (None, None for one document)."""
    if cu_seqlens is None or len(cu_seqlens) <= 2:
        return None, None
    bounds = torch.tensor(list(cu_seqlens), dtype=torch.long)
    return document_ids(bounds, q_pos), document_ids(bounds, kv_pos)


def _band_rectangle(q_pos: torch.Tensor, keys: torch.Tensor, lo: torch.Tensor, left: torch.Tensor
                    ) -> Optional[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1): the rows and keys (increasing positions) that bands of offsets lo..left (one
    per live head, tensors) can pair, from the vectors' ends only -- O(heads log n), not per row (a
    dynamic pattern is planned on every call); rows inside may see nothing. None: nothing."""
    r0 = int(torch.searchsorted(q_pos, keys[:1] + lo).min())  # q - lo >= the first key
    r1 = int(torch.searchsorted(q_pos, keys[-1:] + left, right=True).max())  # q - left <= the last key
    if r1 <= r0:
        return None
    c0 = int(torch.searchsorted(keys, q_pos[r0:r0 + 1] - left).min())
    c1 = int(torch.searchsorted(keys, q_pos[r1 - 1:r1] - lo, right=True).max())
    return (r0, r1, c0, c1) if c1 > c0 else None


def _cut(t: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    return None if t is None else t[a:b]


def run_blocks(shared: SharedRuns, q_pos: torch.Tensor, kv_pos: torch.Tensor, heads: int,
               cu_seqlens: Optional[Sequence[int]] = None, window: Window = None,
               device: Optional[torch.device] = None) -> list[BlockMask]:
    """The "positions" blocks of queries at ``q_pos`` x keys at ``kv_pos`` (CPU, increasing global
    positions) under a pattern split into shared runs: one per run [lo, hi] over every key (band
    (hi, -lo)), and one over the vertical keys (gathered: ``kv_index`` on ``device``) at every
    offset from the first gap between runs on, the later runs cut out as holes (HeadBands.holes,
    the same for all ``heads`` query heads; a plain band when no run lies inside), each narrowed by
    ``window`` (its left bound) and ``cu_seqlens`` (document ids); blocks no query sees anything of
    are left out. Together they hold every visible pair once: a pair at an offset in a run is the
    run's; any other is a vertical line's. One lines block, not one per gap: one merge and one
    kernel call per direction for all of them."""
    q_pos, kv_pos = q_pos.cpu().long(), kv_pos.cpu().long()
    q_doc, kv_doc = _doc_ids(cu_seqlens, q_pos, kv_pos)
    floor = key_floor(q_pos, cu_seqlens, window)
    w_left = None if window is None else window[0]
    on_line = torch.isin(kv_pos, shared.vertical).nonzero().squeeze(1)
    out = []

    def add(lo: int, hi: Optional[int], idx: Optional[torch.Tensor], holes: Optional[torch.Tensor] = None) -> None:
        left = hi if w_left is None else (w_left if hi is None else min(hi, w_left))
        keys = kv_pos if idx is None else kv_pos[idx]
        if (left is not None and left < lo) or not keys.numel():
            return
        top = torch.searchsorted(keys, q_pos - lo, right=True)  # each query's keys at offsets >= lo: [.., top)
        bottom = torch.zeros_like(top) if floor is None else torch.searchsorted(keys, floor)
        if hi is not None:
            bottom = torch.maximum(bottom, torch.searchsorted(keys, q_pos - hi))
        seeing = (top > bottom).nonzero().squeeze(1)
        if not seeing.numel():
            return
        # trimmed to the rows that see a key and the keys seen (a prefix of rows sees nothing: torch's
        # varlen op takes a block only if every row sees something)
        r0, r1 = int(seeing[0]), int(seeing[-1]) + 1
        c0, c1 = int(bottom[r0:r1].min()), int(top[r0:r1].max())
        docs = None if kv_doc is None else (kv_doc if idx is None else kv_doc[idx])
        if idx is None:
            kv_start, kv_stop, kv_index = c0, c1, None
        else:
            kv_start, kv_stop, kv_index = 0, c1 - c0, idx[c0:c1].to(device or "cpu")
        band = (left, -lo)
        if holes is not None:  # per-head bands are bounded: the largest offset of the rectangle
            reach = left if left is not None else max(0, int(q_pos[r1 - 1]) - int(keys[c0]))
            band = HeadBands(torch.tensor([[reach, -lo]]).expand(heads, 2).clone(), None, holes)
        out.append(BlockMask("positions", r0, r1, kv_start, kv_stop, 1, q_pos[r0:r1], keys[c0:c1],
                             _cut(q_doc, r0, r1), _cut(docs, c0, c1), band=band, kv_index=kv_index))

    for lo, hi in shared.runs:
        add(lo, hi, None)
    first = shared.gaps()[0][0]
    inside = [(a, b) for a, b in shared.runs if a > first]
    holes = torch.tensor(inside, dtype=torch.long).view(1, -1, 2).expand(heads, -1, -1).clone() if inside else None
    add(first, None, on_line, holes)
    return out


def head_run_blocks(pattern: VerticalSlash, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                    cu_seqlens: Optional[Sequence[int]] = None, window: Window = None) -> list[BlockMask]:
    """The "positions" blocks of the pattern's long slash runs (>= LONG_RUN offsets,
    :meth:`VerticalSlash.slash_runs`) for queries at ``q_pos`` x keys at ``kv_pos`` (CPU, increasing):
    block r holds every head's r-th run [lo, hi] as that head's band (hi, -lo) (:class:`HeadBands`;
    a head with fewer runs sees nothing there; one shared band when all heads agree), over every key,
    narrowed by ``window`` and ``cu_seqlens`` and trimmed to the rectangle of rows and keys the
    bands can reach (rows inside it may see nothing). The rest of the pattern is :func:`plan_pair`
    with ``dense_apart``."""
    q_pos, kv_pos = q_pos.cpu().long(), kv_pos.cpu().long()
    _, _, _, lo, hi = (t.cpu() for t in pattern.slash_runs())
    per_head = pattern.long_runs_per_head()
    q_doc, kv_doc = _doc_ids(cu_seqlens, q_pos, kv_pos)
    first = torch.tensor([0] + per_head[:-1]).cumsum(0)  # each head's first run (runs are ordered by head, lo)
    out = []
    for r in range(max(per_head, default=0)):
        has = torch.tensor(per_head) > r
        at = torch.where(has, first + r, 0)
        run_lo, run_hi = torch.where(has, lo[at], 1), torch.where(has, hi[at], 0)  # no run: lo > hi, empty
        left = run_hi if window is None else torch.minimum(run_hi, torch.tensor(window[0]))
        empty = left < run_lo
        bounds = torch.stack([torch.where(empty, -1, left), torch.where(empty, 0, -run_lo)], 1)  # [h, 2]
        live = ~empty
        box = _band_rectangle(q_pos, kv_pos, run_lo[live], left[live]) if bool(live.any()) and kv_pos.numel() else None
        if box is None:
            continue
        r0, r1, c0, c1 = box
        band = (int(bounds[0, 0]), int(bounds[0, 1])) if bool((bounds == bounds[:1]).all()) else HeadBands(bounds)
        out.append(BlockMask("positions", r0, r1, c0, c1, 1, q_pos[r0:r1], kv_pos[c0:c1], _cut(q_doc, r0, r1),
                             _cut(kv_doc, c0, c1), band=band))
    return out


def head_line_blocks(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                     cu_seqlens: Optional[Sequence[int]] = None, window: Window = None,
                     device: Optional[torch.device] = None) -> list[BlockMask]:
    """The "positions" block of the pattern's vertical lines for queries at ``q_pos`` x keys at
    ``kv_pos`` (CPU, increasing): the keys on any head's line, gathered (``kv_index`` on ``device``),
    each head seeing its own (:class:`HeadBands` ``keys``) at the offsets outside its long slash runs
    (those pairs are the runs'): each head's band runs from its first gap between runs to the
    sequence's end, its later runs cut out as holes (``HeadBands.holes``), narrowed by ``window``
    and ``cu_seqlens``, trimmed like :func:`head_run_blocks`. One block (a list of at most one):
    every head's program visits the union of the lines, as the sparse tiles do (a tile's columns
    are those any head sees there), but with no bit mask to unpack and no plan to build."""
    q_pos, kv_pos = q_pos.cpu().long(), kv_pos.cpu().long()
    S = seq_len
    on_line = pattern.lookup(S)[0].index_select(1, kv_pos.to(pattern.device)).cpu()  # [h, sk]
    idx = on_line.any(0).nonzero().squeeze(1)
    if not idx.numel():
        return []
    keys, kp = on_line[:, idx], kv_pos[idx]
    _, _, _, lo, hi = (t.cpu() for t in pattern.slash_runs())
    bounds_of_runs = list(zip(lo.tolist(), hi.tolist()))  # ordered by head, then lo
    runs, at = [], 0  # per head: its long runs, increasing
    for n in pattern.long_runs_per_head():
        runs.append(bounds_of_runs[at:at + n])
        at += n
    first = [offset_gaps(r, S)[0][0] for r in runs]  # each head's first offset outside its runs
    inside = [[(a, b) for a, b in r if a > f] for r, f in zip(runs, first)]  # its runs inside its band: holes
    n_holes = max((len(x) for x in inside), default=0)
    holes = None
    if n_holes:
        holes = torch.tensor([[1, 0]], dtype=torch.long).repeat(len(runs), n_holes, 1)  # lo > hi: no hole
        for h, x in enumerate(inside):
            if x:
                holes[h, :len(x)] = torch.tensor(x, dtype=torch.long)
    q_doc, kv_doc = _doc_ids(cu_seqlens, q_pos, kp)
    g_lo = torch.tensor(first)
    left = torch.full_like(g_lo, S) if window is None else torch.full_like(g_lo, min(S, window[0]))
    live = (left >= g_lo) & keys.any(1)
    box = _band_rectangle(q_pos, kp, g_lo[live], left[live]) if bool(live.any()) else None
    if box is None:
        return []
    r0, r1, c0, c1 = box
    bounds = torch.stack([torch.where(live, left, -1), torch.where(live, -g_lo, 0)], 1)
    return [BlockMask("positions", r0, r1, 0, c1 - c0, 1, q_pos[r0:r1], kp[c0:c1], _cut(q_doc, r0, r1),
                      _cut(kv_doc, c0, c1), band=HeadBands(bounds, keys[:, c0:c1].clone(), holes),
                      kv_index=idx[c0:c1].to(device or "cpu"))]


def dense_runs_per_head(pattern: VerticalSlash) -> bool:
    """Whether :func:`head_run_blocks` and :func:`head_line_blocks` take the pattern's long slash
    runs and vertical lines: no head has more than MAX_RUN_BLOCKS long runs (one block per run
    index, and one lines block with the runs as holes)."""
    return max(pattern.long_runs_per_head(), default=0) <= MAX_RUN_BLOCKS


def pattern_blocks(pattern: VerticalSlash, layout: str, q_rank: int, kv_rank: int, world_size: int,
                   local_len: int, stripe: int = 1, q_rows: Optional[int] = None, *,
                   documents: Optional[Documents] = None, window: Window = None) -> list[tuple[slice, BlockMask]]:
    """The (batch slice, BlockMask) list of a block pair under ``pattern``: a ``sparse`` block
    carrying its PackedTiles and a ``gather`` block carrying its row groups (each when it has
    any), or [] when nothing is visible (CPConfig.blocks' contract). Rows limited to [0, q_rows).
    Where :func:`runs_apart_for` the pattern's device and the pattern splits into shared runs
    (:meth:`VerticalSlash.shared_runs`), the pair is :func:`run_blocks`' ``positions`` blocks instead.

    ``documents`` (validated boundaries: one plan per group of samples sharing them) and
    ``window`` intersect the pattern with the document mask and the sliding window. A pair (or a
    group's samples) that the dense document/window mask leaves empty is skipped without
    planning. Cached on the pattern with the plans, for the PLAN_MASKS most recent masks.
    """
    if documents is not None and documents.partition is not None:
        raise ValueError(f"sparse patterns do not run on layout {documents.layout!r} (placed by documents): use "
                         "layout 'zigzag', 'contiguous' or 'striped'")
    cache = _mask_cache(pattern, documents, window)
    key = (layout, q_rank, kv_rank, world_size, local_len, stripe, q_rows, runs_apart_for(pattern.device))
    if key not in cache["blocks"]:
        out = []
        groups = documents.groups if documents is not None else ((None, None, None),)
        for first, end, bounds in groups:
            batch = slice(first, end)
            alone = None if documents is None else Documents(documents.seq_len, ((first, end, bounds),))
            if not visible_blocks(alone, layout, q_rank, kv_rank, world_size, local_len, True, stripe, q_rows,
                                  window):
                continue  # the dense mask (causal, documents, window) already sees nothing here
            seq_len = local_len * world_size
            apart = runs_apart_for(pattern.device)
            shared = pattern.shared_runs(seq_len) if apart else None
            per_head = apart and shared is None and dense_runs_per_head(pattern)
            dense = []
            if shared is not None or per_head:  # dense blocks (see MAX_RUN_BLOCKS)
                q_pos = layout_indices_on(seq_len, q_rank, world_size, layout, stripe, "cpu")
                kv_pos = layout_indices_on(seq_len, kv_rank, world_size, layout, stripe, "cpu")
                dense = (run_blocks(shared, q_pos, kv_pos, pattern.vertical.shape[0], bounds, window, pattern.device)
                         if shared is not None
                         else head_run_blocks(pattern, q_pos, kv_pos, bounds, window)
                         + head_line_blocks(pattern, seq_len, q_pos, kv_pos, bounds, window, pattern.device))
            for m in dense:
                m = m if q_rows is None else m.clip_rows(q_rows)
                if m.kind != "empty":
                    out.append((batch, m))
            if shared is not None or (per_head and not pattern.slash_runs()[0].numel()):
                continue  # no short offsets: nothing left for the sparse tiles
            plan, rows = _pair_plan(pattern, layout, q_rank, kv_rank, world_size, local_len, stripe, bounds, window,
                                    cache["plans"], dense_apart=per_head)
            if q_rows is not None:
                plan = plan.first_rows(q_rows)
                rows = tuple(g for g in (group.first(q_rows) for group in rows) if g is not None)
            if plan:
                out.append((batch, BlockMask("sparse", 0, local_len, 0, local_len, plan=plan)))
            if rows:
                out.append((batch, BlockMask("gather", 0, local_len, 0, local_len, plan=rows)))
        cache["blocks"][key] = out
    return list(cache["blocks"][key])
