"""Static vertical-slash sparse attention under context parallelism (MTraining's pattern).

A :class:`VerticalSlash` pattern gives every query head h a set of vertical lines (global key
indices) and slash lines (diagonal offsets >= 0): query i sees key j <= i iff j is a vertical line
of h or i - j is a slash offset of h. :func:`sparse_cp_attention` computes exactly that masked
attention over the ring and burst schedules (flat or double ring, every layout). The pattern is
data, like document masks: :func:`pattern_blocks` turns a (q rank, kv rank) block pair into a
plan (:func:`plan_pair`, built from the lines: no queries x keys matrix) of two parts -- for every
64-row query tile, the key columns many of its cells see (vertical lines, a band) with the per-head
visibility there, computed as tiles by :mod:`megatron_burst.kernels.block_sparse` (or its Triton
twin on CUDA); and the scattered rest (isolated slashes), gathered row by row by
:mod:`megatron_burst.kernels.row_gather`. A pair with nothing visible is skipped like a causal
block in the future.

A query that sees no key at all (no vertical line before it and no slash through it) gets output
0 and zero gradients (FlashAttention's convention for fully masked rows).

:func:`imbalance` measures how evenly a pattern's work spreads over ranks and ring steps
(MTraining's worker- and step-level imbalance degrees).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_burst.layout import BlockMask, check_seq_len, layout_indices

import os

# rows and columns of the block-sparse kernel's tiles ($MEGATRON_BURST_SPARSE_TILE overrides, for measuring)
TILE = int(os.environ.get("MEGATRON_BURST_SPARSE_TILE", "64"))
# key columns a query tile gathers: "exact" (the columns some row and head of the tile sees: a
# vertical line costs one column, not a 64-wide tile; 1.9x faster than "tiles" at 16K tokens,
# 93.5 % sparse, see bench sparse) or "tiles" (whole 64-column tiles with any visible pair)
COLUMNS = os.environ.get("MEGATRON_BURST_SPARSE_COLUMNS", "exact")
# a key column goes to the tile matmul when at least this fraction of the tile's (head, row) cells
# see it, else its visible pairs are gathered row by row (kernels/row_gather.py). Measured on CPU
# (16K tokens, W = 4, fwd + bwd): a gathered pair costs ~16x a tile score (680 vs 41 ns), so 1/16
# is the break-even: an isolated slash (1/64 of a tile's cells per column) is gathered, vertical
# lines and a dense band stay in the matmul.
DENSE_COLUMN = float(os.environ.get("MEGATRON_BURST_SPARSE_DENSE_COLUMN", "0.0625"))


@dataclass(eq=False)  # hashed by identity: plans are cached per pattern object
class VerticalSlash:
    """vertical: int tensor [h, kv] of global key indices; slash: int tensor [h, ks] of diagonal
    offsets >= 0 (h = query heads; under GQA each query head has its own lines). Query i of head
    h sees key j <= i iff j in vertical[h] or i - j in slash[h]. Repeated entries are harmless."""

    vertical: torch.Tensor
    slash: torch.Tensor

    def check(self, seq_len: int, heads: int) -> None:
        """Raise ValueError unless the pattern fits ``heads`` query heads over ``seq_len`` tokens."""
        for name, t in (("vertical", self.vertical), ("slash", self.slash)):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 2:
                raise ValueError(f"VerticalSlash.{name} must be an int32/int64 tensor [heads, lines], got "
                                 f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
            if t.shape[0] != heads:
                raise ValueError(f"VerticalSlash.{name} has {t.shape[0]} heads but q has {heads} query heads: "
                                 "give one row of lines per query head")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= seq_len):
                raise ValueError(f"VerticalSlash.{name} holds values in [{int(t.min())}, {int(t.max())}], outside "
                                 f"[0, {seq_len}) for a global sequence of {seq_len} tokens")

    def lookup(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_vertical [h, seq_len] bool, is_slash [h, seq_len] uint8) tables (CPU, cached; uint8 for
        torch.gather, ~6x faster on CPU than indexing a bool table with [tq, sk] indices)."""
        cached = getattr(self, "_lookup", None)
        if cached is None or cached[0] != seq_len:
            h = self.vertical.shape[0]
            is_v = torch.zeros(h, seq_len, dtype=torch.bool)
            is_s = torch.zeros(h, seq_len, dtype=torch.bool)
            is_v.scatter_(1, self.vertical.long().cpu(), True)
            is_s.scatter_(1, self.slash.long().cpu(), True)
            cached = (seq_len, is_v, is_s.to(torch.uint8))
            self._lookup = cached
        return cached[1], cached[2]

    def visibility(self, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [h, len(q_pos), len(kv_pos)]: which query sees which key, per head."""
        is_v, is_s = self.lookup(seq_len)
        diff = q_pos[:, None] - kv_pos[None, :]
        causal = diff >= 0
        h = is_s.shape[0]
        on_slash = torch.gather(is_s, 1, diff.clamp_min(0).reshape(1, -1).expand(h, -1))
        return causal & (is_v[:, kv_pos][:, None, :] | on_slash.view(h, *diff.shape).bool())

    def dense(self, seq_len: int) -> torch.Tensor:
        """Boolean [h, seq_len, seq_len] visibility (the definition tests check against)."""
        pos = torch.arange(seq_len)
        return self.visibility(seq_len, pos, pos)


@dataclass(frozen=True)
class SparseTile:
    """One query tile of a block-sparse plan: rows [q0, q1), the key columns ``cols`` it gathers
    (LongTensor; see :func:`plan_tiles`) and the visibility ``vis`` [h, q1-q0, len(cols)]."""

    q0: int
    q1: int
    cols: torch.Tensor
    vis: torch.Tensor


class TilePlan(tuple):
    """The tiles of a block pair's plan (a tuple of SparseTile) that can also carry the packed form
    its kernel builds once (kernels/block_sparse.py), so that form lives as long as the plan."""


@dataclass(frozen=True)
class SparseRows:
    """A group of the row-gathered part of a block-sparse plan (kernels/row_gather.py): local
    query rows ``rows`` [R] (increasing), idx [h, R, n] the local key indices each row gathers
    (padding: 0) and valid [h, R, n] which of them are visible. A plan's rows are grouped by how
    many keys they gather (rounded up to a power of two), so little is padded."""

    rows: torch.Tensor
    idx: torch.Tensor
    valid: torch.Tensor

    def first(self, q_rows: int) -> Optional["SparseRows"]:
        """This group limited to rows < q_rows (None if none is left)."""
        keep = int((self.rows < q_rows).sum())
        if keep == self.rows.numel():
            return self
        return SparseRows(self.rows[:keep], self.idx[:, :keep], self.valid[:, :keep]) if keep else None


def plan_pair(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor,
              tile: Optional[int] = None, columns: Optional[str] = None, dense_column: Optional[float] = None
              ) -> tuple[tuple[SparseTile, ...], tuple[SparseRows, ...]]:
    """The sparse plan of queries at ``q_pos`` x keys at ``kv_pos``: (tiles, row groups).

    Query tiles of ``tile`` (default TILE) rows; in each, the key columns that at least
    ``dense_column`` (default DENSE_COLUMN) of the tile's (head, row) cells see go to the tile
    kernel (``columns``, default COLUMNS: those "exact" columns, or the whole "tiles" of ``tile``
    columns holding them); the other visible pairs are gathered row by row (row groups; empty
    when there are none). ``dense_column=0`` puts every visible column in the tiles. Every
    visible pair lands in exactly one of the two parts.
    """
    TILE = tile or globals()["TILE"]
    COLUMNS = columns or globals()["COLUMNS"]
    threshold = DENSE_COLUMN if dense_column is None else dense_column
    nq, sk, h = q_pos.numel(), kv_pos.numel(), pattern.vertical.shape[0]
    T = -(-nq // TILE)
    rows_in = torch.full((T,), TILE)
    rows_in[-1] = nq - (T - 1) * TILE
    count = column_counts(pattern, seq_len, q_pos, kv_pos, TILE)  # [T, sk] cells of a tile seeing a column
    dense = (count > 0) & (count >= threshold * h * rows_in[:, None])
    if COLUMNS != "exact":  # whole column tiles holding a dense column
        blocks = torch.nn.functional.pad(dense, (0, (-sk) % TILE)).view(T, -1, TILE).any(-1)
        dense = blocks.repeat_interleave(TILE, 1)[:, :sk]
    scattered = (count > 0) & ~dense  # after widening: a column is in the tiles or gathered, never both
    tiles, leftovers = [], []
    for t in (dense | scattered).any(1).nonzero().squeeze(1).tolist():
        q0, q1 = t * TILE, t * TILE + int(rows_in[t])
        cols, rest = dense[t].nonzero().squeeze(1), scattered[t].nonzero().squeeze(1)
        vis = pattern.visibility(seq_len, q_pos[q0:q1], kv_pos[torch.cat([cols, rest])])  # the definition, once
        if cols.numel():  # the tile's dense columns
            tiles.append(SparseTile(q0, q1, cols, vis[:, :, :cols.numel()].contiguous()))
        if rest.numel():  # every visible pair of the other columns, gathered row by row
            nz = vis[:, :, cols.numel():].nonzero()
            leftovers.append(torch.stack([nz[:, 0], nz[:, 1] + q0, rest[nz[:, 2]]], 1))
    nz = torch.cat(leftovers) if leftovers else torch.zeros(0, 3, dtype=torch.long)
    return TilePlan(tiles), _row_groups(nz, h, nq)


# slash runs at least this long are counted per column by binary search instead of pair by pair
LONG_RUN = 16


def column_counts(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor, tile: int
                  ) -> torch.Tensor:
    """[tiles, sk]: how many (head, row) cells of each ``tile``-row query tile see each key, from the
    pattern's lines (no [queries x keys] matrix): a vertical line's column is seen by the tile's
    rows at or after it; a run of consecutive slash offsets [a, b] makes column c seen by the rows
    with kv_pos[c] + a <= q_pos <= kv_pos[c] + b (a binary search in the tile's sorted positions);
    short runs are counted pair by pair. Pairs on a vertical line's column count once."""
    nq, sk = q_pos.numel(), kv_pos.numel()
    T = -(-nq // tile)
    big = 4 * seq_len  # pads the last tile: above every position
    # int32 throughout: positions < 2^31, counts <= tile x heads; half the memory traffic of int64
    q_sorted = torch.nn.functional.pad(q_pos.int(), (0, T * tile - nq), value=big).view(T, tile).sort(1).values
    kv = kv_pos.int()[None, :].expand(T, sk).contiguous()
    where_kv = torch.full((seq_len,), -1, dtype=torch.long)
    where_kv[kv_pos] = torch.arange(sk)
    tile_of = torch.arange(nq) // tile
    counts = torch.zeros(T, sk, dtype=torch.int32)
    for h in range(pattern.vertical.shape[0]):
        per_head = torch.zeros(T, sk, dtype=torch.int32)
        offsets = torch.unique(pattern.slash[h].long())
        starts = torch.cat([torch.ones(1, dtype=torch.bool), offsets[1:] != offsets[:-1] + 1]).nonzero().squeeze(1)
        ends = torch.cat([starts[1:], torch.tensor([offsets.numel()])]) - 1
        short = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            if b - a + 1 >= LONG_RUN:
                lo, hi = int(offsets[a]), int(offsets[b])
                per_head += torch.searchsorted(q_sorted, kv + hi, right=True, out_int32=True)
                per_head -= torch.searchsorted(q_sorted, kv + lo, out_int32=True)
            else:
                short.append(offsets[a:b + 1])
        if short:
            src = q_pos[None, :] - torch.cat(short)[:, None]  # [offsets, nq] key position of each slash at each query
            before_start = src < 0
            col = where_kv.index_select(0, src.clamp_min_(0).view(-1)).view(src.shape)
            hit = (col >= 0) & ~before_start
            per_head += torch.bincount((tile_of.expand_as(col)[hit] * sk + col[hit]), minlength=T * sk).view(T, sk).int()
        vcol = where_kv[torch.unique(pattern.vertical[h].long())]
        vcol = vcol[vcol >= 0]
        if vcol.numel():  # rows at or after the line: the tile's rows minus those before it
            rows = (q_sorted < big).sum(1, keepdim=True, dtype=torch.int32)
            per_head[:, vcol] = rows - torch.searchsorted(q_sorted, kv[:, vcol], out_int32=True)
        counts += per_head
    return counts


def _row_groups(nz: torch.Tensor, heads: int, n_rows: int) -> tuple[SparseRows, ...]:
    """Row groups of the visible (head, row, col) triples ``nz`` [p, 3]."""
    if nz.numel() == 0:
        return ()
    cell = nz[:, 0] * n_rows + nz[:, 1]
    order = torch.argsort(cell, stable=True)
    nz, cell = nz[order], cell[order]
    per_cell = torch.bincount(cell, minlength=heads * n_rows)
    slot = torch.arange(cell.numel()) - (per_cell.cumsum(0) - per_cell)[cell]  # rank inside its (head, row)
    n_max = int(per_cell.max())
    idx = torch.zeros(heads, n_rows, n_max, dtype=torch.long)
    valid = torch.zeros(heads, n_rows, n_max, dtype=torch.bool)
    idx[nz[:, 0], nz[:, 1], slot] = nz[:, 2]
    valid[nz[:, 0], nz[:, 1], slot] = True
    per_row = per_cell.view(heads, n_rows).amax(0)
    # rows grouped by their key count rounded up to a power of two: a few groups (each a handful
    # of kernel calls), at most 2x padding
    bucket = torch.where(per_row > 0, 2 ** torch.ceil(torch.log2(per_row.clamp_min(1).double())).long(), 0)
    groups = []
    for n in bucket.unique().tolist():
        if n:
            rows = (bucket == n).nonzero().squeeze(1)
            n = min(n, n_max)
            groups.append(SparseRows(rows, idx[:, rows, :n].contiguous(), valid[:, rows, :n].contiguous()))
    return tuple(groups)


def plan_tiles(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor,
               tile: Optional[int] = None, columns: Optional[str] = None) -> tuple[SparseTile, ...]:
    """The block-sparse plan with every visible column in the tiles (no row-gathered part):
    query tiles of ``tile`` (default TILE) rows that see anything, each with the key columns it
    gathers (``columns``, default COLUMNS: "exact" or whole "tiles" of ``tile`` columns)."""
    return plan_pair(pattern, seq_len, q_pos, kv_pos, tile, columns, dense_column=0.0)[0]


def _pair_plan(pattern: VerticalSlash, layout: str, q_rank: int, kv_rank: int, world_size: int, local_len: int,
               stripe: int) -> tuple[tuple[SparseTile, ...], tuple[SparseRows, ...]]:
    """The plan of a block pair, cached on the pattern (a dynamic pattern's plans go with it)."""
    plans = pattern.__dict__.setdefault("_plans", {})
    key = (layout, q_rank, kv_rank, world_size, local_len, stripe)
    if key not in plans:
        seq_len = local_len * world_size
        q_pos = layout_indices(seq_len, q_rank, world_size, layout, stripe)
        kv_pos = layout_indices(seq_len, kv_rank, world_size, layout, stripe)
        plans[key] = plan_pair(pattern, seq_len, q_pos, kv_pos)
    return plans[key]


def pattern_blocks(pattern: VerticalSlash, layout: str, q_rank: int, kv_rank: int, world_size: int,
                   local_len: int, stripe: int = 1, q_rows: Optional[int] = None) -> list[tuple[slice, BlockMask]]:
    """The (batch slice, BlockMask) list of a block pair under ``pattern``: a ``sparse`` block
    carrying its tiles and a ``gather`` block carrying its row-gathered pairs (each when it has
    any), or [] when nothing is visible (CPConfig.blocks' contract). Rows limited to [0, q_rows)."""
    plan, rows = _pair_plan(pattern, layout, q_rank, kv_rank, world_size, local_len, stripe)
    if q_rows is not None:
        plan = TilePlan(SparseTile(t.q0, min(t.q1, q_rows), t.cols, t.vis[:, :q_rows - t.q0]) for t in plan
                        if t.q0 < q_rows)
        rows = tuple(g for g in (group.first(q_rows) for group in rows) if g is not None)
    out = []
    if plan:
        out.append((slice(None), BlockMask("sparse", 0, local_len, 0, local_len, plan=plan)))
    if rows:
        out.append((slice(None), BlockMask("gather", 0, local_len, 0, local_len, plan=rows)))
    return out


def check_pattern_call(pattern: object, seq_len: int, heads: int, algo: str) -> None:
    """Validate a sparse_cp_attention call's pattern and algorithm (local checks only)."""
    if not isinstance(pattern, VerticalSlash):
        raise ValueError(f"pattern={pattern!r}: pass megatron_burst.VerticalSlash(vertical, slash)")
    if algo not in ("ring", "burst"):
        raise ValueError(f"algo={algo!r}: sparse attention runs on the ring schedules, choose 'ring' or 'burst'")
    pattern.check(seq_len, heads)


def sparse_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: VerticalSlash, *, group=None,
                        layout: str = "striped", stripe: int = 64, algo: str = "burst", ring: Optional[str] = None,
                        softmax_scale: Optional[float] = None, qkv_format: str = "sbhd") -> torch.Tensor:
    """Context-parallel causal attention restricted to a vertical-slash ``pattern`` (exact).

    q [s, b, hq, d], k/v [s, b, hkv, d] ("sbhd"; or [b, s, h, d] "bshd") hold this rank's s tokens
    in ``layout``'s order (block-striped by default: stripes of ``stripe`` tokens dealt round-robin,
    MTraining's balanced sparse ring). ``pattern`` lines are global positions over S = s x CP size.
    ``algo``: "ring" or "burst" backward; ``ring``: "flat" or "double" (group a CPTopology).
    ``pattern`` "dynamic" or a :class:`megatron_burst.dynamic_pattern.Dynamic` (budgets p_v, p_s,
    last_q) estimates MTraining's dynamic pattern from this call's q and k first (identical on
    every rank; not differentiated through).
    Returns this rank's output like q; differentiable. Block pairs, query tiles and key columns
    with no visible pair skip compute; the ring carries every block (the bytes of dense attention).
    """
    from megatron_burst.algorithms import prepare, to_bhsd  # the engine imports this module
    from megatron_burst.dynamic_pattern import Dynamic, estimate

    if qkv_format not in ("sbhd", "bshd"):
        raise ValueError(f"qkv_format={qkv_format!r}: sparse_cp_attention takes 'sbhd' or 'bshd'")
    call = prepare(q, k, v, group=group, algo=algo if algo in ("ring", "burst") else "ring", layout=layout,
                   causal=True, ring=ring, softmax_scale=softmax_scale, qkv_format=qkv_format, stripe=stripe)
    shape = to_bhsd(q, qkv_format).shape
    seq_len = shape[2] * call.cfg.world_size
    if isinstance(pattern, str) and pattern == "dynamic":
        pattern = Dynamic()
    if isinstance(pattern, Dynamic):  # validated here, before the estimate's collectives
        if algo not in ("ring", "burst"):
            raise ValueError(f"algo={algo!r}: sparse attention runs on the ring schedules, choose 'ring' or 'burst'")
        pattern.check(seq_len)
        pattern = estimate(to_bhsd(q, qkv_format), to_bhsd(k, qkv_format), pattern, group=call.cfg.topology.group,
                           layout=layout, stripe=stripe, softmax_scale=call.cfg.scale)
    check_pattern_call(pattern, seq_len, shape[1], algo)
    call.cfg.pattern = pattern
    return call.apply()


def _correlate(q_in: torch.Tensor, kv_in: torch.Tensor) -> torch.Tensor:
    """c[o] = #{i : q_in[i] and kv_in[i - o]} for every offset o in [0, S) (exact, via an FFT)."""
    S = q_in.numel()
    n = 2 * S
    fq = torch.fft.rfft(q_in.double(), n)
    fk = torch.fft.rfft(kv_in.double(), n)
    return torch.fft.irfft(fq * fk.conj(), n)[:S].round().long()


def pair_work(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> int:
    """Visible (head, query, key) pairs of queries at ``q_pos`` x keys at ``kv_pos``, counted per
    line (no [sq, sk] matrix): vertical hits + slash hits - pairs on both."""
    q_in = torch.zeros(seq_len, dtype=torch.bool)
    q_in[q_pos] = True
    kv_in = torch.zeros(seq_len, dtype=torch.bool)
    kv_in[kv_pos] = True
    q_sorted = torch.sort(q_pos).values
    per_offset = _correlate(q_in, kv_in)  # query i = o + j sees key j on diagonal o
    total = 0
    for h in range(pattern.vertical.shape[0]):
        vert = torch.unique(pattern.vertical[h].long())
        vert = vert[kv_in[vert]]
        total += int((q_sorted.numel() - torch.searchsorted(q_sorted, vert)).sum())  # j seen by every i >= j
        offsets = torch.unique(pattern.slash[h].long())
        total += int(per_offset[offsets].sum())
        if vert.numel():
            on_vert = torch.zeros(seq_len, dtype=torch.bool)
            on_vert[vert] = True
            total -= int(_correlate(q_in, on_vert)[offsets].sum())
    return total


def imbalance(pattern: VerticalSlash, seq_len: int, world_size: int, layout: str, stripe: int = 1,
              ring: str = "flat", ranks_per_node: Optional[int] = None) -> dict:
    """MTraining's imbalance degrees of ``pattern``'s work on a ring (work = visible query-key pairs
    over all heads of a block pair; the ring visits pair (r, owner) at the step the schedule does).

    Returns {"worker": max/mean over ranks at each ring step, aggregated as the sum over steps of
    the max over ranks / the sum over steps of the mean (a ring waits for its slowest rank every
    step, so this is its time over the ideal); "worker_total": max/mean over ranks of the whole
    pass's work; "step": the mean over ranks of each rank's max/mean over its ring steps;
    "work": [rank][step] visible pairs}.
    ``ring="double"`` orders steps as the hierarchical (outer x inner) ring does, ``ranks_per_node`` per node.
    """
    check_seq_len(seq_len, world_size, layout, stripe)
    W = world_size
    R = ranks_per_node if ring == "double" else W
    if ring == "double" and (R is None or W % R):
        raise ValueError(f"ring='double' needs ranks_per_node dividing world_size={W}, got {ranks_per_node}")
    idx = [layout_indices(seq_len, r, W, layout, stripe) for r in range(W)]
    work = [[0] * W for _ in range(W)]
    for r in range(W):
        for step in range(W):
            if ring == "double":  # outer step T (node), inner step t (rank inside the node)
                T, t = divmod(step, R)
                node, local = divmod(r, R)
                owner = ((node - T) % (W // R)) * R + (local - t) % R
            else:
                owner = (r - step) % W
            work[r][step] = pair_work(pattern, seq_len, idx[r], idx[owner])
    per_step_max = sum(max(work[r][s] for r in range(W)) for s in range(W))
    total = sum(map(sum, work))
    worker = per_step_max / (total / W) if total else 1.0
    worker_total = max(map(sum, work)) / (total / W) if total else 1.0
    step = sum(max(w) / (sum(w) / W) if sum(w) else 1.0 for w in work) / W
    return {"worker": worker, "worker_total": worker_total, "step": step, "work": work}
