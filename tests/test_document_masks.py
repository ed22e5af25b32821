"""Document masks (cu_seqlens): cp_attention equals a dense masked softmax over the whole packed
sequence for every algorithm x layout x ring shape, skips block pairs that share no document,
sends the same bytes as without documents, and refuses bad boundaries before any collective."""
import pytest
import torch

from document_cases import (bad_cu_seqlens_messages, count_kernel_calls, run_doc_case, run_doc_matrix,
                            run_thd_case, selective_checkpoint_with_documents, thd_error)
from harness import run_ranks
from megatron_burst.masks.documents import check_cu_seqlens, dense_document_mask, document_blocks
from megatron_burst.masks.layout import layout_indices

ALGOS = ["ring", "burst", "auto"]
LAYOUTS = [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)]
TOL = 1e-5  # fp32 rounding, as tests/test_attention.py (a wrong mask gives O(1) errors)
LOCAL_LEN = 8


def uneven_bounds(seq: int) -> list:
    """Documents of 3 and 1 tokens (shorter than any rank's share), one spanning ranks, and the rest."""
    return [0, 3, 4, seq // 2 + 3, seq]


def _assert_exact(results):
    for case, errs in results.items():
        assert errs["finite"], case
        for name in ("out", "dq", "dk", "dv"):
            assert errs[name] <= TOL, f"{case}: {name} error {errs[name]:.2e}"


@pytest.mark.parametrize("layout,stripe", LAYOUTS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_documents_match_dense_reference(world_size, algo, layout, stripe):
    """Forward and dq, dk, dv; causal and full-within-document; MHA and GQA 4:1; shared and
    per-sample boundaries (one sample with a single-token document)."""
    bounds = uneven_bounds(LOCAL_LEN * world_size)
    for rank_results in run_ranks(world_size, run_doc_matrix, algo, layout, bounds, LOCAL_LEN, stripe):
        _assert_exact(rank_results)


@pytest.mark.parametrize("ring", ["flat", "double"])
@pytest.mark.parametrize("algo", ALGOS)
def test_documents_on_two_emulated_nodes(algo, ring):
    """W = 4 as 2 nodes x 2: the double ring (and the flat ring over the node split) with documents."""
    bounds = uneven_bounds(LOCAL_LEN * 4)
    for layout, stripe in LAYOUTS:
        for errs in run_ranks(4, run_doc_case, algo, layout, (8, 2), bounds, LOCAL_LEN, stripe=stripe,
                              ranks_per_node=2, ring=ring):
            _assert_exact({(layout, stripe): errs})


def test_one_document_equals_no_documents():
    """cu_seqlens [0, S] is plain causal attention: same result as without cu_seqlens."""
    for errs in run_ranks(3, run_doc_case, "burst", "zigzag", (4, 4), [0, 24], LOCAL_LEN):
        _assert_exact({"one doc": errs})


@pytest.mark.parametrize("algo", ["ring", "burst"])
@pytest.mark.parametrize("layout,stripe", LAYOUTS)
def test_pairs_sharing_no_document_call_no_kernel(algo, layout, stripe):
    """Kernel calls equal an independent count (from the dense mask) of (kv rank, document) pairs
    with something visible; with one document per rank's share under contiguous, only the home
    block is computed."""
    W = 4
    for bounds in (uneven_bounds(LOCAL_LEN * W), [0, 8, 16, 24, 32]):
        for fwd, fwd_exp, bwd, bwd_exp, errs in run_ranks(W, count_kernel_calls, algo, layout, bounds, LOCAL_LEN,
                                                          stripe):
            assert (fwd, bwd) == (fwd_exp, bwd_exp), (bounds, fwd, fwd_exp, bwd, bwd_exp)
            _assert_exact({"calls": errs})
    per_rank = run_ranks(W, count_kernel_calls, algo, "contiguous", [0, 8, 16, 24, 32], LOCAL_LEN)
    assert [(fwd, bwd) for fwd, _, bwd, _, _ in per_rank] == [(1, 1)] * W  # W-1 pairs skipped per pass


@pytest.mark.parametrize("layout,stripe", [("zigzag", 1), ("contiguous", 1)])
def test_small_adjacent_documents_merge_into_few_kernel_calls(layout, stripe):
    """48 local tokens in 2- and 3-token documents: one call per document would be ~20 per block
    pair; merged runs (MERGE_ROWS) need at most 2 per pair and per pass, with the same exact result."""
    W, n = 2, 48
    bounds = sorted(set(range(0, n * W, 5)) | set(range(0, n * W, 2)) | {n * W})
    for fwd, per_doc, bwd, per_doc_bwd, errs in run_ranks(W, count_kernel_calls, "burst", layout, bounds, n,
                                                          stripe, 128):
        _assert_exact({"merged": errs})
        assert per_doc >= 20 and fwd <= 2 * W and bwd <= 2 * W, (fwd, per_doc, bwd, per_doc_bwd)


@pytest.mark.parametrize("algo", ALGOS)
def test_bytes_unchanged_by_documents(algo):
    """Every block still travels (the ring schedule is mask-independent, so NCCL batches match):
    bytes with documents == bytes without, forward and backward."""
    bounds = uneven_bounds(LOCAL_LEN * 3)
    with_docs = run_ranks(3, run_doc_case, algo, "zigzag", (8, 2), bounds, LOCAL_LEN)
    without = run_ranks(3, run_doc_case, algo, "zigzag", (8, 2), bounds, LOCAL_LEN, with_documents=False)
    for a, b in zip(with_docs, without):
        assert a["bytes"] == b["bytes"] and a["bytes"]["forward"] > 0


def test_bad_cu_seqlens_raise_before_any_collective():
    for messages, moved, group_ok, S in run_ranks(2, bad_cu_seqlens_messages):
        assert group_ok and moved == 0
        assert all(m is not None for m in messages.values()), messages
        assert "starts at 1" in messages["not_starting_at_0"] and "must be 0" in messages["not_starting_at_0"]
        assert f"ends at {S - 1}" in messages["not_ending_at_S"] and f"must be {S}" in messages["not_ending_at_S"]
        assert f"ends at {S + 2}" in messages["past_S"]
        assert "not strictly increasing (3 then 3)" in messages["not_increasing"]
        assert "(3 then 2)" in messages["decreasing"]
        assert "torch.float32" in messages["float_dtype"] and "int32" in messages["float_dtype"]
        assert "1-D" in messages["two_dims"]
        assert "3 per-sample" in messages["wrong_sample_count"]


@pytest.mark.parametrize("merge_rows", [0, 4, 128])
def test_document_blocks_cover_exactly_the_dense_mask(merge_rows):
    """Single process: for every layout and rank pair, the rectangles' union is the dense document
    mask restricted to the pair, rectangles never overlap, and every row of each sees a key --
    one rectangle per document, and with runs of adjacent ones merged."""
    for W in (2, 3, 4):
        seq = 8 * W
        for bounds in (uneven_bounds(seq), [0, 1, 2, 5, seq - 1, seq], [0, seq]):
            for causal in (True, False):
                dense = dense_document_mask(bounds, seq, causal)
                for layout, stripe in LAYOUTS:
                    for i in range(W):
                        qp = layout_indices(seq, i, W, layout, stripe)
                        for j in range(W):
                            kp = layout_indices(seq, j, W, layout, stripe)
                            covered = torch.zeros(8, 8, dtype=torch.int64)
                            for m in document_blocks(qp, kp, bounds, causal, merge_rows):
                                sub = m.dense(8, 8)
                                assert sub[m.q_slice, m.kv_slice].any(1).all(), (layout, i, j, m)
                                covered += sub.long()
                            assert torch.equal(covered, dense[qp][:, kp].long()), (W, bounds, layout, i, j)


def test_check_cu_seqlens_forms():
    docs = check_cu_seqlens(torch.tensor([0, 2, 6]), 6, 3)
    assert docs.groups == ((0, 3, (0, 2, 6)),)
    per = check_cu_seqlens([torch.tensor([0, 6]), torch.tensor([0, 6]), [0, 1, 6]], 6, 3)
    assert per.groups == ((0, 2, (0, 6)), (2, 3, (0, 1, 6)))


@pytest.mark.parametrize("algo,layout", [("burst", "striped"), ("ring", "zigzag"), ("burst", "contiguous")])
def test_selective_checkpoint_with_documents(algo, layout):
    for hits, err in run_ranks(3, selective_checkpoint_with_documents, algo, layout):
        assert hits == 1 and err < TOL


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_packed_thd_sequences(world_size, algo):
    """layout/qkv_format "thd": sequences zigzag-partitioned each (TransformerEngine's THD), one of
    them shorter than a rank's share of it and padded, one unpadded spanning every rank."""
    c = 2 * world_size
    seqlens, padded = [3, 2 * c, c + 1, 1], [c, 2 * c, 2 * c, c]
    for errs in run_ranks(world_size, run_thd_case, algo, seqlens, padded):
        assert errs["shape"] == (sum(padded) // world_size, 8, 8)
        _assert_exact({"thd": {k: v for k, v in errs.items() if k not in ("shape", "bytes")}})


def test_bad_thd_boundaries():
    import megatron_burst as mb

    q, kv = torch.randn(8, 4, 8), torch.randn(8, 2, 8)
    bad = {
        "too long": dict(cu_seqlens=torch.tensor([0, 5, 8]), cu_seqlens_padded=torch.tensor([0, 4, 8])),
        "missing": dict(),
        "4-D": dict(cu_seqlens=torch.tensor([0, 8])),
    }
    msgs = {}
    for name, kw in bad.items():
        with pytest.raises(ValueError) as e:
            x = q[:, None] if name == "4-D" else q
            mb.cp_attention(x, kv, kv, layout="thd", qkv_format="thd", **kw)
        msgs[name] = str(e.value)
    # at W = 2 (run_ranks below) lengths must be multiples of 4; at W = 1 any length is fine
    assert "length 3, not divisible by 2 x CP size = 4" in run_ranks(2, thd_error, [0, 3, 16])[0]
    assert "sequence 0 has 5 tokens" in msgs["too long"]
    assert "pass cu_seqlens" in msgs["missing"]
    assert "[tokens, heads, head_dim]" in msgs["4-D"]


def test_thd_at_cp1_takes_any_length():
    """CP = 1 packs without padding: odd lengths are fine (the 2 x CP rule is for partitioning)."""
    errs = run_ranks(1, run_thd_case, "burst", [3, 5, 1], [3, 5, 1])[0]
    _assert_exact({"thd cp1": {k: v for k, v in errs.items() if k not in ("shape", "bytes")}})


def test_one_rank_documents_run_as_one_kernel_call_without_merges(monkeypatch):
    """At W = 1 a documents call whose one block covers every row of every sample (one document, or
    documents merged into one positions block) is one kernel call forward and backward, with no fp32
    accumulator or merge (an H100 showed ~7 ms and 1.3 GB extra at 32K tokens before: the documents
    group names its samples, slice(0, b), which was not taken for the whole batch)."""
    import megatron_burst as mb
    from megatron_burst.algorithms import function, prepare
    from megatron_burst.algorithms.function import single_block

    S, b = 256, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, b, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    one_doc = torch.tensor([0, S], dtype=torch.int32)
    assert single_block(prepare(q, k, v, causal=True, cu_seqlens=one_doc, algo="burst").cfg, S, b) is not None
    per_sample = [one_doc, torch.tensor([0, 5, S], dtype=torch.int32)]
    assert single_block(prepare(q, k, v, causal=True, cu_seqlens=per_sample, algo="burst").cfg, S, b) is None
    calls = []
    monkeypatch.setattr(function, "block_forward", lambda *a, **kw: calls.append("fwd") or _real_fwd(*a, **kw))
    monkeypatch.setattr(function, "block_backward", lambda *a, **kw: calls.append("bwd") or _real_bwd(*a, **kw))
    out = mb.cp_attention(q, k, v, causal=True, cu_seqlens=one_doc)
    out.backward(torch.ones_like(out))
    assert calls == ["fwd", "bwd"]
    dense = mb.cp_attention(q.detach(), k.detach(), v.detach(), causal=True)
    torch.testing.assert_close(out.detach(), dense, atol=1e-6, rtol=0)


def _real_fwd(*a, **kw):
    from megatron_burst.kernels import block_forward
    return block_forward(*a, **kw)


def _real_bwd(*a, **kw):
    from megatron_burst.kernels import block_backward
    return block_backward(*a, **kw)
