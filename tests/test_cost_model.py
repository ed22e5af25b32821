"""The cost model: BurstEngine Table 1 by hand, our ring model by hand, and the recommendations."""
import pytest

from megatron_burst import cost_model
from megatron_burst.algorithms import backward_bytes, resolve_algo


def test_table1_by_hand():
    # N = 32 GPUs on 4 nodes, T_intra = 1, T_inter = 10:
    #   Ring 6*max(32, 320) = 1920; DoubleRing 4*max(28, 40) + 2*(28 + 40) = 296; Burst 5*max(28, 40) = 200
    assert cost_model.table1(32, 4, 1.0, 10.0) == {"RingAttention": 1920.0, "DoubleRing": 296.0,
                                                   "BurstAttention": 200.0}


def test_table1_ordering_for_the_papers_32_a800_setting():
    """4 x 8 A800: 400 GB/s NVLink, one 200 Gb/s HDR NIC per GPU; 14B (40 heads x 128), 1M tokens, bf16."""
    cluster = cost_model.Cluster(4, 8)
    shape = cost_model.AttnShape(seq=1 << 20, heads=40, kv_heads=40, head_dim=128)
    p = cost_model.hop_bytes(shape, cluster.world)["forward"] / 2  # one K slice: 32768 tokens x 5120 x 2 B
    assert p == 32768 * 5120 * 2
    t = cost_model.table1(32, 4, cluster.hop(p, "intra"), cluster.hop(p, "inter"))
    assert t["BurstAttention"] < t["DoubleRing"] < t["RingAttention"]
    # our model keeps that order in communication time
    pred = cost_model.predict(cluster, shape)
    comm = {k: v["fwd_comm"] + v["bwd_comm"] for k, v in pred.items()}
    assert comm["burst/double"] < comm["ring/double"] < comm["burst/flat"] < comm["ring/flat"]


def test_pass_time_by_hand():
    # 1e6 bytes: intra 8 Gb/s = 1 ms per hop, inter 0.8 Gb/s = 10 ms, no latency; 2 nodes x 2 ranks
    c = cost_model.Cluster(2, 2, intra_gbps=8, inter_gbps=0.8, intra_lat_us=0, inter_lat_us=0)
    assert cost_model.pass_time(c, 1e6, "flat") == pytest.approx(3 * 0.010)  # 3 hops, each waits for inter
    # inter hidden behind inner ring, + last inner ring
    assert cost_model.pass_time(c, 1e6, "double") == pytest.approx(0.010 + 0.001)
    one_node = cost_model.Cluster(1, 4, intra_gbps=8, intra_lat_us=0)
    assert cost_model.pass_time(one_node, 1e6, "flat") == pytest.approx(3 * 0.001)


def test_compute_model_by_hand():
    shape = cost_model.AttnShape(seq=1000, heads=2, kv_heads=2, head_dim=10, causal=True)
    fwd, bwd = cost_model.attention_flops(shape)
    assert fwd == 4 * 1000 ** 2 * 2 * 10 / 2 and bwd == 2.5 * fwd


def test_recommendations():
    cluster = cost_model.Cluster(4, 8)
    mha_14b = cost_model.AttnShape(seq=1 << 20, heads=40, kv_heads=40, head_dim=128)
    llama3_70b = cost_model.AttnShape(seq=1 << 20, heads=64, kv_heads=8, head_dim=128)
    assert cost_model.recommend(cluster, mha_14b) == "burst/double"
    assert cost_model.recommend(cluster, llama3_70b) == "ring/double"  # GQA 8:1: Q-side traffic is 8x larger


@pytest.mark.parametrize("hq,hkv,elem", [(32, 32, 2), (32, 32, 4), (32, 16, 2), (32, 24, 4), (30, 20, 2), (32, 8, 2), (32, 1, 4)])
@pytest.mark.parametrize("nodes", [1, 2])
def test_auto_never_sends_more_than_the_cheaper(hq, hkv, elem, nodes):
    args = (1, hq, hkv, 4096, 128, elem, 8)
    chosen = resolve_algo("auto", *args, nodes=nodes, ring="double")
    assert backward_bytes(chosen, *args) == min(backward_bytes("ring", *args), backward_bytes("burst", *args))


def test_cli_prints_table_and_recommendation(capsys):
    cost_model.main(["--nodes", "4", "--gpus-per-node", "8", "--seq", "1M", "--heads", "64", "--kv-heads", "8",
               "--head-dim", "128", "--layers", "80"])
    out = capsys.readouterr().out
    assert "| ring/double |" in out and "recommendation: --cp-algo ring --cp-ring double" in out


@pytest.mark.parametrize("argv,needle", [
    (["--nodes", "0", "--gpus-per-node", "8", "--seq", "1M", "--heads", "40"], "--nodes 0 must be >= 1"),
    (["--nodes", "1", "--gpus-per-node", "8", "--seq", "1M", "--heads", "40", "--kv-heads", "6"],
     "--heads 40 is not divisible by --kv-heads 6"),
    (["--nodes", "1", "--gpus-per-node", "3", "--seq", "1000", "--heads", "8"], "not divisible by 3 GPUs"),
])
def test_cli_rejects_bad_input_with_a_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cost_model.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_on_one_gpu_says_what_and_why(capsys):
    cost_model.main(["--nodes", "1", "--gpus-per-node", "1", "--seq", "8K", "--heads", "8"])
    out = capsys.readouterr().out
    assert "no context parallelism" in out and "recommendation: --context-parallel-size 1" in out


def test_cli_recommendation_gives_its_reason(capsys):
    cost_model.main(["--nodes", "4", "--gpus-per-node", "8", "--seq", "1M", "--heads", "40", "--head-dim", "128"])
    out = capsys.readouterr().out
    assert "recommendation: --cp-algo burst --cp-ring double: the lowest predicted fwd+bwd time" in out
    assert "3 inter-node hops" in out
