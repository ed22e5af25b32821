"""The memory-lean on-chip variant of the fused loss (``impl="triton_recompute"``): opt-in, **not yet
run on a GPU** (its launch configurations below are untimed defaults).

Two passes, Cut-Cross-Entropy style, with no logits in memory at all and no fp32 [V_local, d]
buffer beyond a bounded slice:

1. **forward** (:func:`lse_forward`): one Triton kernel, grid (token tiles, vocabulary splits).
   Each program recomputes logit tiles ``z = h W^T`` [BLOCK_N, BLOCK_V] in registers (``tl.dot``
   over d, fp32 accumulation) and keeps per row the running max, sum-exp and the target logit --
   the logits are never written. The splits' partial statistics [splits, N] are combined in torch,
   then over TP exactly as the fast path does (MAX all-reduce of the max; one SUM all-reduce of the
   rescaled sum-exp and the target logit). Kept for the backward: ``lse = m + log s`` [N] fp32
   (global over TP) and hidden, weight, labels -- nothing else.
2. **backward**, from the actual incoming per-token gradient g (exact for any g: no loss-mask
   proportionality needed, no recompute warning; ``loss_mask`` and ``weight_grad`` are accepted and
   ignored -- d weight is always formed here):
   (a) d hidden (:func:`hidden_grad`): program i owns BLOCK_N token rows, walks all vocabulary
       tiles, recomputes z, forms ``G = g (exp(z - lse) - onehot)`` rounded once to the input dtype
       (like FlashAttention's P) and adds ``G W_tile`` into its rows of an fp32 [N, d] buffer, one
       BLOCK_D slice of d at a time (fp32 read-modify-write, no atomics, deterministic). Under TP
       the fp32 partial sums are all-reduced (reduce-scattered under sequence parallelism) and only
       then rounded to the input dtype: d hidden is rounded once. The fp32 buffer is freed before
       (b) starts, so it does not add to the peak of the backward.
   (b) d weight (:func:`weight_grad`): program j owns BLOCK_V vocabulary rows, walks all token
       tiles, recomputes z, forms G and adds ``G^T h_tile`` into its rows in fp32. Destination: an
       fp32 d weight (fp32 weights) or Megatron's fp32 ``main_grad`` directly (gradient-
       accumulation fusion: no buffer at all); for a bf16 weight without main_grad, an fp32 slice
       of DW_SCRATCH_BYTES (256 MiB) per chunk of vocabulary rows, each copied once into the bf16
       gradient (one rounding).

FLOPs: 5 x 2 N V d (logits in the forward; logits + G W; logits + G^T h) -- two GEMM-equivalents
more than the fast path's three, one more than CCE's four (which shares the backward's recompute
between d hidden and d weight using atomics). Sharing it here would need either atomics (non-
deterministic, and fp32 atomics would need an fp32 [V, d] or [N, d] target) or a second walk order;
left for a version measured on a GPU.

Memory beyond inputs and the gradients themselves: [splits + 3, N] fp32 statistics, the fp32 d
hidden buffer [N, d] during (a) only (bf16: 4 B + 2 B per element then; fp32 inputs: it *is* d
hidden), and in (b) the fp32 slice (bf16 weight without main_grad). At N = 16K, V = 128K, d = 4096,
bf16, TP = 1: (a) peaks at 384 MiB (fp32 buffer + bf16 d hidden), (b) at 128 MiB d hidden + 1 GiB
d weight + 256 MiB slice = ~1.4 GiB (with main_grad: 128 MiB). The slice could be cut by lowering
DW_SCRATCH_BYTES, at the price of fewer programs per launch (DW_SCRATCH_BYTES / (4 d BLOCK_V)).

Expected cost on the GPU (untimed): the logits recompute makes this compute-bound at 5 GEMM-
equivalents; the fp32 read-modify-write of the owned rows costs 8 B per output element per
partner tile (d hidden: 2 N d x 4 B x V / BLOCK_V in all; d weight: likewise with N / BLOCK_N),
~0.55 TB each at the issue's shape -- likely the bottleneck (~160 ms each at 3.35 TB/s) unless
the slices stay in L2. This is the first thing a GPU run should measure (``python -m
megatron_burst.bench loss --quick --variants fused_recompute fused cce``).

Launch defaults (GPU, untimed): BLOCK_N = BLOCK_V = 128, BLOCK_D = 64, num_warps 8, num_stages 3;
the forward's vocabulary splits make at least 4 programs per SM. Under Triton's CPU interpreter
(tests) every block is 16 and the forward uses INTERPRET_SPLITS splits, so small shapes cover
ragged token, vocabulary, hidden tiles and splits.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_burst.loss import triton_kernels
from megatron_burst.loss.config import LossConfig, local_targets
from megatron_burst.loss.parallel import all_reduce_stats, gather_sequence, reduce_hidden_grad
from megatron_burst.loss.vocab_pass import weight_grad_target

__all__ = ["lse_forward", "hidden_grad", "weight_grad", "launch_config", "IMPL", "DW_SCRATCH_BYTES"]

IMPL = "triton_recompute"

# GPU launch configuration: untimed defaults (see the module docstring).
GPU_BLOCKS = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64)
GPU_LAUNCH = dict(num_warps=8, num_stages=3)
GPU_PROGRAMS_PER_SM = 4
INTERPRET_BLOCKS = dict(BLOCK_N=16, BLOCK_V=16, BLOCK_D=16)
INTERPRET_SPLITS = 3
# fp32 slice of d weight per launch for a 16-bit weight without main_grad.
DW_SCRATCH_BYTES = 256 << 20

_src: dict[str, Any] = {}


def _kernels():
    if not triton_kernels.AVAILABLE:
        raise RuntimeError(f"impl={IMPL!r} needs the triton package: pip install triton")
    if not _src:  # imported on first use: TRITON_INTERPRET must be set before triton is imported
        from megatron_burst.loss import _onchip_src
        _src["m"] = _onchip_src
    return _src["m"]


def launch_config() -> tuple[dict, dict]:
    """(block sizes, launch keywords) for this process (GPU defaults, or the interpreter's)."""
    if triton_kernels.interpreting():  # UPCAST: the interpreter's tl.dot cannot multiply bf16 (see _onchip_src._dot)
        return dict(INTERPRET_BLOCKS, UPCAST=True), {}
    return dict(GPU_BLOCKS, UPCAST=False), dict(GPU_LAUNCH)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 operands


def _splits(n_row_tiles: int, n_vocab_tiles: int, device: torch.device) -> int:
    if triton_kernels.interpreting():
        want = INTERPRET_SPLITS
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = -(-GPU_PROGRAMS_PER_SM * sms // max(1, n_row_tiles))
    return max(1, min(want, n_vocab_tiles))


def lse_forward(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [N] fp32, 0 at ignored labels; lse [N] fp32, global over TP). h: [N, d] (all tokens)."""
    N, d = h.shape
    V = cfg.v_local
    dev = h.device
    if N == 0:
        z = torch.zeros(0, dtype=torch.float32, device=dev)
        return z, z.clone()
    src = _kernels()
    h, weight = h.contiguous(), weight.contiguous()
    blocks, launch = launch_config()
    n_rt = -(-N // blocks["BLOCK_N"])  # token tiles
    n_vt = -(-V // blocks["BLOCK_V"])
    splits = _splits(n_rt, n_vt, dev)
    per_split = -(-n_vt // splits)
    splits = -(-n_vt // per_split)  # no empty split
    tgt, hit = local_targets(labels.long(), cfg)  # (int64 for the kernels)
    st = torch.empty(3, splits, N, dtype=torch.float32, device=dev)
    src.lse_stats_kernel[(n_rt, splits)](h, weight, tgt, st[0], st[1], st[2], N, V, d, h.stride(0),
                                         weight.stride(0), per_split, PREC=_prec(h.dtype), **blocks, **launch)
    m_part, s_part, zt_part = st
    m = m_part.amax(dim=0)
    s = (s_part * torch.exp(m_part - m)).sum(dim=0)
    zt = zt_part.sum(dim=0)
    if cfg.tp_size > 1:
        m_loc = m
        m = m_loc.clone()
        all_reduce_stats(m, dist.ReduceOp.MAX, cfg)
        # One all-reduce for both sums; only the rank holding a token's target contributes its logit.
        sums = torch.stack([s * torch.exp(m_loc - m), torch.where(hit, zt, 0.0)])
        all_reduce_stats(sums, dist.ReduceOp.SUM, cfg)
        s, zt = sums[0], sums[1]
    lse = m + torch.log(s)
    loss = torch.where(labels != cfg.ignore_index, lse - zt, 0.0)
    return loss, lse


def hidden_grad(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                cfg: LossConfig) -> torch.Tensor:
    """d hidden in h's dtype, reduced over TP (this rank's sequence shard under SP), rounded once.
    h: [N, d] all tokens; g: [N] fp32 incoming per-token gradient, 0 at ignored labels."""
    N, d = h.shape
    acc = torch.empty(N, d, dtype=torch.float32, device=h.device)
    if N:
        src = _kernels()
        h, weight = h.contiguous(), weight.contiguous()
        blocks, launch = launch_config()
        tgt, _ = local_targets(labels.long(), cfg)
        src.hidden_grad_kernel[(-(-N // blocks["BLOCK_N"]),)](
            h, weight, tgt, lse.contiguous(), g.contiguous(), acc, N, cfg.v_local, d, h.stride(0), weight.stride(0),
            acc.stride(0), PREC=_prec(h.dtype), **blocks, **launch)
    acc = reduce_hidden_grad(acc, cfg)  # fp32 partial sums over the vocabulary shards
    return acc if h.dtype == torch.float32 else acc.to(h.dtype)


def weight_grad(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                cfg: LossConfig, main_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """d weight [V_local, d] in weight's dtype (each element rounded once), or, with ``main_grad``,
    added into it in fp32 (returns None). h: [N, d] all tokens; g as :func:`hidden_grad`."""
    N, d = h.shape
    V = cfg.v_local
    out, done = weight_grad_target(weight, main_grad, N, V)
    if done:
        return out
    src = _kernels()
    h, weight = h.contiguous(), weight.contiguous()
    blocks, launch = launch_config()
    bv = blocks["BLOCK_V"]
    tgt, _ = local_targets(labels.long(), cfg)
    lse, g = lse.contiguous(), g.contiguous()

    def launch_rows(dest: torch.Tensor, v0: int, count: int, accumulate: bool) -> None:
        src.weight_grad_kernel[(-(-count // bv),)](
            h, weight, tgt, lse, g, dest, N, d, v0, count, h.stride(0), weight.stride(0), dest.stride(0),
            ACCUMULATE=accumulate, PREC=_prec(h.dtype), **blocks, **launch)

    if main_grad is not None:
        if not main_grad.is_contiguous() or main_grad.dtype != torch.float32:
            raise ValueError(f"fused_linear_cross_entropy(impl={IMPL!r}): weight.main_grad must be a contiguous fp32 "
                             f"tensor, got {main_grad.dtype}, strides {main_grad.stride()}")
        launch_rows(main_grad, 0, V, True)
        return None
    if out.dtype == torch.float32:
        launch_rows(out, 0, V, False)
        return out
    rows = max(bv, (DW_SCRATCH_BYTES // (4 * d)) // bv * bv)
    rows = min(rows, V)
    scratch = torch.empty(rows, d, dtype=torch.float32, device=h.device)
    for v0 in range(0, V, rows):  # a few large launches (V / rows), not a loop over tiles
        count = min(rows, V - v0)
        launch_rows(scratch, v0, count, False)
        out[v0:v0 + count].copy_(scratch[:count])  # the one rounding of these rows
    return out


class OnchipLinearCrossEntropyFunction(torch.autograd.Function):
    """apply(hidden [n, d], weight [V/tp, d], labels [N], cfg, main_grad or None) -> loss [N] fp32.

    n = N, or N/tp under sequence parallelism. Saves hidden (the shard), weight, labels, lse [N] and
    the label check (read in the backward: its one host read)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, cfg, main_grad):
        from megatron_burst.loss.config import labels_out_of_range
        h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
        loss, lse = lse_forward(h, weight, labels, cfg)
        del h
        ctx.cfg = cfg
        ctx.main_grad = main_grad if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(hidden, weight, labels, lse, labels_out_of_range(labels, cfg))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        from megatron_burst.loss.autograd import _megatron_dummy_wgrad
        from megatron_burst.loss.config import raise_label_error
        hidden, weight, labels, lse, labels_bad = ctx.saved_tensors
        cfg = ctx.cfg
        if bool(labels_bad):  # the op's one host read
            raise_label_error(labels, cfg)
        g = torch.where(labels != cfg.ignore_index, grad_loss.reshape(-1).float(), 0.0)
        h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
        dh = hidden_grad(h, weight, labels, lse, g, cfg) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            main_grad = ctx.main_grad
            if main_grad is not None:
                weight.main_grad = main_grad  # as Megatron's layer: restore the buffer captured in the forward
            dw = weight_grad(h, weight, labels, lse, g, cfg, main_grad)
            if main_grad is not None:
                dw = _megatron_dummy_wgrad(weight, main_grad)
        return dh, dw, None, None, None


def loss_only(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Inference: the per-token loss [N] fp32, the forward kernel alone (labels checked by the caller)."""
    h = gather_sequence(hidden, cfg) if cfg.sequence_parallel else hidden
    return lse_forward(h, weight, labels, cfg)[0]
