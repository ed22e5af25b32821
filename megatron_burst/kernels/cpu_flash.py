"""torch's fused CPU flash-attention op (``aten._scaled_dot_product_flash_attention_for_cpu``).

Its backward wants the block's output O only to form D = rowsum(dO * O). A rank that holds a remote
Q block in BurstAttention's backward has D but not O, so we hand the op a stand-in O' with the same
row sums against dO: O' = dO * D / rowsum(dO * dO) (and 0 where dO is 0, where D is 0 too). In fp32
that reproduces D to rounding; in bf16 O' is rounded per element, which perturbs D by about
2^-9 / sqrt(head_dim) relative — below the bf16 rounding of dO itself.
"""
from __future__ import annotations

import torch

from megatron_burst.kernels.reference import expand_kv, reduce_kv, visibility

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _mask_args(kind, block, sq, sk, dtype, device, positions=None):
    """(is_causal, additive mask or None, empty rows [sq] bool or None). The op takes an additive
    mask of the query's dtype (block_causal, positions); a row that sees nothing (positions blocks
    of sparse patterns) is left unmasked for the op and answered by the caller (out 0, lse -inf,
    no gradient), since an all -inf row would give NaN."""
    if kind == "full":
        return False, None, None
    if kind == "causal":
        return True, None, None
    vis = visibility(kind, block, sq, sk, device, positions)  # [sq, sk], or [h, sq, sk] (per-head bands)
    empty = ~vis.any(-1)
    if bool(empty.any()):
        vis = vis | empty[..., None]
    else:
        empty = None
    mask = torch.zeros(vis.shape, dtype=dtype, device=device).masked_fill_(~vis, float("-inf"))
    return False, (mask[None] if mask.dim() == 3 else mask), empty  # the op takes 2-d or 4-d masks


def forward(q, k, v, kind="full", block=1, scale=1.0, positions=None):
    """fp32 (out, lse). Lower-precision inputs run through the op in fp32 (exact upcasts): the op
    writes its output in its input dtype, and a bf16 block output would be rounded before the merge."""
    if q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    is_causal, mask, empty = _mask_args(kind, block, q.shape[2], k.shape[2], q.dtype, q.device, positions)
    hq = q.shape[1]
    out, lse = _fwd(q, expand_kv(k, hq), expand_kv(v, hq), 0.0, is_causal, attn_mask=mask, scale=scale)
    if empty is not None:
        out = out.masked_fill(empty[..., None], 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse


def stand_in_output(dout: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """O' [b, h, s, d] with rowsum(dout * O') == D (see module docstring)."""
    do = dout.float()
    norm = (do * do).sum(-1, keepdim=True)
    coef = torch.where(norm > 0, D.float().unsqueeze(-1) / norm.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.zeros_like(norm))
    return (do * coef).to(dout.dtype)


def backward(dout, q, k, v, D, lse, kind="full", block=1, scale=1.0, positions=None):
    is_causal, mask, empty = _mask_args(kind, block, q.shape[2], k.shape[2], q.dtype, q.device, positions)
    hq, hkv = q.shape[1], k.shape[1]
    if empty is not None:  # rows that see nothing: no gradient (dO 0, and P 0 through lse +inf)
        dout = dout.masked_fill(empty[..., None], 0.0)
        D = D.masked_fill(empty, 0.0)
        lse = lse.masked_fill(empty, float("inf"))
    out = stand_in_output(dout, D)
    dq, dk, dv = _bwd(dout.contiguous(), q, expand_kv(k, hq), expand_kv(v, hq), out, lse.contiguous(), 0.0,
                      is_causal, attn_mask=mask, scale=scale)
    return dq, reduce_kv(dk, hkv), reduce_kv(dv, hkv)
