"""The cost model for the whole CP family (allgather, Ulysses, USP beside ring/burst), by hand."""
import pytest

from megatron_burst import cost_model


def test_a2a_time_by_hand():
    # 1e6 bytes per rank: intra 8 Gb/s (1 ms for 1e6 B), inter 0.8 Gb/s; 2 nodes x 4; latencies 1 us / 2 us
    c = cost_model.Cluster(2, 4, intra_gbps=8, inter_gbps=0.8, intra_lat_us=1, inter_lat_us=2)
    assert cost_model.a2a_time(c, 1e6, 1) == 0.0
    assert cost_model.a2a_time(c, 1e6, 4) == pytest.approx(3e-6 + 0.75e-3)  # 3/4 leaves the rank, over NVLink
    assert cost_model.a2a_time(c, 1e6, 8) == pytest.approx(7 * 2e-6 + 0.5 * 1e-2)  # half goes to the other node


def test_ulysses_sizes_follow_heads_and_nodes():
    c = cost_model.Cluster(2, 4)
    assert cost_model.ulysses_sizes(c, cost_model.AttnShape(8192, 8, 8, 64)) == [2, 4, 8]
    assert cost_model.ulysses_sizes(c, cost_model.AttnShape(8192, 8, 2, 64)) == [2, 4, 8]  # kv repeated to 4 or 8
    assert cost_model.ulysses_sizes(c, cost_model.AttnShape(8192, 6, 6, 64)) == [2]  # 6 heads: only U = 2 divides
    # 2 kv heads: split over 2, repeated to 6, but neither with 3
    assert cost_model.ulysses_sizes(cost_model.Cluster(1, 6), cost_model.AttnShape(8192, 6, 2, 64)) == [2, 6]


def test_family_prediction_by_hand_for_allgather_and_ulysses():
    """One node of 2, no latency, intra 8 Gb/s (1e6 B per ms), compute free (huge TFLOP/s)."""
    c = cost_model.Cluster(1, 2, intra_gbps=8, intra_lat_us=0, tflops=1e12)
    shape = cost_model.AttnShape(seq=2000, heads=2, kv_heads=2, head_dim=125, elem=2)  # n = 1000 tokens per rank
    p = cost_model.predict_family(c, shape)
    kv = 2 * 1000 * 2 * 125 * 2  # K,V of one rank: 1e6 B -> 1 ms per hop
    assert p["allgather"]["fwd_comm"] == pytest.approx(1e-3)
    # backward: gather again (1 ms) + reduce-scatter of fp32 dK,dV (2 ms); the last half exposed
    assert p["allgather"]["total"] == pytest.approx(1e-3 + 3e-3 + 1e-3)
    # ulysses: q,k,v (1.5e6 B) and out (0.5e6 B) half leave the rank; backward dO (0.5e6) + fp32 grads (3e6)
    assert p["ulysses"]["total"] == pytest.approx((0.75e6 + 0.25e6 + 0.25e6 + 1.5e6) / 1e9)
    assert p["ulysses"]["fwd_comm_bytes"] == (1.5e6 + 0.5e6) / 2 and kv == 1e6
    assert p["ring/flat"]["total"] == pytest.approx(1e-3 + 1e-3 + 2e-3)  # K,V; then K,V + dK,dV fp32


def test_choices_for_the_papers_settings_stay_in_the_ring_family():
    """Compute-bound 1M-token runs: the rings hide their transfers; Ulysses' and all-gather's exposed
    collectives only add time (the existing recommendations hold with the whole family)."""
    cluster = cost_model.Cluster(4, 8)
    assert cost_model.choose_algorithm(cluster, cost_model.AttnShape(1 << 20, 40, 40, 128), "double") == ("burst", 1)
    assert cost_model.choose_algorithm(cluster, cost_model.AttnShape(1 << 20, 64, 8, 128), "double") == ("ring", 1)


def test_usp_wins_when_the_inter_node_ring_is_exposed():
    """16K tokens on 2 x 8 GPUs with 25 Gb/s NICs: the rings cannot hide their inter-node hops;
    Ulysses inside the node shrinks the ring to 2 members (one inter-node hop per pass)."""
    cluster = cost_model.Cluster(2, 8, inter_gbps=25)
    shape = cost_model.AttnShape(16 * 1024, 32, 32, 128)
    assert cost_model.choose_algorithm(cluster, shape, "double") == ("usp", 8)
    # only the sizes whose groups exist are candidates
    assert cost_model.choose_algorithm(cluster, shape, "double", usp_sizes=()) == ("burst", 1)


def test_latency_bound_tiny_shape_keeps_the_ring_unless_usp_groups_exist():
    """W = 4 in one node, 24 tokens: the ring's 3 hops beat Ulysses' 4 all-to-alls of 3 latencies."""
    cluster, shape = cost_model.Cluster(1, 4), cost_model.AttnShape(24, 4, 4, 8, 2, 4)
    assert cost_model.choose_algorithm(cluster, shape, usp_sizes=())[0] in ("ring", "burst")
    assert cost_model.choose_algorithm(cluster, shape, usp_sizes=(2,)) == ("usp", 2)


def test_no_fitting_algorithm_raises():
    with pytest.raises(ValueError, match="no CP algorithm among ulysses"):
        cost_model.choose_algorithm(cost_model.Cluster(1, 4), cost_model.AttnShape(24, 6, 6, 8), algos=("ulysses",))


def test_cli_recommends_usp_with_megatrons_flags(capsys):
    cost_model.main(["--nodes", "2", "--gpus-per-node", "8", "--seq", "16K", "--heads", "32", "--head-dim", "128",
               "--inter-gbps", "25"])
    out = capsys.readouterr().out
    assert "| usp8/burst/double |" in out and "| allgather |" in out and "| ulysses |" in out
    assert ("recommendation: --cp-algo usp --hierarchical-context-parallel-sizes 8 2 (Megatron: --cp-comm-type "
            "a2a+p2p; ring part burst/double)") in out
