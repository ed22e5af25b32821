"""The vertical-slash planner (megatron_burst.sparse.plan_pair) on random patterns with the edge
cases of its whole-tensor counting: repeated lines, slash runs just below and at LONG_RUN, offset
0, heads without long runs, no vertical or no slash lines, vertical lines in gathered columns, a
short last tile, every layout, both column modes and several thresholds: its counts equal the
definition's, and tiles plus row groups partition the visible pairs."""
import pytest
import torch

import megatron_burst as mb
from megatron_burst.masks.vertical_slash import LONG_RUN, VerticalSlash, column_counts, plan_pair


def _random_pattern(S: int, h: int, g: torch.Generator, case: int) -> VerticalSlash:
    vertical = torch.randint(0, S, (h, 6), generator=g)
    vertical[:, 1] = vertical[:, 0]  # repeated
    slash = torch.randint(0, S, (h, 3 * LONG_RUN), generator=g)
    start = int(torch.randint(0, S - 2 * LONG_RUN, (1,), generator=g))
    slash[0, :LONG_RUN] = torch.arange(start, start + LONG_RUN)  # a run of exactly LONG_RUN
    slash[h - 1, :LONG_RUN - 1] = torch.arange(LONG_RUN - 1)  # one just below, from offset 0
    slash[:, -1] = slash[:, -2]  # repeated
    if case == 1:
        vertical = vertical[:, :0]
    if case == 2:
        slash = slash[:, :0]
    return VerticalSlash(vertical, slash)


@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("layout,stripe,W", [("contiguous", 1, 2), ("zigzag", 1, 3), ("striped", 1, 4),
                                             ("striped", 16, 2)])
def test_plan_matches_the_definition(case, layout, stripe, W):
    S = 96 * W * (2 if layout == "zigzag" else 1)
    g = torch.Generator().manual_seed(case * 100 + W)
    h = 3
    pattern = _random_pattern(S, h, g, case)
    for q_rank, kv_rank in ((W - 1, 0), (0, 0)):
        q_pos = mb.layout_indices(S, q_rank, W, layout, stripe)
        kv_pos = mb.layout_indices(S, kv_rank, W, layout, stripe)
        want = pattern.visibility(S, q_pos, kv_pos)
        for tile in (64, 16):
            pad = (-q_pos.numel()) % tile
            per_tile = torch.nn.functional.pad(want.sum(0), (0, 0, 0, pad)).view(-1, tile, kv_pos.numel()).sum(1)
            assert torch.equal(column_counts(pattern, S, q_pos, kv_pos, tile), per_tile.int())
            for columns in ("exact", "tiles"):
                for dense_column in (0.0, 0.0625, 0.5, 1.0):
                    tiles, groups = plan_pair(pattern, S, q_pos, kv_pos, tile, columns, dense_column)
                    got = torch.zeros(want.shape, dtype=torch.int64)
                    for t in tiles:
                        assert t.q1 - t.q0 <= tile and t.cols.numel() <= tiles.max_cols
                        got[:, t.q0:t.q1][:, :, t.cols] += t.vis.long()
                    for grp in groups:
                        for hh in range(h):
                            for i, r in enumerate(grp.rows.tolist()):
                                got[hh, r, grp.idx[hh, i][grp.valid[hh, i]]] += 1
                    assert int(got.max()) <= 1 and torch.equal(got.bool(), want), (tile, columns,
                                                                                             dense_column)
                    if dense_column == 0.0:
                        assert groups == ()
