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

from typing import Any, Optional

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
