"""The autograd Function of ring, burst and all-gather attention, and the CP forward it runs.

:class:`_CPAttention` takes q, k, v in the caller's format ("sbhd" or "bshd") and returns the
output in that format, contiguous; its backward is the scheme's (ring: K,V,dK,dV circulate;
burst: Q,dO,D,lse,dQ circulate; allgather: dK,dV reduce-scattered). :func:`attention_forward` is
the forward alone (selective checkpointing's store calls it too). A call with nothing to exchange
(one rank, no sparse plan, one block covering every row: :func:`single_block`) is one kernel call
each way, with no fp32 accumulator and no merge. Blocks merge in fp32; the output is rounded to
q's dtype once.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst.algorithms import allgather, burst, ring
from megatron_burst.algorithms.schedule import CPConfig
from megatron_burst.kernels import block_backward, block_forward, reads_output, row_dot
from megatron_burst.kernels.rows import unit_last
from megatron_burst.masks.block import BlockMask

__all__ = ["attention_forward", "from_bhsd", "single_block", "to_bhsd"]

_FORWARD = {"ring": ring.kv_ring_forward, "burst": ring.kv_ring_forward, "allgather": allgather.allgather_forward}
_BACKWARD = {"ring": ring.ring_backward, "burst": burst.burst_backward, "allgather": allgather.allgather_backward}
_LOOK_UP = object()  # attention_forward's default ``whole``: it looks the single block up itself


class _CPAttention(torch.autograd.Function):
    """Ring forward (K,V circulate), backward by ``backward_algo``.

    Takes q, k, v in the caller's format and returns the output in that format, contiguous: a
    [s, b, h, d] output reshapes to Megatron's [s, b, h*d] as a view, and the same storage is what
    the backward keeps (the output is stored once). With ``q_rows`` and a cached tail (sequence-level
    selective checkpointing's recompute), the forward computes only local query rows [0, q_rows)
    and takes (out, lse) of the other rows from the cache; the backward is the same exact backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, cfg: CPConfig, backward_algo: str, qkv_format: str, q_rows: Optional[int] = None,
                out_tail: Optional[torch.Tensor] = None, lse_tail: Optional[torch.Tensor] = None):
        views = [to_bhsd(t, qkv_format) for t in (q, k, v)]
        whole = single_block(cfg, views[0].shape[2], views[0].shape[0])  # looked up once per call
        # one block and nothing exchanged: every kernel reads any strides with a unit-stride last
        # dim, so the caller's tensors are handed over (and kept) as views, as torch's SDPA does;
        # the CP schedules need contiguous buffers
        one = whole is not None and q_rows is None
        qh, kh, vh = [unit_last(t) if one else t.contiguous() for t in views]
        out, _, lse = attention_forward(qh, kh, vh, cfg, qkv_format, q_rows, out_tail, lse_tail, backward_algo,
                                        whole=whole)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.cfg, ctx.backward_algo, ctx.qkv_format, ctx.whole = cfg, backward_algo, qkv_format, whole
        return out

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, out, lse = ctx.saved_tensors
        fmt = ctx.qkv_format
        out_h, whole = to_bhsd(out, fmt), ctx.whole
        dout_h = to_bhsd(dout, fmt)
        dout_h = unit_last(dout_h) if whole is not None else dout_h.contiguous()
        if whole is not None:  # a kernel that reads the output itself needs no D
            D = None if reads_output(qh, whole.kind, ctx.cfg.kernel) else row_dot(dout_h, out_h)
            dq, dk, dv = block_backward(dout_h, qh, kh, vh, D, lse, whole, ctx.cfg.scale, ctx.cfg.kernel, out=out_h)
        else:
            D = row_dot(dout_h, out_h)
            dq, dk, dv = _BACKWARD[ctx.backward_algo](dout_h, qh, kh, vh, D, lse, ctx.cfg, out=out_h)
        grads = (from_bhsd(g.to(qh.dtype), fmt) for g in (dq, dk, dv))
        return (*grads, None, None, None, None, None, None)


def single_block(cfg: CPConfig, n: int, batch_size: int) -> Optional[BlockMask]:
    """The one block that covers every local query row of every sample (``n`` rows, ``batch_size``
    samples) when the call has nothing to exchange (one rank, no sparse plan): then the forward and
    backward are one kernel call each, with no fp32 accumulator and no merge. None otherwise. A
    documents call names its samples explicitly (slice(0, b)): that covers the batch too."""
    if cfg.world_size != 1 or cfg.pattern is not None or cfg.ulysses_size != 1:
        return None
    blocks = cfg.blocks(0, 0, n)
    if len(blocks) != 1:
        return None
    batch, mask = blocks[0]
    whole_batch = (batch.start in (None, 0) and (batch.stop is None or batch.stop >= batch_size)
                   and batch.step in (None, 1))
    return mask if whole_batch and mask.q_start == 0 and mask.q_stop == n else None


def to_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """[s, b, h, d] ("sbhd") or [b, s, h, d] ("bshd") -> a [b, h, s, d] view."""
    return t.permute(1, 2, 0, 3) if qkv_format == "sbhd" else t.permute(0, 2, 1, 3)


def from_bhsd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """Inverse of :func:`to_bhsd` (a view)."""
    return t.permute(2, 0, 1, 3) if qkv_format == "sbhd" else t.permute(0, 2, 1, 3)


def attention_forward(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, cfg: CPConfig, qkv_format: str,
                      q_rows: Optional[int] = None, out_tail: Optional[torch.Tensor] = None,
                      lse_tail: Optional[torch.Tensor] = None, scheme: str = "ring", whole=_LOOK_UP
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CP forward on [b, h, s, d] q/k/v (contiguous, except for a single block: any strides).

    Returns (out in the caller's format, contiguous; the same storage viewed [b, h, s, d];
    lse [b, h, s] fp32). Blocks merge in fp32; the output is rounded to q's dtype once, at the end.
    A single block's output is the kernel's own when it is already in the caller's layout (no copy).
    ``q_rows``/``out_tail``/``lse_tail``: rows [q_rows, s) come from a selective-checkpoint store.
    ``scheme``: "allgather" gathers K,V; ring and burst circulate them. ``whole``: the call's
    :func:`single_block` when the caller has looked it up (None: there is none).
    """
    b, h, s, d = qh.shape
    shape = (s, b, h, vh.shape[-1]) if qkv_format == "sbhd" else (b, s, h, vh.shape[-1])
    if whole is _LOOK_UP:
        whole = single_block(cfg, s, b)
    if q_rows is not None:
        whole = None
    if whole is not None:
        o, lse = block_forward(qh, kh, vh, whole, cfg.scale, cfg.kernel)
        o_caller = from_bhsd(o, qkv_format)
        if o.dtype == qh.dtype and o_caller.is_contiguous():  # cuDNN and the varlen op write q's layout
            return o_caller, o, lse
        out = torch.empty(shape, dtype=qh.dtype, device=qh.device)
        out_h = to_bhsd(out, qkv_format)
        out_h.copy_(o)
        return out, out_h, lse
    out = torch.empty(shape, dtype=qh.dtype, device=qh.device)
    out_h = to_bhsd(out, qkv_format)
    # fp32 inputs accumulate straight into the output; others through one fp32 buffer
    acc = out_h if qh.dtype == torch.float32 else None
    acc, lse = _FORWARD[scheme](qh, kh, vh, cfg, q_rows=q_rows, out=acc)
    if q_rows is not None:
        acc[:, :, q_rows:] = out_tail
        lse[:, :, q_rows:] = lse_tail
    if acc is not out_h:
        out_h.copy_(acc)
    return out, out_h, lse
