"""torch's CUDA flash-attention op (``aten._scaled_dot_product_flash_attention``), fp16/bf16.

For "full" blocks and square "causal" ones (the dispatcher splits other causal rectangles into a
square and a full part, see :func:`megatron_burst.kernels.block_forward`). Arguments are bound by
schema name (:mod:`megatron_burst.kernels.torch_ops`); the backward's dense-call placeholders
(cumulative sequence lengths, RNG state) are what the forward returns, captured once per device.

The backward wants the output O only to form D = rowsum(dO * O): callers that hold the final
output pass it (``out=``); a rank holding a remote query block has D but not O and gets a stand-in
O' with the same row sums (:func:`megatron_burst.kernels.cpu_flash.stand_in_output`).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst.kernels import torch_ops
from megatron_burst.kernels.cpu_flash import stand_in_output
from megatron_burst.kernels.reference import expand_kv, reduce_kv

NAME = "cuda_flash"
KINDS = ("full", "causal")
SQUARE_CAUSAL_ONLY = True  # the dispatcher splits other causal rectangles
TAKES_OUT = True  # the backward reads the final output O (out=) instead of D
_FWD = "_scaled_dot_product_flash_attention"
_BWD = "_scaled_dot_product_flash_attention_backward"
_FWD_ARGS = ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale")
_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
             "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale")


def unavailable() -> Optional[str]:
    """Why this kernel cannot run in this process (None: it can, on a CUDA device)."""
    return torch_ops.fused_op_unavailable(_FWD, _FWD_ARGS, _BWD, _BWD_ARGS)


def supports(dtype: torch.dtype, head_dim: int, kind: str) -> Optional[str]:
    """Why (dtype, head dim, kind) is out of this op's reach (None: supported)."""
    return torch_ops.fused_op_supports(dtype, head_dim, kind, 256)


def _placeholders(device: torch.device, dtype: torch.dtype) -> tuple:
    """(cum_seq_q, cum_seq_k, philox_seed, philox_offset) as the forward returns them for a dense call."""
    res = torch_ops.dense_call_outputs(_FWD, device, dtype, lambda x: torch_ops.call(
        _FWD, query=x, key=x, value=x, dropout_p=0.0, is_causal=False, return_debug_mask=False))
    return res[2], res[3], res[6], res[7]


def _rows(lse: torch.Tensor, rows: int) -> torch.Tensor:
    """lse [b, h, rows]: some builds pad the op's lse past the query rows."""
    return lse if lse.shape[-1] == rows else lse.narrow(-1, 0, rows)


def forward(q, k, v, kind="full", block=1, scale=1.0):
    """(out [b, hq, sq, d] in q's dtype, lse [b, hq, sq] fp32): the op writes only its input dtype,
    so this block's output is rounded once before the fp32 merge."""
    hq = q.shape[1]
    res = torch_ops.call(_FWD, query=q, key=expand_kv(k, hq), value=expand_kv(v, hq), dropout_p=0.0,
                         is_causal=kind == "causal", return_debug_mask=False, scale=scale)
    return res[0], _rows(res[1], q.shape[2])


def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, out: Optional[torch.Tensor] = None):
    """(dq [b, hq, sq, d], dk, dv [b, hkv, sk, d]) in the input dtype; ``out`` the final output of these
    rows when the caller has it (else a stand-in with rowsum(dout * out) == D)."""
    hq, hkv = q.shape[1], k.shape[1]
    cum_q, cum_k, seed, offset = _placeholders(q.device, q.dtype)
    o = stand_in_output(dout, D) if out is None else out.to(q.dtype)
    dq, dk, dv = torch_ops.call(
        _BWD, grad_out=dout.contiguous(), query=q, key=expand_kv(k, hq), value=expand_kv(v, hq), out=o,
        logsumexp=lse.contiguous(), cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=q.shape[2], max_k=k.shape[2],
        dropout_p=0.0, is_causal=kind == "causal", philox_seed=seed, philox_offset=offset, scale=scale)
    return dq, reduce_kv(dk, hkv), reduce_kv(dv, hkv)
