"""Fused rotary position embedding (RoPE): one Triton kernel for forward and backward on GPU, a
plain-torch reference elsewhere; the ``sbhd`` and packed ``thd`` layouts Megatron-Core uses.

Megatron-Core without TransformerEngine applies RoPE unfused
(``rope_utils._apply_rotary_pos_emb_bshd``: about six elementwise kernels per call, each reading
and writing the whole tensor); with ``apply_rope_fusion`` it calls TE's
``fused_apply_rotary_pos_emb`` / ``fused_apply_rotary_pos_emb_thd``. :func:`apply_rope` and
:func:`apply_rope_thd` compute what those compute, in one kernel per direction.

Semantics (``t`` [S, B, H, D], ``freqs`` [S_f >= S, 1, 1, R], R even, R <= D; row s of freqs is
position s)::

    y[..., :R] = x * cos(f) + rotate(x) * sin(f)      x = t[..., :R], f = freqs[s], fp32 math
    y[..., R:] = t[..., R:]                           (passed through unchanged)

with ``rotate`` Megatron's ``_rotate_half``: non-interleaved ``[-x[R/2:], x[:R/2]]``,
interleaved ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``. The result is rounded once to
``t.dtype`` (Megatron's unfused path rounds cos / sin to t's dtype first; in fp32 the two agree).

Which implementation runs (:func:`describe` says it in words):

* CUDA tensors, triton installed, fp16 / bf16 / fp32: the Triton kernel ``triton_rope``, after a
  self-check against :func:`rope_reference` on that device and dtype (once per process, forward
  and backward, both layouts of the rotation, pass-through columns, positions near 30000). A
  failure (an exception, or results off the reference) raises
  :class:`~megatron_burst.kernels.choice.KernelSelfCheckError` naming the kernel, device, dtype
  and the original exception; it is remembered and raised again on every later call. Never a
  silent fallback: ``MEGATRON_BURST_ALLOW_SLOW_KERNELS=1`` (read by
  :meth:`~megatron_burst.kernels.choice.KernelPolicy.from_env`) turns the failure, and a missing
  triton, into a one-time :class:`~megatron_burst.kernels.choice.SlowKernelWarning` and runs the
  reference.
* CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported):
  the same Triton path (that is how CI tests the kernel), without the self-check.
* Otherwise (CPU; float64 anywhere): :func:`rope_reference`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch
from torch import Tensor

from megatron_burst.kernels import triton_env
from megatron_burst.kernels import choice as kernel_choice
from megatron_burst.kernels.choice import KernelPolicy, KernelSelfCheckError, SlowKernelError, remembered

__all__ = ["rope_reference", "apply_rope", "apply_rope_thd", "thd_positions", "describe", "KERNEL_NAME",
           "KERNEL_DTYPES"]

logger = logging.getLogger("megatron_burst.fusions")

KERNEL_NAME = "triton_rope"
# dtypes the kernel covers (it computes in fp32; float64 runs the reference, in float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# device types whose tensors run the self-checked Triton kernel. The one seam tests widen (to
# ("cuda", "cpu")) to exercise the CUDA decision path on CPU tensors.
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)

# Elements (heads x padded head dim) per program on GPU: 2048-4096 keep each thread at 8-16
# values (16-byte vector loads) while a row's cos / sin are computed once for all its heads.
GPU_BLOCK_ELEMENTS = 4096
# Under the interpreter: 4 heads per program (few programs: it runs them one by one), so 5-head
# tests cover a ragged head block.
INTERPRET_BLOCK_H = 4


# ---------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------
def _rotate(x: Tensor, interleaved: bool) -> Tensor:
    """Megatron's ``_rotate_half`` on the last dim of ``x`` [..., R]: [-x2, x1] (halves), or
    (x0, x1, ...) -> (-x1, x0, ...) (interleaved pairs)."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE in plain torch: the definition, differentiable through autograd (also the CPU path).

    t: [S, B, H, D] (sbhd), any strides; freqs: [S_f >= S, 1, 1, R] (rows 0..S-1 used), R even,
    R <= D. Returns [S, B, H, D] in t's dtype: the first R columns ``x cos f + rotate(x) sin f``
    computed in fp32 (float64 for float64 t) and rounded once, columns R.. passed through.
    """
    _validate(t, freqs)
    return _reference(t, freqs, interleaved)


def _reference(t: Tensor, freqs: Tensor, interleaved: bool) -> Tensor:
    """:func:`rope_reference` on validated inputs."""
    S, R = t.shape[0], freqs.shape[-1]
    math_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    f = freqs[:S].to(math_dtype)
    x = t[..., :R].to(math_dtype)
    rotated = x * torch.cos(f) + _rotate(x, interleaved) * torch.sin(f)
    return torch.cat((rotated.to(t.dtype), t[..., R:]), dim=-1)


def _validate(t: Tensor, freqs: Tensor, rows: bool = True) -> None:
    """Raise ValueError naming the shapes and the fix unless t / freqs are a valid RoPE call
    (``rows``: freqs needs a row per position of t; the thd path checks its positions itself)."""
    if t.dim() != 4:
        raise ValueError(f"RoPE: t has shape {tuple(t.shape)}; it needs 4 dims [S, B, H, D] (sbhd). For packed "
                         "sequences [T, H, D] use apply_rope_thd, or t.unsqueeze(1)")
    if not t.is_floating_point():
        raise ValueError(f"RoPE: t has dtype {t.dtype}; it needs a floating dtype")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"RoPE: freqs has shape {tuple(freqs.shape)}; it needs [S_f, 1, 1, R] (one row of angles "
                         "per position, shared by the batch and the heads), e.g. freqs.view(S_f, 1, 1, R)")
    if not freqs.is_floating_point():
        raise ValueError(f"RoPE: freqs has dtype {freqs.dtype}; it needs a floating dtype (the angles, e.g. "
                         "float32 position * inverse frequency)")
    S, D = t.shape[0], t.shape[-1]
    S_f, R = freqs.shape[0], freqs.shape[-1]
    if rows and S_f < S:
        raise ValueError(f"RoPE: freqs has {S_f} rows (shape {tuple(freqs.shape)}) for t of shape {tuple(t.shape)}, "
                         f"{S} positions; pass at least one row per position")
    if R % 2 or R == 0:
        raise ValueError(f"RoPE: freqs has rotary dim {R} (shape {tuple(freqs.shape)}); it needs an even, positive "
                         "rotary dim (columns are rotated in pairs)")
    if R > D:
        raise ValueError(f"RoPE: rotary dim {R} (freqs {tuple(freqs.shape)}) exceeds the head dim {D} of t "
                         f"{tuple(t.shape)}; pass freqs[..., :{D}] or a t with head dim >= {R}")
    if freqs.device != t.device:
        raise ValueError(f"RoPE: freqs is on {freqs.device}, t on {t.device}; move freqs to {t.device}")


# ---------------------------------------------------------------------------------------------
# the Triton kernel
# ---------------------------------------------------------------------------------------------
_jitted: dict[bool, Any] = {}


def _kernel() -> Any:
    """The jitted kernel, decorated on first use (after TRITON_INTERPRET is settled)."""
    if not triton_env.AVAILABLE:
        raise RuntimeError(f"the {KERNEL_NAME} kernel needs the triton package: pip install triton")
    import triton

    from megatron_burst.fusions import _rope_triton_src

    mode = triton_env.interpreting()
    if mode not in _jitted:
        _jitted[mode] = triton.jit(_rope_triton_src.rope_kernel)
    return _jitted[mode]


def launch_options(H: int, D: int, interpret: bool) -> dict:
    """Block sizes (and num_warps on GPU) of a launch over H heads of head dim D."""
    block_d = 1 << max(0, (D - 1).bit_length())
    heads_pow2 = 1 << max(0, (H - 1).bit_length())
    if interpret:
        return {"BLOCK_D": block_d, "BLOCK_H": min(INTERPRET_BLOCK_H, heads_pow2)}
    block_h = max(1, min(heads_pow2, GPU_BLOCK_ELEMENTS // block_d))
    return {"BLOCK_D": block_d, "BLOCK_H": block_h, "num_warps": max(1, min(8, block_h * block_d // 512))}


def _launch(x: Tensor, freqs: Tensor, interleaved: bool, backward: bool) -> Tensor:
    """Run the kernel over x [S, B, H, D] (unit last-dim stride enforced here) with freqs
    [S_f >= S, 1, 1, R]; returns a contiguous [S, B, H, D] tensor in x's dtype: RoPE of x
    (``backward=False``), or the gradient of t given dy = x (``backward=True``)."""
    S, B, H, D = x.shape
    R = freqs.shape[-1]
    y = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    f = freqs.reshape(freqs.shape[0], R)  # a view for Megatron's [S_f, 1, 1, R] freqs
    if f.stride(-1) != 1:
        f = f.contiguous()
    interpret = triton_env.interpreting()
    opts = launch_options(H, D, interpret)
    warps = {} if interpret else {"num_warps": opts.pop("num_warps")}
    grid = (S * B, -(-H // opts["BLOCK_H"]))
    # R and D are constexprs (one compile per model's head / rotary dim): the masks and partner
    # columns they define are then known at compile time and the loads vectorize
    # Triton launches on the current CUDA device: make it x's (a no-op context on CPU)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[grid](x, f, y, B, H, x.stride(0), x.stride(1), x.stride(2), f.stride(0), R=R, D=D,
                        INTERLEAVED=bool(interleaved), BACKWARD=bool(backward), **opts, **warps)
    return y


class _RopeFunction(torch.autograd.Function):
    """The Triton kernel forward and backward (freqs gets no gradient)."""

    @staticmethod
    def forward(ctx, t: Tensor, freqs: Tensor, interleaved: bool) -> Tensor:  # noqa: D102
        ctx.save_for_backward(freqs)
        ctx.interleaved = interleaved
        return _launch(t, freqs, interleaved, backward=False)

    @staticmethod
    def backward(ctx, dy: Tensor):  # noqa: D102
        (freqs,) = ctx.saved_tensors
        return _launch(dy, freqs, ctx.interleaved, backward=True), None, None


# ---------------------------------------------------------------------------------------------
# which implementation runs
# ---------------------------------------------------------------------------------------------
_TRITON, _REFERENCE = "triton", "reference"
# (device, dtype) -> True, or the KernelSelfCheckError its self-check raised
_VERDICTS: dict[tuple[str, torch.dtype], object] = {}
# (device, dtype, path) -> the description logged
_LOGGED: dict[tuple[str, torch.dtype], str] = {}


def _fix_hint() -> str:
    return (f"Report it with your torch and triton versions (torch {torch.__version__}); to train anyway on the "
            "unfused torch RoPE (several times slower), set MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 (it warns once)")


def _choose(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(path, why) for tensors on ``device`` in ``dtype``: path "triton" or "reference"."""
    if dtype not in KERNEL_DTYPES:
        return _REFERENCE, f"{str(dtype).replace('torch.', '')}: the kernel covers fp16 / bf16 / fp32"
    if device.type in FUSED_DEVICE_TYPES:
        # the policy (environment) is read only on the way to a fallback: a passed self-check is a
        # dictionary lookup per call
        if not triton_env.AVAILABLE:
            message = (f"megatron-burst: the {KERNEL_NAME} RoPE kernel cannot run on {device} / {dtype}: triton is "
                       "not installed. Fix: pip install triton")
            if not KernelPolicy.from_env().allow_slow:
                raise SlowKernelError(message + ", or set MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 to run the unfused "
                                                "torch RoPE with a warning")
            kernel_choice._warn_once(("no-triton", "rope", device.type, dtype),
                       message + " -- MEGATRON_BURST_ALLOW_SLOW_KERNELS=1, so the torch reference runs instead")
            return _REFERENCE, "slow fallback: triton is not installed"
        try:
            remembered(_VERDICTS, (str(device), dtype), lambda: self_check(device, dtype), KernelSelfCheckError)
        except KernelSelfCheckError as e:
            if not KernelPolicy.from_env().allow_slow:
                raise
            kernel_choice._warn_once(("failed", "rope", str(device), dtype),
                       f"megatron-burst: {e} -- MEGATRON_BURST_ALLOW_SLOW_KERNELS=1, so the torch reference runs "
                       "instead")
            return _REFERENCE, f"slow fallback: {KERNEL_NAME} failed its self-check"
        return _TRITON, ""
    if device.type == "cpu" and triton_env.AVAILABLE and triton_env.interpreting():
        return _TRITON, "Triton's CPU interpreter"
    return _REFERENCE, ""


def describe(device: torch.device | str, dtype: torch.dtype) -> str:
    """What RoPE runs for tensors on ``device`` in ``dtype``, as a log line, e.g.
    "rope on cuda bfloat16: triton_rope" or "rope on cpu float32: torch reference". On CUDA this
    makes the decision (the self-check runs once; a failure raises as in :func:`apply_rope`)."""
    device = torch.device(device)
    path, why = _choose(device, dtype)
    name = KERNEL_NAME if path == _TRITON else "torch reference"
    return f"rope on {device.type} {str(dtype).replace('torch.', '')}: {name}" + (f" ({why})" if why else "")


def _log_once(device: torch.device, dtype: torch.dtype, path: str, why: str) -> None:
    key = (str(device), dtype)
    if _LOGGED.get(key) != path:
        _LOGGED[key] = path
        name = KERNEL_NAME if path == _TRITON else "torch reference"
        logger.info("megatron-burst: rope on %s %s: %s%s", device.type, str(dtype).replace("torch.", ""), name,
                    f" ({why})" if why else "")


# The self-check's problems: S odd, 2 sequences, heads not a multiple of any head block, a head dim
# that is not a power of two with pass-through columns (R < D), and one with R == D; positions
# near 30000 (long-context angles: the kernel's cos / sin must reduce large arguments as exactly
# as torch does). freqs has more rows than S, as Megatron's do.
SELF_CHECK_CASES = ({"S": 13, "B": 2, "H": 5, "D": 24, "R": 16}, {"S": 7, "B": 1, "H": 3, "D": 32, "R": 32})
SELF_CHECK_POSITION = 30000
# relative to max |reference| (at least 1): fp32 math in both, so fp32 differs by a few fp32 ulps
# of the angle-reduced products; 16-bit by one rounding of the output (2^-8 bf16, 2^-11 fp16).
# A wrong sign or partner is off by O(1).
SELF_CHECK_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _self_check_inputs(case: dict, device: torch.device, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    S, B, H, D, R = (case[k] for k in ("S", "B", "H", "D", "R"))
    t = torch.randn(S, B, H, D, generator=g)
    dy = torch.randn(S, B, H, D, generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    pos = torch.arange(S + 3, dtype=torch.float32) + SELF_CHECK_POSITION
    freqs = torch.outer(pos, inv).repeat_interleave(2, dim=-1)  # any angles: pairs need not share theirs
    freqs = freqs + 0.1 * torch.randn(freqs.shape, generator=g)
    return (t.to(device=device, dtype=dtype), dy.to(device=device, dtype=dtype),
            freqs.view(S + 3, 1, 1, R).to(device))


def _compare(what: str, got: Tensor, ref: Tensor, tol: float) -> Optional[str]:
    if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
        return f"{what} is {tuple(got.shape)} {got.dtype}, the reference {tuple(ref.shape)} {ref.dtype}"
    g, r = got.float(), ref.float()
    if not bool(torch.isfinite(g).all()):
        return f"{what} has non-finite values (the reference has none)"
    err = (g - r).abs().max().item()
    bound = tol * max(1.0, r.abs().max().item())
    if not err <= bound:
        return f"{what} is off the torch reference by {err:.3g} (allowed {bound:.3g})"
    return None


def self_check(device: torch.device, dtype: torch.dtype) -> None:
    """Run the Triton kernel against :func:`rope_reference` on ``device`` in ``dtype``: forward and
    backward (through the autograd function), both rotation layouts, pass-through columns; raise
    KernelSelfCheckError naming the kernel, device, dtype and what failed (the exception chained)."""
    label = f"the {KERNEL_NAME} RoPE kernel on {device} / {dtype}"
    tol = SELF_CHECK_TOL[dtype]
    for i, case in enumerate(SELF_CHECK_CASES):
        t, dy, freqs = _self_check_inputs(case, device, dtype, seed=i)
        for interleaved in (False, True):
            where = f"({'interleaved' if interleaved else 'halves'}, t {tuple(t.shape)}, freqs {tuple(freqs.shape)})"
            try:
                with torch.enable_grad(), torch.autocast(device.type, enabled=False):
                    x = t.detach().clone().requires_grad_()
                    y = _RopeFunction.apply(x, freqs, interleaved)
                    y.backward(dy)
                    xr = t.detach().clone().requires_grad_()
                    yr = rope_reference(xr, freqs, interleaved)
                    yr.backward(dy)
            except Exception as e:  # surfaced, never swallowed: this is how a broken kernel or launch shows
                raise KernelSelfCheckError(f"{label} raised in its self-check {where}: {type(e).__name__}: {e}. "
                                           f"{_fix_hint()}") from e
            for what, got, want in (("forward", y, yr), ("backward (d t)", x.grad, xr.grad)):
                problem = _compare(what, got, want, tol)
                if problem:
                    raise KernelSelfCheckError(f"{label} failed its self-check {where}: {problem}. {_fix_hint()}")
            R = case["R"]
            if not torch.equal(y[..., R:], t[..., R:]):
                raise KernelSelfCheckError(f"{label} failed its self-check {where}: the columns past the rotary dim "
                                           f"{R} are not passed through unchanged. {_fix_hint()}")


def reset() -> None:
    """Forget every self-check verdict, warning and log line of this process (tests)."""
    _VERDICTS.clear()
    _LOGGED.clear()
    for key in [k for k in kernel_choice._WARNED if len(k) > 1 and k[1] == "rope"]:
        kernel_choice._WARNED.discard(key)


# ---------------------------------------------------------------------------------------------
# the public ops
# ---------------------------------------------------------------------------------------------
def apply_rope(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE of ``t`` [S, B, H, D] (sbhd, any strides) with ``freqs`` [S_f >= S, 1, 1, R] (rows
    0..S-1 used; R even, R <= D; any float dtype, fp32 as Megatron's): returns [S, B, H, D] in
    t's dtype, the first R columns rotated, the rest passed through. What Megatron's
    ``_apply_rotary_pos_emb_bshd(t, freqs[:S], interleaved)`` and TE's
    ``fused_apply_rotary_pos_emb(t, freqs, interleaved=...)`` compute. Differentiable in t
    (freqs gets no gradient on the Triton path). See the module docstring for which
    implementation runs."""
    _validate(t, freqs)
    path, why = _choose(t.device, t.dtype)
    _log_once(t.device, t.dtype, path, why)
    if path == _TRITON:
        return _RopeFunction.apply(t, freqs, bool(interleaved))
    return _reference(t, freqs, interleaved)


def thd_positions(cu_seqlens: Tensor, total: int, cp_size: int = 1, cp_rank: int = 0) -> Tensor:
    """The position (freqs row) of each of this rank's ``total`` packed tokens, on cu_seqlens'
    device, without a host synchronization: int64 [total].

    cu_seqlens: [n + 1] int, cumulative GLOBAL (context-parallel padded) sequence lengths; this
    rank holds L_i = (cu[i+1] - cu[i]) // cp_size tokens of sequence i, packed in order (their
    sum must be ``total``). cp_size == 1: positions 0..L_i-1. cp_size > 1: the rank's two zigzag
    halves of seg = L_i // 2 tokens, ``cp_rank * seg + r`` for r < seg, else
    ``L_i * cp_size - (cp_rank + 1) * seg + (r - seg)`` -- Megatron's
    ``_get_thd_freqs_on_this_cp_rank`` with offset 0, and TE's fused THD RoPE.
    """
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    local = (cu[1:] - cu[:-1]) // cp_size  # [n]
    starts = torch.cumsum(local, 0) - local  # where each sequence's tokens begin in t
    seq = torch.repeat_interleave(torch.arange(local.numel(), device=device), local, output_size=total)  # [T]
    r = torch.arange(total, device=device) - starts[seq]  # index within this rank's part of the sequence
    if cp_size == 1:
        return r
    seg = (local // 2)[seq]
    second = local[seq] * cp_size - (cp_rank + 1) * seg + (r - seg)
    return torch.where(r < seg, cp_rank * seg + r, second)


def apply_rope_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int = 1, cp_rank: int = 0,
                   interleaved: bool = False) -> Tensor:
    """RoPE of packed sequences ``t`` [T, H, D] (thd) with ``freqs`` [S_f, 1, 1, R] (row p:
    position p; S_f above every position, i.e. at least the longest global sequence length):
    returns [T, H, D] in t's dtype.

    ``cu_seqlens`` [n + 1] int: cumulative global (CP-padded) sequence lengths; each token's
    position is :func:`thd_positions` (cp_size / cp_rank: the context-parallel group; with
    cp_size > 1 every sequence length must be divisible by 2 * cp_size, as Megatron requires).
    What TE's ``fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_size, cp_rank)`` and
    Megatron's ``_apply_rotary_pos_emb_thd`` (freqs with a row count other than cu_seqlens[-1])
    compute. The positions are computed on the device (no host synchronization); the lengths are
    checked only when cu_seqlens is on the CPU (checking a device tensor would synchronize).
    """
    if t.dim() != 3:
        raise ValueError(f"RoPE thd: t has shape {tuple(t.shape)}; it needs 3 dims [T, H, D] (packed tokens). For "
                         "[S, B, H, D] use apply_rope")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"RoPE thd: cu_seqlens has shape {tuple(cu_seqlens.shape)} / {cu_seqlens.dtype}; it needs "
                         "1-D integer cumulative lengths [n + 1] starting at 0")
    if not (isinstance(cp_size, int) and cp_size >= 1 and isinstance(cp_rank, int) and 0 <= cp_rank < cp_size):
        raise ValueError(f"RoPE thd: cp_rank {cp_rank!r} / cp_size {cp_size!r}; need integers with "
                         "0 <= cp_rank < cp_size (the context-parallel group's rank and size)")
    _validate(t.unsqueeze(1), freqs, rows=False)
    T = t.shape[0]
    if cu_seqlens.device.type == "cpu":
        lengths = cu_seqlens[1:].long() - cu_seqlens[:-1].long()
        even = 2 * cp_size if cp_size > 1 else 1
        if bool((lengths < 0).any()) or bool((lengths % even).any()):
            raise ValueError(f"RoPE thd: sequence lengths {lengths.tolist()} (from cu_seqlens) must be non-negative"
                             + (f" and divisible by 2 * cp_size = {even} (pad each sequence)" if cp_size > 1 else ""))
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > freqs.shape[0]:
            raise ValueError(f"RoPE thd: the longest sequence has {longest} positions (cu_seqlens), freqs only "
                             f"{freqs.shape[0]} rows (shape {tuple(freqs.shape)}); pass freqs for at least {longest} "
                             "positions")
        held = int((lengths // cp_size).sum())
        if held != T:
            raise ValueError(f"RoPE thd: cu_seqlens gives this rank {held} tokens (global lengths "
                             f"{lengths.tolist()} // cp_size {cp_size}) but t has {T} (shape {tuple(t.shape)}); "
                             "pass this rank's packed tokens and the global cu_seqlens")
    positions = thd_positions(cu_seqlens.to(freqs.device), T, cp_size, cp_rank)
    rows = freqs.index_select(0, positions)  # [T, 1, 1, R]
    return apply_rope(t.unsqueeze(1), rows, interleaved).squeeze(1)
