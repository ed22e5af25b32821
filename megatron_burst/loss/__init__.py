"""Fused vocab-parallel LM head + cross-entropy (BurstEngine §3.3) and its baselines.

  fused_linear_cross_entropy      -- the fused op: no N x V tensor, no vocabulary matmul in backward
  recompute_linear_cross_entropy  -- chunked, recomputes logits in backward (CCE-style baseline)
  reference_linear_cross_entropy  -- plain full-logits fp32 autograd version (tests)
  backward_paths, FusedLossRecomputeWarning -- which backward path the fused op took

Modules: fused (public function, algorithm), autograd (its autograd function), choice (what
impl="auto" runs: the self-checked fast path on CUDA), fast (the GPU fast path: cuBLAS GEMMs + one
fused Triton pass per chunk; FLOPs / bytes / memory), triton_kernels (its Triton kernel), chunks
(chunk walker, torch backend), parallel (TP / SP collectives), config (validation and chunking),
recompute, reference; onchip (the opt-in impl="triton_recompute": logits recomputed on chip, untimed).
"""
from megatron_burst.loss.autograd import FusedLossRecomputeWarning, backward_paths
from megatron_burst.loss.config import DEFAULT_TILE_ELEMS
from megatron_burst.loss.fused import fused_linear_cross_entropy
from megatron_burst.loss.recompute import recompute_linear_cross_entropy
from megatron_burst.loss.reference import reference_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy", "recompute_linear_cross_entropy", "reference_linear_cross_entropy",
           "backward_paths", "FusedLossRecomputeWarning", "DEFAULT_TILE_ELEMS"]
