"""torch's CUDA flash-attention op (``aten._scaled_dot_product_flash_attention``), fp16/bf16.

Used for "full" and "causal" blocks (our causal rectangles are always square, so the op's
alignment convention does not matter). The backward gets D through a stand-in output, exactly as
in :mod:`megatron_burst.kernels.cpu_flash`. Not run in CI (no GPU there); the tiled kernel is the
fallback for everything this op does not cover.
"""
from __future__ import annotations

import torch

from megatron_burst.kernels.cpu_flash import stand_in_output
from megatron_burst.kernels.reference import expand_kv, reduce_kv


def supports(q: torch.Tensor, k: torch.Tensor, kind: str) -> bool:
    """fp16/bf16 on CUDA, head dim a multiple of 8 up to 256; causal only on square blocks (the
    flash kernels' causal alignment differs from ours when sq != sk). Not "block_causal" or
    "positions" (document masks): those run on the tiled kernel."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and (kind == "full" or (kind == "causal" and q.shape[2] == k.shape[2])))


def forward(q, k, v, kind="full", block=1, scale=1.0):
    """(out, lse) in fp32. The kernel writes out in q's dtype (fp16/bf16 only), so each block's
    output is rounded once before the fp32 merge -- the one backend where that happens."""
    hq = q.shape[1]
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, expand_kv(k, hq), expand_kv(v, hq), 0.0, kind == "causal", False, scale=scale)
    return res[0].float(), res[1]


def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0):
    hq, hkv = q.shape[1], k.shape[1]
    empty = torch.empty(0, dtype=torch.long, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, expand_kv(k, hq), expand_kv(v, hq), stand_in_output(dout, D), lse.contiguous(),
        empty, empty, q.shape[2], k.shape[2], 0.0, kind == "causal", empty, empty, scale=scale)
    return dq, reduce_kv(dk, hkv), reduce_kv(dv, hkv)
