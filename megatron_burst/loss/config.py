"""Validated settings of one fused-loss call: TP layout, token / vocabulary chunking, backend.

:func:`make_loss_config` checks the arguments of :func:`~megatron_burst.loss.fused_linear_cross_entropy`
(and of the recompute baseline) on the host -- shapes, dtypes, devices, chunk sizes: no tensor is
read, no collective runs -- resolves ``impl="auto"`` (:mod:`megatron_burst.loss.choice`; its
one-time self-check runs on the device), fixes the chunking and returns a :class:`LossConfig`.
One exception to "no collective": on CUDA under TP with the default chunk, the ranks agree on the
chunk once per shape (a MIN all-reduce and one host read, then cached), since the fast path's
default depends on each rank's free memory. The one check that needs the label
*values* (every label in the vocabulary or ``ignore_index``) is split in two, so that it costs no
host read of its own: :func:`labels_out_of_range` forms the answer on the device and
:func:`raise_label_error` (error path only) locates the offending label for the message;
:func:`check_labels` does both with one host read where no backward will read the answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from megatron_burst.loss import triton_kernels

__all__ = ["LossConfig", "make_loss_config", "token_weights", "labels_out_of_range", "check_labels",
           "raise_label_error",
           "DEFAULT_TILE_ELEMS", "DEFAULT_VOCAB_CHUNK", "SUPPORTED_DTYPES"]

# Default logits tile of one token chunk: token_chunk * V_local <= this many fp32 values (256 MiB).
DEFAULT_TILE_ELEMS = 1 << 26
DEFAULT_VOCAB_CHUNK = 16384
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# "triton_recompute": opt-in, never chosen by "auto" (megatron_burst.loss.onchip; not yet run on a GPU).
IMPLS = ("auto", "torch", "triton", "triton_recompute")


@dataclass(frozen=True)
class LossConfig:
    """How one call is laid out: the TP group and this rank's vocabulary rows, the chunk sizes,
    the label convention and the backend. Identical on all ranks of ``group`` except ``tp_rank``."""

    group: Optional[dist.ProcessGroup]  # None when the vocabulary is not split (tp_size == 1)
    tp_size: int
    tp_rank: int
    v_local: int  # vocabulary rows on this rank (V / tp)
    token_chunk: int  # tokens per chunk (a chunk's fp32 logits tile is token_chunk x v_local)
    vocab_chunk: int  # vocabulary rows per logits tile within a chunk
    ignore_index: int
    sequence_parallel: bool  # hidden (and its gradient) is this rank's sequence shard
    impl: str  # "torch", "triton" or "triton_recompute" (resolved: never "auto")
    # "forward": d weight accumulated over token chunks in the forward into an fp32 [V_local, d]
    # buffer (3 GEMMs); "backward": formed per vocabulary tile in the backward, rounded once, no
    # [V_local, d] buffer but the gradient (4 GEMMs; megatron_burst.loss.vocab_pass).
    weight_grad: str = "forward"

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.v_local

    @property
    def vocab_size(self) -> int:
        return self.tp_size * self.v_local


def make_loss_config(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     loss_mask: Optional[torch.Tensor], tp_group: Optional[dist.ProcessGroup], ignore_index: int,
                     sequence_parallel: bool, token_chunk: Optional[int], vocab_chunk: Optional[int], impl: str,
                     name: str = "fused_linear_cross_entropy", weight_grad: str = "forward") -> LossConfig:
    """Validate the arguments (errors name the value and the fix) and fix the chunking.

    Reads no tensor value (label values: :func:`labels_out_of_range`), so it costs no host sync.
    """
    for arg, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dtype not in SUPPORTED_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {arg} has dtype {got}; supported are torch.float32 and torch.bfloat16 "
                             f"(cast {arg} to one of them)")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{name}: hidden is {hidden.dtype} but weight is {weight.dtype}; pass both in the "
                         "same dtype (the output layer computes in the parameter dtype)")
    if weight.dim() != 2 or hidden.dim() < 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{name}: hidden {tuple(hidden.shape)} must be [..., d] and weight {tuple(weight.shape)} "
                         "this rank's vocabulary shard [V/tp, d] (V/tp >= 1) with the same d")
    if labels.device != hidden.device or weight.device != hidden.device:
        raise ValueError(f"{name}: hidden ({hidden.device}), weight ({weight.device}) and labels "
                         f"({labels.device}) must be on one device")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"{name}: labels must hold integer vocabulary ids, got dtype {labels.dtype}")
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    lead = tuple(hidden.shape[:-1])
    if sequence_parallel:
        expect = (lead[0] * tp_size,) + lead[1:]
        if tuple(labels.shape) != expect:
            raise ValueError(f"{name}: with sequence_parallel=True hidden {tuple(hidden.shape)} is this rank's "
                             f"sequence shard and labels must cover the whole sequence, shape {expect} "
                             f"(tp={tp_size}); got labels {tuple(labels.shape)}")
    elif tuple(labels.shape) != lead:
        hint = ""
        if tp_size > 1 and labels.dim() and labels.shape[0] == lead[0] * tp_size:
            hint = " (labels cover tp x hidden's sequence: pass sequence_parallel=True if hidden is a sequence shard)"
        raise ValueError(f"{name}: labels {tuple(labels.shape)} must have hidden's leading shape {lead}{hint}")
    if loss_mask is not None and (not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != labels.shape):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"{name}: loss_mask {got} must have the labels' shape {tuple(labels.shape)}")
    v_local = weight.shape[0]
    n_tokens = max(labels.numel(), 1)
    for arg, v in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}: {arg} must be a positive int (or None for the default), got {v!r}")
    if weight_grad not in ("forward", "backward"):
        raise ValueError(f"{name}: weight_grad must be 'forward' (fp32 accumulator kept from the forward, 3 GEMMs) "
                         f"or 'backward' (per vocabulary tile in the backward, no accumulator, 4 GEMMs), "
                         f"got {weight_grad!r}")
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl must be 'auto', 'torch' or 'triton', got {impl!r} (opt-in, untested on "
                         "GPUs so far: 'triton_recompute')")
    if impl in ("triton", "triton_recompute"):
        triton_kernels.check_device(hidden)
    if impl == "auto":
        raise ValueError(f"{name}: resolve impl='auto' first (megatron_burst.loss.choice.resolve_impl)")
    if token_chunk is None and impl == "triton_recompute":
        token_chunk = n_tokens  # not chunked: its kernels walk token tiles (megatron_burst.loss.onchip)
    if token_chunk is None:
        token_chunk = default_token_chunk(n_tokens, v_local, hidden.shape[-1], hidden.dtype, hidden.device, impl,
                                          weight_grad)
        if tp_size > 1 and hidden.is_cuda:
            # The chunk count fixes the number of collectives: every rank must walk the same chunks,
            # but free memory (fast path) or a fallback (another impl) may differ between ranks.
            token_chunk = _agreed_chunk(token_chunk, tp_group, (n_tokens, v_local, hidden.shape[-1], hidden.dtype),
                                        hidden.device)
    token_chunk = min(token_chunk, n_tokens)
    vocab_chunk = min(vocab_chunk or DEFAULT_VOCAB_CHUNK, v_local)
    return LossConfig(tp_group if tp_size > 1 else None, tp_size, tp_rank, v_local, token_chunk, vocab_chunk,
                      ignore_index, bool(sequence_parallel), impl, weight_grad)


def default_token_chunk(n_tokens: int, v_local: int, d: int, dtype: torch.dtype, device: torch.device,
                        impl: str, weight_grad: str = "forward") -> int:
    """Tokens per chunk when the caller gives none. torch path: a token_chunk x V_local fp32 logits
    tile of at most DEFAULT_TILE_ELEMS values; fast path: :func:`fast_token_chunk`
    (a bounded number of bytes per chunk, at least ~1024 tokens, within the free memory).

    weight_grad="backward" (the memory-lean mode) also keeps the fast path's chunk within the
    weight gradient's own size, so that the forward never peaks above the backward (the two
    gradients + <= 1 MiB: :mod:`megatron_burst.loss.vocab_pass`); its forward has no weight-
    gradient GEMM, so smaller chunks cost little (at least LEAN_MIN_CHUNK tokens)."""
    if impl == "triton":
        t = fast_token_chunk(n_tokens, v_local, d, dtype, device)
        if weight_grad == "backward":
            elt = torch.finfo(dtype).bits // 8
            lean = max(LEAN_MIN_CHUNK, (d * elt) // bytes_per_logit(dtype) // 128 * 128)
            t = min(t, lean)
        return t
    token_chunk = max(1, DEFAULT_TILE_ELEMS // v_local)
    if token_chunk >= 128:
        token_chunk -= token_chunk % 128  # whole GEMM tiles
    return token_chunk


_AGREED_CHUNKS: dict[tuple, int] = {}


def _agreed_chunk(token_chunk: int, group: dist.ProcessGroup, shape: tuple, device: torch.device) -> int:
    """The smallest of the ranks' default chunks (one MIN all-reduce and host read per group and
    shape, then cached; the key holds only what every rank shares)."""
    key = (id(group), shape)
    if key not in _AGREED_CHUNKS:
        t = torch.tensor([token_chunk], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        _AGREED_CHUNKS[key] = int(t.item())
    return _AGREED_CHUNKS[key]


def token_weights(labels: torch.Tensor, loss_mask: Optional[torch.Tensor], ignore_index: int) -> torch.Tensor:
    """w_t = loss_mask_t (1 without a mask), 0 for ignored labels; [N] fp32."""
    valid = (labels.reshape(-1) != ignore_index).float()
    return valid if loss_mask is None else valid * loss_mask.reshape(-1).float()


def local_targets(labels: torch.Tensor, cfg: LossConfig, none: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's column in this rank's vocabulary shard, or ``none`` where this rank does not hold
    it or the label is ignored; whether it does), [T] each (int64, bool)."""
    local = labels - cfg.vocab_start
    hit = (local >= 0) & (local < cfg.v_local) & (labels != cfg.ignore_index)
    return torch.where(hit, local, none), hit


def labels_out_of_range(labels: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """0-dim bool on labels' device: some label is neither ``ignore_index`` nor in [0, V). No host read."""
    bad = (labels != cfg.ignore_index) & ((labels < 0) | (labels >= cfg.vocab_size))
    return bad.any()


def check_labels(labels: torch.Tensor, cfg: LossConfig, name: str = "fused_linear_cross_entropy") -> None:
    """Raise ValueError naming the first label outside the vocabulary (one host read)."""
    if labels.numel() and bool(labels_out_of_range(labels, cfg)):
        raise_label_error(labels, cfg, name)


def raise_label_error(labels: torch.Tensor, cfg: LossConfig, name: str = "fused_linear_cross_entropy") -> NoReturn:
    """Raise the ValueError for the first out-of-range label (call only once one is known to exist)."""
    bad = (labels != cfg.ignore_index) & ((labels < 0) | (labels >= cfg.vocab_size))
    idx = tuple(int(i) for i in bad.nonzero()[0])
    value = int(labels[idx])
    fix = (" -- if weight is a tensor-parallel vocabulary shard, pass tp_group" if cfg.tp_size == 1 and value >= 0
           else f"; mark padding with ignore_index={cfg.ignore_index}")
    raise ValueError(f"{name}: labels{list(idx)} = {value} is outside the vocabulary [0, {cfg.vocab_size}) "
                     f"(tp={cfg.tp_size} x {cfg.v_local} rows){fix}")


FAST_CHUNK_BYTES = 1 << 30  # logits-sized bytes of one chunk (fp32 logits + bf16 gradient)
LEAN_MIN_CHUNK = 256  # tokens: the smallest default chunk of weight_grad="backward" (see default_token_chunk)
MIN_EFFICIENT_CHUNK = 1024  # tokens: GEMM 4 (fp32 accumulator) is compute-bound above ~T = 1200 on Hopper


def bytes_per_logit(dtype: torch.dtype) -> int:
    """Chunk bytes per logit: fp32 logits, plus a separate G in the GEMM dtype unless that is fp32."""
    return 4 if dtype == torch.float32 else 6


def fast_token_chunk(n_tokens: int, v_local: int, d: int, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per chunk for the fast path (megatron_burst.loss.fast), from N, V_local, d, the dtype and
    the free memory (see that module's docstring)."""
    per_token = v_local * bytes_per_logit(dtype)
    t = max(FAST_CHUNK_BYTES // per_token, MIN_EFFICIENT_CHUNK)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        elt = torch.finfo(dtype).bits // 8
        persistent = n_tokens * d * elt + v_local * d * 4  # D and A, allocated before the chunk buffer
        t = min(t, max((free // 2 - persistent) // per_token, 128))
    for step in (512, 256, 128):
        if t >= step:
            t -= t % step
            break
    return max(1, min(t, n_tokens))
