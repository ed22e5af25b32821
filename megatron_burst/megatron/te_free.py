"""``--te-free-fusions``: fused kernels for megatron.core where neither TransformerEngine nor apex is
installed (the same math as the unfused fallbacks megatron.core runs there).

What megatron.core 0.16 runs without TE and apex, and what :func:`install` puts in its place:

* RoPE: ``apply_rope_fusion`` needs TE's ``fused_apply_rotary_pos_emb`` (``TransformerConfig``
  refuses the flag without it, so a TE-free Megatron-LM run passes ``--no-rope-fusion`` and applies
  RoPE in ~6 elementwise kernels per tensor, forward and backward) -> :mod:`megatron_burst.fusions.rope`
  (one Triton kernel each way on CUDA, self-checked); Megatron-LM's default ``--rope-fusion`` then works.
* Adam: torch's ``AdamW`` with its multi-tensor ``foreach`` implementation -> torch's fused Adam
  (:class:`~megatron_burst.fusions.optimizer.FusedTorchAdam`).
* Gradient norm, clipping and the fp32-main -> bf16-model parameter copy: per-tensor Python loops
  (the norm with one host synchronization per tensor) -> ``torch._foreach`` ops
  (:func:`~megatron_burst.fusions.optimizer.multi_tensor_l2norm` / ``multi_tensor_scale``).

Each replacement goes into the megatron.core module attribute that megatron.core reads when it
runs (``rope_utils.fused_apply_rotary_pos_emb[_thd]``, ``optimizer.Adam`` /
``USING_PYTORCH_OPTIMIZER``, ``optimizer.optimizer.multi_tensor_scale_impl``,
``optimizer.clip_grads.l2_norm_impl`` / ``multi_tensor_scale_impl``), and only where that attribute
still holds megatron.core's TE/apex-free fallback: what TE or apex provide is left as it is. Call it
before the model's ``TransformerConfig`` and the optimizer are built (the Megatron-LM glue does so in
its model provider, :mod:`megatron_burst.train` at setup). :func:`uninstall` restores the originals.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["install", "uninstall", "unfused_here", "fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"]

# (module, attribute) -> the value megatron.core had before install()
_ORIGINALS: Dict[Tuple[str, str], Any] = {}


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """TE's ``fused_apply_rotary_pos_emb`` signature (megatron.core.extensions.transformer_engine):
    t [s, b, h, d] (sbhd), freqs [s, 1, 1, r] fp32 -> [s, b, h, d]. ``transpose_output_memory`` is
    ignored, as TE >= 2.3 ignores it."""
    from megatron_burst.fusions.rope import apply_rope

    return apply_rope(t, freqs, interleaved=interleaved)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                                   cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """TE's ``fused_apply_rotary_pos_emb_thd`` signature: t [T, h, d] packed sequences whose global
    (CP-padded) boundaries are ``cu_seqlens`` [n + 1], this rank's zigzag part of each; freqs
    [max_s, 1, 1, r] -> [T, h, d]."""
    from megatron_burst.fusions.rope import apply_rope_thd

    return apply_rope_thd(t, cu_seqlens, freqs, cp_size=cp_size, cp_rank=cp_rank)


def _set(module: str, name: str, value: Any) -> None:
    mod = importlib.import_module(module)
    _ORIGINALS.setdefault((module, name), getattr(mod, name))
    setattr(mod, name, value)


def _fallbacks() -> Dict[str, Callable]:
    from megatron.core import utils

    return {"scale": utils.local_multi_tensor_scale, "l2norm": utils.local_multi_tensor_l2_norm}


def install() -> List[str]:
    """Put the fused kernels into megatron.core where it holds its TE/apex-free fallbacks (module
    docstring). Idempotent. Returns one line per component: what now runs, or why it was left."""
    from megatron_burst.fusions import optimizer as fused_opt
    from megatron_burst.fusions.rope import describe as describe_rope

    lines: List[str] = []
    rope = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    ours_line = f"megatron-burst's ({describe_rope(_device(), torch.bfloat16)})"
    for name, ours in (("fused_apply_rotary_pos_emb", fused_apply_rotary_pos_emb),
                       ("fused_apply_rotary_pos_emb_thd", fused_apply_rotary_pos_emb_thd)):
        current = getattr(rope, name, None)
        if current is None or current is ours:
            _set(rope.__name__, name, ours)
            lines.append(f"{name}: {ours_line}")
        else:
            lines.append(f"{name}: left as it is ({_origin(current)})")

    opt_pkg = importlib.import_module("megatron.core.optimizer")
    if getattr(opt_pkg, "Adam", None) is fused_opt.FusedTorchAdam:
        lines.append("Adam: torch's fused Adam (FusedTorchAdam)")
    elif getattr(opt_pkg, "USING_PYTORCH_OPTIMIZER", False):
        why = fused_opt.fused_adam_unavailable()
        if why:
            raise RuntimeError(f"--te-free-fusions: {why}")
        _set(opt_pkg.__name__, "Adam", fused_opt.FusedTorchAdam)
        # megatron.core then builds Adam(..., adam_w_mode=...) as it does TE's / apex's FusedAdam
        _set(opt_pkg.__name__, "USING_PYTORCH_OPTIMIZER", False)
        lines.append("Adam: torch's fused Adam (FusedTorchAdam) instead of torch's foreach AdamW")
    else:
        lines.append(f"Adam: left as it is ({_origin(getattr(opt_pkg, 'Adam', None))})")

    fallback = _fallbacks()
    targets = (("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl", "scale", fused_opt.multi_tensor_scale),
               ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl", "scale", fused_opt.multi_tensor_scale),
               ("megatron.core.optimizer.clip_grads", "l2_norm_impl", "l2norm", fused_opt.multi_tensor_l2norm))
    for module, name, kind, ours in targets:
        mod = importlib.import_module(module)
        current = getattr(mod, name, None)
        label = f"{module.rsplit('.', 1)[-1]}.{name}"
        if current is ours:
            lines.append(f"{label}: torch _foreach ops")
        elif current is fallback[kind]:
            _set(module, name, ours)
            lines.append(f"{label}: torch _foreach ops instead of megatron.core's per-tensor loop")
        else:
            lines.append(f"{label}: left as it is ({_origin(current)})")
    return lines


def unfused_here(device: Optional[torch.device] = None) -> Optional[str]:
    """Without ``--te-free-fusions``: the start-up line saying what megatron.core runs unfused on
    this CUDA machine for want of TE and apex, and the flag that changes it (None on CPU, where
    these are not the cost, or where TE / apex or the fusions are in place)."""
    device = device or _device()
    if device.type != "cuda":
        return None
    opt_pkg = importlib.import_module("megatron.core.optimizer")
    if not getattr(opt_pkg, "USING_PYTORCH_OPTIMIZER", False):
        return None
    return ("megatron-burst: neither TransformerEngine nor apex is installed, so megatron.core runs RoPE unfused "
            "(--no-rope-fusion), torch's foreach AdamW and per-tensor gradient-norm / copy loops; "
            "--te-free-fusions gives it fused kernels for these (same math)")


def uninstall() -> None:
    """Restore every megatron.core attribute :func:`install` replaced."""
    for (module, name), value in reversed(list(_ORIGINALS.items())):
        setattr(importlib.import_module(module), name, value)
    _ORIGINALS.clear()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _origin(obj: Optional[Any]) -> str:
    if obj is None:
        return "none"
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
