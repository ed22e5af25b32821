"""The cuda_varlen kernel (torch's varlen flash ops) and its per-block dispatcher, on CPU:

* block plans (segments + one window pair) against a brute-force boolean mask, for random
  documents, bands, offsets and gaps, and for every block the document/window masks produce;
* refusals name their reason (striped positions, documents on one side, alignments that differ,
  rows that see nothing, the op's "window >= max_k is unbounded" rule);
* the op calls bind torch's schemas under FakeTensorMode (b=2, GQA, out= or D);
* forward/backward numerics through an emulation of the op's documented semantics (bottom-right
  windows per segment, lse layouts [h, total] and [segments, h, max_q], native GQA);
* varlen_or_triton routes eligible blocks to cuda_varlen and the rest to Triton, and the kernel
  choice's self-check runs both routes.
"""
from __future__ import annotations

import math
import types

import pytest
import torch

from megatron_burst.kernels import choice, cuda_varlen as cv, reference, tiled, torch_ops, varlen_dispatch
from megatron_burst.masks.block import HeadBands, positions_visibility
from megatron_burst.masks.documents import document_blocks
from megatron_burst.masks.layout import layout_indices
from megatron_burst.masks.window import window_blocks

CPU = torch.device("cpu")


def _op_mask(cu_q, cu_k, max_k, left, right, causal, sq, sk) -> torch.Tensor:
    """What FlashAttention-2's varlen op sees (written from its documentation and mha_varlen_fwd /
    set_params_fprop, independently of the module): per segment, bottom-right aligned; -1 unbounded;
    a window >= max_k is unbounded; is_causal sets right = 0; with one side bounded, the open side
    becomes a window of max_k."""
    if causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    if left < 0 and right >= 0:  # set_params_fprop: one side bounded, the open one becomes max_k
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    vis = torch.zeros(sq, sk, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        qa, qb, ka, kb = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        i, j = torch.arange(qb - qa)[:, None], torch.arange(kb - ka)[None, :]
        c = i + (kb - ka) - (qb - qa)  # the diagonal of row i, bottom-right aligned
        vis[qa:qb, ka:kb] = ((j >= c - left) if left >= 0 else True) & ((j <= c + right) if right >= 0 else True)
    return vis


def _check_plan(positions, sq, sk):
    plan = cv.block_plan(positions, sq, sk)
    want = positions_visibility(*positions, sq, sk)
    if isinstance(plan, cv.VarlenPlan):
        got = _op_mask(plan.cu_q, plan.cu_k, plan.max_k, plan.left, plan.right, plan.causal, sq, sk)
        assert torch.equal(got, want), (positions, plan)
        assert torch.equal(cv.flash_visibility(plan, sq, sk), want)
        assert want.any(1).all(), "a planned block has a row that sees nothing"
    return plan


def _random_positions(g: torch.Generator):
    """A random block: contiguous or gapped position runs, documents or not, a random band."""
    def rnd(n):
        return int(torch.randint(0, n, (1,), generator=g))

    seq = 40
    bounds = sorted({0, seq} | {rnd(seq) for _ in range(rnd(5))})
    doc_of = torch.searchsorted(torch.tensor(bounds[1:-1], dtype=torch.long), torch.arange(seq), right=True)
    kind = rnd(4)
    if kind == 0:  # diagonal
        a = rnd(20)
        q_pos = kv_pos = torch.arange(a, a + 1 + rnd(20))
    elif kind == 1:  # two contiguous ranges at an offset
        a, b = rnd(20), rnd(20)
        q_pos, kv_pos = torch.arange(a, a + 1 + rnd(20)), torch.arange(b, b + 1 + rnd(20))
    elif kind == 2:  # stripes
        s = 1 + rnd(3)
        q_pos, kv_pos = torch.arange(rnd(s), seq, s), torch.arange(rnd(s), seq, s)
    else:  # zigzag-like: two chunks
        q_pos = torch.cat([torch.arange(0, 5 + rnd(5)), torch.arange(30, 30 + 1 + rnd(9))])
        kv_pos = torch.cat([torch.arange(rnd(5), 10), torch.arange(28, 40)])
    band = [(None, 0), (rnd(12), 0), (rnd(8), rnd(8)), (None, None), (None, rnd(5))][rnd(5)]
    docs = rnd(3) > 0
    return (q_pos, kv_pos, doc_of[q_pos] if docs else None, doc_of[kv_pos] if docs else None, band)


def test_plans_equal_the_brute_force_mask_on_random_blocks():
    g = torch.Generator().manual_seed(0)
    planned = 0
    for _ in range(600):
        positions = _random_positions(g)
        plan = _check_plan(positions, positions[0].numel(), positions[1].numel())
        planned += isinstance(plan, cv.VarlenPlan)
    assert planned > 150  # the generator reaches both outcomes
    assert planned < 580


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_plans_of_every_document_and_window_block(layout):
    """Every block the document and window masks produce is either refused or planned exactly; on
    the contiguous layout every block is planned (the common case: diagonal, many documents)."""
    W, local = 2, 48
    seq = W * local
    refused = 0
    for bounds in ([0, seq], [0, 3, 7, 20, 21, 50, 70, seq], list(range(0, seq + 1, 8))):
        for window in (None, (5, 0), (17, 0)):
            for i in range(W):
                for j in range(W):
                    qp = layout_indices(seq, i, W, layout, 1)
                    kp = layout_indices(seq, j, W, layout, 1)
                    masks = window_blocks(document_blocks(qp, kp, bounds, True), qp, kp, window, True)
                    for m in masks:
                        if m.kind != "positions":
                            continue
                        plan = _check_plan(m.mask_data, m.q_stop - m.q_start, m.kv_stop - m.kv_start)
                        refused += isinstance(plan, str)
                        if layout == "contiguous":
                            assert isinstance(plan, cv.VarlenPlan), (bounds, window, i, j, plan)
    if layout == "striped":
        assert refused > 0


def test_many_documents_on_the_diagonal_are_one_causal_varlen_call():
    pos = torch.arange(4096)
    doc = pos // 64
    plan = cv.block_plan((pos, pos, doc, doc, (None, 0)), 4096, 4096)
    assert plan.cu_q == plan.cu_k == tuple(range(0, 4097, 64)) and plan.causal and plan.max_q == 64
    plan = cv.block_plan((pos, pos, doc, doc, (16, 0)), 4096, 4096)
    assert (plan.left, plan.right) == (16, 0) and not plan.causal
    # a window over one contiguous range, keys from 1024 positions earlier (a ring step's block)
    window = _check_plan((pos[1024:2048], pos[:2048], None, None, (1024, 0)), 1024, 2048)
    assert (window.cu_q, window.cu_k, window.left, window.right) == ((0, 1024), (0, 2048), 1024, 0)


@pytest.mark.parametrize("positions,sq,sk,reason", [
    ((torch.arange(0, 20, 2), torch.arange(0, 20, 2), None, None, (None, 0)), 10, 10, "not consecutive"),
    ((torch.arange(8), torch.arange(8), torch.tensor([0] * 4 + [1] * 4), torch.tensor([0] * 8), (None, 0)), 8, 8,
     "one side only"),
    # document 0 diagonal, document 1 offset by 2: one window pair cannot align both
    ((torch.arange(8), torch.cat([torch.arange(4), torch.arange(2, 6)]), torch.tensor([0] * 4 + [1] * 4),
      torch.tensor([0] * 4 + [1] * 4), (None, 0)), 8, 8, "differs between segments"),
    ((torch.arange(4, 8), torch.arange(6, 10), None, None, (None, 0)), 4, 4, "sees nothing"),
    ((torch.arange(4), torch.arange(4), torch.tensor([0, 0, 0, 0]), None, (None, 0)), 4, 4, "one side only"),
    # q 12 rows vs k 4 columns at the same start: wr = 8 >= max_k = 4 would be unbounded in the op
    ((torch.arange(10, 22), torch.arange(10, 14), None, None, (None, 0)), 12, 4, "treat it as unbounded"),
    ((torch.arange(10), torch.arange(10), None, None, (-3, 5)), 10, 10, "sees nothing"),
    ((torch.arange(2, 12), torch.arange(0, 4), None, None, (None, 0)), 10, 4, "treat it as unbounded"),
    # a zigzag documents + window block (an H100 gave NaN for it): 193 rows after 74 keys, window 193;
    # the op would bound the open right side at max_k = 74 and cut the first rows
    ((torch.arange(384, 577), torch.arange(310, 384), None, None, (193, 0)), 193, 74, "open right side"),
    # a slash run's band (keys at offsets 2..5): its first rows see nothing
    ((torch.arange(10), torch.arange(10), None, None, (5, -2)), 10, 10, "sees nothing"),
    # per-head bands of a sparse pattern: one window per call cannot express them
    ((torch.arange(10), torch.arange(10), None, None, HeadBands(torch.tensor([[3, 0], [5, -1]]))), 10, 10,
     "per-head bands"),
])
def test_ineligible_blocks_are_refused_with_the_reason(positions, sq, sk, reason):
    plan = cv.block_plan(positions, sq, sk)
    assert isinstance(plan, str) and reason in plan, plan
    with pytest.raises(ValueError, match="cannot compute this .* positions block exactly"):
        cv._plan(positions, sq, sk)


def test_plans_are_cached_per_block_vectors():
    pos = torch.arange(32)
    data = (pos, pos, pos // 8, pos // 8, (None, 0))
    first = cv.cached_plan(data, 32, 32)
    assert cv.cached_plan(data, 32, 32) is first
    assert cv.cached_plan((pos, pos, None, None, (None, 0)), 32, 32) is not first


# ------------------------------------------------------ op calls: schemas under fake tensors


def _recording(monkeypatch):
    seen = []
    real_call = torch_ops.call

    def call(name, **kw):
        seen.append((name, kw))
        return real_call(name, **kw)

    monkeypatch.setattr(torch_ops, "call", call)
    return seen


def test_varlen_ops_bind_torch_schemas_on_fake_cuda_tensors(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = _recording(monkeypatch)
    pos = torch.arange(80)
    data = (pos, pos, (pos >= 30).long(), (pos >= 30).long(), (20, 0))
    with FakeTensorMode():
        assert cv.unavailable() is None and varlen_dispatch.route(
            torch.empty(1, 4, 80, 64, device="cuda", dtype=torch.bfloat16),
            torch.empty(1, 2, 80, 64, device="cuda", dtype=torch.bfloat16), data) is cv
        # sbhd storage viewed as [b, h, s, d], like Megatron's tensors
        q = torch.empty(80, 2, 4, 64, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
        k = torch.empty(80, 2, 2, 64, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
        D = torch.empty(2, 4, 80, device="cuda")
        out, lse = cv.forward(q, k, k, "positions", 1, 0.125, positions=data)
        assert out.shape == (2, 4, 80, 64) and lse.shape == (2, 4, 80) and lse.dtype == torch.float32
        for extra in ({}, {"out": out}):
            dq, dk, dv = cv.backward(q, q, k, k, D, lse, "positions", 1, 0.125, positions=data, **extra)
            assert dq.shape == (2, 4, 80, 64) and dk.shape == dv.shape == (2, 2, 80, 64)
    fwd = [kw for name, kw in seen if name == "_flash_attention_forward" and kw["query"].shape[0] == 80][0]
    assert fwd["query"].shape == (80, 4, 64) and fwd["key"].shape == (80, 2, 64)  # packed, GQA not expanded
    assert fwd["cum_seq_q"].dtype == torch.int32 and fwd["cum_seq_q"].shape == (3,)
    assert cv.cached_plan(data, 80, 80).cu_q == (0, 30, 80)
    assert (fwd["max_q"], fwd["max_k"], fwd["window_size_left"], fwd["window_size_right"]) == (50, 50, 20, 0)
    assert fwd["is_causal"] is False and fwd["scale"] == 0.125
    bwd = [kw for name, kw in seen if name == "_flash_attention_backward"][-1]
    assert bwd["logsumexp"].shape == (4, 80) and bwd["window_size_left"] == 20
    rng = {"rng_state", "unused"} & set(bwd) or {"philox_seed", "philox_offset"} & set(bwd)
    assert len(rng) == 2


def test_unknown_rng_arguments_are_a_loud_schema_error(monkeypatch):
    monkeypatch.setattr(cv, "_RNG_NAMES", (("seed_tensor", "offset_tensor"),))
    assert "none of the RNG argument pairs" in cv.unavailable()
    pos = torch.arange(8)
    with pytest.raises(torch_ops.OpSchemaError, match="none of the RNG argument pairs"):
        cv.backward(torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16),
                    torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16),
                    torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), positions=(pos, pos, None, None, (None, 0)))


# ------------------------------------------------------ numerics through an emulated op


def _emulated_op(lse_layout: int):
    """torch_ops.call stand-in computing the varlen ops on CPU in fp32 from their documented
    semantics; lse as [h, total] (2) or [segments, h, max_q] (3)."""
    real_call = torch_ops.call

    def call(name, **kw):
        if name not in ("_flash_attention_forward", "_flash_attention_backward"):
            return real_call(name, **kw)
        names = {a.name for a in torch_ops.schema_arguments(name)}
        assert set(kw) <= names, set(kw) - names
        q, k, v = kw["query"].float(), kw["key"].float(), kw["value"].float()
        cu_q, cu_k = kw["cum_seq_q"].tolist(), kw["cum_seq_k"].tolist()
        vis = _op_mask(cu_q, cu_k, kw["max_k"], kw["window_size_left"], kw["window_size_right"], kw["is_causal"],
                       q.shape[0], k.shape[0])
        hq, hkv = q.shape[1], k.shape[1]
        ke, ve = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        scale = kw["scale"] if kw.get("scale") is not None else q.shape[-1] ** -0.5  # None: the op's default
        s = torch.einsum("qhd,khd->hqk", q, ke) * scale
        s = s.masked_fill(~vis, float("-inf"))
        seg = torch.repeat_interleave(torch.arange(len(cu_q) - 1), torch.tensor(cu_q).diff())
        row = torch.arange(q.shape[0]) - torch.tensor(cu_q)[seg]
        if name == "_flash_attention_forward":
            lse = torch.logsumexp(s, -1)  # [h, total]
            out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), ve)
            if lse_layout == 3:
                lse3 = torch.full((len(cu_q) - 1, hq, kw["max_q"]), 7.0)
                lse3[seg, :, row] = lse.t()
                lse = lse3
            return out.to(kw["query"].dtype), lse, torch.zeros(2, dtype=torch.int64), torch.zeros(()), torch.zeros(0)
        lse = kw["logsumexp"]
        assert lse.dim() == lse_layout
        if lse_layout == 3:
            lse = lse[seg, :, row].t()
        do, o = kw["grad_out"].float(), kw["out"].float()
        p = torch.exp(s - lse[..., None])
        D = (do * o).sum(-1).t()  # [h, total]
        dv = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - D[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, ke) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
        red = lambda t: t.reshape(t.shape[0], hkv, hq // hkv, -1).sum(2)  # noqa: E731
        dt = kw["query"].dtype
        return dq.to(dt), red(dk).to(dt), red(dv).to(dt)

    return call


def _blocks():
    pos = torch.arange(96)
    doc = torch.searchsorted(torch.tensor([10, 40, 41, 70]), pos, right=True)
    return [
        ("documents", (pos, pos, doc, doc, (None, 0)), 96, 96),
        ("window", (pos[32:], pos[:96], None, None, (24, 0)), 64, 96),
        ("documents+window", (pos, pos, doc, doc, (9, 0)), 96, 96),
        ("non-causal band", (pos[:64], pos[:64], None, None, (5, 3)), 64, 64),
    ]


@pytest.mark.parametrize("lse_layout", [2, 3])
@pytest.mark.parametrize("case", _blocks(), ids=lambda c: c[0])
def test_forward_backward_through_the_emulated_op(monkeypatch, case, lse_layout):
    monkeypatch.setattr(torch_ops, "call", _emulated_op(lse_layout))
    monkeypatch.setattr(torch_ops, "_DENSE_OUTPUTS", {})
    _, data, sq, sk = case
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, d = 2, 4, 2, 16
    q = torch.randn(sq, b, hq, d, generator=g).bfloat16().permute(1, 2, 0, 3)  # sbhd views
    k = torch.randn(sk, b, hkv, d, generator=g).bfloat16().permute(1, 2, 0, 3)
    v = torch.randn(sk, b, hkv, d, generator=g).bfloat16().permute(1, 2, 0, 3)
    do = torch.randn(b, hq, sq, d, generator=g).bfloat16()
    scale = 1 / math.sqrt(d)
    ref_out, ref_lse = reference.forward(q.float(), k.float(), v.float(), "positions", 1, scale, positions=data)
    out, lse = cv.forward(q, k, v, "positions", 1, scale, positions=data)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    D = (do.float() * ref_out).sum(-1)
    ref = reference.backward(do.float(), q.float(), k.float(), v.float(), D, ref_lse, "positions", 1, scale,
                             positions=data)
    for extra in ({"out": ref_out}, {}):
        got = cv.backward(do, q, k, v, D, ref_lse, "positions", 1, scale, positions=data, **extra)
        for a, r in zip(got, ref):
            assert a.shape == r.shape
            torch.testing.assert_close(a.float(), r, atol=3e-2 * max(1.0, r.abs().max().item()), rtol=0)


# ------------------------------------------------------ the dispatcher and the kernel choice


def _tiled_part(calls: list):
    mod = types.ModuleType("megatron_burst.kernels.triton_masked")
    mod.__name__ = "megatron_burst.kernels.triton_masked"

    def forward(q, k, v, kind="full", block=1, scale=1.0, positions=None):
        calls.append("triton")
        return tiled.forward(q, k, v, kind, block, scale, positions)

    def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, positions=None):
        calls.append("triton")
        return tiled.backward(dout, q, k, v, D, lse, kind, block, scale, positions)

    mod.forward, mod.backward = forward, backward
    mod.unavailable = lambda: None
    mod.supports = lambda dtype, head_dim, kind: None
    return mod


def test_dispatcher_routes_per_block_and_the_self_check_runs_both_routes(monkeypatch):
    """On a fused device (CPU declared one, the op emulated), "positions" chooses varlen_or_triton;
    its self-check sends the documents + window and offset blocks to cuda_varlen and the striped ones
    (plain, a block_causal block's stripe rest, per-head bands with holes) to Triton, each against the
    float64 reference. A D=None backward of a Triton block forms D from out."""
    calls = []
    monkeypatch.setattr(torch_ops, "call", _emulated_op(2))
    monkeypatch.setattr(torch_ops, "_DENSE_OUTPUTS", {})
    monkeypatch.setattr(torch_ops, "fake_mode_active", lambda: True)  # CPU tensors pass for CUDA ones
    monkeypatch.setattr(varlen_dispatch, "triton_masked", _tiled_part(calls))
    real_forward = cv.forward
    monkeypatch.setattr(cv, "forward", lambda *a, **kw: (calls.append("varlen"), real_forward(*a, **kw))[1])
    monkeypatch.setattr(choice, "FUSED_DEVICE_TYPES", ("cpu",))
    for name in ("_VERIFIED", "_CHOSEN", "_LOGGED"):
        monkeypatch.setattr(choice, name, {})
    monkeypatch.setattr(choice, "_WARNED", set())
    for var in ("MEGATRON_BURST_KERNEL", "MEGATRON_BURST_SPARSE_KERNEL", "MEGATRON_BURST_ALLOW_SLOW_KERNELS"):
        monkeypatch.delenv(var, raising=False)
    got = choice.choose(CPU, torch.bfloat16, 32, ("positions",))
    assert got.get("positions", "forward") == "varlen_or_triton"
    # 5 self-check cases: 2 varlen (forward recorded), 3 Triton (forward and backward recorded)
    assert calls == ["varlen", "varlen"] + ["triton"] * 6
    cases = choice._self_check_cases("positions")
    q = torch.zeros(1, 4, 80, 32, dtype=torch.bfloat16)
    routes = [varlen_dispatch.route(q[:, :, :c["sq"]], q[:, :2, :c["sk"]], c["positions"]).__name__ for c in cases]
    assert routes == ["megatron_burst.kernels.cuda_varlen"] * 2 + ["megatron_burst.kernels.triton_masked"] * 3
    # a wrong varlen result fails the self-check loudly
    monkeypatch.setattr(choice, "_VERIFIED", {})
    monkeypatch.setattr(cv, "forward", lambda *a, **kw: (real_forward(*a, **kw)[0] * 0, real_forward(*a, **kw)[1]))
    with pytest.raises(choice.KernelSelfCheckError, match="varlen_or_triton .* out is off the float64 reference"):
        choice.checked("varlen_or_triton", CPU, torch.bfloat16, 32, ("positions",))
    # D=None with out: the Triton route forms D itself
    striped = cases[2]["positions"]
    g = torch.Generator().manual_seed(2)
    qs, ks, do = (torch.randn(1, 2, 48, 8, generator=g) for _ in range(3))
    out, lse = tiled.forward(qs, ks, ks, "positions", 1, 0.3, striped)
    a = varlen_dispatch.backward(do, qs, ks, ks, None, lse, "positions", 1, 0.3, positions=striped, out=out)
    b = tiled.backward(do, qs, ks, ks, (do * out).sum(-1), lse, "positions", 1, 0.3, striped)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_positions_candidates_on_cuda():
    assert choice.GPU_CANDIDATES["positions"] == ("varlen_or_triton", "triton_masked")
    assert cv.supports(torch.bfloat16, 128, "positions") is None
    assert "fp16/bf16" in cv.supports(torch.float32, 128, "positions")
    assert "positions only" in cv.supports(torch.bfloat16, 128, "causal")
    assert "varlen" in varlen_dispatch.supports(torch.float32, 64, "positions")
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    pos = torch.arange(8)
    assert not cv.supports_block(q, q[:, :2], (pos, pos, None, None, (None, 0)))  # CPU tensors: not the op's


def test_merge_policy_runs_of_small_documents_are_one_block():
    """masks.documents.merges: documents below MERGE_ROWS (8192) rows and columns merge into one
    positions block however many there are (one varlen call); larger ones keep their own causal
    call; the union stays the exact document mask."""
    from megatron_burst.masks.documents import MERGE_ROWS, dense_document_mask

    assert MERGE_ROWS == 8192
    pos = torch.arange(4096)
    (block,) = document_blocks(pos, pos, list(range(0, 4097, 64)), True)
    assert block.kind == "positions" and cv.block_plan(block.mask_data, 4096, 4096).cu_q == tuple(range(0, 4097, 64))
    n = 8192 + 300
    pos = torch.arange(n)
    bounds = [0, 100, 200, 8392, 8442, n]
    blocks = document_blocks(pos, pos, bounds, True)
    assert [(m.kind, m.q_start, m.q_stop) for m in blocks] == [("positions", 0, 200), ("causal", 200, 8392),
                                                               ("positions", 8392, n)]
    assert len(document_blocks(pos, pos, bounds, True, merge_rows=0)) == 5
    seq = 96
    dense = dense_document_mask([0, 1, 5, 30, 31, 64, seq], seq)
    for W, layout in ((2, "contiguous"), (2, "zigzag"), (3, "striped")):
        local = seq // W
        for i in range(W):
            qp = layout_indices(seq, i, W, layout, 1)
            for j in range(W):
                kp = layout_indices(seq, j, W, layout, 1)
                covered = torch.zeros(local, local, dtype=torch.long)
                for m in document_blocks(qp, kp, [0, 1, 5, 30, 31, 64, seq], True):
                    covered += m.dense(local, local).long()
                assert torch.equal(covered, dense[qp][:, kp].long()), (layout, i, j)


def test_merge_limit_follows_the_device_of_the_kernel_choice():
    """64 documents of 256 tokens at W = 1: on CUDA (kernels that skip what no document covers) one
    positions block; on CPU (the fused op computes every pair of a block) one causal block each."""
    import dataclasses

    import megatron_burst.masks.documents as docs_mod
    from megatron_burst.algorithms import prepare
    from megatron_burst.kernels.choice import KernelChoice

    S = 16384
    q, k = torch.randn(S, 1, 4, 16), torch.randn(S, 1, 2, 16)
    cu = torch.arange(0, S + 1, 256, dtype=torch.int32)
    cfg = prepare(q, k, k, causal=True, cu_seqlens=cu, algo="ring").cfg
    assert cfg.merge == (docs_mod.CPU_MERGE_ROWS, docs_mod.CPU_MERGE_ROWS)
    on_cpu = cfg.blocks(0, 0, S)
    assert len(on_cpu) == 64 and {m.kind for _, m in on_cpu} == {"causal"}
    on_cuda = dataclasses.replace(cfg, kernel=KernelChoice("cuda", torch.bfloat16, 16, ())).blocks(0, 0, S)
    assert [(m.kind, m.q_start, m.q_stop) for _, m in on_cuda] == [("positions", 0, S)]
