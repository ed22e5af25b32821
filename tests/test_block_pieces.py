"""BlockMask pieces and grids, the geometry all-gather and Ulysses/USP compute with, against the
definition (global positions)."""
import itertools

import pytest
import torch

from megatron_burst.algorithms.allgather import kv_pieces
from megatron_burst.algorithms.schedule import CPConfig
from megatron_burst.masks.layout import block_mask, global_causal_mask, layout_indices
from megatron_burst.topology import CPTopology

CASES = [("contiguous", 1, 6), ("zigzag", 1, 6), ("striped", 1, 6), ("striped", 2, 8), ("striped", 3, 9)]


@pytest.mark.parametrize("layout,stripe,n", CASES)
def test_restrict_kv_is_the_column_slice(layout, stripe, n):
    W = 3
    step = stripe if layout == "striped" else 1
    for i, j in itertools.product(range(W), repeat=2):
        full = block_mask(layout, i, j, W, n, True, stripe)
        for lo in range(0, n, step):
            for hi in range(lo + 1, n + 1):
                piece = full.restrict_kv(lo, hi).shifted(0, -lo)
                assert torch.equal(piece.dense(n, hi - lo), full.dense(n, n)[:, lo:hi]), (i, j, lo, hi)


@pytest.mark.parametrize("layout,stripe,n", CASES)
def test_kv_pieces_tile_the_block(layout, stripe, n):
    cfg = CPConfig(CPTopology(None, 0, 1, 1, None), "flat", layout, stripe, True, 1.0)
    pieces = kv_pieces(cfg, n)
    assert pieces[0][0] == 0 and pieces[-1][1] == n and len(pieces) == 2
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all(lo % (stripe if layout == "striped" else 1) == 0 for lo, _ in pieces)


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)])
@pytest.mark.parametrize("U,members", [(2, 2), (4, 1), (2, 1), (3, 2)])
def test_visible_grid_is_causality_of_the_gathered_sequences(layout, stripe, U, members):
    """A ring member under Ulysses holds U CP ranks' shards in rank order; its visible regions
    against another member's are exactly kpos <= qpos on those tokens."""
    W, n = U * members, 4
    seq = W * n
    cfg = CPConfig(CPTopology(None, 0, members, 1, None), "flat", layout, stripe, True, 1.0, ulysses_size=U)
    pos = lambda m: torch.cat([layout_indices(seq, m * U + a, W, layout, stripe) for a in range(U)])  # noqa: E731
    for qm, km in itertools.product(range(members), repeat=2):
        got = torch.zeros(U * n, U * n, dtype=torch.bool)
        for _, mask in cfg.blocks(qm, km, U * n):
            got |= mask.dense(U * n, U * n)
        assert torch.equal(got, pos(km)[None, :] <= pos(qm)[:, None]), (qm, km)
    # and with U = 1 it is the plain per-rank block mask
    plain = CPConfig(CPTopology(None, 0, W, 1, None), "flat", layout, stripe, True, 1.0)
    for i, j in itertools.product(range(W), repeat=2):
        dense = sum((m.dense(n, n).int() for _, m in plain.blocks(i, j, n)), torch.zeros(n, n, dtype=torch.int))
        assert torch.equal(dense.bool(), global_causal_mask(layout, i, j, W, n, stripe))
