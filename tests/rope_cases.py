"""Cases of the fused RoPE Triton kernel, run under Triton's CPU interpreter in a fresh process:

    TRITON_INTERPRET=1 python tests/rope_cases.py

(the variable must be set before triton is first imported; megatron.core imports it). Prints one
JSON line: per case the max abs errors of the kernel's forward ("err_fwd") and backward
("err_bwd") against ``rope_reference`` run through autograd on the same inputs, against
Megatron's own unfused functions where the case says so ("meg_fwd", "meg_bwd"; fp32 only:
Megatron rounds cos / sin to t's dtype first), 16-bit errors in units of the output dtype's ulp
("ulps_fwd", "ulps_bwd"), whether the pass-through columns are bitwise equal ("pass_through"),
and what the case ran on ("path", "strided", "dtype"). tests/test_fused_rope.py asserts on them.
"""
from __future__ import annotations

import json
import time

import torch

from megatron_burst.fusions import rope
from megatron_burst.kernels.choice import KernelSelfCheckError

SEED = 1234


class FakeCPGroup:
    """What Megatron's ``_apply_rotary_pos_emb_thd`` reads of a context-parallel group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def make_freqs(rows: int, R: int, start: float = 0.0, jitter: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Megatron-style fp32 angles [rows, 1, 1, R]: positions start.. times inverse frequencies
    (halves layout: the R/2 frequencies repeated), plus ``jitter`` noise (so a kernel that reads
    the wrong column of freqs, e.g. sin f[j] for sin f[p(j)], is seen)."""
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    pos = torch.arange(rows, dtype=torch.float32) + start
    f = torch.outer(pos, inv)
    f = torch.cat((f, f), dim=-1)
    return (f + jitter * torch.randn(f.shape, generator=g)).view(rows, 1, 1, R)


def maxabs(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """max |a - b| (max |a| without b) in float64; 0 for empty tensors."""
    d = a.double() if b is None else a.double() - b.double()
    return d.abs().max().item() if d.numel() else 0.0


def ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| in units of ref's ulp in ref's dtype (zero: the smallest normal's)."""
    info = torch.finfo(ref.dtype)
    r = ref.double()
    _, exp = torch.frexp(r)  # r = m 2^exp, 0.5 <= |m| < 1
    ulp = torch.ldexp(torch.full_like(r, info.eps), exp - 1)  # eps: the ulp of 1; 2^(exp - 1) the leading bit
    ulp = torch.where(r == 0, torch.full_like(r, info.tiny), ulp)
    return maxabs((got.double() - r) / ulp)


def fwd_bwd(fn, t: torch.Tensor, freqs: torch.Tensor, dy: torch.Tensor, interleaved: bool):
    """fn(t, freqs, interleaved) and d t for the cotangent dy."""
    x = t.detach().clone().requires_grad_()
    y = fn(x, freqs, interleaved)
    y.backward(dy)
    return y.detach(), x.grad


def megatron_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs[:t.shape[0]], rotary_interleaved=interleaved)


def bshd_case(S: int, B: int, H: int, D: int, R: int, dtype=torch.float32, interleaved=False, rows=None,
              start=0.0, megatron=False, seed=0) -> dict:
    g = torch.Generator().manual_seed(SEED + seed)
    t = torch.randn(S, B, H, D, generator=g).to(dtype)
    dy = torch.randn(S, B, H, D, generator=g).to(dtype)
    freqs = make_freqs(rows or S, R, start, jitter=0.3, seed=seed)
    t0 = time.time()
    y, dx = fwd_bwd(rope.apply_rope, t, freqs, dy, interleaved)
    res = {"secs": round(time.time() - t0, 2), "dtype": str(dtype), "path": rope.describe(t.device, dtype),
           "strided": False, "shape": list(y.shape), "out_dtype": str(y.dtype), "grad_dtype": str(dx.dtype)}
    yr, dxr = fwd_bwd(rope.rope_reference, t, freqs, dy, interleaved)
    res["err_fwd"] = maxabs(y, yr)
    res["err_bwd"] = maxabs(dx, dxr)
    res["scale"] = max(maxabs(yr), maxabs(dxr))
    res["pass_through"] = bool(torch.equal(y[..., R:], t[..., R:]) and torch.equal(dx[..., R:], dy[..., R:]))
    if dtype != torch.float32:
        res["ulps_fwd"], res["ulps_bwd"] = ulps(y, yr), ulps(dx, dxr)
    if megatron:
        ym, dxm = fwd_bwd(megatron_bshd, t, freqs, dy, interleaved)
        res["meg_fwd"] = maxabs(y, ym)
        res["meg_bwd"] = maxabs(dx, dxm)
    return res


def strided_case(S: int, B: int, H: int, D: int, R: int, interleaved: bool, seed: int = 0, gqa: bool = False) -> dict:
    """q and k from a torch.split of one fused projection output (strided views), grads flowing back
    into the fused tensor. Default: [S, B, H, 3 D] split on the last dim (head stride 3 D);
    ``gqa``: [S, B, H + 2 * H/... heads, D] split on the head dim (H query heads, 1 key, 1 value
    head: strided in s and b)."""
    g = torch.Generator().manual_seed(SEED + 100 + seed)
    fused = torch.randn(S, B, H + 2, D, generator=g) if gqa else torch.randn(S, B, H, 3 * D, generator=g)
    freqs = make_freqs(S + 5, R, jitter=0.3, seed=seed)
    parts = (H, 1, 1) if gqa else (D, D, D)
    dim = 2 if gqa else 3
    cot = [torch.randn(fused.narrow(dim, 0, n).shape, generator=g) for n in parts]

    def run(fn):
        x = fused.clone().requires_grad_()
        q, k, v = torch.split(x, parts, dim=dim)
        strided = not q.is_contiguous() and not k.is_contiguous()
        outs = (fn(q, freqs, interleaved), fn(k, freqs, interleaved), v)
        sum((o * c).sum() for o, c in zip(outs, cot)).backward()
        return [o.detach() for o in outs[:2]], x.grad, strided

    t0 = time.time()
    (yq, yk), grad, strided = run(rope.apply_rope)
    secs = round(time.time() - t0, 2)
    (rq, rk), rgrad, _ = run(rope.rope_reference)
    return {"secs": secs, "dtype": "torch.float32", "strided": strided, "path": rope.describe("cpu", torch.float32),
            "err_fwd": max(maxabs(yq, rq), maxabs(yk, rk)),
            "err_bwd": maxabs(grad, rgrad),
            "scale": max(maxabs(rq), maxabs(rgrad)),
            "pass_through": bool(torch.equal(yq[..., R:], fused.narrow(dim, 0, parts[0])[..., R:]))}


def thd_case(lengths: list[int], cp_size: int, H: int, D: int, R: int, interleaved=False, seed: int = 0) -> dict:
    """apply_rope_thd on every rank of a CP group vs Megatron's _apply_rotary_pos_emb_thd, forward
    and backward (fp32), and vs rope_reference on the same gathered positions."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    rows = max(lengths) + 3  # more rows than the longest sequence, and != cu[-1] (Megatron's other case)
    assert rows != int(cu[-1])
    freqs = make_freqs(rows, R, jitter=0.3, seed=seed)
    res = {"secs": 0.0, "err_fwd": 0.0, "err_bwd": 0.0, "meg_fwd": 0.0, "meg_bwd": 0.0, "scale": 0.0,
           "pass_through": True, "ranks": 0, "tokens": [], "dtype": "torch.float32",
           "path": rope.describe("cpu", torch.float32), "strided": False}
    for rank in range(cp_size):
        g = torch.Generator().manual_seed(SEED + 200 + seed + rank)
        T = sum(n // cp_size for n in lengths)
        t = torch.randn(T, H, D, generator=g)
        dy = torch.randn(T, H, D, generator=g)
        ours = lambda x, f, i: rope.apply_rope_thd(x, cu, f, cp_size, rank, i)  # noqa: E731
        meg = lambda x, f, i: _apply_rotary_pos_emb_thd(x, cu, f, rotary_interleaved=i,  # noqa: E731
                                                        cp_group=FakeCPGroup(cp_size, rank))
        t0 = time.time()
        y, dx = fwd_bwd(ours, t, freqs, dy, interleaved)
        res["secs"] += round(time.time() - t0, 2)
        ym, dxm = fwd_bwd(meg, t, freqs, dy, interleaved)
        pos = rope.thd_positions(cu, T, cp_size, rank)
        gathered = freqs[pos]
        ref = lambda x, f, i: rope.rope_reference(x.unsqueeze(1), gathered, i).squeeze(1)  # noqa: E731
        yr, dxr = fwd_bwd(ref, t, freqs, dy, interleaved)
        res["meg_fwd"] = max(res["meg_fwd"], maxabs(y, ym))
        res["meg_bwd"] = max(res["meg_bwd"], maxabs(dx, dxm))
        res["err_fwd"] = max(res["err_fwd"], maxabs(y, yr))
        res["err_bwd"] = max(res["err_bwd"], maxabs(dx, dxr))
        res["scale"] = max(res["scale"], maxabs(ym), maxabs(dxm))
        res["pass_through"] &= bool(torch.equal(y[..., R:], t[..., R:]))
        res["ranks"] += 1
        res["tokens"].append(T)
    return res


def self_check_case(dtype: torch.dtype) -> dict:
    """The CUDA decision path on CPU tensors (FUSED_DEVICE_TYPES widened): the real kernel passes
    its own self-check, and the decision names it."""
    saved = rope.FUSED_DEVICE_TYPES
    rope.FUSED_DEVICE_TYPES = ("cuda", "cpu")
    rope.reset()
    t0 = time.time()
    try:
        line = rope.describe("cpu", dtype)
    except KernelSelfCheckError as e:  # reported, so that the other cases still report theirs
        line = f"{type(e).__name__}: {e}"
    try:
        return {"describe": line, "secs": round(time.time() - t0, 2),
                "verdict": rope._VERDICTS.get(("cpu", dtype)) is True}
    finally:
        rope.FUSED_DEVICE_TYPES = saved
        rope.reset()


def main() -> dict:
    out: dict = {}
    # fp32: the reference and Megatron's unfused bshd; R < D (pass-through), B = 2, 5 heads (the
    # interpreter's head block is 4: a ragged one), odd S, freqs with more rows than S, angles of
    # positions near 30000 (large arguments to cos / sin)
    for inter in (False, True):
        name = "interleaved" if inter else "halves"
        out[f"fp32_{name}_r16_d24"] = bshd_case(15, 2, 5, 24, 16, interleaved=inter, rows=19, start=30000.0,
                                                megatron=True, seed=1 + inter)
        out[f"fp32_{name}_full_d32"] = bshd_case(9, 2, 3, 32, 32, interleaved=inter, megatron=True, seed=3 + inter)
        out[f"bf16_{name}_r16_d24"] = bshd_case(11, 2, 5, 24, 16, torch.bfloat16, inter, rows=14, seed=5 + inter)
        out[f"strided_split_{name}"] = strided_case(9, 2, 5, 16, 12, inter, seed=int(inter))
    out["fp16_halves_d20"] = bshd_case(11, 1, 5, 20, 20, torch.float16, rows=12, seed=7)
    out["strided_gqa_split"] = strided_case(13, 2, 4, 16, 16, False, seed=2, gqa=True)
    out["empty_s0"] = bshd_case(0, 2, 3, 16, 16, seed=8)
    # thd: uneven documents, each divisible by 2 * cp_size (Megatron's requirement)
    out["thd_cp1"] = thd_case([5, 13, 1, 30], 1, 3, 24, 16, seed=0)
    out["thd_cp1_interleaved"] = thd_case([7, 2, 11], 1, 3, 16, 16, interleaved=True, seed=1)
    out["thd_cp2"] = thd_case([8, 20, 4], 2, 3, 24, 16, seed=2)
    out["thd_cp3"] = thd_case([12, 30, 6], 3, 3, 16, 16, seed=3)
    out["thd_cp2_interleaved"] = thd_case([4, 12], 2, 2, 16, 8, interleaved=True, seed=4)
    out["self_check_fp32"] = self_check_case(torch.float32)
    out["self_check_bf16"] = self_check_case(torch.bfloat16)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))


def compile_for_gpu(dtype: torch.dtype = torch.bfloat16, H: int = 32, D: int = 128, R: int = 128,
                    interleaved: bool = False, backward: bool = False, capability: int = 90) -> dict:
    """The kernel compiled ahead of time for a CUDA GPU of ``capability`` without one, with the
    wrapper's GPU launch options for H heads of head dim D (pointers and strides declared
    16-divisible, as Triton specializes a real launch): the compiled stages, shared memory, and
    from the PTX / LLVM IR the global load / store instructions, approximate trig instructions
    and the libdevice functions called."""
    import re
    from collections import Counter

    from triton_masked_cases import aot_compile

    opts = rope.launch_options(H, D, interpret=False)
    warps = opts.pop("num_warps")
    opts.update(R=R, D=D, INTERLEAVED=interleaved, BACKWARD=backward)
    elem = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    compiled = aot_compile(rope._kernel(), opts, {"X": elem, "F": "fp32", "Y": elem},
                           {"num_warps": warps, "num_stages": 1}, capability)
    ptx, llir = compiled.asm.get("ptx", ""), compiled.asm.get("llir", "")
    return {"stages": sorted(compiled.asm), "shared": compiled.metadata.shared, "num_warps": warps,
            "BLOCK_H": opts["BLOCK_H"], "BLOCK_D": opts["BLOCK_D"],
            "memory_ops": dict(Counter(re.findall(r"\b((?:ld|st)\.global[.\w]*)", ptx))),
            "approx_trig": len(re.findall(r"\b(?:sin|cos)\.approx", ptx)),
            "libdevice": sorted(set(re.findall(r"__nv_(?:sin|cos)f\b", llir)))}
