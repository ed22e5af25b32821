"""torch's cuDNN attention op (``aten._scaled_dot_product_cudnn_attention``), fp16/bf16 on CUDA.

The fastest dense kernel torch ships on Hopper: 1.7x its flash op at 32K tokens causal on an H200
(the first GPU check, ``shared/gpu/first_gpu_results.jsonl``). Used like
:mod:`megatron_burst.kernels.cuda_flash` ("full" and square "causal" blocks; the same schema-bound
calls and forward-returned placeholders). The op returns lse as [b, h, s, 1]; this adapter hands
[b, h, s] to the engine and reshapes it back for the backward.

Per-block gate. The private op has none of the shape and layout checks that
``F.scaled_dot_product_attention`` runs before it picks cuDNN, and a block outside cuDNN's support
can crash the process in the backward (a segfault on an H100, torch 2.11, cuDNN 9.19, in the GPU
suite's small odd-length blocks) instead of raising. So every block first asks torch's own public
eligibility test, ``torch.backends.cuda.can_use_cudnn_attention`` on the block's exact tensors (with
cuDNN's runtime switch treated as on: a user disabling cuDNN for their own SDPA calls does not
change ours), cached per (shapes, strides, dtype, causal); a block it refuses runs torch's flash op
(:mod:`megatron_burst.kernels.cuda_flash`, the same kinds and conventions), logged once per shape
class. A torch without that test sends every block to flash.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_burst.kernels import torch_ops
from megatron_burst.kernels.cpu_flash import stand_in_output
from megatron_burst.kernels import cuda_flash
from megatron_burst.kernels.cuda_flash import _rows
from megatron_burst.kernels.reference import expand_kv, reduce_kv

logger = logging.getLogger("megatron_burst.kernels")

NAME = "cudnn"
KINDS = ("full", "causal")
SQUARE_CAUSAL_ONLY = True  # the dispatcher splits other causal rectangles
TAKES_OUT = True  # the backward reads the final output O (out=) instead of D
_FWD = "_scaled_dot_product_cudnn_attention"
_BWD = "_scaled_dot_product_cudnn_attention_backward"
_FWD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
             "return_debug_mask", "scale")
_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
             "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")


def unavailable() -> Optional[str]:
    """Why this kernel cannot run in this process (None: it can, on a CUDA device)."""
    if torch.cuda.is_available() and not torch.backends.cudnn.is_available():
        return "torch was built without cuDNN"
    why = torch_ops.fused_op_unavailable(_FWD, _FWD_ARGS, _BWD, _BWD_ARGS)
    flash = cuda_flash.unavailable()
    return why or (None if flash is None else f"its flash op for blocks cuDNN does not take is missing: {flash}")


def supports(dtype: torch.dtype, head_dim: int, kind: str) -> Optional[str]:
    """Why (dtype, head dim, kind) is out of this op's reach (None: supported). Head dims above 128
    are left to the flash op: cuDNN's backward support for them depends on its version."""
    return torch_ops.fused_op_supports(dtype, head_dim, kind, 128)


def _placeholders(device: torch.device, dtype: torch.dtype) -> tuple:
    """(cum_seq_q, cum_seq_k, philox_seed, philox_offset, lse rank) as the forward returns them."""
    res = torch_ops.dense_call_outputs(_FWD, device, dtype, lambda x: _forward_op(x, x, x, False, None))
    return res[2], res[3], res[6], res[7], res[1].dim()


def _forward_op(q, k, v, causal, scale):
    return torch_ops.call(_FWD, query=q, key=k, value=v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0,
                          is_causal=causal, return_debug_mask=False, scale=scale)


_NATIVE_GQA: dict[tuple, bool] = {}


def native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build's cuDNN op takes fewer key/value heads than query heads (then K and V are
    not repeated per query head in memory). A capability probe, once per (device, dtype): a tiny
    forward with 2 query heads over 1 kv head; the self-check then validates whichever path runs."""
    key = (str(device), dtype)
    if key not in _NATIVE_GQA:
        if torch_ops.fake_mode_active():
            return False
        q, kv = torch.zeros(1, 2, 16, 8, dtype=dtype, device=device), torch.zeros(1, 1, 16, 8, dtype=dtype, device=device)
        try:
            _forward_op(q, kv, kv, False, None)
            _NATIVE_GQA[key] = True
        except RuntimeError:  # this build wants equal head counts: K, V are expanded instead
            _NATIVE_GQA[key] = False
        logger.info("megatron-burst: cuDNN attention on %s / %s takes GQA %s", device, dtype,
                    "natively" if _NATIVE_GQA[key] else "through expanded K, V")
    return _NATIVE_GQA[key]


def _kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    return t if t.shape[1] == hq or native_gqa(t.device, t.dtype) else expand_kv(t, hq)


_TAKES: dict[tuple, bool] = {}


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a permutation of a contiguous tensor (no gaps, no overlap)."""
    span = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size > 1 and stride != span:
            return False
        span *= size
    return True


def takes_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether torch would run cuDNN attention on these exact tensors (q [b, hq, sq, d], k/v
    [b, hkv, sk, d] as this adapter passes them): torch's public eligibility test, cached."""
    if torch_ops.fake_mode_active():
        return True  # schema checks on fake tensors (CPU tests): nothing to ask a device
    key = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(v.shape), v.stride(), q.dtype, causal,
           q.device)
    hit = _TAKES.get(key)
    if hit is None:
        hit = _TAKES[key] = _torch_would_run_cudnn(q, k, v, causal)
        if not hit:
            logger.info("megatron-burst: cuDNN attention does not take a %s block q %s k %s (strides %s / %s); "
                        "torch's flash op runs it", "causal" if causal else "full", tuple(q.shape), tuple(k.shape),
                        q.stride(), k.stride())
    return hit


def _torch_would_run_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    cuda_backends = torch.backends.cuda
    if not hasattr(cuda_backends, "can_use_cudnn_attention") or not hasattr(cuda_backends, "SDPAParams"):
        return False
    if q.device.type != "cuda":  # never cuDNN; and torch's check would start CUDA (it raises on a CUDA build
        return False             # of torch without a driver, seen with torch 2.11+cu130 on a CPU machine)
    gqa = q.shape[1] != k.shape[1]
    try:
        params = cuda_backends.SDPAParams(q, k, v, None, 0.0, causal, gqa)
    except TypeError:  # torch before enable_gqa: the 6-argument form (and no GQA)
        if gqa:
            return False
        params = cuda_backends.SDPAParams(q, k, v, None, 0.0, causal)
    enabled = cuda_backends.cudnn_sdp_enabled()
    cuda_backends.enable_cudnn_sdp(True)  # ask about shapes and layouts, not the user's SDPA switch
    try:
        return bool(cuda_backends.can_use_cudnn_attention(params, False))
    finally:
        cuda_backends.enable_cudnn_sdp(enabled)


def forward(q, k, v, kind="full", block=1, scale=1.0):
    """(out [b, hq, sq, d] in q's dtype, lse [b, hq, sq] fp32); blocks cuDNN does not take run flash."""
    hq, sq = q.shape[1], q.shape[2]
    kk, vv = _kv(k, hq), _kv(v, hq)  # once: without native GQA these are copies
    if not takes_block(q, kk, vv, kind == "causal"):
        return cuda_flash.forward(q, k, v, kind, block, scale)
    res = _forward_op(q, kk, vv, kind == "causal", scale)
    lse = res[1]
    return res[0], _rows(lse.reshape(lse.shape[0], lse.shape[1], -1), sq)


def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, out: Optional[torch.Tensor] = None):
    """(dq [b, hq, sq, d], dk, dv [b, hkv, sk, d]) in the input dtype (see cuda_flash.backward); blocks
    cuDNN does not take run flash."""
    hq, hkv = q.shape[1], k.shape[1]
    kk, vv = _kv(k, hq), _kv(v, hq)  # once: without native GQA these are copies
    if not takes_block(q, kk, vv, kind == "causal"):
        return cuda_flash.backward(dout, q, k, v, D, lse, kind, block, scale, out=out)
    cum_q, cum_k, seed, offset, lse_rank = _placeholders(q.device, q.dtype)
    o = stand_in_output(dout, D) if out is None else out.to(q.dtype)
    # the op reads O and dO with one set of strides: both as they are when they share one dense
    # layout with a unit-stride last dim (a one-block call's sbhd views, as SDPA itself passes
    # them), else both contiguous
    if o.stride() != dout.stride() or o.stride(-1) != 1 or not _dense(o):
        dout, o = dout.contiguous(), o.contiguous()
    lse = lse.contiguous()
    if lse_rank == 4:
        lse = lse.unsqueeze(-1)
    dq, dk, dv = torch_ops.call(
        _BWD, grad_out=dout, query=q, key=kk, value=vv, out=o, logsumexp=lse,
        philox_seed=seed, philox_offset=offset, attn_bias=None, cum_seq_q=cum_q, cum_seq_k=cum_k,
        max_q=q.shape[2], max_k=k.shape[2], dropout_p=0.0, is_causal=kind == "causal", scale=scale)
    if dk.shape[1] != hkv:
        dk, dv = reduce_kv(dk, hkv), reduce_kv(dv, hkv)
    return dq, dk, dv
