"""Calling torch's private fused attention ops by their schema, on any torch from 2.6 on.

The fused CUDA attention of torch (``aten._scaled_dot_product_flash_attention`` and
``aten._scaled_dot_product_cudnn_attention`` with their backwards) are private ops: argument
lists, placeholder conventions and output shapes change between releases. This module binds
arguments by the names in the op's registered schema (not by position), so a renamed or added
argument is an explicit :class:`OpSchemaError` naming the op and the argument, never a silently
shifted call. The "no varlen / no dropout" placeholders a backward takes (cumulative sequence
lengths, RNG state) are the values the op's own forward returns for a dense call: that is what
torch's autograd passes, so it is right for the installed build by construction.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class OpSchemaError(RuntimeError):
    """The installed torch registers a private op with a schema this adapter does not know."""


def op_packet(name: str) -> Optional[Any]:
    """``torch.ops.aten.<name>`` or None when this torch build lacks it."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


def schema_arguments(name: str) -> Optional[list]:
    """The arguments of ``aten::<name>.default`` (torch.FunctionSchema arguments), or None if absent."""
    packet = op_packet(name)
    if packet is None:
        return None
    try:
        return list(packet.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return None


def missing_reason(name: str, needed: tuple[str, ...]) -> Optional[str]:
    """Why ``aten::<name>`` cannot be called with the arguments ``needed`` (None: it can)."""
    args = schema_arguments(name)
    if args is None:
        return f"torch {torch.__version__} has no aten::{name}"
    names = {a.name for a in args}
    absent = [n for n in needed if n not in names]
    if absent:
        return f"aten::{name} in torch {torch.__version__} has no argument(s) {', '.join(absent)}"
    required = [a.name for a in args if a.name not in needed and not a.has_default_value()
                and "Optional" not in str(a.type)]
    if required:
        return f"aten::{name} in torch {torch.__version__} requires argument(s) {', '.join(required)} this adapter does not pass"
    return None


def call(name: str, **kwargs: Any):
    """Call ``aten::<name>`` with ``kwargs`` bound by schema name: positional arguments in schema
    order, keyword-only ones by keyword. Raises OpSchemaError when the schema lacks a given name or
    requires one not given (the call would otherwise shift arguments or fail obscurely)."""
    args = schema_arguments(name)
    if args is None:
        raise OpSchemaError(f"torch {torch.__version__} has no aten::{name}")
    unknown = set(kwargs) - {a.name for a in args}
    if unknown:
        raise OpSchemaError(f"aten::{name} in torch {torch.__version__} has no argument(s) {', '.join(sorted(unknown))}; "
                            f"its schema: {op_packet(name).default._schema}")
    positional, keyword = [], {}
    for a in args:
        if a.name not in kwargs:
            if not a.has_default_value() and "Optional" not in str(a.type):
                raise OpSchemaError(f"aten::{name} in torch {torch.__version__} requires {a.name!r}; its schema: "
                                    f"{op_packet(name).default._schema}")
            if not a.kwarg_only:
                # a later positional argument is given: every earlier one must be spelled out
                if any(b.name in kwargs and not b.kwarg_only for b in args[args.index(a) + 1:]):
                    positional.append(a.default_value if a.has_default_value() else None)
            continue
        if a.kwarg_only:
            keyword[a.name] = kwargs[a.name]
        else:
            positional.append(kwargs[a.name])
    return op_packet(name).default(*positional, **keyword)


def fake_mode_active() -> bool:
    """Under FakeTensorMode (CPU tests of the CUDA adapters) the schema checks still apply."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def fused_op_unavailable(fwd: str, fwd_args: tuple[str, ...], bwd: str, bwd_args: tuple[str, ...]) -> Optional[str]:
    """Why torch's fused CUDA op pair (``fwd``, ``bwd``) cannot be called here (None: it can)."""
    if not torch.cuda.is_available() and not fake_mode_active():
        return "no CUDA device"
    return missing_reason(fwd, fwd_args) or missing_reason(bwd, bwd_args)


def fused_op_supports(dtype: torch.dtype, head_dim: int, kind: str, max_head_dim: int) -> Optional[str]:
    """Why torch's fused CUDA attention ops do not cover (dtype, head dim, kind) (None: they do)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"fp16/bf16 only, not {dtype}"
    if head_dim % 8 or head_dim > max_head_dim:
        return f"head dim a multiple of 8 up to {max_head_dim}, not {head_dim}"
    if kind not in ("full", "causal"):
        return f"mask kind {kind!r} (full and causal only)"
    return None


_DENSE_OUTPUTS: dict[tuple, tuple] = {}


def dense_call_outputs(fwd: str, device: torch.device, dtype: torch.dtype,
                       run: Callable[[torch.Tensor], tuple]) -> tuple:
    """What ``run`` (a call of the forward op ``fwd`` on one tiny dense input) returns on (device,
    dtype), once: the placeholders its backward takes for a dense call. Not kept under fake tensors
    (they must not stand in for a real run's)."""
    key = (fwd, str(device), dtype)
    if key in _DENSE_OUTPUTS:
        return _DENSE_OUTPUTS[key]
    found = tuple(run(torch.zeros(1, 1, 16, 8, dtype=dtype, device=device)))
    if not fake_mode_active():
        _DENSE_OUTPUTS[key] = found
    return found
