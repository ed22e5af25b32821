"""Topology-aware CP: the double ring equals the reference; bytes are classed by link exactly."""
import pytest

from harness import run_ranks
from test_attention import _assert_close
from topology_cases import construction_error, link_bytes, run_topology_matrix


@pytest.mark.parametrize("algo", ["ring", "burst"])
@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 2), (8, 4), (8, 2)])
def test_double_ring_matches_reference(world_size, ranks_per_node, algo):
    """Every layout, causal and full, MHA and GQA 4:1, on nodes x ranks = W."""
    layouts = ("contiguous", "zigzag", "striped") if world_size == 4 else ("zigzag", "striped")
    for rank_results in run_ranks(world_size, run_topology_matrix, ranks_per_node, "double", algo, layouts):
        _assert_close(rank_results)


def test_flat_ring_over_topology_matches_reference():
    for rank_results in run_ranks(4, run_topology_matrix, 2, "flat", "burst", ("zigzag",)):
        _assert_close(rank_results)


# Per-rank volumes by hand for W=4 = 2 nodes x 2, MHA b=2, hq=hkv=4, n=6, d=8, fp32:
#   one K,V block = 2*2*4*6*8*4 = 3072 B; a dK,dV block = 3072 B (fp32);
#   burst backward block: Q,dO 3072 + dQ 1536 + D,lse 384 = 4992 B.
# double ring: every rank sends per pass 2 intra hops (R-1 per node visit, 2 nodes) and 1 inter hop.
# flat ring: 3 hops per pass, all inter for the last rank of a node (ranks 1, 3), all intra otherwise.
KV, RING_BWD, BURST_BWD = 3072, 3072 + 3072, 4992


@pytest.mark.parametrize("algo,bwd", [("ring", RING_BWD), ("burst", BURST_BWD)])
def test_link_bytes_double_ring(algo, bwd):
    for links, rank, R in run_ranks(4, link_bytes, 2, "double", algo):
        assert links == {("forward", "intra"): 2 * KV, ("forward", "inter"): 1 * KV,
                         ("backward", "intra"): 2 * bwd, ("backward", "inter"): 1 * bwd}, (rank, links)


@pytest.mark.parametrize("algo,bwd", [("ring", RING_BWD), ("burst", BURST_BWD)])
def test_link_bytes_flat_ring(algo, bwd):
    for links, rank, R in run_ranks(4, link_bytes, 2, "flat", algo):
        crosses = rank % R == R - 1
        assert links == {("forward", "intra"): 0 if crosses else 3 * KV, ("forward", "inter"): 3 * KV if crosses else 0,
                         ("backward", "intra"): 0 if crosses else 3 * bwd,
                         ("backward", "inter"): 3 * bwd if crosses else 0}, (rank, links)


def test_bad_ranks_per_node_raises_before_any_collective():
    for msg, group_ok in run_ranks(4, construction_error, 3):
        assert msg is not None and "not divisible by ranks_per_node=3" in msg
        assert group_ok
    for msg, group_ok in run_ranks(2, construction_error, 0):
        assert msg is not None and "positive" in msg
        assert group_ok
