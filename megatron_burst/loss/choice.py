"""Which implementation ``impl="auto"`` runs, its one-time self-check on the device, and the log line.

* On CUDA with triton installed: the fast path (``"triton"``, :mod:`megatron_burst.loss.fast`),
  after a self-check against the fp32 reference on that device for that dtype (once per process,
  device and dtype; a remembered failure is raised again). The self-check runs the public op on
  a small problem (odd sizes, several chunks and vocabulary tiles, ignored labels, a loss mask),
  forward and both backward paths (scaled and recompute), and the weight gradient by vocabulary
  tiles (``weight_grad="backward"``), and compares the loss, d hidden and d weight with an fp32
  autograd computation. An exception raises :class:`LossSelfCheckError`
  naming the implementation, device and dtype, with the exception's text and the exception
  chained (``__cause__``); a result off the reference raises it naming the quantity, the error
  and the bound.
* ``MEGATRON_BURST_ALLOW_SLOW_KERNELS=1`` (the attention kernels' switch, read in one place:
  :meth:`megatron_burst.kernels.choice.KernelPolicy.from_env`): a failed self-check warns
  (:class:`~megatron_burst.kernels.choice.SlowKernelWarning`, once) and the torch path runs.
* On CUDA without triton: the torch path with a one-time SlowKernelWarning
  (``MEGATRON_BURST_ALLOW_SLOW_KERNELS=0``: an error).
* Elsewhere (CPU): the torch path (the Triton kernel runs on CPU only in the interpreter, for tests).

Every decision is logged once per (device, dtype, implementation) on
``logging.getLogger("megatron_burst.loss")`` (INFO; WARNING for a fallback).
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Callable, Optional

import torch

from megatron_burst.kernels.choice import (KernelPolicy, KernelSelfCheckError, SlowKernelError, SlowKernelWarning,
                                           remembered)
from megatron_burst.loss import triton_kernels
from megatron_burst.loss.autograd import FusedLossRecomputeWarning, backward_paths

__all__ = ["resolve_impl", "self_check", "LossSelfCheckError", "FAST_DEVICE_TYPES", "describe", "decisions"]

logger = logging.getLogger("megatron_burst.loss")

FAST_DEVICE_TYPES = ("cuda",)  # device types where "auto" runs the fast path (tests add "cpu" + interpreter)
FAST_NAME = "triton"
DESCRIPTION = {"triton": "triton (cuBLAS GEMMs + one fused Triton softmax-gradient pass per token chunk)",
               "torch": "torch (GEMMs + torch elementwise passes)",
               "triton_recompute": "triton_recompute (opt-in: logits recomputed on chip in Triton kernels, "
                                   "never stored)"}

# (device, dtype) -> True, or the LossSelfCheckError the self-check raised
_VERDICTS: dict[tuple[str, torch.dtype], object] = {}
_LOGGED: dict[tuple[str, torch.dtype], str] = {}
_WARNED: set = set()


class LossSelfCheckError(KernelSelfCheckError):
    """The fused loss's fast path failed its self-check on this device (an exception, or results off
    the fp32 reference). A :class:`~megatron_burst.kernels.choice.KernelSelfCheckError`."""


def describe(device: torch.device, dtype: torch.dtype, impl: str) -> str:
    return f"fused LM loss on {device} / {str(dtype).replace('torch.', '')}: {DESCRIPTION[impl]}"


def decisions() -> list[str]:
    """One line per (device, dtype) decided in this process so far (for banners and tests)."""
    return sorted(describe(torch.device(dev), dtype, impl) for (dev, dtype), impl in _LOGGED.items())


def _log_once(device: torch.device, dtype: torch.dtype, impl: str, level: int = logging.INFO) -> None:
    key = (str(device), dtype)
    if _LOGGED.get(key) != impl:
        _LOGGED[key] = impl
        logger.log(level, "megatron-burst: %s", describe(device, dtype, impl))


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, SlowKernelWarning, stacklevel=5)
        logger.warning(message)


def _fix_hint() -> str:
    return (f"Report it with your torch version ({torch.__version__}); to train anyway on the slower torch path, "
            "pass impl='torch' or set MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 (falls back with a warning)")


def resolve_impl(impl: str, hidden: torch.Tensor, loss_fn: Callable) -> str:
    """``impl`` as given ("torch" / "triton"), or what "auto" runs for hidden's device and dtype;
    ``loss_fn`` is the fused loss the self-check runs (megatron_burst.loss.fused_linear_cross_entropy,
    passed in so this module sits below it)."""
    if impl != "auto":
        return impl
    device, dtype = hidden.device, hidden.dtype
    if device.type not in FAST_DEVICE_TYPES:
        _log_once(device, dtype, "torch")
        return "torch"
    policy = KernelPolicy.from_env()
    if not triton_kernels.AVAILABLE:
        message = (f"megatron-burst: the fused LM loss on {device} / {dtype} runs its torch path, about 1.7x slower "
                   "than its Triton path (triton is not installed). Fix: pip install triton")
        if policy.allow_slow is False:
            raise SlowKernelError(message + " (MEGATRON_BURST_ALLOW_SLOW_KERNELS=0 makes this an error)")
        _warn_once(("no-triton", device.type, dtype), message)
        _log_once(device, dtype, "torch", logging.WARNING)
        return "torch"
    try:
        checked(device, dtype, loss_fn)
    except LossSelfCheckError as e:
        if not policy.allow_slow:
            raise
        _warn_once(("failed", str(device), dtype),
                   f"megatron-burst: {e} -- MEGATRON_BURST_ALLOW_SLOW_KERNELS=1, so the torch path runs instead")
        _log_once(device, dtype, "torch", logging.WARNING)
        return "torch"
    _log_once(device, dtype, FAST_NAME)
    return FAST_NAME


def checked(device: torch.device, dtype: torch.dtype, loss_fn: Callable) -> None:
    """Self-check the fast path once per (device, dtype); re-raise a remembered failure."""
    remembered(_VERDICTS, (str(device), dtype), lambda: self_check(device, dtype, loss_fn), LossSelfCheckError)


# Bounds relative to max |reference| (and at least 1 for the loss): bf16 carries one rounding of G
# and of the hidden gradient (2^-8 relative, summed over ~V / d terms); fp32 allows TF32 GEMMs if
# the caller enabled them. A wrong kernel (a missing term, a wrong max) is off by O(1).
SELF_CHECK_TOL = {torch.bfloat16: {"loss": 1e-3, "dh": 2e-2, "dw": 2e-2},
                  torch.float32: {"loss": 1e-3, "dh": 5e-3, "dw": 5e-3}}
# N tokens in chunks of T (a ragged last one), V vocabulary rows (more than one GPU tile of 4096, a
# ragged last tile), hidden size d. Under Triton's interpreter (CPU tests) its tiles are 16 wide.
# Vt: vocabulary rows per tile of the weight_grad="backward" pass (None: its default, 2048: three
# tiles at V = 5003), so that tiles after the first (their columns shifted in the kernel) are checked
SELF_CHECK_SHAPE = dict(N=200, V=5003, d=64, T=64, Vt=None)
INTERPRET_SELF_CHECK_SHAPE = dict(N=40, V=53, d=16, T=16, Vt=24)


def _shape() -> dict:
    return INTERPRET_SELF_CHECK_SHAPE if triton_kernels.interpreting() else SELF_CHECK_SHAPE


def _inputs(device: torch.device, dtype: torch.dtype):
    s = _shape()
    g = torch.Generator().manual_seed(20240611)
    hidden = torch.randn(s["N"], s["d"], generator=g)
    weight = torch.randn(s["V"], s["d"], generator=g) * (2.0 / math.sqrt(s["d"]))
    labels = torch.randint(0, s["V"], (s["N"],), generator=g)
    labels[torch.randperm(s["N"], generator=g)[:7]] = -100
    mask = (torch.rand(s["N"], generator=g) > 0.2).float() * (labels != -100)
    other = torch.randn(s["N"], generator=g)  # per-token weights not proportional to the mask
    to = dict(device=device)
    return (hidden.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), labels.to(**to),
            mask.to(**to), other.to(**to))


def _far_logits(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, weight) with a shared direction e added to every token (norm 30) and the last
    vocabulary row 4 e: each token's logit there lies ~3 REF_SPAN above the rest, every gradient row
    alike in size (so the max-relative comparison stays as tight for all of them)."""
    e = torch.zeros(hidden.shape[1], device=hidden.device)
    e[0] = 1.0
    far_w = weight.detach().clone()
    far_w[-1] = (4.0 * e).to(weight.dtype)
    lift = 3 * triton_kernels.REF_SPAN / 4.0
    return (hidden.float() + lift * e).to(hidden.dtype), far_w


def _compare(what: str, got: torch.Tensor, ref: torch.Tensor, tol: float, floor: float = 0.0) -> Optional[str]:
    g, r = got.float(), ref.float()
    if tuple(g.shape) != tuple(r.shape):
        return f"{what} has shape {tuple(g.shape)}, the reference {tuple(r.shape)}"
    if not bool(torch.isfinite(g).all()):
        return f"{what} has non-finite values (the reference has none)"
    err = (g - r).abs().max().item() if g.numel() else 0.0
    bound = tol * max(r.abs().max().item() if r.numel() else 0.0, floor)
    if not err <= bound:
        return f"{what} is off the fp32 reference by {err:.3g} (allowed {bound:.3g})"
    return None


def self_check(device: torch.device, dtype: torch.dtype, fused_linear_cross_entropy: Callable,
               impl: str = FAST_NAME) -> None:
    """Run the fast path (or ``impl``, e.g. the opt-in "triton_recompute", which "auto" never runs)
    of ``fused_linear_cross_entropy`` against the fp32 reference on ``device`` in ``dtype`` (scaled
    and recompute backward); raise LossSelfCheckError naming what failed (the exception chained)."""

    s = _shape()
    label = f"the fused LM loss implementation {impl!r} on {device} / {dtype}"
    tol = SELF_CHECK_TOL.get(dtype, SELF_CHECK_TOL[torch.bfloat16])
    hidden, weight, labels, mask, other = _inputs(device, dtype)
    valid = labels != -100
    paths = dict(backward_paths)  # the self-check's backward passes are not the caller's
    try:
        # weight_grad="backward": d weight by vocabulary tiles, the kernel writing G over its logits' rows;
        # its forward reads each logit once. Then the same with every token's logit against the last
        # vocabulary row far above its first tile's (the kernel walks each row again from its max).
        far_h, far_w = _far_logits(hidden, weight)
        for kind, r, weight_grad, ht, wt in (("scaled", mask / mask.sum(), "forward", hidden, weight),
                                             ("recompute", other, "forward", hidden, weight),
                                             ("scaled", mask / mask.sum(), "backward", hidden, weight),
                                             ("scaled, far logits", mask / mask.sum(), "backward", far_h, far_w)):
            where = (f"({kind} backward, weight_grad={weight_grad!r}, N={s['N']} V={s['V']} d={s['d']} in chunks "
                     f"of {s['T']})")
            try:
                with torch.enable_grad(), torch.autocast(device.type, enabled=False), warnings.catch_warnings():
                    warnings.simplefilter("ignore", FusedLossRecomputeWarning)
                    h = ht.detach().clone().requires_grad_()
                    w = wt.detach().clone().requires_grad_()
                    loss = fused_linear_cross_entropy(h, w, labels, loss_mask=mask, token_chunk=s["T"], impl=impl,
                                                      weight_grad=weight_grad, vocab_chunk=s["Vt"])
                    (loss * r).sum().backward()
                    h32 = ht.detach().float().requires_grad_()
                    w32 = wt.detach().float().requires_grad_()
                    ref = torch.nn.functional.cross_entropy(h32 @ w32.t(), labels, reduction="none")
                    (ref * r).sum().backward()
            except Exception as e:  # surfaced, never swallowed: this is how a broken kernel or op shows
                raise LossSelfCheckError(f"{label} raised in its self-check {where}: {type(e).__name__}: {e}. "
                                         f"{_fix_hint()}") from e
            for what, got, want, floor in (("loss", loss[valid], ref[valid], 1.0), ("d hidden", h.grad, h32.grad, 0.0),
                                           ("d weight", w.grad, w32.grad, 0.0)):
                key = {"loss": "loss", "d hidden": "dh", "d weight": "dw"}[what]
                problem = _compare(what, got, want, tol[key], floor)
                if problem:
                    raise LossSelfCheckError(f"{label} failed its self-check {where}: {problem}. {_fix_hint()}")
    finally:
        backward_paths.clear()
        backward_paths.update(paths)
