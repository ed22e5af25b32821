"""Local block attention kernels behind one interface, chosen per mask kind, plus the lse merge.

Kernels (see each module): ``reference`` (naive, tests only), ``tiled`` (plain torch, any device),
``cpu_flash`` (torch's fused CPU op), ``cuda_flash`` and ``cudnn`` (torch's fused CUDA ops, 16-bit
"full"/"causal"), ``cuda_varlen`` (torch's varlen flash op, the "positions" blocks it expresses
exactly; ``varlen_or_triton`` routes each "positions" block to it or to Triton), ``triton_masked`` (Triton: every dense kind, masks as per-row/column data),
``block_sparse`` / ``triton_block_sparse`` (vertical-slash tiles) and ``row_gather`` (gathered
rows). Which one runs, and what happens when none fused fits, is :mod:`megatron_burst.kernels.choice`:
a CP call resolves a :class:`~megatron_burst.kernels.choice.KernelChoice` for the mask kinds it
can produce (self-checked, agreed by every rank, logged) and every block of the call uses it.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional, Union

import torch

from megatron_burst.kernels import (cpu_flash, cuda_flash, cuda_varlen, cudnn_sdpa, reference, tiled, triton_masked,
                                    varlen_dispatch)
from megatron_burst.kernels import choice as selection
from megatron_burst.kernels.rows import row_dot  # noqa: F401  (the package's face)
from megatron_burst.kernels.choice import (KernelChoice, KernelPolicy, KernelSelfCheckError, SlowKernelError,
                                           SlowKernelWarning, choose, report)
from megatron_burst.masks.block import BlockMask

BACKENDS: dict[str, ModuleType] = {
    "reference": reference, "tiled": tiled, "cpu_flash": cpu_flash, "cuda_flash": cuda_flash, "cudnn": cudnn_sdpa,
    "triton_masked": triton_masked, "cuda_varlen": cuda_varlen, "varlen_or_triton": varlen_dispatch,
}
_VERIFIED = selection._VERIFIED  # self-check verdicts, per process (test harnesses clear it)

# what a block may be told to run: a call's KernelChoice, a kernel name (forced), or None (choose now)
KernelSpec = Union[KernelChoice, str, None]


def select(q: torch.Tensor, kind: str, direction: str, name: Optional[str] = None,
           k: Optional[torch.Tensor] = None) -> ModuleType:
    """The kernel module for a ``kind`` block of q's (device, dtype, head dim) in ``direction``:
    ``name`` (or $MEGATRON_BURST_KERNEL) where it covers the kind, else the policy's choice."""
    choice = choose(q.device, q.dtype, q.shape[-1], (kind,), KernelPolicy.from_env(name))
    return selection.module(choice.get(kind, direction))


def select_sparse(q: torch.Tensor) -> ModuleType:
    """The kernel of vertical-slash tiles (``sparse`` blocks) for q's device and dtype."""
    return select(q, "sparse", "forward")


def _resolve(spec: KernelSpec, q: torch.Tensor, kind: str, direction: str) -> ModuleType:
    if isinstance(spec, KernelChoice):
        name = spec.get(kind, direction)
        if name is not None:
            return selection.module(name)
        spec = None  # a kind the call did not predict: chosen (and checked) now
    if isinstance(spec, str) and spec not in selection.DENSE_NAMES:
        raise ValueError(f"unknown attention kernel {spec!r}: choose one of {', '.join(selection.DENSE_NAMES)}")
    return select(q, kind, direction, spec)


def _square_causal_parts(mask: BlockMask) -> list[tuple[BlockMask, int]]:
    """A non-square causal rectangle as a square causal part and (when taller than wide) a full part
    below it, with each part's row offset in the rectangle: torch's fused ops align causal masks by
    their own convention when sq != sk; a square has only one."""
    rows, cols = mask.q_stop - mask.q_start, mask.kv_stop - mask.kv_start
    side = min(rows, cols)
    parts = [(BlockMask("causal", mask.q_start, mask.q_start + side, mask.kv_start, mask.kv_start + side), 0)]
    if rows > cols:
        parts.append((BlockMask("full", mask.q_start + side, mask.q_stop, mask.kv_start, mask.kv_stop), side))
    return parts


def _needs_square(impl: ModuleType, mask: BlockMask) -> bool:
    return (mask.kind == "causal" and getattr(impl, "SQUARE_CAUSAL_ONLY", False)
            and mask.q_stop - mask.q_start != mask.kv_stop - mask.kv_start)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float,
                  kernel: KernelSpec = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the visible rectangle of a block. q [b, hq, n, d], k/v [b, hkv, m, d].

    Returns (out [b, hq, q_rows, d], lse [b, hq, q_rows] fp32) for rows ``mask.q_slice``. ``out`` is
    fp32 (fp64 for fp64 inputs) from the plain and Triton kernels, and q's dtype from torch's fused
    CUDA ops (they write only their input dtype); the merge reads either.
    """
    qs = q[:, :, mask.q_slice]
    impl = _resolve(kernel, qs, mask.kind, "forward")
    if _needs_square(impl, mask):
        parts = [block_forward(q, k, v, part, scale, kernel) for part, _ in _square_causal_parts(mask)]
        return torch.cat([o for o, _ in parts], 2), torch.cat([l for _, l in parts], 2)
    ks, vs = mask.kv_of(k), mask.kv_of(v)
    return impl.forward(qs, ks, vs, mask.kind, mask.block, scale, **_mask_data(mask))


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: torch.Tensor,
                   lse: torch.Tensor, mask: BlockMask, scale: float, kernel: KernelSpec = None,
                   out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the visible rectangle: (dq [b,hq,q_rows,d], dk, dv [b,hkv,kv_rows,d]).

    D = rowsum(dout * out) [b, hq, n] and lse [b, hq, n] are for the whole q block (fp32). ``out``
    [b, hq, n, d]: the final output of these query rows when the caller holds it (kernels that read
    O, torch's fused ops, then skip building a stand-in from D; D may then be None, see
    :func:`reads_output`).
    """
    qsl = mask.q_slice
    qs = q[:, :, qsl]
    impl = _resolve(kernel, qs, mask.kind, "backward")
    if D is None and (out is None or not getattr(impl, "TAKES_OUT", False)):
        raise ValueError(f"block_backward got D=None, but the {impl.__name__.rsplit('.', 1)[-1]} kernel needs D "
                         "(or the final output, out=, if it reads it)")
    if _needs_square(impl, mask):
        dq, dk, dv = [], 0, 0
        for part, _ in _square_causal_parts(mask):
            g = block_backward(dout, q, k, v, D, lse, part, scale, kernel, out)
            kv_rows = part.kv_stop - part.kv_start
            dq.append(g[0])
            dk = dk + torch.nn.functional.pad(g[1].float(), (0, 0, 0, mask.kv_stop - mask.kv_start - kv_rows))
            dv = dv + torch.nn.functional.pad(g[2].float(), (0, 0, 0, mask.kv_stop - mask.kv_start - kv_rows))
        return torch.cat([t.float() for t in dq], 2), dk, dv
    extra = _mask_data(mask)
    if out is not None and getattr(impl, "TAKES_OUT", False):
        extra["out"] = out[:, :, qsl]
    return impl.backward(dout[:, :, qsl], qs, mask.kv_of(k), mask.kv_of(v), None if D is None else D[:, :, qsl],
                         lse[:, :, qsl], mask.kind, mask.block, scale, **extra)


def reads_output(q: torch.Tensor, kind: str, kernel: KernelSpec = None) -> bool:
    """Whether the backward kernel of ``kind`` blocks forms D from the output it is given (``out=``),
    so a caller holding the output may pass D=None."""
    return getattr(_resolve(kernel, q, kind, "backward"), "TAKES_OUT", False)


def _mask_data(mask: BlockMask) -> dict:
    """Extra kernel arguments of data-carrying mask kinds (sparse plans; positions and document ids)."""
    if mask.kind in ("sparse", "gather"):
        return {"plan": mask.plan}
    return {"positions": mask.mask_data} if mask.kind == "positions" else {}


def empty_accumulator(q: torch.Tensor, dv: int, out: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Running fp32 (out, lse) for q [b, h, n, d]'s rows before any block: out [b, h, n, dv] zeros
    (``out`` reused, zeroed, when given) and lse [b, h, n] -inf, what :func:`merge_into` folds into."""
    b, h, n, _ = q.shape
    if out is None:
        out = torch.zeros(b, h, n, dv, dtype=torch.float32, device=q.device)
    else:
        out.zero_()
    return out, torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Fold a partial result into running fp32 (out, lse), in place, stably.

    out_acc [b, h, r, d] fp32 and lse_acc [b, h, r] fp32 (may be -inf where nothing was seen yet);
    out_blk/lse_blk the block's normalized output and lse for the same rows (lse_blk may be -inf
    where a sparse block's row sees nothing; such a row's out_blk is 0).
    """
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    ref = new_lse.masked_fill(torch.isinf(new_lse), 0.0)  # -inf + -inf: weights 0, not NaN
    # two passes over the [.., r, d] rows (a scale in place, then one fused multiply-add reading the
    # block's output in its own dtype): no fp32 copy of out_blk, no temporary product
    out_acc.mul_(torch.exp(lse_acc - ref).unsqueeze(-1))
    if torch.promote_types(out_blk.dtype, out_acc.dtype) != out_acc.dtype:  # e.g. fp64 blocks into fp32
        out_blk = out_blk.to(out_acc.dtype)
    out_acc.addcmul_(out_blk, torch.exp(lse_blk - ref).unsqueeze(-1))
    lse_acc.copy_(new_lse)
