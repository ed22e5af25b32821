"""Layouts: token placement, shard/unshard, and the per-block causal visibility."""
import pytest
import torch

import megatron_burst as mb
from megatron_burst.masks.layout import block_mask, global_causal_mask, seq_divisor


def test_indices_by_hand():
    assert mb.layout_indices(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    # zigzag: 2W = 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert mb.layout_indices(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert mb.layout_indices(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert mb.layout_indices(12, 2, 3, "zigzag").tolist() == [4, 5, 6, 7]
    assert mb.layout_indices(9, 1, 3, "striped").tolist() == [1, 4, 7]
    assert mb.layout_indices(12, 1, 3, "striped", stripe=2).tolist() == [2, 3, 8, 9]


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2), ("striped", 3)])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_partition_and_roundtrip(layout, stripe, world_size):
    seq = seq_divisor(layout, world_size, stripe) * 3
    owned = torch.cat([mb.layout_indices(seq, r, world_size, layout, stripe) for r in range(world_size)])
    assert sorted(owned.tolist()) == list(range(seq))  # every token exactly once
    for r in range(world_size):
        idx = mb.layout_indices(seq, r, world_size, layout, stripe)
        assert torch.all(idx[1:] > idx[:-1])  # local order is increasing global order
    x = torch.randn(2, seq, 3)
    shards = [mb.shard(x, 1, r, world_size, layout, stripe) for r in range(world_size)]
    assert torch.equal(mb.unshard(shards, 1, layout, stripe), x)


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2), ("striped", 3)])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_block_mask_matches_global_positions(layout, stripe, world_size, mult):
    n = seq_divisor(layout, world_size, stripe) * mult // world_size
    for i in range(world_size):
        for j in range(world_size):
            m = block_mask(layout, i, j, world_size, n, causal=True, stripe=stripe)
            assert torch.equal(m.dense(n, n), global_causal_mask(layout, i, j, world_size, n, stripe)), (i, j)
            assert block_mask(layout, i, j, world_size, n, causal=False, stripe=stripe).dense(n, n).all()


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_balanced_layouts_give_equal_causal_work(layout):
    W, n = 4, 8
    work = [sum(int(block_mask(layout, i, j, W, n, True).dense(n, n).sum()) for j in range(W)) for i in range(W)]
    if layout == "zigzag":
        assert len(set(work)) == 1, work
    else:  # striped: row a of rank i sees tokens 0..a*W+i: W*n(n-1)/2 + n(i+1) in all, near-equal
        assert work == [W * n * (n - 1) // 2 + n * (i + 1) for i in range(W)], work


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="divisible by 8"):
        mb.layout_indices(12, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="unknown layout"):
        mb.layout_indices(8, 0, 2, "spiral")
    with pytest.raises(ValueError, match="rank=2"):
        mb.layout_indices(8, 2, 2, "contiguous")
    with pytest.raises(ValueError, match="stripe"):
        mb.layout_indices(8, 0, 2, "zigzag", stripe=2)


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 4)])
def test_one_rank_holds_any_length_in_order(layout, stripe):
    """Issue M2: at CP = 1 an odd --seq-length failed at the first step ("not divisible by 2, which
    layout='zigzag' needs with world_size=1"). On one rank every layout is the identity."""
    from megatron_burst.masks.layout import check_seq_len

    for seq in (1, 7, 31, 127):
        check_seq_len(seq, 1, layout, stripe)
        assert seq_divisor(layout, 1, stripe) == 1
        assert torch.equal(mb.layout_indices(seq, 0, 1, layout, stripe), torch.arange(seq))
        x = torch.randn(2, seq, 3)
        assert torch.equal(mb.shard(x, 1, 0, 1, layout, stripe), x)
        assert torch.equal(mb.unshard([x], 1, layout, stripe), x)
    with pytest.raises(ValueError, match="divisible by 4"):  # two ranks still need their chunks
        check_seq_len(30, 2, "zigzag")
