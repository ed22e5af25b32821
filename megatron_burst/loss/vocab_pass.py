"""The weight gradient by vocabulary tiles, in the backward (``weight_grad="backward"``).

The default (``weight_grad="forward"``) forms the weight gradient in the forward, walking token
chunks and accumulating ``A += G_c^T h_c`` into an fp32 [V_local, d] buffer kept until the backward:
three GEMMs, but 4 B per weight element of extra memory (2 GiB at V = 128K, d = 4096) -- the
largest buffer of the whole op, larger than the bf16 weight gradient itself.

Here the loop order is vocabulary-outer instead: for each tile of ``vt`` vocabulary rows the
logits of *all* tokens against that tile are recomputed (``z = h W_tile^T``, fp32), turned into the
weighted softmax gradient with the forward's per-token max / sum-exp (global over TP, so no
collective is needed), and ``dW_tile = G^T h`` is accumulated over the tokens in fp32 (in the GEMM,
or in an fp32 tile buffer [vt, d] when the tokens are split) and written **once** in the weight
dtype -- or added in fp32 into Megatron's ``main_grad``. Nothing of size [V_local, d] exists but
the gradient itself, and each weight-gradient element is rounded to bf16 exactly once (the
unfused path's rounding), whatever the number of tokens. The price: a fourth vocabulary GEMM
(the logits recompute), 2 N V_local d FLOPs.

Because the incoming per-token gradient g is known here, the weight gradient is exact for any g
(no proportionality to the loss mask needed for it).

Buffers (the only allocations besides the result): fp32 logits and the G tile [tn, vt]
(6 B per element for bf16, 4 B for fp32: G overwrites z), the fp32 tile accumulator [vt, d] when
the tokens are split into sub-chunks (tn < N) and the result is not itself fp32, and [3, tn] fp32
statistics. ``vt`` = min(vocab_chunk, VOCAB_TILE) rows, ``tn`` tokens from TILE_BYTES.
At N = 16K, V = 128K, d = 4096, bf16: vt = 2048, tn = 4096: 48 MiB of logits / G, 32 MiB accumulator.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_burst.loss import triton_kernels
from megatron_burst.loss.config import LossConfig

__all__ = ["weight_grad_by_vocab_tiles", "weight_grad_target", "vocab_pass_tiles", "VOCAB_TILE", "TILE_BYTES"]

# Vocabulary rows per tile: the GEMMs are [tn, d] x [d, vt] and [vt, tn] x [tn, d]; 2048 keeps both
# compute-bound on Hopper at tn >= 1024 while the tile accumulator stays 32 MiB at d = 4096.
VOCAB_TILE = 2048
# Logits-tile bytes (fp32 z + 16-bit G) per (token sub-chunk, vocabulary tile).
TILE_BYTES = 48 << 20


def vocab_pass_tiles(n_tokens: int, cfg: LossConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(vt, tn): vocabulary rows per tile and tokens per sub-chunk of the pass (see the module docstring)."""
    vt = max(1, min(cfg.vocab_chunk, VOCAB_TILE, cfg.v_local))
    per_elem = 4 if dtype == torch.float32 else 6
    tn = max(1, min(n_tokens, TILE_BYTES // (per_elem * vt)))
    if tn >= 256 and tn < n_tokens:
        tn -= tn % 128  # whole GEMM tiles
    return vt, tn


def _logits(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, impl: str) -> None:
    """out [tn, vt] fp32 <- h w^T, rounded as the forward rounded them (the statistics m, s were
    formed from these very values: any other rounding would break softmax's normalization)."""
    if h.dtype == torch.float32:
        torch.mm(h, w.t(), out=out)
    elif impl == "torch":
        out.copy_(torch.mm(h, w.t()))  # the torch path's logits are in the input dtype (as Megatron's)
    elif h.is_cuda:
        torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
    else:  # CPU (interpreter tests): bf16 values and their products are exact in fp32
        torch.mm(h.float(), w.float().t(), out=out)


def _softmax_grad(z: torch.Tensor, G: torch.Tensor, tgt: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                  g: torch.Tensor, impl: str) -> None:
    """G [tn, vt] <- g_t (exp(z - m_t) / s_t - [v == tgt_t]) in G's dtype; tgt [tn]: tile column or -1."""
    if impl == "triton":
        st = torch.stack([m, s, torch.zeros_like(m)])
        triton_kernels.ce_rows(z, tgt, st, grad=G, wts=g, compute_stats=False)
        return
    z.sub_(m[:, None]).exp_().mul_((g / s)[:, None])
    hit = tgt >= 0
    z.scatter_add_(1, tgt.clamp(min=0)[:, None], torch.where(hit, -g, 0.0)[:, None])
    if G.data_ptr() != z.data_ptr():
        G.copy_(z)


def _accumulate(acc: torch.Tensor, G: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """acc [vt, d] fp32 (+)= G^T h with fp32 products and sums (``first``: overwrite)."""
    if G.dtype == torch.float32:
        if first:
            torch.mm(G.t(), h, out=acc)
        else:
            acc.addmm_(G.t(), h)
    elif G.is_cuda:
        from megatron_burst.loss.fast import _addmm_fp32_works
        if first:
            torch.mm(G.t(), h, out_dtype=torch.float32, out=acc)
        elif _addmm_fp32_works(G.device):
            torch.addmm(acc, G.t(), h, out_dtype=torch.float32, out=acc)
        else:  # older torch: an fp32 product the size of the tile, then one add
            acc.add_(torch.mm(G.t(), h, out_dtype=torch.float32))
    elif first:  # CPU: bf16 values and their products are exact in fp32
        torch.mm(G.t().float(), h.float(), out=acc)
    else:
        acc.addmm_(G.t().float(), h.float())


def weight_grad_target(weight: torch.Tensor, main_grad: Optional[torch.Tensor], n_tokens: int, v_local: int
                       ) -> tuple[Optional[torch.Tensor], bool]:
    """(out, done) of a d weight pass: ``out`` the [v_local, d] gradient to fill in weight's dtype, or
    None when the pass adds into ``main_grad``; ``done`` when there are no tokens, ``out`` then being
    the pass's result already (zeros, or None: nothing to add)."""
    if main_grad is not None:
        return None, n_tokens == 0
    out = torch.empty(v_local, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return (out.zero_(), True) if n_tokens == 0 else (out, False)


def weight_grad_by_vocab_tiles(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, m_all: torch.Tensor,
                               s_all: torch.Tensor, g: torch.Tensor, cfg: LossConfig,
                               main_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """d weight = sum_t g_t (p_t - y_t)^T h_t, one vocabulary tile at a time, each rounded once.

    h: [N, d] (the full sequence: gathered under sequence parallelism), weight: [V_local, d],
    labels: [N] global ids, m_all / s_all: [N] fp32 global (over TP) per-token max and sum-exp of
    the logits from the forward, g: [N] fp32 incoming per-token gradient, 0 at ignored labels.
    ``main_grad``: [V_local, d] fp32 buffer to add the gradient into (returns None), else returns
    the gradient [V_local, d] in weight's dtype.
    """
    N, d = h.shape
    V = cfg.v_local
    out, done = weight_grad_target(weight, main_grad, N, V)
    if done:
        return out
    vt, tn = vocab_pass_tiles(N, cfg, h.dtype)
    split = tn < N
    weight = weight.contiguous()
    z_buf = torch.empty(tn * vt, dtype=torch.float32, device=h.device)
    g_buf = None if h.dtype == torch.float32 else torch.empty(tn * vt, dtype=h.dtype, device=h.device)
    # fp32 tile accumulator only where the destination cannot accumulate in fp32 itself.
    acc_buf = (torch.empty(vt, d, dtype=torch.float32, device=h.device)
               if split and main_grad is None and weight.dtype != torch.float32 else None)
    local = labels - cfg.vocab_start
    valid_tgt = (labels != cfg.ignore_index) & (local >= 0) & (local < V)
    for a in range(0, V, vt):
        b = min(a + vt, V)
        w_tile = weight[a:b]
        if main_grad is not None:
            dest, first_overwrites = main_grad[a:b], False  # add into Megatron's buffer
        elif acc_buf is not None:
            dest, first_overwrites = acc_buf[:b - a], True
        else:
            dest, first_overwrites = out[a:b], True  # one GEMM over all tokens (or fp32 out): no buffer
        for t0 in range(0, N, tn):
            t1 = min(t0 + tn, N)
            n = (t1 - t0) * (b - a)
            z = z_buf[:n].view(t1 - t0, b - a)
            G = z if g_buf is None else g_buf[:n].view(t1 - t0, b - a)
            _logits(h[t0:t1], w_tile, z, cfg.impl)
            col = local[t0:t1] - a
            tgt = torch.where(valid_tgt[t0:t1] & (col >= 0) & (col < b - a), col, -1)
            _softmax_grad(z, G, tgt, m_all[t0:t1], s_all[t0:t1], g[t0:t1].contiguous(), cfg.impl)
            if dest.dtype != torch.float32:
                # Tokens not split: one GEMM over all of them straight into the 16-bit result (fp32
                # sums in the GEMM, one rounding). CPU: in fp32, then one rounding, to be sure of it.
                if G.is_cuda:
                    torch.mm(G.t(), h[t0:t1], out=dest)
                else:
                    dest.copy_(torch.mm(G.t().float(), h[t0:t1].float()))
            else:
                _accumulate(dest, G, h[t0:t1], first_overwrites and t0 == 0)
        if acc_buf is not None:
            out[a:b].copy_(acc_buf[:b - a])  # the one rounding of this tile's gradient
    return out if main_grad is None else None
