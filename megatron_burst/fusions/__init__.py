"""Fused kernels for what megatron.core runs unfused without TransformerEngine and apex, each beside
the plain torch reference its tests compare against:

* :mod:`megatron_burst.fusions.rope` -- rotary position embeddings (sbhd and packed THD), one
  Triton kernel forward and one backward on CUDA;
* :mod:`megatron_burst.fusions.optimizer` -- torch's fused Adam with apex's ``FusedAdam``
  constructor, and the multi-tensor gradient norm / scale over ``torch._foreach`` ops.

:mod:`megatron_burst.megatron.te_free` installs them into megatron.core (``--te-free-fusions``).
"""
from megatron_burst.fusions.optimizer import FusedTorchAdam, multi_tensor_l2norm, multi_tensor_scale
from megatron_burst.fusions.rope import apply_rope, apply_rope_thd, rope_reference

__all__ = ["FusedTorchAdam", "multi_tensor_l2norm", "multi_tensor_scale", "apply_rope", "apply_rope_thd",
           "rope_reference"]
