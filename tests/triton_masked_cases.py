"""Cases of the Triton masked attention kernel, run under Triton's CPU interpreter in a fresh process:

    TRITON_INTERPRET=1 python tests/triton_masked_cases.py

(the variable must be set before triton is first imported). Prints one JSON line: per case the max
abs errors of out, lse, dq, dk, dv ("err_*") against kernels.reference computed in fp64 (backward
with D from the reference output), the reference magnitudes ("scale_*"), and for 16-bit cases the
errors of kernels.tiled on the same 16-bit inputs ("tiled_*"; the reference then runs on the fp32
values the 16-bit inputs were rounded from). tests/test_triton_masked.py asserts on them.

:func:`compile_for_gpu` compiles a kernel for a CUDA GPU without one (tests and config choice).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from megatron_burst.kernels import reference, tiled, triton_masked
from megatron_burst.masks.block import HeadBands

NAMES = ("out", "lse", "dq", "dk", "dv")
SCALE = 0.3


def inputs(b, hq, hkv, sq, sk, d, seed, sbhd=False, dv=None):
    """fp32 q, k, v, dout [b, h, s, d]; with ``sbhd`` strided views of [s, b, h, d] tensors."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    mk = lambda h, s, e: torch.randn(s, b, h, e, generator=g)  # noqa: E731
    ts = (mk(hq, sq, d), mk(hkv, sk, d), mk(hkv, sk, dv), mk(hq, sq, dv))
    return tuple(t.permute(1, 2, 0, 3) if sbhd else t.permute(1, 2, 0, 3).contiguous() for t in ts)


def dense_reference(q, k, v, dout, kind, block, positions):
    """fp64 (out, lse, dq, dk, dv) from kernels.reference; rows that see nothing (which the reference
    does not take: it would give NaN) are left out of its call and get out 0, lse -inf, dq 0."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    sq, sk = q.shape[2], k.shape[2]
    vis = reference.visibility(kind, block, sq, sk, q.device, positions)
    # rows no head sees anything in (per-head bands: rows seen by some heads stay, with their empty heads' lse -inf)
    keep = torch.ones(sq, dtype=torch.bool) if vis is None else vis.reshape(-1, sq, sk).any(-1).any(0)
    rows = keep.nonzero().flatten()
    pos = positions
    if positions is not None and not bool(keep.all()):
        q_pos, kv_pos, q_doc, kv_doc, band = positions
        pos = (None if q_pos is None else q_pos[rows], kv_pos, None if q_doc is None else q_doc[rows], kv_doc, band)
    qk, dk_ = q[:, :, rows], dout[:, :, rows]
    o, lse = reference.forward(qk, k, v, kind, block, SCALE, pos)
    D = (dk_ * o).sum(-1)
    dq, dk, dv = reference.backward(dk_, qk, k, v, D, lse, kind, block, SCALE, pos)
    b, hq = q.shape[:2]
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64)
    lse_all = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64)
    dq_all = torch.zeros_like(q)
    out[:, :, rows], lse_all[:, :, rows], dq_all[:, :, rows] = o, lse, dq
    return out, lse_all, dq_all, dk, dv


def errors(got, ref, prefix="err"):
    res = {}
    for name, a, e in zip(NAMES, got, ref):
        if name == "lse":  # the same rows -inf, then the finite ones
            res[f"{prefix}_lse_inf_matches"] = bool(torch.equal(torch.isinf(a), torch.isinf(e)))
            fin = torch.isfinite(e)
            a, e = a[fin], e[fin]
        res[f"{prefix}_{name}"] = (a.double() - e).abs().max().item() if e.numel() else 0.0
        res[f"shape_{name}"] = res.get(f"shape_{name}", True) and list(a.shape) == list(e.shape)
    return res


def run_case(kind, b=1, hq=2, hkv=2, sq=37, sk=53, d=16, dv=None, block=1, positions=None, dtype=torch.float32,
             sbhd=False, seed=0, lse_override=None):
    """Kernel vs fp64 reference (and, for 16-bit, tiled on the same inputs). ``lse_override(lse, D)``
    may replace the lse / D given to the backward (the reference backward gets the same)."""
    q, k, v, dout = inputs(b, hq, hkv, sq, sk, d, seed, sbhd, dv)
    ref = dense_reference(q, k, v, dout, kind, block, positions)
    D = (dout.double() * ref[0]).sum(-1).float()
    lse = ref[1].float()
    if lse_override is not None:
        lse, D = lse_override(lse, D)
    x = tuple(t.to(dtype) for t in (q, k, v, dout))
    if sbhd:  # keep the strided layout for the 16-bit copies too
        x = tuple(t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in x)
    qx, kx, vx, dox = x
    t0 = time.time()
    got = triton_masked.forward(qx, kx, vx, kind, block, SCALE, positions)
    got = got + triton_masked.backward(dox, qx, kx, vx, D, lse, kind, block, SCALE, positions)
    res = {"secs": round(time.time() - t0, 2), "dtype": str(dtype),
           "strided": not qx.is_contiguous(), "empty_rows": int(torch.isinf(ref[1]).sum()),
           "out_dtypes": [str(t.dtype) for t in got],
           "finite": all(bool(torch.isfinite(t).all()) for i, t in enumerate(got) if i != 1)}
    res.update(errors(got, ref))
    res.update({f"scale_{n}": e[torch.isfinite(e)].abs().max().item() if torch.isfinite(e).any() else 0.0
                for n, e in zip(NAMES, ref)})
    if torch.isinf(ref[1]).any():  # the empty rows themselves: out 0, lse -inf, dq 0
        empty = torch.isinf(ref[1])
        res["empty_out_max"] = got[0][empty].abs().max().item()
        res["empty_dq_max"] = got[2][empty].abs().max().item()
        res["empty_lse_all_neg_inf"] = bool((got[1][empty] == float("-inf")).all())
    if dtype != torch.float32:
        ti = tiled.forward(qx, kx, vx, kind, block, SCALE, positions)
        ti = ti + tiled.backward(dox, qx, kx, vx, D, lse, kind, block, SCALE, positions)
        res.update(errors(ti, ref, "tiled"))
    return res


def docs(*lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def zigzag(rank, world, chunk):
    """Global positions a zigzag rank holds: chunks rank and 2 * world - 1 - rank."""
    a, b = rank * chunk, (2 * world - 1 - rank) * chunk
    return torch.cat([torch.arange(a, a + chunk), torch.arange(b, b + chunk)])


def cases() -> dict:
    """name -> keyword arguments of :func:`run_case`."""
    ar = torch.arange
    doc48 = docs(9, 20, 19)
    return {
        "full_37x53": dict(kind="full", sq=37, sk=53),
        "full_53x37_gqa_d24": dict(kind="full", hq=4, hkv=2, sq=53, sk=37, d=24),
        "causal_37x53": dict(kind="causal", sq=37, sk=53, b=2),
        "causal_53x37_gqa_d24_sbhd": dict(kind="causal", hq=4, hkv=2, sq=53, sk=37, d=24, sbhd=True),
        "causal_48_gqa_d80": dict(kind="causal", hq=4, hkv=2, sq=48, sk=48, d=80),
        "causal_dv_differs": dict(kind="causal", sq=40, sk=40, d=16, dv=24),
        "block_causal_b4_37": dict(kind="block_causal", block=4, hq=4, hkv=2, sq=37, sk=37),
        "block_causal_b4_45x29": dict(kind="block_causal", block=4, sq=45, sk=29),
        "docs_only": dict(kind="positions", sq=48, sk=48,
                          positions=(None, None, doc48, docs(12, 14, 22), (None, 0))),
        "window_docs_l5_r0_gqa_sbhd": dict(kind="positions", hq=4, hkv=2, sq=48, sk=48, sbhd=True,
                                           positions=(ar(48), ar(48), doc48, doc48, (5, 0))),
        "band_l3_r2": dict(kind="positions", sq=50, sk=47, positions=(ar(50), ar(47) + 2, None, None, (3, 2))),
        "offset_q40_79_kv0_39": dict(kind="positions", sq=40, sk=40,
                                     positions=(ar(40, 80), ar(40), None, None, (None, 0))),
        "offset_q40_79_kv20_59": dict(kind="positions", sq=40, sk=40,
                                      positions=(ar(40, 80), ar(20, 60), None, None, (None, 0))),
        "zigzag_diag_gqa": dict(kind="positions", hq=4, hkv=2, sq=32, sk=32,
                                positions=(zigzag(0, 2, 16), zigzag(0, 2, 16), None, None, (None, 0))),
        "zigzag_q1_kv0_docs": dict(kind="positions", sq=32, sk=32,
                                   positions=(zigzag(1, 2, 16), zigzag(0, 2, 16), docs(20, 12), docs(6, 26),
                                              (None, 0))),
        "empty_rows": dict(kind="positions", hq=4, hkv=2, sq=40, sk=40,
                           positions=(ar(40), ar(40), docs(10, 8, 22), torch.cat([docs(15), docs(0, 0, 25)]),
                                      (None, 0))),
        # a slash run of a sparse pattern: keys at offsets 4..9 (band (9, -4)); rows 0..3 see nothing
        "slash_run_l9_r-4_gqa": dict(kind="positions", hq=4, hkv=2, sq=50, sk=47,
                                     positions=(ar(50), ar(47), None, None, (9, -4))),
        # per-head slash runs (HeadBands): head 0 offsets 4..9, head 1 0..3, head 2 15..20, head 3 nothing
        "head_bands_gqa": dict(kind="positions", hq=4, hkv=2, sq=50, sk=47,
                               positions=(ar(50), ar(47), None, None, HeadBands(torch.tensor(
                                   [[9, -4], [3, 0], [20, -15], [-1, 0]])))),
        "head_bands_docs_zigzag": dict(kind="positions", hq=2, sq=32, sk=32,
                                       positions=(zigzag(1, 2, 16), zigzag(0, 2, 16), docs(20, 12), docs(6, 26),
                                                  HeadBands(torch.tensor([[12, -2], [40, -30]])))),
        # gathered keys every head sees only its own of (HeadBands.keys), each head its band of offsets
        "head_bands_keys_gqa": dict(kind="positions", hq=4, hkv=2, sq=50, sk=21,
                                    positions=(ar(50), ar(0, 63, 3), None, None, HeadBands(
                                        torch.tensor([[50, 0], [50, -5], [6, -2], [50, 0]]),
                                        torch.rand(4, 21, generator=torch.Generator().manual_seed(1)) < 0.5))),
        # a block_causal block's part above the diagonal of its stripes (masks.block.split_block_causal,
        # stripe 4, 45 x 29): columns after the row in the row's stripe; each stripe's last row sees nothing
        "stripe_rest_b4_45x29_gqa": dict(kind="positions", hq=4, hkv=2, sq=45, sk=29,
                                         positions=(ar(45), ar(29), ar(45) // 4, ar(29) // 4, (-1, None))),
        # holes (HeadBands.holes): offsets a head's band covers but another block holds (slash runs);
        # head 0 offsets 0..3, 20..27 and 44..45 cut out, head 1 none (padding), head 2 10..40, head 3 all
        # of them; three holes per head: the kernels run four (a power of two), the last empty
        "head_bands_holes_gqa": dict(kind="positions", hq=4, hkv=2, sq=50, sk=47,
                                     positions=(ar(50), ar(47), None, None, HeadBands(
                                         torch.tensor([[60, 0], [60, 0], [60, 0], [60, 0]]), None,
                                         torch.tensor([[[0, 3], [20, 27], [44, 45]], [[1, 0], [1, 0], [1, 0]],
                                                       [[10, 40], [1, 0], [1, 0]], [[0, 60], [1, 0], [1, 0]]])))),
        # gathered keys (every third position), per-head keys, documents and holes together
        "head_bands_holes_keys_docs": dict(kind="positions", hq=4, hkv=2, sq=50, sk=21,
                                           positions=(ar(50), ar(0, 63, 3), docs(30, 20), docs(11, 10), HeadBands(
                                               torch.tensor([[50, 0], [50, -2], [9, 0], [50, 0]]),
                                               torch.rand(4, 21, generator=torch.Generator().manual_seed(2)) < 0.6,
                                               torch.tensor([[[3, 5]], [[0, 8]], [[1, 0]], [[12, 20]]])))),
        "bf16_causal_gqa": dict(kind="causal", hq=4, hkv=2, sq=48, sk=48, dtype=torch.bfloat16),
        "bf16_window_docs_sbhd": dict(kind="positions", sq=48, sk=48, dtype=torch.bfloat16, sbhd=True,
                                      positions=(ar(48), ar(48), doc48, doc48, (5, 0))),
        "fp16_full_d24": dict(kind="full", sq=37, sk=45, d=24, dtype=torch.float16),
    }


def empty_rows_finite_lse(lse, D):
    """The empty rows as if they saw keys in other blocks: a finite global lse and some D."""
    empty = torch.isinf(lse)
    return torch.where(empty, torch.full_like(lse, 0.7), lse), torch.where(empty, torch.full_like(D, 0.3), D)


def skipped_tiles_unread() -> dict:
    """Causal 32 x 64 with NaN in k/v rows 32..63, which no row sees: the kernels must never load
    those tiles (a NaN reaches the output through P.V or dS.K even where P is 0)."""
    q, k, v, dout = inputs(1, 2, 1, 32, 64, 16, seed=5)
    k, v = k.clone(), v.clone()
    k[:, :, 32:] = float("nan")
    v[:, :, 32:] = float("nan")
    ref = dense_reference(q, k[:, :, :32], v[:, :, :32], dout, "causal", 1, None)
    D = (dout.double() * ref[0]).sum(-1).float()
    out, lse = triton_masked.forward(q, k, v, "causal", 1, SCALE)
    dq, dk, dv = triton_masked.backward(dout, q, k, v, D, ref[1].float(), "causal", 1, SCALE)
    res = errors((out, lse, dq, dk[:, :, :32], dv[:, :, :32]), ref)
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in (out, lse, dq, dk, dv))
    res["unseen_grads_zero"] = bool((dk[:, :, 32:] == 0).all() and (dv[:, :, 32:] == 0).all())
    res.update({f"scale_{n}": e[torch.isfinite(e)].abs().max().item() for n, e in zip(NAMES, ref)})
    return res


NAMES_OF_KERNELS = {"forward": "masked_fwd_kernel", "dq": "masked_bwd_dq_kernel", "dkdv": "masked_bwd_dkdv_kernel"}


def launch_signature(arg_names, opts: dict, pointers: dict, unit_strides: tuple = ()) -> tuple[dict, dict]:
    """(signature, attributes) of an ahead-of-time compile, as Triton specializes a real launch:
    ``opts`` keys constexpr; ``pointers`` name -> element type, 16-divisible; ``scale``/``scale2``
    fp32; other arguments i32, those starting with "s" (strides) 16-divisible, except
    ``unit_strides``, which become the constexpr 1 (added to ``opts``)."""
    signature, attrs = {}, {}
    for i, name in enumerate(arg_names):
        if name in opts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = f"*{pointers[name]}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "scale2"):
            signature[name] = "fp32"
        elif name in unit_strides:
            signature[name], opts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if name.startswith("s"):  # strides
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def aot_compile(fn, opts: dict, pointers: dict, launch: dict, capability: int = 90, unit_strides: tuple = ()):
    """``fn`` (a jitted kernel) compiled for a CUDA GPU of ``capability`` without one, down to a
    cubin: signature from :func:`launch_signature` (``opts``, ``pointers``, ``unit_strides``),
    ``launch`` the compile options (num_warps, num_stages), FP fusion on as at run time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = launch_signature(fn.arg_names, opts, pointers, unit_strides)
    return triton.compile(ASTSource(fn, signature, opts, attrs), target=GPUTarget("cuda", capability, 32),
                          options={**launch, "enable_fp_fusion": True})


def compile_for_gpu(kernel: str, dtype: torch.dtype, d: int, capability: int = 90, flags: dict | None = None) -> dict:
    """Compile ``kernel`` ("forward", "dq", "dkdv") for a CUDA GPU of ``capability`` without one,
    with the module's GPU launch options for ``dtype`` and head dim ``d`` and the mask ``flags``
    (default: every flag on, int32 keys). Pointers and strides are declared 16-divisible, as Triton
    specializes them at run time. Returns the compiled stages, shared memory (bytes), the number
    of wgmma instructions in the PTX and, from the bundled cuobjdump (where present), registers and
    stack (spill) bytes per thread."""
    import re
    import subprocess
    import tempfile

    import triton

    fn = triton_masked._kernels()[NAMES_OF_KERNELS[kernel]]
    opts = triton_masked.launch_options(kernel, {dtype}, d, d, interpret=False)
    warps, stages = opts.pop("num_warps"), opts.pop("num_stages")
    opts.update(flags or dict(POS=2, HAS_LEFT=True, HAS_RIGHT=True, HAS_DOC=True, PER_HEAD=True, HAS_KEYS=True,
                              HAS_HOLES=True, N_HOLES=4))
    elem = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    pointers = {"Q": elem, "K": elem, "V": elem, "DO": elem, "RANGES": "i32", "QKEY": "i32", "KKEY": "i32",
                "QDOC": "i32", "KDOC": "i32", "HBAND": "i32", "HKEYS": "i8", "HHOLES": "i32", "OUT": "fp32", "LSE": "fp32", "DELTA": "fp32", "DQ": "fp32",
                "DK": "fp32", "DV_": "fp32"}
    compiled = aot_compile(fn, opts, pointers, {"num_warps": warps, "num_stages": stages}, capability)
    res = {"stages": sorted(compiled.asm), "shared": compiled.metadata.shared, "num_warps": warps,
           "num_stages": stages, "BLOCK_M": opts["BLOCK_M"], "BLOCK_N": opts["BLOCK_N"],
           "wgmma": compiled.asm.get("ptx", "").count("wgmma.mma_async"),
           # loads the software pipeliner turned into asynchronous copies (0: the tile loops run unpipelined)
           "async_copies": compiled.asm.get("ttgir", "").count("async_copy_global_to_local")}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if "cubin" in compiled.asm and os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
        if found:
            res["registers"], res["stack"] = int(found["REG"]), int(found["STACK"])
    return res


def _shared_runs_pattern(seq: int, heads: int):
    """Vertical lines 30 and 50, slash offsets 2..7 and 20..27, the same for every head; planned into
    dense blocks (vertical_slash.runs_apart_for forced)."""
    from megatron_burst.masks import vertical_slash

    vertical_slash._RUNS_OVERRIDE = True
    slash = torch.cat([torch.arange(2, 8), torch.arange(20, 28)])
    return vertical_slash.VerticalSlash(torch.tensor([30, 50]).expand(heads, -1).contiguous(),
                                        slash.expand(heads, -1).contiguous())


def _per_head_runs_pattern(seq: int, heads: int):
    """Vertical line 30; slash offsets 0..19 for every head but the last (3..22), and 41; the band
    in per-head dense blocks, the rest in sparse tiles (vertical_slash.runs_apart_for forced)."""
    from megatron_burst.masks import vertical_slash

    vertical_slash._RUNS_OVERRIDE = True
    slash = torch.cat([torch.arange(20), torch.tensor([41])]).expand(heads, -1).clone()
    slash[-1, :20] += 3
    return vertical_slash.VerticalSlash(torch.tensor([30]).expand(heads, -1).contiguous(), slash)


def engine_blocks() -> dict:
    """Every block the CP engine produces at W = 3 (documents + window under zigzag, block-striped,
    THD, a two-sided window without causality), through kernels.block_forward/block_backward with
    the Triton kernel and with the reference; the largest relative error over all blocks."""
    from megatron_burst import kernels
    from megatron_burst.algorithms.schedule import CPConfig
    from megatron_burst.masks.documents import check_cu_seqlens, check_thd
    from megatron_burst.topology import CPTopology

    W, n = 3, 24
    topo = CPTopology(None, 0, W, W, None)
    configs = {
        "zigzag_docs_window": CPConfig(topo, "flat", "zigzag", 1, True, 0.3,
                                       documents=check_cu_seqlens(torch.tensor([0, 5, 30, 31, 72]), 72, 1),
                                       window=(9, 0)),
        "block_striped": CPConfig(topo, "flat", "striped", 4, True, 0.3),
        "thd": CPConfig(topo, "flat", "thd", 1, True, 0.3, documents=check_thd([0, 18, 72], None, n, W, 1)),
        "window_two_sided": CPConfig(topo, "flat", "contiguous", 1, False, 0.3, window=(4, 3)),
        # a vertical-slash pattern planned as on CUDA: slash runs and gathered vertical keys as
        # positions blocks (bands with a negative right bound, rows that see nothing, kv_index)
        "pattern_shared_runs": CPConfig(topo, "flat", "striped", 4, True, 0.3, window=(40, 0),
                                        pattern=_shared_runs_pattern(72, 4)),
        # each head its own band (the last head's shifted): per-head positions blocks (HeadBands)
        "pattern_per_head_runs": CPConfig(topo, "flat", "zigzag", 1, True, 0.3,
                                          documents=check_cu_seqlens(torch.tensor([0, 30, 72]), 72, 1),
                                          pattern=_per_head_runs_pattern(72, 4)),
    }
    worst, kinds = 0.0, set()
    g = torch.Generator().manual_seed(5)
    for name, cfg in configs.items():
        for qr in range(W):
            for kr in range(W):
                for bs, mask in cfg.blocks(qr, kr, n):
                    if mask.kind not in triton_masked.KINDS:  # a pattern's sparse tiles: another kernel
                        continue
                    kinds.add(mask.kind + (" gathered" if mask.kv_index is not None else "")
                              + (" per head" if isinstance(mask.band, HeadBands) else "")
                              + (" holes" if isinstance(mask.band, HeadBands) and mask.band.holes is not None else ""))
                    q, do = torch.randn(1, 4, n, 16, generator=g), torch.randn(1, 4, n, 16, generator=g)
                    k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
                    D, lse = torch.randn(1, 4, n, generator=g), torch.randn(1, 4, n, generator=g) + 4
                    got = kernels.block_forward(q, k, v, mask, 0.3, "triton_masked")
                    ref = kernels.block_forward(q, k, v, mask, 0.3, "reference")
                    got += kernels.block_backward(do, q, k, v, D, lse, mask, 0.3, "triton_masked")
                    ref += kernels.block_backward(do, q, k, v, D, lse, mask, 0.3, "reference")
                    for a, b in zip(got, ref):
                        fin = torch.isfinite(b)
                        err = (a.float() - b.float())[fin].abs().max().item() if fin.any() else 0.0
                        worst = max(worst, err / max(1.0, b[fin].abs().max().item() if fin.any() else 1.0))
    return {"worst": worst, "kinds": sorted(kinds)}


def main() -> None:
    if not triton_masked.interpreting():
        sys.exit("usage: TRITON_INTERPRET=1 python tests/triton_masked_cases.py")
    only = set(sys.argv[1:])
    results = {}
    for name, kw in cases().items():
        if not only or name in only:
            results[name] = run_case(**kw)
    if not only or "empty_rows_finite_lse" in only:
        results["empty_rows_finite_lse"] = run_case(**cases()["empty_rows"], lse_override=empty_rows_finite_lse)
    # the dk/dv launch split over q tiles (as for a few keys and many queries on a GPU), forced here
    saved = triton_masked.DKDV_PROGRAMS, triton_masked.DKDV_SPLIT_TILES
    triton_masked.DKDV_PROGRAMS, triton_masked.DKDV_SPLIT_TILES = 1 << 20, 1
    try:
        for name in ("slash_run_l9_r-4_gqa", "window_docs_l5_r0_gqa_sbhd", "block_causal_b4_45x29", "head_bands_gqa",
                     "head_bands_keys_gqa", "head_bands_holes_keys_docs"):
            if not only or f"split_{name}" in only:
                results[f"split_{name}"] = run_case(**cases()[name])
    finally:
        triton_masked.DKDV_PROGRAMS, triton_masked.DKDV_SPLIT_TILES = saved
    if not only or "engine_blocks" in only:
        results["engine_blocks"] = engine_blocks()
    if not only or "skipped_tiles_unread" in only:
        results["skipped_tiles_unread"] = skipped_tiles_unread()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
