"""The Triton block-sparse attention kernel (megatron_burst.kernels.triton_block_sparse): forward
(out, lse) and backward (dq, dk, dv) against block_sparse and a dense fp64 reference under
Triton's CPU interpreter (a fresh process: TRITON_INTERPRET=1 must be set before triton is
imported); MHA and GQA, head dims 16 and 24, a short last tile, an absent tile, rows that see
nothing, plans of a real vertical-slash pattern, bf16 input, strided inputs, and
sparse_cp_attention on 2 gloo ranks equal to the torch kernel. Then, in this process: the packed
plan and its cache, and the kernel choice (select_sparse)."""
import importlib.util
import warnings

import pytest
import torch

from harness import run_interpreted
from megatron_burst import kernels
from megatron_burst.kernels import block_sparse, triton_block_sparse as tbs
from megatron_burst.masks.vertical_slash import SparseTile

HAVE_TRITON = importlib.util.find_spec("triton") is not None
TOL = 1e-5  # relative to the reference's largest magnitude; every case runs fp32 math


@pytest.fixture(scope="module")
def interpreted():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton): the Triton kernel is untested")
    return run_interpreted("triton_sparse_cases.py", drop_env=("MEGATRON_BURST_SPARSE_KERNEL",))


def _check_case(r, what):
    assert r["finite"] and r["lse_inf_matches"], (what, r)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert r[f"shape_{name}"], (what, name)
        for src in ("torch", "dense"):
            assert r[f"{src}_{name}"] <= TOL * max(1.0, r[f"scale_{name}"]), (what, src, name, r)


@pytest.mark.parametrize("case", ["mha_d16", "gqa_d24", "gqa_bf16"])
def test_hand_plans_match_block_sparse_and_dense(interpreted, case):
    """Tiles of 16, 16 and 5 rows (one absent in between) with 10, 37 and 45 columns, rows seeing nothing."""
    r = interpreted[case]
    assert r["empty_rows"] > 0 and r["dtype"] == ("torch.bfloat16" if "bf16" in case else "torch.float32")
    _check_case(r, case)


def test_vertical_slash_plans_match(interpreted):
    assert interpreted["pattern_mask_matches"]
    assert interpreted["pattern_t64"]["tile_rows"] == [64, 16]
    assert interpreted["pattern_t16"]["tile_rows"] == [16] * 5
    for tile in (64, 16):
        r = interpreted[f"pattern_t{tile}"]
        assert r["empty_rows"] > 0
        _check_case(r, f"tile {tile}")


def test_self_check_passes(interpreted):
    assert interpreted["verify"] == {"torch.float32": True, "torch.bfloat16": True}


def test_sparse_cp_attention_with_triton_equals_torch(interpreted):
    for rank, r in enumerate(interpreted["cp"]):
        assert r["selected"] == ["triton_block_sparse", "block_sparse"], r
        triton_calls, torch_calls = r["calls"]
        assert triton_calls["forward"] > 0 and triton_calls["backward"] > 0, r
        assert torch_calls == {"forward": 0, "backward": 0}, r
        for name in ("out", "dq", "dk", "dv"):
            assert r[name] <= TOL * max(1.0, r[f"scale_{name}"]), (rank, name, r)


def _plan(heads=2):
    g = torch.Generator().manual_seed(0)
    return (SparseTile(0, 16, torch.arange(0, 70), torch.rand(heads, 16, 70, generator=g) < 0.5),
            SparseTile(16, 21, torch.tensor([3, 9]), torch.ones(heads, 5, 2, dtype=torch.bool)))


def test_packed_plan_layout_and_cache(monkeypatch):
    plan = _plan()
    p = tbs.pack(plan, 2, torch.device("cpu"))
    assert tbs.pack(plan, 2, torch.device("cpu")) is p  # cached per plan object
    assert p.q0.tolist() == [0, 16] and p.q1.tolist() == [16, 21] and p.block_m == 16
    assert p.col_start.tolist() == [0, 70, 72] and p.cols.tolist() == list(range(70)) + [3, 9]
    assert p.vis_words.tolist() == [3, 1] and p.vis_start.tolist() == [0, 2 * 16 * 3]
    assert p.vis.numel() == 2 * 16 * 3 + 2 * 5 * 1
    for t, start, words in zip(plan, p.vis_start.tolist(), p.vis_words.tolist()):
        h, rows, nc = t.vis.shape
        w = p.vis[start:start + h * rows * words].view(h, rows, words).long() & 0xFFFFFFFF
        bits = (w[..., None] >> torch.arange(32)) & 1  # [h, rows, words, 32]
        assert torch.equal(bits.reshape(h, rows, -1)[..., :nc].bool(), t.vis)
    assert bool((p.vis < 0).any())  # bit 31 set somewhere: the signed words unpack as well
    other = _plan()
    assert tbs.pack(other, 2, torch.device("cpu")) is not p  # an equal but distinct plan packs anew
    monkeypatch.setattr(tbs, "PACK_CACHE", 1)  # bounded: the oldest entries go first
    tbs.pack(_plan(), 2, torch.device("cpu"))
    assert len(tbs._packed) == 1 and tbs.pack(plan, 2, torch.device("cpu")) is not p
    monkeypatch.setattr(tbs, "PACK_CACHE", 8)
    monkeypatch.setattr(tbs, "PACK_CACHE_BYTES", p.nbytes * 2)  # and by the bytes held
    for _ in range(3):
        tbs.pack(_plan(), 2, torch.device("cpu"))
    assert len(tbs._packed) == 2


def test_tile_plans_carry_their_packed_form():
    """A TilePlan (what the CP code passes) keeps its packed form as an attribute: it dies with the
    plan (a dynamic pattern's plans) instead of sitting in the LRU."""
    from megatron_burst.masks.vertical_slash import TilePlan

    plan = TilePlan(_plan())
    before = len(tbs._packed)
    p = tbs.pack(plan, 2, torch.device("cpu"))
    assert tbs.pack(plan, 2, torch.device("cpu")) is p and len(tbs._packed) == before
    assert plan._triton_packed == {torch.device("cpu"): p}


def test_bad_plans_name_the_problem():
    with pytest.raises(ValueError, match=r"visibility \(2, 16, 70\); expected \[3, 16, 70\] for 3 query heads"):
        tbs.pack(_plan(), 3, torch.device("cpu"))
    t = _plan()[0]
    with pytest.raises(ValueError, match="overlap at row 8"):
        tbs.pack((t, SparseTile(8, 24, t.cols, t.vis)), 2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"tile 0 has rows \[0, 16\) and a column -1: indices must be >= 0"):
        tbs.pack((SparseTile(0, 16, t.cols - 1, t.vis),), 2, torch.device("cpu"))
    p = tbs.pack(_plan(), 2, torch.device("cpu"))
    assert (p.rows, p.keys) == (21, 70)
    q = torch.zeros(1, 2, 21, 8)
    with pytest.raises(ValueError, match="reaches query row 20 and key 69 but q has 20 rows and k 70"):
        tbs._fits(p, q[:, :, :20], torch.zeros(1, 2, 70, 8))
    tbs._fits(p, q, torch.zeros(1, 2, 70, 8))


def test_select_sparse(monkeypatch):
    q = torch.zeros(1, 2, 21, 8)
    monkeypatch.delenv("MEGATRON_BURST_SPARSE_KERNEL", raising=False)
    assert kernels.select_sparse(q) is block_sparse  # CPU default
    monkeypatch.setenv("MEGATRON_BURST_SPARSE_KERNEL", "triton")
    assert kernels.select_sparse(q) is tbs
    monkeypatch.setenv("MEGATRON_BURST_SPARSE_KERNEL", "torch")
    assert kernels.select_sparse(q) is block_sparse
    monkeypatch.setenv("MEGATRON_BURST_SPARSE_KERNEL", "cuda")
    with pytest.raises(ValueError, match="MEGATRON_BURST_SPARSE_KERNEL='cuda': choose one of torch, triton"):
        kernels.select_sparse(q)


def test_failed_self_check_is_an_error_unless_slow_kernels_are_allowed(monkeypatch):
    """On a fused device (CPU declared one here), a Triton kernel whose self-check raises or is off
    block_sparse stops the call with the reason; MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 falls back
    to block_sparse with a warning."""
    from megatron_burst.kernels import choice

    monkeypatch.setattr(choice, "FUSED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(choice, "_VERIFIED", {})
    monkeypatch.setattr(choice, "_WARNED", set())
    monkeypatch.setattr(choice, "_CHOSEN", {})
    monkeypatch.delenv("MEGATRON_BURST_SPARSE_KERNEL", raising=False)
    monkeypatch.delenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", raising=False)
    monkeypatch.setattr(tbs, "unavailable", lambda: None)
    monkeypatch.setattr(tbs, "verify", lambda device, dtype: (_ for _ in ()).throw(RuntimeError("dq is off by 3")))
    with pytest.raises(choice.KernelSelfCheckError, match="triton_block_sparse attention kernel on cpu / "
                                                          "torch.float16 raised in its self-check: RuntimeError: dq "
                                                          "is off by 3"):
        choice.choose(torch.device("cpu"), torch.float16, 8, ("sparse",))
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "1")
    with pytest.warns(choice.SlowKernelWarning, match="dq is off by 3"):
        got = choice.choose(torch.device("cpu"), torch.float16, 8, ("sparse",))
    assert got.get("sparse", "forward") == "block_sparse"


def test_verify_names_what_is_off(monkeypatch):
    """verify() raises naming the output that disagrees with block_sparse (never a bare False)."""
    monkeypatch.setattr(tbs, "forward", lambda q, k, v, kind, block, scale, plan: block_sparse.forward(
        q, k, v, kind, block, scale * 1.5, plan=plan))
    monkeypatch.setattr(tbs, "backward", block_sparse.backward)
    with pytest.raises(RuntimeError, match="out is off block_sparse"):
        tbs.verify(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not HAVE_TRITON or tbs.interpreting(), reason="needs triton, outside the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_compile_for_hopper_and_fit_ampere_shared_memory(dtype):
    """No GPU here: compile both kernels for sm_90 with the GPU launch options (head dim 128, the
    largest) down to a cubin; the shared memory also fits an A100's 163 KiB per block. The forward
    and dq column loops are software-pipelined (asynchronous copies: they walk per-(tile, head)
    chunk lists with no test inside; with the per-chunk skip they had none)."""
    import triton_sparse_cases

    for direction in ("forward", "dq", "dkdv"):
        got = triton_sparse_cases.compile_for_gpu(direction, dtype, 128)
        print(direction, dtype, {k: got[k] for k in ("shared", "async_copies")})
        assert "cubin" in got["stages"] and got["shared"] <= 163 * 1024, (direction, got)
        if direction != "dkdv":
            assert got["async_copies"] > 0, (direction, got)


@pytest.mark.skipif(not HAVE_TRITON or tbs.interpreting(), reason="needs triton, outside the interpreter")
def test_cpu_tensors_without_interpreter_name_the_fix():
    q = torch.zeros(1, 2, 21, 8)
    with pytest.raises(ValueError, match="needs CUDA tensors .* set TRITON_INTERPRET=1"):
        tbs.forward(q, q, q, plan=_plan())
    out, lse = tbs.forward(q, q, q, plan=())  # an empty plan needs no kernel
    assert not out.any() and torch.isinf(lse).all()


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_chunk_lists_name_each_heads_chunks(block_n):
    """chunk_lists: for each tile and head (or group of heads), exactly the column chunks of block_n in
    which that head (some head of the group) sees a pair, increasing, with their count -- for planner tiles (uniform bitmask, listed on the
    device: BLOCK_N 64 / 32 on a GPU) and hand-written ones (tile by tile), against the tiles
    written out. The forward and dq kernels walk only these."""
    import triton_sparse_cases
    from megatron_burst.masks.vertical_slash import plan_tiles

    pattern = triton_sparse_cases.vs_pattern()
    pos = torch.arange(80)
    planned = plan_tiles(pattern, 80, pos, pos, tile=16, columns="exact")
    hand = tbs.pack(triton_sparse_cases.hand_plan(2, 53, 45, seed=1), 2, torch.device("cpu"))
    assert planned.words is not None and hand.words is None
    for p in (planned, hand):
        for group in (1, 2):  # per query head (forward, dq); per kv head of 2 query heads (dk/dv)
            lists, counts, n = tbs.chunk_lists(p, block_n, group)
            assert tuple(lists.shape) == (p.tiles, p.heads // group, n) and n == -(-p.max_cols // block_n)
            for t, tile in enumerate(p):
                cols = tile.vis.shape[-1]
                for h in range(p.heads // group):
                    heads = tile.vis[h * group:(h + 1) * group]
                    want = [j for j in range(-(-cols // block_n)) if heads[..., j * block_n:(j + 1) * block_n].any()]
                    got = lists[t, h, :counts[t, h]].tolist()
                    assert got == want, (t, h, group, got, want)
            assert tbs.chunk_lists(p, block_n, group)[0] is lists  # cached on the plan
