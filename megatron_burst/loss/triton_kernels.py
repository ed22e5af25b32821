"""The fused loss's Triton kernels, wrapped: per-token softmax statistics and the logits gradient of
one token chunk (``ce_rows``), the one-read forward's d hidden epilogue (``dh_rows``), and the
vocabulary pass's tile gradient, fused with its GEMM (``tile_grad``) or on a transposed tile
(``grad_cols``) (GPU; CPU via Triton's interpreter).
The algorithm is in :mod:`megatron_burst.loss.fast`.

:func:`ce_rows` runs ``ce_rows_kernel`` (source: :mod:`megatron_burst.loss._triton_src`) over the
rows of a chunk's fp32 logits ``z`` [T, V_local]: statistics (max, sum-exp, target logit), the
gradient ``G = w * (softmax - onehot)`` in G's dtype, or both in one launch (TP = 1: one program
per row reads it twice, statistics first).

Interpreter: Triton decides at decoration time whether a function is compiled or interpreted, and
its own library functions (``tl.zeros``, ...) are decorated when triton is first imported -- so
``TRITON_INTERPRET=1`` must be set before the process imports triton (megatron.core imports it).
The tests therefore run the interpreted kernel in a fresh subprocess. The kernel is wrapped on
first use, so this module itself may be imported before the variable is set.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import torch

AVAILABLE = importlib.util.find_spec("triton") is not None

# Logits per tile of a row walk. GPU: 4096 fp32 = 16 KiB per tile, 16 values per thread at 8
# warps (vectorized 16-byte loads); the interpreter walks small tiles so the tests cover several
# tiles per row and a ragged last one.
GPU_BLOCK_V = 4096
GPU_NUM_WARPS = 8
INTERPRET_BLOCK_V = 16
# ``unnormalized``: how far (natural-log units) a row's logits may rise above the reference (its
# first tile's max) before the row is walked again from its true max. exp(40) = 2.4e17: G's values,
# their fp32 sum over any vocabulary and the fp32 d hidden GEMM stay far inside fp32's range.
REF_SPAN = 40.0


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_jitted: dict[tuple[str, bool], Any] = {}


def _kernel(name: str = "ce_rows_kernel") -> Any:
    if not AVAILABLE:
        raise RuntimeError("impl='triton' needs the triton package: pip install triton")
    import triton

    from megatron_burst.loss import _triton_src

    key = (name, interpreting())
    if key not in _jitted:
        _jitted[key] = triton.jit(getattr(_triton_src, name))
    return _jitted[key]


def check_device(t: torch.Tensor) -> None:
    """Raise unless the kernel can run on ``t``'s device."""
    if not AVAILABLE:
        raise ValueError("impl='triton' needs the triton package (pip install triton); use impl='torch'")
    if not t.is_cuda and not interpreting():
        raise ValueError(f"impl='triton' needs CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 to run "
                         "the kernel in Triton's CPU interpreter, or use impl='torch'")


def _block_v(V: int) -> int:
    if interpreting():
        return INTERPRET_BLOCK_V
    return min(GPU_BLOCK_V, max(128, 1 << (V - 1).bit_length()))


def ce_rows(z: torch.Tensor, tgt: torch.Tensor, stats: torch.Tensor, *, grad: Optional[torch.Tensor] = None,
            wts: Optional[torch.Tensor] = None, compute_stats: bool = True, col0: int = 0,
            unnormalized: bool = False) -> None:
    """Softmax statistics and / or the weighted logits gradient of the rows of ``z``.

    z: [T, V] fp32 logits, unit column stride (any row stride); tgt: [T] int64 local target
    column, any value outside [0, V) meaning no target among these columns; ``col0``: subtracted from
    tgt first (a vocabulary tile's caller passes the shard's columns and the tile's start, so the
    kernel shifts them: no launch per tile for it; int32 or int64); stats: [3, T] fp32, each row with
    unit stride (a column slice of a [3, N] tensor works) -- written (max m, sum exp(z - m), target
    logit or 0) when ``compute_stats``, else read ([2, T] is enough then: the global m and s). ``grad``: [T, V] in
    the GEMM dtype, unit column stride (may be ``z`` itself for fp32, or for 16-bit the first half of
    each of z's rows: a view of z's storage whose row stride in bytes is z's): receives
    ``wts[t] * (exp(z - m) / s - [v == tgt[t]])``; ``wts``: [T] fp32. At least one of the two.

    ``unnormalized`` (the d-hidden-only forward; one read of z): ``grad`` (its own storage, not z's)
    receives ``exp(z - r_t)`` with a per-row reference r_t -- unweighted, 0 at the target's column and
    at the row's max's -- and stats, [5, T] here, receives (r, sum exp(z - r), target logit or 0,
    the row's max, its column as fp32). r_t is the row's first tile's max, or its true max where a
    later logit exceeds that by more than REF_SPAN; the caller turns G W into the gradient's product
    with W by a factor per row and adds the two columns' terms (see :mod:`megatron_burst.loss.fast`).
    """
    kernel = _kernel()
    T, V = z.shape
    if T == 0:
        return
    if z.stride(1) != 1 or (grad is not None and grad.stride(1) != 1) or (T > 1 and stats.stride(1) != 1):
        raise ValueError(f"ce_rows: z, grad and each row of stats need unit column stride (z {tuple(z.stride())}, "
                         f"grad {None if grad is None else tuple(grad.stride())}, stats {tuple(stats.stride())})")
    if grad is None and not compute_stats:
        raise ValueError("ce_rows: nothing to do (neither statistics nor a gradient asked for)")
    if unnormalized and (grad is None or wts is not None or not compute_stats or col0
                         or grad.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()):
        raise ValueError("ce_rows(unnormalized=True) writes statistics and exp(z - r) to a grad buffer of its own "
                         "(not z's storage; no wts, no col0): a row whose logits exceed r by more than REF_SPAN "
                         "is read again")
    if unnormalized and (stats.shape[0] < 5 or V >= 1 << 24):
        raise ValueError(f"ce_rows(unnormalized=True) needs stats of 5 rows (got {tuple(stats.shape)}) and fewer "
                         f"than 2^24 columns (got {V}: the max's column is stored as fp32)")
    g = z if grad is None else grad
    g_in_z = g.dtype != z.dtype and g.data_ptr() == z.data_ptr()
    if g_in_z and (T > 1 and g.stride(0) * g.element_size() != z.stride(0) * z.element_size()
                   or g.element_size() > z.element_size()):
        raise ValueError(f"ce_rows: a {g.dtype} grad in z's storage must lie in the first half of each of z's rows "
                         f"(row stride {z.stride(0) * z.element_size()} bytes); got row stride "
                         f"{g.stride(0) * g.element_size()} bytes")
    w = stats[0] if wts is None else wts  # unread without GRAD
    block = _block_v(V)
    kwargs = {} if interpreting() else {"num_warps": max(1, min(GPU_NUM_WARPS, block // 256))}
    top = stats[3:5] if unnormalized else stats[:2]  # unread outside unnormalized
    if compute_stats and stats.shape[0] < 3:
        raise ValueError(f"ce_rows: statistics are written to 3 rows (got stats of shape {tuple(stats.shape)})")
    z_tgt = stats[2] if compute_stats else stats[1]  # unwritten without STATS
    kernel[(T,)](z, g, tgt, w, stats[0], stats[1], z_tgt, top[0], top[1], V, col0, z.stride(0), g.stride(0),
                 BLOCK_V=block, STATS=compute_stats and not unnormalized, GRAD=grad is not None and not unnormalized,
                 G_IN_Z=g_in_z, UNNORM=unnormalized, REF_SPAN=float(REF_SPAN), **kwargs)


# d hidden columns per program of the epilogue: 1024 fp32 = 4 KiB of P per program, 4 warps
DH_BLOCK_D = 1024
INTERPRET_BLOCK_D = 16


def dh_rows(P: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, stats: torch.Tensor, tgt: torch.Tensor,
            labels: torch.Tensor, wdh: torch.Tensor, loss: torch.Tensor, m_all: torch.Tensor, s_all: torch.Tensor,
            ignore_index: int) -> None:
    """The one-read forward's epilogue at TP = 1 (one launch; ``dh_rows_kernel``'s docstring has the formula).

    P: [T, d] fp32, E W; weight: [V, d] (16-bit), unit column stride; out: [T, d] in weight's dtype
    (this chunk's rows of D); stats: [5, T] fp32 from ``ce_rows(unnormalized=True)``, unit column
    stride; tgt: [T] the target column or -1 (``config.local_targets``); labels: [T]; wdh: [T] fp32, the
    loss weights times ``fast.hidden_grad_prescale``. Written: out, and loss, m_all, s_all ([T] fp32
    each, any stride).
    """
    T, d = P.shape
    if T == 0:
        return
    if P.stride(1) != 1 or weight.stride(1) != 1 or out.stride(1) != 1 or (T > 1 and stats.stride(1) != 1):
        raise ValueError(f"dh_rows: P, weight, out and each row of stats need unit column stride "
                         f"(P {tuple(P.stride())}, "
                         f"weight {tuple(weight.stride())}, out {tuple(out.stride())}, stats {tuple(stats.stride())})")
    if any(t.numel() > 1 and t.stride(0) != 1 for t in (tgt, labels, wdh, loss, m_all, s_all)):
        raise ValueError("dh_rows: tgt, labels, wdh, loss, m_all and s_all need unit stride")
    if stats.shape[0] < 5 or out.shape != P.shape or weight.shape[1] != d:
        raise ValueError(f"dh_rows: stats [5, T], out and P [T, d], weight [V, d] (got stats {tuple(stats.shape)}, "
                         f"P {tuple(P.shape)}, out {tuple(out.shape)}, weight {tuple(weight.shape)})")
    kernel = _kernel("dh_rows_kernel")
    block = INTERPRET_BLOCK_D if interpreting() else min(DH_BLOCK_D, max(128, 1 << (d - 1).bit_length()))
    kwargs = {} if interpreting() else {"num_warps": 4}
    kernel[(T, -(-d // block))](P, weight, out, stats, tgt, labels, wdh, loss, m_all, s_all, d, ignore_index,
                                P.stride(0), weight.stride(0), out.stride(0), stats.stride(0), BLOCK_D=block, **kwargs)


# tokens per block of the transposed tile's row walk: 2048 fp32 = 8 KiB, 8 warps
GRAD_COLS_BLOCK_T = 2048


def grad_cols(zt: torch.Tensor, gt: torch.Tensor, tgt: torch.Tensor, stats: torch.Tensor, wts: torch.Tensor,
              col0: int) -> None:
    """The vocabulary pass's weighted softmax gradient on a transposed tile: ``gt[v, t] = wts[t] *
    (exp(zt[v, t] - m_t) / s_t - [v == tgt[t] - col0])`` (``grad_cols_kernel``).

    zt: [vt, tn] fp32 logits (a vocabulary row per row), unit column stride; gt: [vt, tn] 16-bit or zt
    itself, unit column stride -- for 16-bit in zt's storage it must be the first half of each of zt's
    rows (row stride in bytes equal to zt's); tgt: [tn] int32 / int64 target columns of the shard;
    stats: [2, tn] fp32 rows m, s with unit stride; wts: [tn] fp32 contiguous.
    """
    vt, tn = zt.shape
    if vt == 0 or tn == 0:
        return
    if zt.stride(1) != 1 or gt.stride(1) != 1 or stats.stride(-1) != 1 or wts.stride(0) != 1 or tgt.stride(0) != 1:
        raise ValueError(f"grad_cols: unit column strides needed (zt {tuple(zt.stride())}, gt {tuple(gt.stride())}, "
                         f"stats {tuple(stats.stride())})")
    g_in_z = gt.dtype != zt.dtype and gt.data_ptr() == zt.data_ptr()
    if g_in_z and vt > 1 and gt.stride(0) * gt.element_size() != zt.stride(0) * zt.element_size():
        raise ValueError(f"grad_cols: a {gt.dtype} gt in zt's storage must lie in the first half of each of zt's rows")
    kernel = _kernel("grad_cols_kernel")
    block = INTERPRET_BLOCK_V if interpreting() else min(GRAD_COLS_BLOCK_T, max(128, 1 << (tn - 1).bit_length()))
    kwargs = {} if interpreting() else {"num_warps": max(1, min(8, block // 256))}
    kernel[(vt,)](zt, gt, tgt, wts, stats[0], stats[1], tn, col0, zt.stride(0), gt.stride(0), BLOCK_T=block,
                  G_IN_Z=g_in_z, **kwargs)


# tile_grad's launch on the GPU: 128 x 256 blocks of G, K in steps of 64, 8 warps, 3 stages (a common
# Hopper wgmma configuration for bf16: (128 + 256) x 64 x 2 B x 3 = 144 KiB of shared memory); the
# interpreter walks 32 x 32 x 32 blocks (the tests' shapes still ragged, with several K steps)
TILE_GRAD_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
INTERPRET_TILE_GRAD_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, WIDEN=True)


def tile_grad(h: torch.Tensor, w: torch.Tensor, g_out: torch.Tensor, tgt: torch.Tensor, stats: torch.Tensor,
              wts: torch.Tensor, col0: int) -> None:
    """One vocabulary tile's weighted softmax gradient straight from its GEMM (``tile_grad_kernel``):
    ``g_out[t, v] = wts[t] * (exp((h w^T)[t, v] - m_t) / s_t - [v == tgt[t] - col0])``, the logits
    accumulated in fp32 and never stored.

    h: [tn, d] and w: [vt, d], 16-bit, unit column stride; g_out: [tn, vt] 16-bit, unit column stride;
    tgt: [tn] int32 / int64 target columns of the shard; stats: [2, tn] fp32 rows m, s with unit
    stride; wts: [tn] fp32 contiguous.
    """
    tn, d = h.shape
    vt = w.shape[0]
    if tn == 0 or vt == 0:
        return
    if h.dtype == torch.float32 or w.dtype != h.dtype or g_out.dtype != h.dtype:
        raise ValueError(f"tile_grad: 16-bit h, w and g_out of one dtype (got {h.dtype}, {w.dtype}, {g_out.dtype})")
    if (h.stride(1) != 1 or w.stride(1) != 1 or g_out.stride(1) != 1 or stats.stride(-1) != 1
            or wts.stride(0) != 1 or tgt.stride(0) != 1 or w.shape[1] != d or tuple(g_out.shape) != (tn, vt)):
        raise ValueError(f"tile_grad: h [tn, d], w [vt, d], g_out [tn, vt] with unit column strides (got h "
                         f"{tuple(h.shape)}/{h.stride()}, w {tuple(w.shape)}/{w.stride()}, g_out {tuple(g_out.shape)}/"
                         f"{g_out.stride()})")
    cfg = dict(INTERPRET_TILE_GRAD_CONFIG if interpreting() else TILE_GRAD_CONFIG)
    grid = (-(-tn // cfg["BLOCK_M"]) * -(-vt // cfg["BLOCK_N"]),)
    _kernel("tile_grad_kernel")[grid](h, w, g_out, tgt, wts, stats[0], stats[1], tn, vt, d, col0, h.stride(0),
                                      w.stride(0), g_out.stride(0), EVEN_K=d % cfg["BLOCK_K"] == 0, **cfg)
