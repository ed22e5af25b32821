"""The Triton masked attention kernel (megatron_burst.kernels.triton_masked): forward (out, lse) and
backward (dq, dk, dv) against kernels.reference in fp64 under Triton's CPU interpreter (a fresh
process: TRITON_INTERPRET=1 must be set before triton is imported), for every mask kind: full and
causal with sq != sk both ways, block_causal, positions with documents only, a sliding window with
documents, a two-sided band, offset and zigzag positions; MHA and GQA; head dims 16, 24 and 80 (and
dv != d); bf16 / fp16 inputs against the fp64 reference of their fp32 originals and against
kernels.tiled; strided (sbhd) inputs; rows that see nothing; tiles no row sees are never read.
Then, in this process: the tile ranges against brute force, the mask data, supports(), launch
options, errors, and an ahead-of-time compile of the GPU kernels for sm_90."""
import importlib.util

import pytest
import torch

from harness import run_interpreted
from megatron_burst.kernels import triton_masked as tm

HAVE_TRITON = importlib.util.find_spec("triton") is not None
TOL = 1e-5  # fp32 cases, relative to the reference's largest magnitude (at least 1)
TOL_16 = {"torch.bfloat16": 3e-2, "torch.float16": 5e-3}
NAMES = ("out", "lse", "dq", "dk", "dv")

FP32_CASES = ["full_37x53", "full_53x37_gqa_d24", "causal_37x53", "causal_53x37_gqa_d24_sbhd", "causal_48_gqa_d80",
              "causal_dv_differs", "block_causal_b4_37", "block_causal_b4_45x29", "docs_only",
              "window_docs_l5_r0_gqa_sbhd", "band_l3_r2", "offset_q40_79_kv0_39", "offset_q40_79_kv20_59",
              "zigzag_diag_gqa", "zigzag_q1_kv0_docs", "empty_rows", "empty_rows_finite_lse", "slash_run_l9_r-4_gqa",
              "stripe_rest_b4_45x29_gqa", "head_bands_gqa", "head_bands_holes_gqa", "head_bands_holes_keys_docs", "head_bands_docs_zigzag", "split_head_bands_gqa", "head_bands_keys_gqa",
              "split_head_bands_keys_gqa", "split_head_bands_holes_keys_docs",
              # the dk/dv kernel's q tiles split among programs (partial dk / dv summed by the host)
              "split_slash_run_l9_r-4_gqa", "split_window_docs_l5_r0_gqa_sbhd", "split_block_causal_b4_45x29"]
LOW_CASES = ["bf16_causal_gqa", "bf16_window_docs_sbhd", "fp16_full_d24"]


@pytest.fixture(scope="module")
def interpreted():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton): the Triton masked kernel is untested")
    return run_interpreted("triton_masked_cases.py")


def _common(r, what):
    assert r["finite"] and r["err_lse_inf_matches"], (what, r)
    assert r["out_dtypes"] == ["torch.float32"] * 5, (what, r["out_dtypes"])
    for name in NAMES:
        assert r[f"shape_{name}"], (what, name)


@pytest.mark.parametrize("case", FP32_CASES)
def test_fp32_matches_fp64_reference(interpreted, case):
    r = interpreted[case]
    _common(r, case)
    for name in NAMES:
        assert r[f"err_{name}"] <= TOL * max(1.0, r[f"scale_{name}"]), (case, name, r)


@pytest.mark.parametrize("case", LOW_CASES)
def test_16bit_inputs_as_accurate_as_tiled(interpreted, case):
    """Against the fp64 reference of the fp32 values the 16-bit inputs were rounded from: within the
    dtype's tolerance and within 1.5x of kernels.tiled on the same inputs (which computes in fp32;
    this kernel also rounds P and dS to the input dtype, as on the GPU)."""
    r = interpreted[case]
    _common(r, case)
    assert r["tiled_lse_inf_matches"]
    for name in NAMES:
        scale = max(1.0, r[f"scale_{name}"])
        assert r[f"err_{name}"] <= TOL_16[r["dtype"]] * scale, (case, name, r)
        assert r[f"err_{name}"] <= 1.5 * r[f"tiled_{name}"] + 1e-6 * scale, (case, name, r)


def test_cases_cover_layouts_and_dtypes(interpreted):
    assert interpreted["causal_53x37_gqa_d24_sbhd"]["strided"] and interpreted["bf16_window_docs_sbhd"]["strided"]
    assert not interpreted["full_37x53"]["strided"]
    assert {interpreted[c]["dtype"] for c in LOW_CASES} == {"torch.bfloat16", "torch.float16"}


@pytest.mark.parametrize("case", ["empty_rows", "empty_rows_finite_lse"])
def test_rows_that_see_nothing(interpreted, case):
    """Document 1 has no keys in the block: its rows get out 0, lse -inf and zero dq, whether the
    given (global) lse of those rows is -inf or finite (they saw keys in other blocks)."""
    r = interpreted[case]
    assert r["empty_rows"] == 4 * 8  # 4 heads x 8 rows
    assert r["empty_out_max"] == 0.0 and r["empty_dq_max"] == 0.0 and r["empty_lse_all_neg_inf"], r


def test_tiles_no_row_sees_are_never_read(interpreted):
    r = interpreted["skipped_tiles_unread"]
    assert r["finite"] and r["unseen_grads_zero"], r
    for name in NAMES:
        assert r[f"err_{name}"] <= TOL * max(1.0, r[f"scale_{name}"]), (name, r)


# ---------------------------------------------------------------------------------------------
# in this process: host-side pieces
# ---------------------------------------------------------------------------------------------
def _brute(a, b, ad, bd, lo_off, hi_off, n_outer, n_inner):
    vis = torch.ones(n_outer, n_inner, dtype=torch.bool)
    if a is not None:
        if hi_off is not None:
            vis &= b[None, :] <= a[:, None] + hi_off
        if lo_off is not None:
            vis &= b[None, :] >= a[:, None] - lo_off
    if ad is not None:
        vis &= ad[:, None] == bd[None, :]
    return vis


def _check_ranges(a, b, ad, bd, lo_off, hi_off, n_outer, n_inner, to, ti, partial_ok):
    got = tm._tile_ranges(a, b, ad, bd, lo_off, hi_off, n_outer, n_inner, to, ti, partial_ok)
    vis = _brute(a, b, ad, bd, lo_off, hi_off, n_outer, n_inner)
    n_t = -(-n_inner // ti)
    assert got.dtype == torch.int32 and tuple(got.shape) == (-(-n_outer // to), 4)
    for i, (lo, f_lo, f_hi, hi) in enumerate(got.tolist()):
        assert 0 <= lo <= f_lo <= f_hi <= hi <= n_t
        block = vis[i * to:(i + 1) * to]
        for t in range(n_t):
            tile = block[:, t * ti:(t + 1) * ti]
            if tile.any():  # every visible pair is in a visited tile
                assert lo <= t < hi, (i, t, got[i])
            whole = bool(tile.all()) and (partial_ok or tile.shape[1] == ti)
            assert (f_lo <= t < f_hi) == whole, (i, t, got[i], whole)
    return got


def test_tile_ranges_match_brute_force():
    """Random nondecreasing keys and documents, bands with None / negative bounds, partial edge tiles."""
    g = torch.Generator().manual_seed(0)
    sorted_ints = lambda n, hi: torch.randint(0, hi, (n,), generator=g).sort().values  # noqa: E731
    for trial in range(60):
        n_outer, n_inner = [int(x) for x in torch.randint(1, 70, (2,), generator=g)]
        use_keys, use_docs = trial % 3 != 2, trial % 2 == 0
        a = sorted_ints(n_outer, 80) if use_keys else None
        b = sorted_ints(n_inner, 80) if use_keys else None
        ad = sorted_ints(n_outer, 4) if use_docs else None
        bd = sorted_ints(n_inner, 4) if use_docs else None
        bounds = [None, 0, 3, 7, -2]
        lo_off, hi_off = bounds[trial % 5], bounds[(trial // 5) % 5]
        to, ti = [(16, 16), (16, 32), (64, 16), (8, 8)][trial % 4]
        _check_ranges(a, b, ad, bd, lo_off, hi_off, n_outer, n_inner, to, ti, partial_ok=trial % 2 == 1)


def test_tile_ranges_of_causal_and_offset_blocks():
    # causal 53 x 37, tiles of 16: q tile i sees kv tiles up to its diagonal; fully below it unmasked
    ar = torch.arange
    got = _check_ranges(ar(53), ar(37), None, None, None, 0, 53, 37, 16, 16, False)
    assert got.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2], [0, 0, 2, 3], [0, 0, 2, 3]]  # kv tile 2 is partial
    # the dk/dv side (kv tiles over q tiles): the partial edge q tile may run unmasked
    got = _check_ranges(ar(37), ar(53), None, None, 0, None, 37, 53, 16, 16, True)
    assert got.tolist() == [[0, 1, 4, 4], [1, 2, 4, 4], [2, 3, 4, 4]]
    # q positions 40..79 over kv 0..39 (right 0): everything visible, all complete tiles unmasked
    got = _check_ranges(ar(40, 80), ar(40), None, None, None, 0, 40, 40, 16, 16, False)
    assert got.tolist() == [[0, 0, 2, 3]] * 3
    # kv entirely in the future: nothing visited
    got = _check_ranges(ar(10), ar(20, 40), None, None, None, 0, 10, 20, 16, 16, False)
    assert got.tolist() == [[0, 0, 0, 0]]


def test_index_kind_ranges_are_cached():
    m = tm._Mask("causal", 1, None, 53, 37, torch.device("cpu"))
    r = m.ranges("q", 53, 37, 16, 16, False, torch.device("cpu"))
    assert m.ranges("q", 53, 37, 16, 16, False, torch.device("cpu")) is r
    assert tm._Mask("full", 1, None, 8, 8, torch.device("cpu")).ranges("kv", 8, 8, 16, 16, True, "cpu").tolist() \
        == [[0, 0, 1, 1]]


def test_mask_data():
    ar = torch.arange
    m = tm._Mask("block_causal", 4, None, 8, 8, torch.device("cpu"))
    assert (m.pos, m.div, m.left, m.right, m.has_doc) == (1, 4, None, 0, False)
    m = tm._Mask("positions", 1, (ar(8), ar(8), ar(8) // 3, ar(8) // 3, (5, None)), 8, 8, torch.device("cpu"))
    assert (m.pos, m.left, m.right, m.has_doc) == (2, 5, None, True)
    assert all(t.dtype == torch.int32 for t in m.vectors(torch.zeros(1))[:4])  # small CPU keys: int32
    assert not m.flags()["PER_HEAD"]
    # per-head bands: the envelope as the scalars, every head's (left, right) as an int32 vector
    from megatron_burst.masks.block import HeadBands
    m = tm._Mask("positions", 1, (ar(8), ar(8), None, None, HeadBands(torch.tensor([[3, -1], [5, -4]]))), 8, 8,
                 "cpu")
    assert (m.pos, m.left, m.right, m.flags()["PER_HEAD"]) == (2, 5, -1, True)
    assert m.vectors(torch.zeros(1))[4].tolist() == [3, -1, 5, -4]
    assert tuple(m.ranges("q", 8, 8, 4, 4, False, torch.device("cpu")).shape) == (2, 2, 4)  # [tiles, heads, 4]
    # documents only (positions None), or a band without bounds: no key condition
    assert tm._Mask("positions", 1, (None, None, ar(8), ar(8), (None, 0)), 8, 8, "cpu").pos == 0
    assert tm._Mask("positions", 1, (ar(8), ar(8), None, None, (None, None)), 8, 8, "cpu").pos == 0
    # huge bounds on small keys are no bound; very negative ones are clamped (key + bound fits int32)
    m = tm._Mask("positions", 1, (ar(8), ar(8), None, None, (1 << 40, -(1 << 40))), 8, 8, "cpu")
    assert (m.left, m.right) == (None, -tm.KEY_LIMIT)
    # keys beyond KEY_LIMIT (or negative) keep int64 and the exact bounds
    big = ar(8) + (1 << 33)
    m = tm._Mask("positions", 1, (big, big, None, None, (1 << 40, 0)), 8, 8, "cpu")
    assert m.vectors(torch.zeros(1))[0].dtype == torch.int64 and m.left == 1 << 40


def test_bad_mask_arguments_name_the_problem():
    ar = torch.arange
    with pytest.raises(ValueError, match="in pairs"):
        tm._Mask("positions", 1, (ar(4), None, None, None, (None, 0)), 4, 4, "cpu")
    with pytest.raises(ValueError, match=r"kv_pos has shape \(5,\); expected \[4\]"):
        tm._Mask("positions", 1, (ar(4), ar(5), None, None, (None, 0)), 4, 4, "cpu")
    with pytest.raises(ValueError, match="needs positions="):
        tm._Mask("positions", 1, None, 4, 4, "cpu")
    with pytest.raises(ValueError, match="takes kinds full, causal, block_causal, positions; got 'sparse'"):
        tm._Mask("sparse", 1, None, 4, 4, "cpu")
    from megatron_burst.masks.block import HeadBands
    two_heads = torch.tensor([[3, 0], [5, 0]])
    with pytest.raises(ValueError, match=r"HeadBands.holes has shape \(2, 2\); expected \[2, n, 2\]"):
        tm._Mask("positions", 1, (ar(4), ar(4), None, None, HeadBands(two_heads, None, torch.zeros(2, 2))), 4, 4, "cpu")
    m = tm._Mask("positions", 1, (ar(4), ar(4), None, None, HeadBands(two_heads, None, torch.tensor(
        [[[1, 2]], [[1, 0]]]))), 4, 4, "cpu")
    assert m.flags()["HAS_HOLES"] and m.flags()["N_HOLES"] == 1 and m.vectors(torch.zeros(1))[6].tolist() == [1, 2, 1, 0]
    # three holes per head run as four (a power of two: few compiled variants), the fourth empty
    m = tm._Mask("positions", 1, (ar(4), ar(4), None, None, HeadBands(two_heads, None, torch.tensor(
        [[[1, 2], [4, 5], [7, 7]], [[1, 0], [1, 0], [1, 0]]]))), 4, 4, "cpu")
    assert m.flags()["N_HOLES"] == 4 and m.vectors(torch.zeros(1))[6].view(2, 4, 2)[:, 3].tolist() == [[1, 0], [1, 0]]
    with pytest.raises(ValueError, match="HeadBands has 2 heads but q has 4 query heads"):
        m.check_heads(4)


def test_every_block_the_engine_produces(interpreted):
    """The CP engine's own BlockMasks (documents and windows under zigzag, block-striped, THD, a
    two-sided window, a sparse pattern's slash runs and its gathered vertical keys with the runs
    cut out as holes) through the dispatcher: the Triton kernel equals the reference."""
    r = interpreted["engine_blocks"]
    assert {"full", "causal", "block_causal", "positions", "positions gathered per head holes",
            "positions per head"} <= set(r["kinds"]), r["kinds"]
    assert r["worst"] <= 1e-5, r


def test_choice_interface(monkeypatch):
    """What megatron_burst.kernels.choice reads: why the kernel cannot run here, and per (dtype,
    head dim, kind) why it does not cover a block (None: it does)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if HAVE_TRITON and not torch.cuda.is_available():
        assert tm.unavailable() == "no CUDA device"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tm.unavailable() == (None if HAVE_TRITON else "triton is not installed (pip install triton)")
    for kind in tm.KINDS:
        assert tm.supports(torch.bfloat16, 128, kind) is None
    assert tm.supports(torch.float64, 128, "full") == "fp16/bf16/fp32 only, not torch.float64"
    assert tm.supports(torch.bfloat16, 264, "full") == "head dim up to 256, not 264"
    assert "mask kind 'sparse'" in tm.supports(torch.bfloat16, 64, "sparse")


def test_supports(monkeypatch):
    q, k = torch.zeros(1, 4, 8, 64), torch.zeros(1, 2, 8, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not tm.supports_block(q, k, "causal")  # CPU tensors, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tm.supports_block(q, k, "causal") == HAVE_TRITON
    if HAVE_TRITON:
        for kind in tm.KINDS:
            assert tm.supports_block(q.bfloat16(), k.bfloat16(), kind) and tm.supports_block(q.half(), k.half(), kind)
        assert tm.supports_block(torch.zeros(1, 4, 8, 256), torch.zeros(1, 2, 8, 256), "full")
    assert tm.KINDS == ("full", "causal", "block_causal", "positions")
    assert not tm.supports_block(q, k, "sparse") and not tm.supports_block(q.double(), k.double(), "full")
    assert not tm.supports_block(torch.zeros(1, 4, 8, 257), torch.zeros(1, 2, 8, 257), "full")
    assert not tm.supports_block(torch.zeros(1, 3, 8, 64), k, "full")  # 3 query heads over 2 kv heads


def test_dkdv_splits():
    """Enough dk/dv programs: one split; few kv tiles over many q tiles: splits of >= DKDV_SPLIT_TILES
    q tiles covering every q tile, to about DKDV_PROGRAMS programs."""
    assert tm.dkdv_splits(tm.DKDV_PROGRAMS, 4096) == (1, 4096)
    splits, per = tm.dkdv_splits(64, 4096)  # ~1000 gathered keys x 8 kv heads, 64K queries
    assert splits * 64 >= tm.DKDV_PROGRAMS and per >= tm.DKDV_SPLIT_TILES and splits * per >= 4096
    assert (splits - 1) * per < 4096
    assert tm.dkdv_splits(1, 3) == (1, 3)


def test_launch_options():
    o = tm.launch_options("forward", {torch.bfloat16}, 128, 128, interpret=False)
    assert (o["BLOCK_M"], o["BLOCK_N"], o["num_warps"], o["num_stages"]) == tm.GPU_CONFIG[("forward", 128, 16)]
    assert (o["MODE"], o["WIDEN"], o["BLOCK_D"]) == (1, False, 128)
    o = tm.launch_options("dkdv", {torch.float32}, 80, 80, interpret=False)
    assert (o["MODE"], o["WIDEN"], o["PRECISION"], o["BLOCK_D"], o["D"]) == (0, False, "ieee", 128, 80)
    o = tm.launch_options("dq", {torch.float32, torch.bfloat16}, 24, 24, interpret=False)  # mixed: widened fp32
    assert (o["MODE"], o["WIDEN"], o["PRECISION"], o["BLOCK_D"]) == (0, True, "ieee", 32)
    o = tm.launch_options("dq", {torch.bfloat16}, 200, 200, interpret=True)
    assert (o["BLOCK_M"], o["BLOCK_N"], o["MODE"], o["WIDEN"], o["BLOCK_D"]) == (16, 16, 2, True, 256)
    assert tm.launch_options("forward", {torch.float16}, 16, 16, interpret=True)["MODE"] == 3
    for key in tm.GPU_CONFIG:
        assert key[0] in ("forward", "dq", "dkdv") and key[1] in (64, 128, 256) and key[2] in (16, 32)
    assert len(tm.GPU_CONFIG) == 18


@pytest.mark.skipif(not HAVE_TRITON or tm.interpreting(), reason="needs triton, outside the interpreter")
def test_cpu_tensors_without_interpreter_name_the_fix():
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="needs CUDA tensors .* set TRITON_INTERPRET=1"):
        tm.forward(q, q, q, "causal")


@pytest.mark.skipif(not HAVE_TRITON or tm.interpreting(), reason="needs triton, outside the interpreter")
@pytest.mark.parametrize("kernel", ["forward", "dq", "dkdv"])
def test_kernels_compile_for_hopper(kernel):
    """No GPU here: compile each kernel for sm_90 with the GPU launch options at head dim 128, bf16,
    every mask flag on (4 holes per head too), down to a cubin; tensor-core (wgmma) code, shared
    memory within an H100's 227 KiB, and software-pipelined tile loops (asynchronous copies in the
    TTGIR: a runtime loop inside the tile loop, as the holes once had, leaves none). Registers /
    spill bytes (cuobjdump) are printed (pytest -s)."""
    import triton_masked_cases

    got = triton_masked_cases.compile_for_gpu(kernel, torch.bfloat16, 128)
    print(kernel, {k: got.get(k) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "registers", "stack",
                                           "shared", "wgmma", "async_copies")})
    assert "cubin" in got["stages"] and got["shared"] <= 227 * 1024 and got["wgmma"] > 0, (kernel, got)
    assert got["async_copies"] > 0, (kernel, got)


def test_mask_vectors_reach_the_device_once(monkeypatch):
    """_on_device: a CPU mask vector is copied to the device once and reused while it lives (the
    same block comes back every step and layer); a derived copy (clamped, padded) is cached under
    its own tag; the cache keeps at most VECTOR_CACHE_BYTES, oldest dropped. The meta device
    stands in for CUDA."""
    monkeypatch.setattr(tm, "_DEVICE_VECTORS", type(tm._DEVICE_VECTORS)())
    monkeypatch.setattr(tm, "VECTOR_CACHE_BYTES", 3 * 64 * 4)  # three int32 vectors of 64
    meta = torch.device("meta")
    a, b, c = (torch.arange(64) + i for i in range(3))
    first = tm._on_device(a, torch.int32, meta)
    assert tm._on_device(a, torch.int32, meta) is first and first.dtype == torch.int32 and first.device == meta
    assert tm._on_device(a, torch.int64, meta) is not first  # another dtype, another copy
    doubled = tm._on_device(a, torch.int32, meta, lambda t: t * 2, "double")
    assert doubled is not first and tm._on_device(a, torch.int32, meta, lambda t: t * 2, "double") is doubled
    tm._on_device(b, torch.int32, meta)
    tm._on_device(c, torch.int32, meta)
    assert sum(v.numel() * v.element_size() for _, v in tm._DEVICE_VECTORS.values()) <= tm.VECTOR_CACHE_BYTES
    assert tm._on_device(a, torch.int32, meta) is not first  # dropped as the oldest, copied again
    on_cpu = tm._on_device(a, torch.int32, torch.device("cpu"))  # CPU (interpreter): no cache needed
    assert on_cpu.dtype == torch.int32 and torch.equal(on_cpu, a.int())
