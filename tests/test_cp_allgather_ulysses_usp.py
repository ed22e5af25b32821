"""algo = allgather / ulysses / usp equal the full-sequence reference (forward and every gradient),
send exactly the bytes their analysis says, refuse bad inputs before any collective, and complete
under NCCL's rules."""
import pytest

from attention_cases import run_case
from cp_family_cases import (auto_choice, bad_family_inputs, family_schedule, link_split, run_family_matrix,
                             run_usp_case, selective_fallback, usp_doc_case)
from harness import run_ranks
from megatron_burst.algorithms import allgather, burst, ring, ulysses
from test_attention import FP32_TOL, HAND_BYTES, _assert_close
from test_nccl_schedule import _assert_replays

LAYOUTS = [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)]
# head counts each world size allows for Ulysses: MHA, GQA, MQA (KV heads repeated to the group)
ULYSSES_HEADS = {2: ("mha", "gqa4", "mqa"), 3: ((3, 3), (6, 3), (6, 1)), 4: ("mha", "gqa4", "mqa"),
                 8: ((8, 8), (8, 2), (8, 1))}


@pytest.mark.parametrize("layout,stripe", LAYOUTS)
@pytest.mark.parametrize("algo", ["allgather", "ulysses"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matrix_fp32(world_size, algo, layout, stripe):
    """{causal, full} x {MHA, GQA, MQA}; local length 12 (6 stripes of 2 when block-striped)."""
    heads = ("mha", "gqa4", "mqa") if algo == "allgather" else ULYSSES_HEADS[world_size]
    for rank_results in run_ranks(world_size, run_family_matrix, algo, layout, heads, stripe=stripe,
                                  local_len=12):
        _assert_close(rank_results)


@pytest.mark.parametrize("algo,layout", [("allgather", "zigzag"), ("ulysses", "striped"), ("allgather", "striped")])
def test_world_size_8(algo, layout):
    heads = ("gqa4", "mqa") if algo == "allgather" else ULYSSES_HEADS[8]
    for rank_results in run_ranks(8, run_family_matrix, algo, layout, heads, local_len=4):
        _assert_close(rank_results)


@pytest.mark.parametrize("ring_backward", ["ring", "burst", "auto"])
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_usp_2x2(layout, ring_backward):
    """U = 2 Ulysses groups, a ring of 2 across them; MHA, GQA, MQA (kv repeated to 2), causal/full."""
    for rank_results in run_ranks(4, run_family_matrix, "usp", layout, ("mha", "gqa4", "mqa"), ulysses_size=2,
                                  ring_backward=ring_backward):
        _assert_close(rank_results)


@pytest.mark.parametrize("ulysses_size,ranks_per_node,ring_name", [(2, None, None), (4, None, None),
                                                                    (2, 4, "double"), (2, 4, "flat")])
def test_usp_2x4_and_4x2(ulysses_size, ranks_per_node, ring_name):
    """W = 8: 2 x 4 and 4 x 2; with 2 nodes of 4 the ring over the 4 groups is a double ring."""
    for causal in (True, False):
        for heads in ((8, 8), (8, 2)):
            for errs in run_ranks(8, run_usp_case, "zigzag", causal, heads, ulysses_size, ranks_per_node,
                                  ring=ring_name, local_len=4):
                _assert_close({(ulysses_size, ranks_per_node, ring_name, causal, heads): errs})


def test_usp_edges_are_ulysses_and_ring():
    """U = W is Ulysses and U = 1 the ring: same bytes and results as those algorithms."""
    uly = run_ranks(4, run_case, "ulysses", "zigzag", True, "gqa4")
    usp_w = run_ranks(4, run_case, "usp", "zigzag", True, "gqa4", ulysses_size=4)
    rng = run_ranks(4, run_case, "ring", "zigzag", True, "gqa4")
    usp_1 = run_ranks(4, run_case, "usp", "zigzag", True, "gqa4", ulysses_size=1, ring_backward="ring")
    for a, b in ((uly, usp_w), (rng, usp_1)):
        for ra, rb in zip(a, b):
            assert ra["bytes"] == rb["bytes"]
            assert all(ra[n] == rb[n] for n in ("out", "dq", "dk", "dv"))


# Exact volumes for b=2, n=6 local tokens, d=8, fp32 (e=4), W=4. One head of n tokens: u = b*n*d*4 = 384 B.
#   allgather: forward 3 x K,V = 3*2*hkv*u; backward K,V again + dK,dV (fp32) = 2 x forward
#   ulysses (U=4): forward 3/4 of [q,k,v] (hq+2hkv' heads) + 3/4 of out (hq); backward 3/4 dO + 3/4 dq,dk,dv
#   usp (U=2, ring of 2 members of 12 tokens, hq/2 and hkv'/2 heads): 1/2 of the same a2a buffers + one hop
U_BYTES = 384
HAND_FAMILY_BYTES = {
    # heads: {algo: (forward, backward)}; MHA hq = hkv = 4, GQA 8/2, MQA 4/1 (repeated to 4 / to 2 heads)
    "mha": {"allgather": (3 * 2 * 4 * U_BYTES, 6 * 2 * 4 * U_BYTES),
            "ulysses": (3 * (12 + 4) * U_BYTES // 4, 3 * (4 + 12) * U_BYTES // 4),
            "usp/ring": ((12 + 4) * U_BYTES // 2 + 2 * 2 * 2 * U_BYTES,
                         (4 + 12) * U_BYTES // 2 + 2 * (2 * 2 * 2 * U_BYTES)),
            # burst's ring part: Q,dO (2 heads of 12 tokens: 2 x 4u), dQ fp32 (4u), D,lse (2*b*2*12*4 B)
            "usp/burst": ((12 + 4) * U_BYTES // 2 + 2 * 2 * 2 * U_BYTES,
                          (4 + 12) * U_BYTES // 2 + 2 * 4 * U_BYTES + 4 * U_BYTES + 2 * 2 * 2 * 12 * 4)},
    "gqa4": {"allgather": (3 * 2 * 2 * U_BYTES, 6 * 2 * 2 * U_BYTES),
             "ulysses": (3 * (8 + 8 + 8) * U_BYTES // 4, 3 * (8 + 16) * U_BYTES // 4)},
    "mqa": {"allgather": (3 * 2 * 1 * U_BYTES, 6 * 2 * 1 * U_BYTES),
            "ulysses": (3 * (4 + 8 + 4) * U_BYTES // 4, 3 * (4 + 12) * U_BYTES // 4)},
}


@pytest.mark.parametrize("heads", list(HAND_FAMILY_BYTES))
def test_exact_bytes(heads):
    hq, hkv = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}[heads]
    for name, (fwd, bwd) in HAND_FAMILY_BYTES[heads].items():
        algo, _, ring_backward = name.partition("/")
        if algo == "usp":
            results = run_ranks(4, run_usp_case, "zigzag", True, heads, 2, ring_backward=ring_backward)
        else:
            results = run_ranks(4, run_case, algo, "zigzag", True, heads)
        for errs in results:
            assert errs["bytes"] == {"forward": fwd, "backward": bwd}, (name, heads, errs["bytes"])
            assert errs["received"] == fwd + bwd
            _assert_close({name: errs})
        # the documented formulas give the same figures
        if algo == "allgather":
            assert (allgather.forward_bytes(2, hkv, 6, 8, 4, 4), allgather.backward_bytes(2, hq, hkv, 6, 8, 4, 4)) \
                == (fwd, bwd)
        if algo == "ulysses":
            assert (ulysses.a2a_forward_bytes(2, hq, hkv, 6, 8, 4, 4),
                    ulysses.a2a_backward_bytes(2, hq, hkv, 6, 8, 4, 4)) == (fwd, bwd)
        if algo == "usp":
            ring_bwd = {"ring": ring.backward_bytes, "burst": burst.backward_bytes}[ring_backward]
            assert ulysses.a2a_forward_bytes(2, hq, hkv, 6, 8, 4, 2) + ring.forward_bytes(2, hkv // 2, 12, 8, 4, 2) \
                == fwd
            assert ulysses.a2a_backward_bytes(2, hq, hkv, 6, 8, 4, 2) + ring_bwd(2, hq // 2, hkv // 2, 12, 8, 4, 2) \
                == bwd


def test_allgather_sends_the_ring_volume():
    """All-gather and the ring move the same bytes in both directions (both are ring collectives);
    all-gather sends them as 2 collectives per direction instead of W-1 hops."""
    ring_fwd, ring_bwd, _ = HAND_BYTES["gqa4"]
    assert HAND_FAMILY_BYTES["gqa4"]["allgather"] == (ring_fwd, ring_bwd)


def test_bad_inputs_raise_before_any_collective():
    for messages, moved, group_ok in run_ranks(4, bad_family_inputs):
        assert group_ok and moved == 0
        for name, msg in messages.items():
            assert msg is not None, f"{name} did not raise ValueError"
        assert "6 query heads" in messages["ulysses_heads"] and "usp" in messages["ulysses_heads"]
        assert "6 key/value heads" in messages["ulysses_kv_heads"] and "usp" in messages["ulysses_kv_heads"]
        assert "ulysses_size=3 does not divide the CP size 4" in messages["usp_size_not_dividing"]
        assert "needs ulysses_size" in messages["usp_without_size"]
        assert "build_usp_topology" in messages["usp_without_groups"]
        assert "3 query heads" in messages["usp_heads"]
        assert "p2p" in messages["ring_backward"]
        assert "divisible by 8" in messages["allgather_seq"]


NCCL_CASES = [
    ("allgather", 2, {}), ("allgather", 3, {}), ("allgather", 8, {}), ("ulysses", 4, {}), ("ulysses", 8, {}),
    ("usp", 4, dict(ulysses_size=2, ring_backward="burst")),
    ("usp", 4, dict(ulysses_size=2, ring_backward="ring")),
    ("usp", 8, dict(ulysses_size=2, ranks_per_node=4, ring_backward="burst", ring="double")),
    ("usp", 8, dict(ulysses_size=2, ranks_per_node=4, ring_backward="ring", ring="double")),
    ("usp", 8, dict(ulysses_size=4, ranks_per_node=4, ring_backward="burst")),
]


@pytest.mark.parametrize("algo,world_size,kw", NCCL_CASES)
def test_schedules_complete_under_nccl(algo, world_size, kw):
    heads = (8, 2)
    for rank, res in enumerate(run_ranks(world_size, family_schedule, algo, "zigzag", heads, **kw)):
        _assert_replays(res, f"{algo} {kw} W={world_size} rank {rank}")
        assert res["max_err"] < FP32_TOL
        expected = {"allgather": {"all_gather", "reduce_scatter"}, "ulysses": {"all_to_all"},
                    "usp": {"all_to_all", "send", "recv"}}[algo]
        assert set(res["kinds"]) == expected


def test_auto_keeps_the_ring_family_when_latency_decides_and_uses_usp_groups_when_built():
    """At the exact-bytes shape (W=4, 6 tokens) the ring's 3 hops beat Ulysses' 2 x 3-latency
    all-to-alls and all-gather's exposed reduce-scatter; once USP groups of 2 exist, usp (1 a2a
    latency + 1 hop per pass) is predicted faster and auto runs it (its exact bytes)."""
    fwd, ring_bwd, burst_bwd = HAND_BYTES["mha"]
    for errs in run_ranks(4, auto_choice, "mha"):
        assert errs["bytes"] == {"forward": fwd, "backward": min(ring_bwd, burst_bwd)}
    usp_fwd, usp_bwd = HAND_FAMILY_BYTES["mha"]["usp/burst"]
    for errs in run_ranks(4, auto_choice, "mha", 2):
        assert errs["bytes"] == {"forward": usp_fwd, "backward": usp_bwd}
        _assert_close({"auto": errs})


def test_bytes_are_classed_by_the_link_they_cross():
    """2 nodes x 2 ranks: Ulysses sends 1 of its 3 chunks inside the node; a ring collective sends
    everything to the next rank (inter from the node's last rank); USP's all-to-all stays inside
    the node and only its ring crosses."""
    from megatron_burst.algorithms import ring as ring_mod

    for rank, (links, total) in enumerate(run_ranks(4, link_split, "ulysses", 2)):
        for phase in ("forward", "backward"):
            assert links[(phase, "intra")] * 3 == total[phase] and links[(phase, "inter")] * 3 == 2 * total[phase]
    for rank, (links, total) in enumerate(run_ranks(4, link_split, "allgather", 2)):
        crosses = rank % 2 == 1  # rank 1 -> 2 and rank 3 -> 0 leave the node
        assert links[("forward", "inter" if crosses else "intra")] == total["forward"]
    ring_fwd = ring_mod.forward_bytes(2, 2, 12, 8, 4, 2)  # one hop of the 2-member ring, 2 heads of 12 tokens
    for links, total in run_ranks(4, link_split, "usp", 2):
        assert links[("forward", "inter")] == ring_fwd
        assert links[("forward", "intra")] == total["forward"] - ring_fwd


def test_selective_checkpointing_falls_back_to_a_plain_recompute_for_ulysses():
    for same, hits in run_ranks(2, selective_fallback, "ulysses"):
        assert same and hits == 0


# ----------------------------------------------------------------------------- documents (cu_seqlens, THD)
# The engine's document masks (megatron_burst.documents, CPConfig.blocks) flow through the family:
# all-gather attends gathered keys through the same blocks, Ulysses/USP per CP-rank shard pair.

@pytest.mark.parametrize("layout,stripe", LAYOUTS)
@pytest.mark.parametrize("algo,world_size", [("allgather", 2), ("allgather", 3), ("allgather", 4), ("ulysses", 2),
                                             ("ulysses", 4)])
def test_documents_match_dense_reference(algo, world_size, layout, stripe):
    from document_cases import run_doc_matrix
    from test_document_masks import LOCAL_LEN, _assert_exact, uneven_bounds

    for rank_results in run_ranks(world_size, run_doc_matrix, algo, layout, uneven_bounds(LOCAL_LEN * world_size),
                                  LOCAL_LEN, stripe):
        _assert_exact(rank_results)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_usp_documents_match_dense_reference(layout):
    from test_document_masks import LOCAL_LEN, _assert_exact, uneven_bounds

    for errs in run_ranks(4, usp_doc_case, layout, uneven_bounds(LOCAL_LEN * 4), LOCAL_LEN):
        _assert_exact({layout: errs})


@pytest.mark.parametrize("algo,world_size", [("allgather", 2), ("allgather", 4), ("ulysses", 2), ("ulysses", 4)])
def test_packed_thd_sequences(algo, world_size):
    from document_cases import run_thd_case
    from test_document_masks import _assert_exact

    c = 2 * world_size
    seqlens, padded = [3, 2 * c, c + 1, 1], [c, 2 * c, 2 * c, c]
    for errs in run_ranks(world_size, run_thd_case, algo, seqlens, padded):
        _assert_exact({"thd": {k: v for k, v in errs.items() if k not in ("shape", "bytes")}})
