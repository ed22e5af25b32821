"""Block-sparse attention in Triton (GPU; CPU through Triton's interpreter), the fast twin of
:mod:`megatron_burst.kernels.block_sparse` with the same (out, lse) / gradients interface.

Plan: a :class:`megatron_burst.masks.vertical_slash.PackedTiles` (what the planner builds on the device, read
as it is) or hand-written tiles (a tuple of :class:`megatron_burst.masks.vertical_slash.SparseTile`, packed once
per (plan object, device), see :func:`pack`). The kernels read its flat device tensors

* ``q0``, ``q1`` [T] int32 -- each tile's query rows [q0, q1) (at most 64 rows);
* ``col_start``, ``col_end`` [T] int64 and ``cols`` int32 -- tile t's key columns are
  ``cols[col_start[t]:col_end[t]]`` (local key indices, any count per tile);
* ``vis_start``, ``vis_head`` [T] int64, ``vis_words`` [T] int32 and ``vis`` int32 -- tile t's
  visibility ``vis[h, r, c]`` as a bitmask: ``vis_words[t]`` words per (head, row), head h's rows
  from ``vis_start[t] + h * vis_head[t]``; column c is bit ``c % 32`` of word ``c // 32`` (8x
  smaller than bool).

Hand-written tiles are packed tile after tile (``vis_head`` = rows x words of the tile). A
:class:`megatron_burst.masks.vertical_slash.TilePlan` carries its packed form as an attribute, so it dies with
the plan. A plain tuple's packed form is cached by ``id(plan)`` together with a reference to the
plan (the id cannot be reused while it is held) in a bounded LRU (PACK_CACHE entries and
PACK_CACHE_BYTES of packed tensors).

Grids. Forward: one program per (batch * query head, tile); it holds its tile's query rows
(BLOCK_M >= rows) and walks the chunks of BLOCK_N of the tile's columns that its head sees some
pair in (a tile's columns are the union over heads; :func:`chunk_lists` lists each head's, so the
loop holds no test and is software-pipelined): reads the chunk's bits, gathers the K/V rows by
column index, ``tl.dot`` scores (fp32 accumulation), masks them by the
bitmask and keeps an online softmax; writes out (fp32; 0 where a row sees nothing) and lse (fp32;
-inf there). Backward, two kernels recomputing P from the given lse: dq per (batch * query head,
tile), stored for the tile's rows (tiles' rows are disjoint); dk/dv per (batch * kv head, tile),
walking the chunks some head of the GQA group sees (a list per (tile, kv head)), summing the
chunk's dk/dv over the group's query heads in registers and adding them with one
``tl.atomic_add`` into fp32 [b, hkv, sk, *] buffers (columns repeat across tiles): GROUP times
fewer atomics than one program per query head adding its own, for two more products per chunk.

Precision: fp32 inputs run every product in IEEE fp32. 16-bit inputs multiply q.k^T and do.v^T
in the input dtype (fp32 accumulation) and round P and dS to the input dtype for P.V, P^T.dO,
dS.K and dS^T.Q (fp32 accumulation), as FlashAttention does. Under the interpreter (whose
``tl.dot`` mishandles 16-bit operands) and for mixed input dtypes the tiles are widened to fp32 and
every product runs in fp32. Head dims up to 128, padded to a power of two with masks.

Triton is imported on first use (the kernel source is :mod:`._triton_block_sparse_src`), so
TRITON_INTERPRET=1 works when set before the process first imports triton; see
:mod:`megatron_burst.loss.triton_kernels` for why.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch

from megatron_burst.kernels import block_sparse
from megatron_burst.kernels.triton_env import AVAILABLE, interpreting, unavailable  # noqa: F401  (module face)
from megatron_burst.masks.vertical_slash import PackedTiles, SparseTile, as_packed


# GPU (column chunk BLOCK_N, warps) per (direction, input bits). No GPU was available to time them:
# they are the spill-free choices among BLOCK_N in {16, 32, 64} x warps in {4, 8} by the register
# and stack use of the kernels compiled for sm_90 at head dims 64 and 128 (the IEEE-fp32 dots
# need far more registers than the 16-bit MMA ones, hence the narrow fp32 chunks).
GPU_CONFIG = {("forward", 32): (16, 8), ("backward", 32): (16, 8),
              ("forward", 16): (64, 8), ("backward", 16): (32, 8)}
# The interpreter is slow per program, and small chunks keep its numpy temporaries small.
INTERPRET_BLOCK_N = 16
MAX_HEAD_DIM = 128
PACK_CACHE = 256
PACK_CACHE_BYTES = 1 << 30


def supports(dtype: torch.dtype, head_dim: int, kind: str) -> Optional[str]:
    """Why (dtype, head dim, kind) is out of this kernel's reach (None: supported)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"fp16/bf16/fp32 only, not {dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"head dim up to {MAX_HEAD_DIM}, not {head_dim}"
    return None if kind == "sparse" else f"mask kind {kind!r} (sparse only)"


_packed: "OrderedDict[tuple[int, torch.device], tuple[tuple, PackedTiles]]" = OrderedDict()


def _next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def pack(plan, heads: int, device: torch.device) -> PackedTiles:
    """``plan`` for ``heads`` query heads on ``device`` as the kernels read it: a PackedTiles as it
    is (copied once if on another device); hand-written tiles (a tuple of SparseTile) packed and
    cached: on the plan itself when it carries attributes (megatron_burst.masks.vertical_slash.TilePlan: the
    packed form dies with the plan), else in a bounded LRU keyed by id(plan) that holds the plan.

    Raises ValueError if the plan's heads differ, a tile's visibility is not
    [heads, q1 - q0, len(cols)], tiles' rows overlap or an index is negative (the kernels index
    memory by them unchecked).
    """
    device = torch.device(device)
    if isinstance(plan, PackedTiles):
        return as_packed(plan, heads, device)
    if hasattr(plan, "__dict__"):
        store = plan.__dict__.setdefault("_triton_packed", {})
        if device not in store or store[device].heads != heads:
            store[device] = PackedTiles.from_tiles(plan, heads, device)
        return store[device]
    key = (id(plan), device)
    hit = _packed.get(key)
    if hit is not None and hit[0] is plan and hit[1].heads == heads:
        _packed.move_to_end(key)
        return hit[1]
    packed = PackedTiles.from_tiles(plan, heads, device)
    _packed[key] = (plan, packed)
    held = sum(entry[1].nbytes for entry in _packed.values())
    while len(_packed) > 1 and (len(_packed) > PACK_CACHE or held > PACK_CACHE_BYTES):  # keep the newest
        held -= _packed.popitem(last=False)[1][1].nbytes
    return packed


# rows x words of visibility read per step while listing chunks (bounds the temporaries)
CHUNK_LIST_STEP = 1 << 24


def chunk_lists(p: PackedTiles, block_n: int, group: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(lists [T, heads / group, n] int32, counts [T, heads / group] int32, n): for each tile and
    group of ``group`` consecutive query heads (1: each head; the GQA group: each kv head), the
    tile's column chunks [j block_n, (j + 1) block_n) in which some head of the group sees a pair,
    increasing (entries past the count are padding). The kernels walk these instead of testing
    every chunk: a runtime test around a chunk's loads leaves the loop unpipelined on the GPU. On
    p's device with no host read for the planner's uniform layout (``p.words``); hand-written tiles
    are listed tile by tile on the host. Cached on ``p`` per (``block_n`` (a power of two), group)."""
    store = p.__dict__.setdefault("_chunk_lists", {})
    if (block_n, group) not in store:
        n = max(1, -(-p.max_cols // block_n))
        seen = store.get(("seen", block_n))
        if seen is None:
            seen = store[("seen", block_n)] = (_chunks_seen_uniform(p, block_n, n) if p.words is not None
                                               else _chunks_seen_by_tile(p, block_n, n))
        if group > 1:
            seen = seen.view(p.tiles, p.heads // group, group, n).any(2)
        index = torch.arange(n, dtype=torch.int32, device=p.device).expand_as(seen)
        lists = torch.where(seen, index, n).sort(-1).values.to(torch.int32)  # seen chunks first, increasing
        store[(block_n, group)] = (lists.contiguous(), seen.sum(-1, dtype=torch.int32).contiguous(), n)
    return store[(block_n, group)]


def _chunks_seen_uniform(p: PackedTiles, block_n: int, n: int) -> torch.Tensor:
    """[T, heads, n] bool from the uniform bitmask [T, heads, max_rows, words]: any bit of chunk j."""
    T, h, R, W = p.tiles, p.heads, p.max_rows, p.words
    vis = p.vis[:T * h * R * W].view(T, h, R, W)
    out = torch.zeros(T, h, n, dtype=torch.bool, device=p.device)
    step = max(1, CHUNK_LIST_STEP // max(1, h * R * W))
    for a in range(0, T, step):
        x = vis[a:a + step]
        if block_n >= 32:  # whole words per chunk
            per = block_n // 32
            x = torch.nn.functional.pad(x, (0, n * per - W)) if n * per > W else x[..., :n * per]
            any_bit = x.ne(0).view(*x.shape[:3], n, per).any(-1)
        else:  # several chunks per word: its bit fields
            per, field = 32 // block_n, (1 << block_n) - 1
            parts = [((x >> (i * block_n)) & field).ne(0) for i in range(per)]
            any_bit = torch.stack(parts, -1).view(*x.shape[:3], W * per)[..., :n]
            if any_bit.shape[-1] < n:
                any_bit = torch.nn.functional.pad(any_bit, (0, n - any_bit.shape[-1]))
        out[a:a + step] = any_bit.any(2)
    return out


def _chunks_seen_by_tile(p: PackedTiles, block_n: int, n: int) -> torch.Tensor:
    """[T, heads, n] bool of hand-written tiles (their own layouts), from the tiles written out."""
    out = torch.zeros(p.tiles, p.heads, n, dtype=torch.bool)
    for t, tile in enumerate(p):
        cols = tile.vis.shape[-1]
        pad = -(-cols // block_n) * block_n - cols
        seen = torch.nn.functional.pad(tile.vis.any(1).cpu(), (0, pad)).view(p.heads, -1, block_n).any(-1)
        out[t, :, :seen.shape[1]] = seen
    return out.to(p.device)


_HELPERS = ("_chunk_kv", "_chunk_seen")
_jitted: dict[bool, tuple[dict, tuple[Any, tuple[Any, Any]]]] = {}


def _kernels() -> tuple[Any, tuple[Any, Any]]:
    """(forward, (backward dq, backward dk/dv)) jitted for the current interpreter mode."""
    if not AVAILABLE:
        raise RuntimeError("the triton block-sparse kernel needs the triton package: pip install triton, or set "
                           "MEGATRON_BURST_SPARSE_KERNEL=torch")
    import triton

    from megatron_burst.kernels import _triton_block_sparse_src as src

    mode = interpreting()
    if mode not in _jitted:
        helpers = {name: triton.jit(getattr(src, name)) for name in _HELPERS}
        _jitted[mode] = (helpers, (triton.jit(src.sparse_fwd_kernel), (triton.jit(src.sparse_bwd_dq_kernel),
                                                                       triton.jit(src.sparse_bwd_dkdv_kernel))))
    helpers, kernels = _jitted[mode]
    src.__dict__.update(helpers)  # the kernels call the helpers of this mode by their global names
    return kernels


def _fits(p: PackedTiles, q: torch.Tensor, k: torch.Tensor) -> None:
    """The kernels index q rows and k/v rows by the plan unchecked: refuse a plan beyond the tensors."""
    if p.rows > q.shape[2] or p.keys > k.shape[2]:
        raise ValueError(f"sparse plan reaches query row {p.rows - 1} and key {p.keys - 1} but q has {q.shape[2]} "
                         f"rows and k {k.shape[2]}: the plan belongs to another block")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not q.is_cuda and not interpreting():
        raise ValueError(f"the triton block-sparse kernel needs CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 "
                         "to run it in Triton's CPU interpreter, or MEGATRON_BURST_SPARSE_KERNEL=torch")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"the triton block-sparse kernel takes head dims up to {MAX_HEAD_DIM}, got q {q.shape[-1]} "
                         f"v {v.shape[-1]}; set MEGATRON_BURST_SPARSE_KERNEL=torch")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")


def launch_options(direction: str, dtypes: set, d: int, dv: int, block_m: int, interpret: bool) -> dict:
    """Compile-time options and warps of a launch: ``direction`` "forward" or "backward", ``dtypes``
    the input tensors' dtypes, head dims ``d`` (q, k) and ``dv`` (v), ``block_m`` the padded tile rows."""
    # Triton 3.9's interpreter returns garbage from tl.dot on 16-bit operands (it multiplies the raw
    # bits), and tl.dot needs equal operand dtypes: widen the loaded tiles to fp32 there (exact).
    widen = len(dtypes) > 1 or (interpret and dtypes != {torch.float32})
    wide = widen or dtypes == {torch.float32}
    block_n, warps = GPU_CONFIG[(direction, 32 if wide else 16)]
    if interpret:
        block_n = INTERPRET_BLOCK_N
    # LOWP: P and dS rounded to the 16-bit input dtype for their products (full-rate tensor cores,
    # half the registers of fp32 operands); never under the interpreter (16-bit dots widened there)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_next_pow2(d), BLOCK_DV=_next_pow2(dv), WIDEN=widen,
                PRECISION="ieee" if wide else "tf32", LOWP=not wide, num_warps=warps)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "sparse", block: int = 1,
            scale: float = 1.0, plan: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, hq, sq, d], k [b, hkv, sk, d], v [b, hkv, sk, dv] -> (out fp32 [b, hq, sq, dv], lse fp32 [b, hq, sq]).

    Rows outside the plan's tiles, and rows that see nothing, get out 0 and lse -inf.
    """
    b, hq, sq, d = q.shape
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    if not plan or b * hq == 0:
        return out, lse
    _check(q, k, v)
    p = pack(plan, hq, q.device)
    _fits(p, q, k)
    fwd, _ = _kernels()
    opts = launch_options("forward", {q.dtype, k.dtype, v.dtype}, d, v.shape[-1], p.block_m, interpreting())
    fwd[(b * hq, p.tiles)](
        q, k, v, out, lse, p.q0, p.q1, p.col_start, p.col_end, p.cols, p.vis_start, p.vis_head, p.vis_words, p.vis,
        *chunk_lists(p, opts["BLOCK_N"]), float(scale), hq, hq // k.shape[1], d, v.shape[-1],
        *q.stride(), *k.stride(), *v.stride(), *out.stride()[:3], *lse.stride()[:2], **opts)
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: torch.Tensor,
             lse: torch.Tensor, kind: str = "sparse", block: int = 1, scale: float = 1.0, plan: tuple = ()
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [b, hq, sq, d], dk [b, hkv, sk, d], dv [b, hkv, sk, dv]), fp32.

    dout [b, hq, sq, dv]; D = rowsum(dout * out) and lse [b, hq, sq] (fp32) for all rows.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dq = torch.zeros(b, hq, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, hkv, sk, v.shape[-1], dtype=torch.float32, device=q.device)
    if not plan or b * hq == 0:
        return dq, dk, dv
    _check(q, k, v)
    p = pack(plan, hq, q.device)
    _fits(p, q, k)
    _, (bwd_dq, bwd_dkdv) = _kernels()
    # one stride set serves both row statistics, rows adjacent
    D, lse = D.float(), lse.float()
    if D.stride() != lse.stride() or lse.stride(-1) != 1:
        D, lse = D.contiguous(), lse.contiguous()
    plan_args = (p.q0, p.q1, p.col_start, p.col_end, p.cols, p.vis_start, p.vis_head, p.vis_words, p.vis)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride()[:2])
    opts = launch_options("backward", {q.dtype, k.dtype, v.dtype, dout.dtype}, d, v.shape[-1], p.block_m,
                          interpreting())
    # dq per (batch * query head, tile), stored; dk/dv per (batch * kv head, tile), the GQA group's
    # query heads summed before one atomic add per column chunk
    bwd_dq[(b * hq, p.tiles)](q, k, v, dout, D, lse, dq, *plan_args, *chunk_lists(p, opts["BLOCK_N"]), float(scale),
                              hq, hq // hkv, d, v.shape[-1], *strides, *dq.stride()[:3], **opts)
    bwd_dkdv[(b * hkv, p.tiles)](q, k, v, dout, D, lse, dk, dv, *plan_args, *chunk_lists(p, opts["BLOCK_N"], hq // hkv),
                                 float(scale), hkv, hq // hkv, d, v.shape[-1], *strides, *dk.stride()[:3],
                                 *dv.stride()[:3], **opts)
    return dq, dk, dv


def verify(device: torch.device, dtype: torch.dtype, tol: float = 3e-2) -> bool:
    """Check this kernel against :mod:`block_sparse` on a small GQA plan (forward and backward):
    True, or the exception of the call, or RuntimeError naming the output that is off
    (megatron_burst.kernels.choice turns either into a KernelSelfCheckError).

    The plan has a short last tile, a row that sees nothing and tiles with different column counts;
    errors are measured relative to the reference's largest magnitude (``tol`` allows for bf16).
    """

    g = torch.Generator().manual_seed(0)
    hq, hkv, sq, sk, d = 4, 2, 80, 96, 64
    mk = lambda h, s: torch.randn(1, h, s, d, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = mk(hq, sq), mk(hkv, sk), mk(hkv, sk), mk(hq, sq)
    tiles = []
    for q0, q1, nc in ((0, 64, 40), (64, 80, 96)):
        cols = torch.randperm(sk, generator=g)[:nc].sort().values
        vis = torch.rand(hq, q1 - q0, nc, generator=g) < 0.3
        vis[1, 3] = False  # a row that sees nothing
        tiles.append(SparseTile(q0, q1, cols, vis))
    plan = tuple(tiles)
    try:
        ref_out, ref_lse = block_sparse.forward(q, k, v, "sparse", 1, 0.125, plan=plan)
        D = (do.float() * ref_out).sum(-1)
        ref = (ref_out, ref_lse) + block_sparse.backward(do, q, k, v, D, ref_lse, "sparse", 1, 0.125, plan=plan)
        got = forward(q, k, v, "sparse", 1, 0.125, plan=plan)
        got = got + backward(do, q, k, v, D, ref_lse, "sparse", 1, 0.125, plan=plan)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            if a.shape != b.shape or not torch.equal(torch.isinf(a), torch.isinf(b)):
                raise RuntimeError(f"{name}: shape {tuple(a.shape)} or its -inf rows differ from block_sparse's "
                                   f"{tuple(b.shape)}")
            a, b = (torch.where(torch.isinf(t), 0.0, t.float()) for t in (a, b))  # NaN stays and fails
            err, allowed = (a - b).abs().max().item(), tol * max(b.abs().max().item(), 1.0)
            if not err <= allowed:
                raise RuntimeError(f"{name} is off block_sparse by {err:.3g} (allowed {allowed:.3g})")
    finally:
        _packed.pop((id(plan), torch.device(device)), None)
    return True
