"""layout="balanced": tokens placed by the dispatch planner from the batch's documents.

cp_attention equals a dense masked softmax over the whole packed sequence (forward and dq, dk, dv)
for every algorithm, causal and full, MHA and GQA, shared and per-sample boundaries, with a window,
on the double ring, under usp and through the selective activation store; layout_indices is a
permutation with S / W increasing positions per rank; what balanced cannot do is refused by name,
before any collective."""
import pytest
import torch

import megatron_burst as mb
from balanced_cases import balanced_matrix, mixed_bounds, refusals, selective_checkpoint, topology_matrix
from harness import run_ranks
from megatron_burst import documents, layout
from megatron_burst.masks.dispatch import plan_dispatch

TOL = 1e-5  # fp32 rounding (a wrong placement or mask gives O(1) errors)


def _assert_exact(results: dict) -> None:
    for case, errs in results.items():
        assert errs["finite"], case
        for name in ("out", "dq", "dk", "dv"):
            assert errs[name] <= TOL, f"{case}: {name} error {errs[name]:.2e}"


@pytest.mark.parametrize("world_size,local_len", [(2, 12), (3, 12), (4, 12), (3, 70)])
def test_balanced_matches_dense_reference(world_size, local_len):
    """ring, burst, allgather, ulysses x causal/full x MHA/GQA on one long document split over the
    ranks plus short whole ones; per-sample boundaries; windows with documents; prebuilt Documents.
    S = 3 x 70 = 210 (not a power of two) runs the ring family only (Ulysses is the same code path)."""
    algos = ("ring", "burst", "allgather", "ulysses") if local_len == 12 else ("ring", "burst")
    plan = plan_dispatch(mixed_bounds(local_len * world_size), world_size)
    assert any(level != 1 for level in plan.levels) and 1 in plan.levels, plan.levels  # split and whole documents
    for rank_results in run_ranks(world_size, balanced_matrix, local_len, algos):
        _assert_exact(rank_results)


def test_balanced_on_double_ring_and_usp():
    """W = 4 as 2 nodes x 2: ring and burst on the double ring; usp with U = 2 (MHA and GQA, a window)."""
    for rank_results in run_ranks(4, topology_matrix, 12):
        _assert_exact(rank_results)


@pytest.mark.parametrize("algo", ["burst", "allgather"])
def test_balanced_through_the_selective_store(algo):
    """The store keeps each rank's later rows: a rank's balanced tokens are in increasing global order."""
    for hits, err in run_ranks(3, selective_checkpoint, algo):
        assert hits == 1 and err <= TOL


def test_refusals_name_the_fix_before_any_collective():
    for messages, moved, group_ok in run_ranks(2, refusals):
        assert group_ok and moved == 0, (moved, messages)
        assert all(m is not None for m in messages.values()), messages
        assert "layout='balanced'" in messages["no_cu_seqlens"] and "pass cu_seqlens" in messages["no_cu_seqlens"]
        assert "balanced" in messages["pattern"] and "zigzag" in messages["pattern"]
        assert "balanced_documents" in messages["plain_documents"]
        assert "for 4 ranks" in messages["other_world_size"] and "world_size=2" in messages["other_world_size"]
        assert "ends at 9" in messages["bad_end"]
        assert "check_cu_seqlens" in messages["balanced_documents_zigzag"]


# --------------------------------------------------------------------------------------------- #
# single process


@pytest.mark.parametrize("world_size,seq", [(2, 24), (3, 36), (4, 48), (3, 210), (1, 7)])
def test_layout_indices_is_a_permutation_of_increasing_rank_lists(world_size, seq):
    bounds = mixed_bounds(seq) if seq > 20 else [0, 3, seq]
    cu = torch.tensor(bounds, dtype=torch.int32)
    rows = [layout.layout_indices(seq, r, world_size, "balanced", cu_seqlens=cu) for r in range(world_size)]
    for row in rows:
        assert row.dtype == torch.long and row.numel() == seq // world_size
        assert bool((row[1:] > row[:-1]).all())
    assert torch.equal(torch.sort(torch.cat(rows)).values, torch.arange(seq))
    plan = plan_dispatch(bounds, world_size)
    for r in range(world_size):
        assert torch.equal(rows[r], plan.indices(r))
        assert torch.equal(layout.layout_indices(seq, r, world_size, "balanced", plan=plan), rows[r])
    x = torch.randn(2, seq, 3)
    shards = [mb.shard(x, 1, r, world_size, "balanced", cu_seqlens=cu) for r in range(world_size)]
    assert torch.equal(shards[0], x[:, rows[0]])
    assert torch.equal(mb.unshard(shards, 1, "balanced", plan=plan), x)


def test_per_sample_boundaries_plan_on_their_union():
    a, b = [0, 5, 24], [0, 10, 20, 24]
    docs = mb.balanced_documents([torch.tensor(a), torch.tensor(b)], 24, 2, 2)
    assert docs.groups == ((0, 1, tuple(a)), (1, 2, tuple(b)))
    assert docs.plan == plan_dispatch([0, 5, 10, 20, 24], 2) and docs.layout == "balanced"
    assert torch.equal(layout.layout_indices(24, 1, 2, "balanced", cu_seqlens=[a, b]), docs.plan.indices(1))


def test_positions_and_plans_are_cached():
    """Per-layer lookups reuse the plan's index rows and its hash (no O(S) or O(runs) work per layer)."""
    docs = mb.balanced_documents(torch.tensor(mixed_bounds(48)), 48, 1, 4)
    assert mb.balanced_documents(torch.tensor(mixed_bounds(48)), 48, 1, 4).plan is docs.plan
    first = documents.rank_positions("balanced", 2, 4, 12, partition=docs.plan)
    assert documents.rank_positions("balanced", 2, 4, 12, partition=docs.plan) is first
    assert torch.equal(first, docs.plan.indices(2))
    assert docs.plan.__dict__["_hash"] == hash(docs.plan)


def test_errors_name_the_value_and_the_fix():
    cu = torch.tensor([0, 3, 12])
    with pytest.raises(ValueError, match="length 12 is not divisible by 5.*balanced.*pad"):
        layout.layout_indices(12, 0, 5, "balanced", cu_seqlens=cu)
    with pytest.raises(ValueError, match="not divisible by world_size=5.*pad the batch"):
        mb.balanced_documents(cu, 12, 1, 5)
    with pytest.raises(ValueError, match="pass cu_seqlens"):
        layout.layout_indices(12, 0, 2, "balanced")
    with pytest.raises(ValueError, match="only in layout 'balanced'"):
        layout.layout_indices(12, 0, 2, "zigzag", cu_seqlens=cu)
    with pytest.raises(ValueError, match="places 12 tokens on 2 ranks.*24 tokens on 2"):
        layout.layout_indices(24, 0, 2, "balanced", plan=plan_dispatch([0, 3, 12], 2))
    with pytest.raises(ValueError, match="ends at 10 but the global sequence has 12 tokens"):
        layout.layout_indices(12, 0, 2, "balanced", cu_seqlens=[0, 3, 10])
    with pytest.raises(ValueError, match="documents"):
        layout.block_mask("balanced", 0, 1, 2, 6, True)
    assert layout.seq_divisor("balanced", 3) == 3 and "balanced" not in layout.LAYOUTS  # not a Megatron flag yet
    with pytest.raises(ValueError, match="layout='balanced' places tokens.*pass cu_seqlens"):
        mb.cp_attention(torch.randn(8, 1, 2, 4), torch.randn(8, 1, 2, 4), torch.randn(8, 1, 2, 4), layout="balanced")


def test_linear_attention_takes_balanced_with_its_documents():
    """Linear attention runs in the balanced layout (tests/test_linear_runs.py) given the documents that
    place it; without them, or with documents placed for it in a call of another layout, it refuses."""
    q = torch.randn(128, 1, 2, 16)
    with pytest.raises(ValueError, match="layout='balanced' places tokens by the batch's documents"):
        mb.linear_attention(q, q, q, layout="balanced")
    docs = mb.balanced_documents(torch.tensor([0, 40, 128]), 128, 1, 1)
    with pytest.raises(ValueError, match="placed for layout 'balanced' do not fit layout='contiguous'"):
        mb.linear_attention(q, q, q, layout="contiguous", cu_seqlens=docs)
    out = mb.linear_attention(q, q, q, layout="balanced", cu_seqlens=docs)  # one rank: the sequence in order
    want = mb.linear_attention(q, q, q, cu_seqlens=torch.tensor([0, 40, 128]))
    assert torch.equal(out, want)


def test_node_aware_placement_is_exact_and_keeps_documents_inside_nodes():
    """W = 4 as 2 nodes x 2: ring, burst and allgather are exact with the plan placed for the nodes
    (raw cu_seqlens and prebuilt Documents), and ring / burst send fewer bytes over the inter-node
    link than the one-node plan does (here none: every split document sits on one node). Documents
    placed for another node size are refused by name, before any transfer."""
    from balanced_cases import node_placement

    for results in run_ranks(4, node_placement):
        message, moved, group_ok = results.pop("mismatch")
        assert message is not None and moved == 0 and group_ok
        assert "placed for 4 ranks per node" in message and "has 2" in message, message
        assert "ranks_per_node=2" in message, message
        _assert_exact({case: errs for case, errs in results.items()})
        for algo in ("ring", "burst"):
            node_aware, one_node = results[(algo, "nodes")], results[(algo, "one_node_plan")]
            assert node_aware["inter_bytes"] < one_node["inter_bytes"], (algo, node_aware, one_node)
            assert node_aware["inter_bytes"] == 0, (algo, node_aware)


def test_layout_functions_take_ranks_per_node():
    """balanced_plan / shard / unshard / layout_indices / balanced_documents plan for the given nodes,
    cached per node size (None and W are one node), and a plan placed for other nodes is refused."""
    S, W = 48, 4
    cu = torch.tensor(mixed_bounds(S))
    placed = layout.balanced_plan(cu, S, W, ranks_per_node=2)
    assert placed is layout.balanced_plan(cu, S, W, ranks_per_node=2) and placed.ranks_per_node == 2
    assert layout.balanced_plan(cu, S, W) is layout.balanced_plan(cu, S, W, ranks_per_node=W)
    assert placed != layout.balanced_plan(cu, S, W) and placed.member_order == (0, 2, 1, 3)
    assert mb.balanced_documents(cu, S, 1, W, ranks_per_node=2).plan is placed
    x = torch.arange(S * 3).reshape(S, 3)
    shards = [layout.shard(x, 0, r, W, "balanced", cu_seqlens=cu, ranks_per_node=2) for r in range(W)]
    assert all(torch.equal(s[:, 0] // 3, placed.indices(r)) for r, s in enumerate(shards))
    assert torch.equal(layout.unshard(shards, 0, "balanced", cu_seqlens=cu, ranks_per_node=2), x)
    assert torch.equal(layout.unshard(shards, 0, "balanced", plan=placed), x)
    with pytest.raises(ValueError, match=r"placed for 2 ranks per node.*ranks_per_node=4"):
        layout.layout_indices(S, 0, W, "balanced", plan=placed, ranks_per_node=4)
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide world_size=4"):
        layout.balanced_plan(cu, S, W, ranks_per_node=3)
    with pytest.raises(ValueError, match="only in layout 'balanced'"):
        layout.layout_indices(S, 0, W, "zigzag", ranks_per_node=2)
