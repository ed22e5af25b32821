"""Local block attention kernels behind one interface, chosen at run time, plus the lse merge.

Backends (see each module): ``reference`` (naive, tests only), ``tiled`` (plain torch, any device),
``cpu_flash`` (torch's fused CPU op), ``cuda_flash`` (torch's fused CUDA op, fp16/bf16).

Default choice, measured on this project's CPU machine (``python -m megatron_burst.bench kernels``):
the CPU flash op is ~2x faster than the tiled kernel in fp32, forward and backward; in bf16 its
forward is still faster but its backward is ~4x slower (and rounds in bf16), so bf16 backward uses
the tiled kernel. Override with MEGATRON_BURST_KERNEL=<name> (both directions) for experiments.

A fused GPU backend is used only after it has checked itself on the device: the first time it would
be chosen for a (device, dtype), a small causal and full block runs through it and through the
reference, forward and backward; on any mismatch or error it is dropped for that (device, dtype)
with a warning and the tiled kernel is used instead.

Sparse blocks (vertical-slash plans) have their own pair, chosen by :func:`select_sparse`:
``block_sparse`` (plain torch) and ``triton_block_sparse`` (Triton, the CUDA default once it has
checked itself against block_sparse the same way); $MEGATRON_BURST_SPARSE_KERNEL=torch|triton forces one.
"""
from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Optional

import torch

from megatron_burst.kernels import (block_sparse, cpu_flash, cuda_flash, reference, row_gather, tiled,
                                    triton_block_sparse)
from megatron_burst.layout import BlockMask

BACKENDS: dict[str, ModuleType] = {
    "reference": reference, "tiled": tiled, "cpu_flash": cpu_flash, "cuda_flash": cuda_flash,
}


_VERIFIED: dict[tuple, bool] = {}


def verify(impl: ModuleType, device: torch.device, dtype: torch.dtype, tol: float = 3e-2) -> bool:
    """Check ``impl`` against the reference on a small GQA block (causal and full, fwd and bwd).

    Errors are measured relative to the reference's largest magnitude; ``tol`` allows for bf16.
    """
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn(1, h, 64, 64, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = mk(4), mk(2), mk(2), mk(4)
    try:
        for kind in ("causal", "full"):
            ref_out, ref_lse = reference.forward(q, k, v, kind, 1, 0.125)
            D = (do.float() * ref_out.float()).sum(-1)
            ref = (ref_out, ref_lse) + reference.backward(do, q, k, v, D, ref_lse, kind, 1, 0.125)
            out, lse = impl.forward(q, k, v, kind, 1, 0.125)
            got = (out, lse) + tuple(impl.backward(do, q, k, v, D, ref_lse, kind, 1, 0.125))
            for a, b in zip(got, ref):
                if a.shape != b.shape:
                    return False
                if (a.float() - b.float()).abs().max() > tol * b.float().abs().max().clamp_min(1.0):
                    return False
    except Exception:  # an op missing or with another signature in this torch build
        return False
    return True


def _fused_gpu_ok(impl: ModuleType, q: torch.Tensor, check=None, fallback: str = "tiled") -> bool:
    """Whether ``impl`` passed its one-time self-check (``check(device, dtype)``, default :func:`verify`)."""
    key = (impl.__name__, q.device, q.dtype)
    if key not in _VERIFIED:
        _VERIFIED[key] = check(q.device, q.dtype) if check is not None else verify(impl, q.device, q.dtype)
        if not _VERIFIED[key]:
            warnings.warn(f"megatron-burst: the {impl.__name__.rsplit('.', 1)[-1]} attention kernel failed its "
                          f"self-check on {q.device} / {q.dtype}; using the {fallback} kernel there instead")
    return _VERIFIED[key]


SPARSE_BACKENDS: dict[str, ModuleType] = {"torch": block_sparse, "triton": triton_block_sparse}


def select_sparse(q: torch.Tensor) -> ModuleType:
    """The block-sparse kernel: $MEGATRON_BURST_SPARSE_KERNEL if set, else Triton on CUDA when it is
    installed and passed its self-check on (device, dtype), else the plain-torch block_sparse."""
    name = os.environ.get("MEGATRON_BURST_SPARSE_KERNEL") or None
    if name is not None:
        if name not in SPARSE_BACKENDS:
            raise ValueError(f"MEGATRON_BURST_SPARSE_KERNEL={name!r}: choose one of {', '.join(SPARSE_BACKENDS)}")
        return SPARSE_BACKENDS[name]
    if q.is_cuda and triton_block_sparse.AVAILABLE and _fused_gpu_ok(
            triton_block_sparse, q, triton_block_sparse.verify, "block_sparse"):
        return triton_block_sparse
    return block_sparse


def select(q: torch.Tensor, kind: str, direction: str, name: Optional[str] = None,
           k: Optional[torch.Tensor] = None) -> ModuleType:
    """The backend for a block: ``name`` (or $MEGATRON_BURST_KERNEL) if given, else the measured default."""
    name = name or os.environ.get("MEGATRON_BURST_KERNEL") or None
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"unknown attention kernel {name!r}: choose one of {', '.join(BACKENDS)}")
        return BACKENDS[name]
    if q.is_cuda:
        usable = cuda_flash.supports(q, q if k is None else k, kind) and _fused_gpu_ok(cuda_flash, q)
        return cuda_flash if usable else tiled
    if q.device.type == "cpu":
        if direction == "forward" or q.dtype == torch.float32:
            return cpu_flash
    return tiled


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float,
                  kernel: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the visible rectangle of a block. q [b, hq, n, d], k/v [b, hkv, m, d].

    Returns (out [b, hq, q_rows, d], lse [b, hq, q_rows]) for rows ``mask.q_slice``, both fp32 (fp64
    for fp64 inputs): block outputs reach the merge unrounded, except from ``cuda_flash``, whose
    kernel only writes its input dtype.
    """
    qs, ks, vs = q[:, :, mask.q_slice], k[:, :, mask.kv_slice], v[:, :, mask.kv_slice]
    impl = _data_kernel(mask.kind, qs) or select(qs, mask.kind, "forward", kernel, ks)
    return impl.forward(qs, ks, vs, mask.kind, mask.block, scale, **_mask_data(mask))


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: torch.Tensor,
                   lse: torch.Tensor, mask: BlockMask, scale: float, kernel: Optional[str] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the visible rectangle: (dq [b,hq,q_rows,d], dk, dv [b,hkv,kv_rows,d]).

    D = rowsum(dout * out) [b, hq, n] and lse [b, hq, n] are for the whole q block (fp32).
    """
    qsl, ksl = mask.q_slice, mask.kv_slice
    qs, ks = q[:, :, qsl], k[:, :, ksl]
    impl = _data_kernel(mask.kind, qs) or select(qs, mask.kind, "backward", kernel, ks)
    return impl.backward(dout[:, :, qsl], qs, ks, v[:, :, ksl], D[:, :, qsl], lse[:, :, qsl], mask.kind,
                         mask.block, scale, **_mask_data(mask))


# mask kinds that carry a sparse plan, and the kernel that reads it
_DATA_KERNELS: dict[str, ModuleType] = {"sparse": block_sparse, "gather": row_gather}


def _data_kernel(kind: str, q: torch.Tensor) -> Optional[ModuleType]:
    """The kernel of a data-carrying mask kind (None for other kinds); sparse tiles: :func:`select_sparse`."""
    return select_sparse(q) if kind == "sparse" else _DATA_KERNELS.get(kind)


def _mask_data(mask: BlockMask) -> dict:
    """Extra kernel arguments of data-carrying mask kinds ("positions": positions and document ids)."""
    if mask.kind in _DATA_KERNELS:
        return {"plan": mask.plan}
    return {"positions": mask.mask_data} if mask.kind == "positions" else {}


def row_dot(a: torch.Tensor, b: torch.Tensor, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """rowsum(a * b) over the last dim, accumulated in fp32 (fp64 for fp64): [..., n, d] x2 -> [..., n].

    D = rowsum(dO * O) of the attention backward. Computed over chunks of rows, so at most one
    chunk of the fp32 copies exists at a time (not two full fp32 copies of dO and O); any strides.
    """
    acc_dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    out = torch.empty(a.shape[:-1], dtype=acc_dtype, device=a.device)
    n, d = a.shape[-2], a.shape[-1]
    per_row = max(1, a.numel() // max(n, 1))
    rows = max(1, chunk_elems // per_row)
    for i in range(0, n, rows):
        sl = slice(i, min(i + rows, n))
        out[..., sl] = (a[..., sl, :].to(acc_dtype) * b[..., sl, :].to(acc_dtype)).sum(-1)
    return out


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
    ref = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)  # -inf + -inf: weights 0, not NaN
    out_acc.mul_(torch.exp(lse_acc - ref)[..., None])
    out_acc.add_(out_blk.float() * torch.exp(lse_blk - ref)[..., None])
    lse_acc.copy_(new_lse)
