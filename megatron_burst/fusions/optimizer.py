"""Torch-native stand-ins for the fused optimizer kernels Megatron-Core takes from
TransformerEngine or apex.

Without either, megatron.core 0.16 falls back to torch's ``AdamW`` (the multi-tensor ``foreach``
implementation: about ten passes over parameters and states, plus a temporary of the parameters'
size) and to per-tensor Python loops for the gradient norm (one host synchronization per tensor),
gradient clipping and the main-to-model parameter copy. Here the same math runs as:

* :class:`FusedTorchAdam`: ``torch.optim.Adam(fused=True)`` (one kernel reading parameter, gradient
  and both moments once), constructed like apex's / TE's ``FusedAdam`` (``adam_w_mode``), so
  megatron.core's ``get_megatron_optimizer`` can build it in their place.
* :func:`multi_tensor_l2norm` / :func:`multi_tensor_scale`: the call signatures of apex's
  ``amp_C.multi_tensor_l2norm`` / ``multi_tensor_scale`` (through megatron.core's
  ``local_multi_tensor_applier``) over ``torch._foreach_*`` ops: no host synchronization, one
  launch per group of tensors instead of one or two per tensor.

:mod:`megatron_burst.megatron.te_free` installs them into megatron.core (``--te-free-fusions``).
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["FusedTorchAdam", "multi_tensor_l2norm", "multi_tensor_scale", "fused_adam_unavailable"]


def fused_adam_unavailable() -> Optional[str]:
    """Why :class:`FusedTorchAdam` cannot be built with this torch (None: it can)."""
    if "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam.__init__).parameters:
        return (f"torch {torch.__version__}'s Adam has no decoupled_weight_decay argument (AdamW mode of a "
                "fused Adam): use a newer torch, or drop --te-free-fusions")
    return None


class FusedTorchAdam(torch.optim.Adam):
    """``torch.optim.Adam(fused=True)`` with apex / TransformerEngine ``FusedAdam``'s constructor.

    ``adam_w_mode=True`` (their default, and megatron.core's with ``decoupled_weight_decay``) is
    AdamW: the decay multiplies the parameter by ``1 - lr * weight_decay`` outside the moments;
    False is Adam with L2 regularization. The state is torch's (``step``, ``exp_avg``,
    ``exp_avg_sq`` per parameter), which megatron.core's checkpointing reads when neither TE nor
    apex is installed. Parameters may be on any device torch's fused Adam supports (CUDA, CPU, ...).
    Arguments of the fused libraries that change the algorithm or the state's precision
    (``bias_correction=False``, ``master_weights``, ``exp_avg_dtype``, ...) are refused.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adam_w_mode: bool = True, bias_correction: bool = True,
                 amsgrad: bool = False, **unsupported: Any) -> None:
        if unsupported:
            raise TypeError(f"FusedTorchAdam (--te-free-fusions) does not take {sorted(unsupported)}: these are "
                            "TransformerEngine's precision-aware optimizer options; drop them or install TE")
        if not bias_correction:
            raise ValueError("FusedTorchAdam: bias_correction=False is not torch's Adam; drop --te-free-fusions")
        why = fused_adam_unavailable()
        if why:
            raise RuntimeError(why)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True, decoupled_weight_decay=adam_w_mode)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                        per_tensor: bool, *args: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The L2 norm of all tensors of ``tensor_lists[0]`` together: ([1] fp32 on their device, the
    per-tensor norms [n] fp32 when ``per_tensor`` else None). apex's ``multi_tensor_l2norm``
    signature; ``chunk_size`` and ``noop_flag`` are unused (no chunking, and like megatron.core's
    local fallback it does not flag non-finite values). Never synchronizes with the host."""
    tensors = tensor_lists[0]
    if not tensors:
        raise ValueError("multi_tensor_l2norm: no tensors (megatron.core calls it only with some)")
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors, 2.0)])
    total = torch.linalg.vector_norm(norms, 2.0).reshape(1)
    return total, (norms if per_tensor else None)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                       scale: float) -> None:
    """``dst = src * scale`` for every pair of ``tensor_lists = [srcs, dsts]`` (dtypes may differ:
    fp32 main parameters into bf16 model parameters), in place where ``dst is src``. apex's
    ``multi_tensor_scale`` signature; ``chunk_size`` and ``noop_flag`` unused (as in
    megatron.core's local fallback, non-finite values are not flagged)."""
    srcs, dsts = tensor_lists[0], tensor_lists[1]
    if len(srcs) != len(dsts):
        raise ValueError(f"multi_tensor_scale: {len(srcs)} sources but {len(dsts)} destinations")
    if not srcs:
        return
    in_place = all(s is d for s, d in zip(srcs, dsts))
    if in_place:
        if scale != 1.0:
            torch._foreach_mul_(dsts, scale)
        return
    if any(s is d for s, d in zip(srcs, dsts)):
        raise ValueError("multi_tensor_scale: some destinations are their sources and some are not; "
                         "pass either all in place or none")
    torch._foreach_copy_(dsts, srcs if scale == 1.0 else torch._foreach_mul(srcs, scale))
