"""Cases of the Triton block-sparse kernel, run under Triton's CPU interpreter in a fresh process:

    TRITON_INTERPRET=1 python tests/triton_sparse_cases.py

(the variable must be set before triton is first imported). Prints one JSON line: per case the max
abs errors of out, lse, dq, dk, dv against block_sparse ("torch_*") and against a dense masked fp64
reference built from the tiles' visibility ("dense_*"), with the reference magnitudes ("scale_*").
tests/test_triton_block_sparse.py asserts on them.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from megatron_burst.kernels import block_sparse, triton_block_sparse
from megatron_burst.masks.vertical_slash import SparseTile, plan_tiles

NAMES = ("out", "lse", "dq", "dk", "dv")


def dense_reference(q, k, v, dout, plan, scale):
    """fp64 (out, lse, dq, dk, dv) of attention under the plan's visibility laid out densely
    ([hq, sq, sk]; pairs outside every tile invisible); rows seeing nothing: out 0, lse -inf, no grad."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    vis = torch.zeros(hq, sq, sk, dtype=torch.bool)
    for t in plan:
        vis[:, t.q0:t.q1, t.cols] = t.vis
    leaves = [t.detach().double().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = leaves[0], leaves[1].repeat_interleave(hq // hkv, 1), leaves[2].repeat_interleave(hq // hkv, 1)
    empty = ~vis.any(-1, keepdim=True)
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # -inf on empty rows
    out = (torch.softmax(scores.masked_fill(empty, 0.0), -1) * ~empty) @ vh
    out.backward(dout.double())
    return (out.detach(), lse.detach()) + tuple(t.grad for t in leaves)


def compare(q, k, v, dout, plan, scale) -> dict:
    """Errors of the Triton kernel vs block_sparse and vs the dense reference (see the module docstring)."""
    ref = block_sparse.forward(q, k, v, "sparse", 1, scale, plan=plan)
    D = (dout.float() * ref[0]).sum(-1)
    ref = ref + block_sparse.backward(dout, q, k, v, D, ref[1], "sparse", 1, scale, plan=plan)
    got = triton_block_sparse.forward(q, k, v, "sparse", 1, scale, plan=plan)
    got = got + triton_block_sparse.backward(dout, q, k, v, D, ref[1], "sparse", 1, scale, plan=plan)
    dense = dense_reference(q, k, v, dout, plan, scale)
    res = {"empty_rows": int(torch.isinf(dense[1]).sum()), "dtype": str(q.dtype),
           "finite": all(bool(torch.isfinite(t).all()) for i, t in enumerate(got) if i != 1)}
    for name, a, r, e in zip(NAMES, got, ref, dense):
        res[f"shape_{name}"] = list(a.shape) == list(e.shape)
        if name == "lse":  # the same rows -inf, then compare the finite ones
            res["lse_inf_matches"] = bool(torch.equal(torch.isinf(a), torch.isinf(e)) and
                                         torch.equal(torch.isinf(r), torch.isinf(e)))
            fin = torch.isfinite(e)
            a, r, e = a[fin], r[fin], e[fin]
        res[f"torch_{name}"] = (a.double() - r.double()).abs().max().item()
        res[f"dense_{name}"] = (a.double() - e).abs().max().item()
        res[f"scale_{name}"] = e.abs().max().item()
    return res


def hand_plan(hq: int, sq: int, sk: int, seed: int) -> tuple:
    """Tiles [0, 16), [16, 32) and the short last one [48, sq = 53) with 10, 37 and all sk columns
    (rows [32, 48) absent); in tile 0 one row of head 0 sees nothing, in tile 1 a row sees nothing
    in any head."""
    g = torch.Generator().manual_seed(seed)
    tiles = []
    for q0, q1, nc in ((0, 16, 10), (16, 32, 37), (48, sq, sk)):
        cols = torch.randperm(sk, generator=g)[:nc].sort().values
        vis = torch.rand(hq, q1 - q0, nc, generator=g) < 0.4
        tiles.append([q0, q1, cols, vis])
    tiles[0][3][0, 2] = False
    tiles[1][3][:, 5] = False
    return tuple(SparseTile(*t) for t in tiles)


def inputs(b, hq, hkv, sq, sk, d, dtype, seed, sbhd=False):
    """q, k, v, dout [b, h, s, d]; with ``sbhd`` as strided views of [s, b, h, d] tensors (as the CP code passes)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s: torch.randn(s, b, h, d, generator=g).to(dtype)  # noqa: E731
    ts = (mk(hq, sq), mk(hkv, sk), mk(hkv, sk), mk(hq, sq))
    return tuple(t.permute(1, 2, 0, 3) if sbhd else t.permute(1, 2, 0, 3).contiguous() for t in ts)


def vs_pattern():
    """A vertical-slash pattern over 80 tokens, 4 heads, with rows that see nothing (no 0 slash)."""
    import megatron_burst as mb

    g = torch.Generator().manual_seed(3)
    return mb.VerticalSlash(torch.randint(0, 80, (4, 3), generator=g), torch.randint(1, 20, (4, 3), generator=g))


def cp_rank(kernel: str) -> dict:
    """sparse_cp_attention (burst, striped by 16) on this rank with MEGATRON_BURST_SPARSE_KERNEL=kernel:
    out and grads of q, k, v (4 query / 2 kv heads, d 16, 48 local tokens), the kernel select_sparse
    picks and how often the Triton kernel's forward and backward were called."""
    import torch.distributed as dist

    import megatron_burst as mb
    from megatron_burst import kernels

    os.environ["MEGATRON_BURST_SPARSE_KERNEL"] = kernel
    try:
        W, r = dist.get_world_size(), dist.get_rank()
        q, k, v, dout = (t.permute(2, 0, 1, 3) for t in inputs(1, 4, 2, 48 * W, 48 * W, 16, torch.float32, 7))
        sh = lambda t: mb.shard(t, 0, r, W, "striped", 16).clone()  # noqa: E731
        ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
        calls = {"forward": 0, "backward": 0}
        for name in calls:  # count the Triton kernel's calls (restored below)
            def counted(*a, _fn=getattr(triton_block_sparse, name), _name=name, **kw):
                calls[_name] += 1
                return _fn(*a, **kw)
            setattr(triton_block_sparse, f"_orig_{name}", getattr(triton_block_sparse, name))
            setattr(triton_block_sparse, name, counted)
        pattern = mb.VerticalSlash(torch.tensor([[0, 9], [3, 50], [1, 2], [70, 75]]),
                                   torch.tensor([[0, 5], [0, 17], [2, 33], [0, 1]]))
        out = mb.sparse_cp_attention(ql, kl, vl, pattern, layout="striped", stripe=16, algo="burst")
        out.backward(sh(dout))
        return {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                "selected": kernels.select_sparse(ql).__name__.rsplit(".", 1)[-1],
                "calls": calls}
    finally:
        del os.environ["MEGATRON_BURST_SPARSE_KERNEL"]
        for name in ("forward", "backward"):
            if hasattr(triton_block_sparse, f"_orig_{name}"):
                setattr(triton_block_sparse, name, getattr(triton_block_sparse, f"_orig_{name}"))
                delattr(triton_block_sparse, f"_orig_{name}")


def compile_for_gpu(direction: str, dtype: torch.dtype, d: int, capability: int = 90) -> dict:
    """Compile a kernel (``direction``: "forward", "dq" or "dkdv", the backward's two) for a CUDA GPU of
    ``capability`` without one, with the launch options the module uses there (64-row tiles).
    Returns its shared memory (bytes) and the compiled stages."""
    from triton_masked_cases import aot_compile

    fwd, (dq, dkdv) = triton_block_sparse._kernels()  # also binds the helpers the kernels call
    fn = {"forward": fwd, "dq": dq, "dkdv": dkdv}[direction]
    opts = triton_block_sparse.launch_options("forward" if direction == "forward" else "backward", {dtype}, d, d, 64,
                                              interpret=False)
    warps = opts.pop("num_warps")
    elem = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    pointers = {"Q": elem, "K": elem, "V": elem, "DO": elem, "TILE_Q0": "i32", "TILE_Q1": "i32", "COL_START": "i64",
                "COL_END": "i64", "COLS": "i32", "VIS_START": "i64", "VIS_HEAD": "i64", "VIS_WORDS": "i32",
                "VIS": "i32", "CHUNKS": "i32", "N_CHUNKS": "i32", "OUT": "fp32", "LSE": "fp32", "DELTA": "fp32",
                "DQ": "fp32", "DK": "fp32", "DV_": "fp32"}
    kernel = aot_compile(fn, opts, pointers, {"num_warps": warps}, capability,
                         unit_strides=("sqd", "skd", "svd", "sdod"))
    return {"shared": kernel.metadata.shared, "stages": sorted(kernel.asm), "regs": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None),
            # loads the software pipeliner made asynchronous copies (0: the column loop runs unpipelined)
            "async_copies": kernel.asm.get("ttgir", "").count("async_copy_global_to_local")}


def main() -> None:
    if not triton_block_sparse.interpreting():
        sys.exit("usage: TRITON_INTERPRET=1 python tests/triton_sparse_cases.py")
    results = {}
    for name, (hq, hkv, d, dtype, sbhd) in {"mha_d16": (2, 2, 16, torch.float32, False),
                                             "gqa_d24": (4, 2, 24, torch.float32, True),
                                             "gqa_bf16": (4, 2, 16, torch.bfloat16, True)}.items():
        q, k, v, dout = inputs(2, hq, hkv, 53, 45, d, dtype, seed=len(name))
        results[name] = compare(q, k, v, dout, hand_plan(hq, 53, 45, seed=hq + d), 0.3)
    pattern = vs_pattern()
    pos = torch.arange(80)
    q, k, v, dout = inputs(1, 4, 2, 80, 80, 16, torch.float32, seed=11)
    for tile in (64, 16):  # tiles of 64 rows (the last one 16) and of 16
        plan = plan_tiles(pattern, 80, pos, pos, tile=tile, columns="exact")
        results[f"pattern_t{tile}"] = compare(q, k, v, dout, plan, 0.25)
        results[f"pattern_t{tile}"]["tile_rows"] = [t.q1 - t.q0 for t in plan]
    # the visibility of the real pattern, independently of plan_tiles (for the dense check)
    full = pattern.dense(80)
    results["pattern_mask_matches"] = all(
        bool(torch.equal(full[:, t.q0:t.q1][:, :, t.cols], t.vis)) and
        int(full[:, t.q0:t.q1].sum()) == int(t.vis.sum())
        for t in plan_tiles(pattern, 80, pos, pos, tile=16))

    # the self-check select_sparse runs before using the kernel on a (device, dtype)
    results["verify"] = {str(dt): triton_block_sparse.verify(torch.device("cpu"), dt, tol=1e-5)
                         for dt in (torch.float32, torch.bfloat16)}

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import triton_sparse_cases  # not __main__: the ranks must unpickle the function by its module name
    from harness import run_ranks, shutdown_pools
    try:
        cp = {kern: run_ranks(2, triton_sparse_cases.cp_rank, kern, timeout=300) for kern in ("triton", "torch")}
    finally:
        shutdown_pools(stop_forkserver=True)
    results["cp"] = [{"selected": [cp[kern][r]["selected"] for kern in ("triton", "torch")],
                      "calls": [cp[kern][r]["calls"] for kern in ("triton", "torch")],
                      **{n: (cp["triton"][r][n] - cp["torch"][r][n]).abs().max().item() for n in ("out", "dq", "dk", "dv")},
                      **{f"scale_{n}": cp["torch"][r][n].abs().max().item() for n in ("out", "dq", "dk", "dv")}}
                     for r in range(2)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
