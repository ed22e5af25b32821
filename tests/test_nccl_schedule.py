"""Every point-to-point pattern completes under NCCL's rules, not only on gloo.

Schedules are recorded while real cp_attention calls run forward and backward on gloo ranks, then
replayed by megatron_burst.nccl_check (no buffering, FIFO per communicator -- and also one FIFO per
rank across communicators -- k-th send matches k-th receive, tags ignored). New algorithms join
ATTENTION_CASES as they land. The synthetic traces below show the checker can fail, and how.
"""
import pytest

from harness import run_ranks
from megatron_burst.comm import TracedBatch, TracedOp
from megatron_burst.nccl_check import replay
import nccl_cases

# (world size, ranks per node) for the double ring: one rank per node, 2 x 2, 2 x 4, 4 x 2
DOUBLE = {2: 1, 3: 1, 4: 2, 8: 4}
ATTENTION_CASES = [(algo, ring, W) for algo in ("ring", "burst", "auto") for ring in ("flat", "double")
                   for W in (2, 3, 4, 8)]


def _assert_replays(result, what):
    for model in ("per_comm", "serialized"):
        ok, text, total = result[model]
        assert ok, f"{what} ({model}): {text}"
        assert total > 0, f"{what}: nothing was recorded"


@pytest.mark.parametrize("algo,ring,world_size", ATTENTION_CASES)
def test_attention_schedules_complete_under_nccl(algo, ring, world_size):
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.attention_schedule, algo, ring, DOUBLE[world_size])):
        _assert_replays(res, f"{algo}/{ring} W={world_size} rank {rank}")
        assert res["max_err"] < 1e-5  # and the recorded run was a correct one


def test_double_ring_four_nodes_of_two():
    for res in run_ranks(8, nccl_cases.attention_schedule, "burst", "double", 2, "striped", "mha"):
        _assert_replays(res, "burst/double 4 nodes x 2")


def test_checker_fails_on_a_lone_send_schedule():
    """The old ring_pass pattern: fine on gloo, stuck under NCCL, reported at the first send."""
    for rank, (ok_on_gloo, res) in enumerate(run_ranks(3, nccl_cases.lone_send_ring)):
        assert ok_on_gloo
        ok, text, _ = res["per_comm"]
        assert not ok
        assert "first stuck: rank 0 group" in text and "[lone send]" in text, text
        assert "queued behind group" in text, text


def test_collectives_are_counted_traced_and_replayed():
    for res in run_ranks(3, nccl_cases.collectives_schedule):
        assert res["values_ok"]
        # all_gather of 6 fp32: 2 x 24 B out; all_to_all of 6 fp32 over 3 ranks: 2/3 of 24 B out
        assert res["bytes"] == {"forward": 48, "backward": 16}
        _assert_replays(res, "all_gather + all_to_all")


# ------------------------------------------------------------------ synthetic traces (no ranks)

def _post(bid, comm, ops, members=(0, 1), label=""):
    return ("post", TracedBatch(bid, comm, tuple(members), tuple(TracedOp(*o) for o in ops), label))


def _send(peer, n=64):
    return ("send", peer, n)


def _recv(peer, n=64):
    return ("recv", peer, n)


def test_send_and_receive_in_one_group_complete():
    traces = {r: [_post(0, "c", [_send(1 - r), _recv(1 - r)]), ("wait", 0)] for r in (0, 1)}
    assert replay(traces).ok
    assert replay(traces, serialize_communicators=True).ok


def test_sends_posted_before_their_receives_deadlock():
    traces = {r: [_post(0, "c", [_send(1 - r)], label="send"), _post(1, "c", [_recv(1 - r)], label="recv"),
                  ("wait", 0), ("wait", 1)] for r in (0, 1)}
    report = replay(traces)
    assert not report.ok
    assert "first stuck: rank 0 group #0 [send]" in str(report)
    assert "queued behind group #0 [send]" in str(report)


def test_a_host_wait_orders_groups_across_communicators():
    # rank 0 waits for its send on "a" before posting a receive on "b"; rank 1 does the mirror:
    # separate communicators, but each host blocks before posting what the other needs
    traces = {0: [_post(0, "a", [_send(1)]), ("wait", 0), _post(1, "b", [_recv(1)]), ("wait", 1)],
              1: [_post(0, "b", [_send(0)]), ("wait", 0), _post(1, "a", [_recv(0)]), ("wait", 1)]}
    report = replay(traces)
    assert not report.ok and "not posted yet" in str(report)


def test_communicator_order_matters_only_when_serialized():
    # no waits in between: per-communicator streams can run both; one FIFO per rank cannot
    traces = {0: [_post(0, "a", [_send(1)]), _post(1, "b", [_recv(1)]), ("wait", 0), ("wait", 1)],
              1: [_post(0, "b", [_send(0)]), _post(1, "a", [_recv(0)]), ("wait", 0), ("wait", 1)]}
    assert replay(traces).ok
    assert not replay(traces, serialize_communicators=True).ok


def test_size_mismatch_and_unmatched_operations_are_reported():
    traces = {0: [_post(0, "c", [_send(1, 64), _send(1, 32)]), ("wait", 0)],
              1: [_post(0, "c", [_recv(0, 128)]), ("wait", 0)]}
    report = replay(traces)
    assert not report.ok
    text = str(report)
    assert "size mismatch" in text and "sends 64 B" in text and "expects 128 B" in text
    assert "send of 32 B to rank 1 has no matching receive" in text


def test_collectives_run_in_posting_order_per_communicator():
    gather, a2a = ("all_gather", -1, 16), ("all_to_all", -1, 16)
    same = {r: [_post(0, "c", [gather]), _post(1, "c", [a2a]), ("wait", 0), ("wait", 1)] for r in (0, 1)}
    assert replay(same).ok
    crossed = {0: same[0], 1: [_post(0, "c", [a2a]), _post(1, "c", [gather]), ("wait", 0), ("wait", 1)]}
    assert not replay(crossed).ok


def test_first_use_of_a_communicator_needs_every_member():
    # a communicator of three ranks whose first use is a send between two of them: NCCL creates
    # it lazily with all members, so rank 2 never joining leaves the others hanging
    traces = {0: [_post(0, "c", [_send(1)], members=(0, 1, 2)), ("wait", 0)],
              1: [_post(0, "c", [_recv(0)], members=(0, 1, 2)), ("wait", 0)],
              2: []}
    assert replay(traces, lazy_init=False).ok
    assert not replay(traces).ok


@pytest.mark.parametrize("ring,world_size", [("flat", 3), ("flat", 4), ("double", 4)])
def test_selective_checkpoint_recompute_schedules_complete_under_nccl(ring, world_size):
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.selective_recompute_schedule, ring,
                                         DOUBLE[world_size])):
        assert res["hits"] == 1
        _assert_replays(res, f"selective recompute {ring} W={world_size} rank {rank}")


@pytest.mark.parametrize("algo,layout,causal", [
    ("lasp2", "contiguous", True), ("lasp2", "zigzag", True), ("lasp2", "striped", True), ("lasp2", "zigzag", False),
    ("lasp1", "contiguous", True), ("lasp1", "zigzag", True), ("lasp1", "striped", True), ("lasp1", "contiguous", False),
])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_linear_attention_schedules_complete_under_nccl(algo, layout, causal, world_size):
    """LASP-2's all-gathers and LASP-1's chain of lone sends (sends posted before the matching
    receive is reached) complete under NCCL's rules: the chain runs in global segment order."""
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.linear_schedule, algo, layout, causal)):
        _assert_replays(res, f"{algo} {layout} causal={causal} W={world_size} rank {rank}")
        assert res["max_err"] < 1e-5


@pytest.mark.parametrize("layout,world_size,kernel", [(lay, W, "torch") for lay in ("contiguous", "zigzag", "striped")
                                                     for W in (2, 3, 4)]
                         + [("zigzag", 3, "fla"), ("striped", 2, "fla")])
def test_gated_delta_rule_schedules_complete_under_nccl(layout, world_size, kernel):
    """The gated delta rule's (A, B) all-gather forward and dS all-gather backward; with fla's maps
    (the wide call) as well as ours."""
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.gdn_schedule, layout, kernel)):
        _assert_replays(res, f"gdn {layout} {kernel} W={world_size} rank {rank}")
        assert res["max_err"] < 1e-5


@pytest.mark.parametrize("world_size", [2, 3])
def test_linear_run_layout_schedules_complete_under_nccl(world_size):
    """THD and balanced in the linear family: a rank's all-gather part padded to the most runs a rank
    holds (NCCL needs equal counts), and the conv halo over runs."""
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.run_layouts_schedule, timeout=300)):
        _assert_replays(res, f"run layouts W={world_size} rank {rank}")
        assert res["max_err"] < 1e-5


@pytest.mark.parametrize("algo,ring,world_size", [(a, r, W) for a in ("ring", "burst") for r in ("flat", "double")
                                                  for W in (3, 4)])
def test_document_mask_schedules_complete_under_nccl(algo, ring, world_size):
    """With cu_seqlens, ranks skip block pairs that share no document, but every transfer is still
    posted in the same order (tests/test_document_masks.py checks the bytes are unchanged)."""
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.document_schedule, algo, ring, DOUBLE[world_size])):
        _assert_replays(res, f"documents {algo}/{ring} W={world_size} rank {rank}")
        assert res["max_err"] < 1e-5


@pytest.mark.parametrize("algo,ring,world_size", [("ring", "flat", 3), ("burst", "flat", 4), ("ring", "double", 4),
                                                  ("burst", "double", 8)])
def test_direct_traffic_schedules_complete_under_nccl(algo, ring, world_size):
    """Direct traffic (cfg.traffic = "direct"): each rank sends a block only to the ranks whose mask
    needs it, so ranks post different numbers of messages, yet every batch still meets its peers'."""
    results = run_ranks(world_size, nccl_cases.direct_document_schedule, algo, ring, DOUBLE[world_size])
    for rank, res in enumerate(results):
        _assert_replays(res, f"direct {algo}/{ring} W={world_size} rank {rank}")
        assert res["max_err"] < 1e-5
    assert sum(r["sent"] for r in results) < sum(r["ring_sent"] for r in results)


@pytest.mark.parametrize("algo,world_size", [("ring", 4), ("burst", 8)])
def test_node_aware_balanced_schedules_complete_under_nccl(algo, world_size):
    """The balanced layout on 2 nodes: the direct pass runs over the CP group in the plan's member
    order (every rank derives it from the same plan), sends nothing across nodes for these mixes,
    and its recorded schedule replays under NCCL's rules."""
    results = run_ranks(world_size, nccl_cases.balanced_nodes_schedule, algo, DOUBLE[world_size])
    for rank, res in enumerate(results):
        _assert_replays(res, f"balanced on nodes {algo} W={world_size} rank {rank}")
        assert res["max_err"] < 1e-5 and res["inter"] == 0, res
    assert sum(r["sent"] for r in results) > 0


@pytest.mark.parametrize("algo", ["ring", "burst"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sparse_dynamic_schedules_complete_under_nccl(algo, world_size):
    """MTraining's dynamic pattern: the attention-mass all-reduce, then the (unchanged) ring."""
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.sparse_dynamic_schedule, algo)):
        _assert_replays(res, f"sparse dynamic {algo} W={world_size} rank {rank}")
        assert res["finite"] and "all_reduce" in res["kinds"], res["kinds"]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_gated_delta_net_conv_halo_schedules_complete_under_nccl(layout, world_size):
    """CPGatedDeltaNet's short-conv halo: one all-gather of segment tails each way."""
    for rank, res in enumerate(run_ranks(world_size, nccl_cases.previous_tokens_schedule, layout)):
        _assert_replays(res, f"conv halo {layout} W={world_size} rank {rank}")
        assert res["max_err"] < 1e-6
