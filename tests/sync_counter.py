"""Count the device-to-host synchronisations code would make on CUDA, while running it on CPU tensors.

On CPU nothing waits, so :class:`SyncCounter` counts what would: the ops that read a value back
(``aten._local_scalar_dense``: ``int(t)``, ``float(t)``, ``bool(t)``, ``t.item()``), the ops whose
output size depends on the data (``nonzero``, ``unique``, ``masked_select``, indexing by a bool
mask, ``repeat_interleave`` by a tensor without ``output_size``, ``bincount``: on CUDA each reads
a size back before it can allocate), copies to the host (``_to_copy`` / ``copy_`` from another
device to the CPU) and ``Tensor.tolist`` / ``Tensor.cpu`` / ``Tensor.numpy`` calls (on CPU tensors
they dispatch nothing, so they are counted by wrapping the methods while the counter is active).
``nonzero_static`` (its size given) is not a synchronisation.

    with SyncCounter() as c:
        plan = ...
    c.count, c.ops  # total, and the ops counted (a Counter by name)
"""
from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_READ_BACK = {aten._local_scalar_dense.default}
_DATA_SIZED = {aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
               aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default}
_HOST_METHODS = ("tolist", "cpu", "numpy")


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class SyncCounter(TorchDispatchMode):
    """Counts the would-be synchronisations of the code run inside it (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self._saved: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = None
        if func in _READ_BACK or func in _DATA_SIZED:
            name = str(func.overloadpacket.__name__)
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _is_bool_index(args[1]):
            name = f"{func.overloadpacket.__name__} (bool mask)"
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            name = "repeat_interleave"
        elif func is aten._to_copy.default and kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu":
                name = "copy to host"
        elif func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            name = "copy to host"
        if name is not None:
            self.ops[name] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for method in _HOST_METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = torch.Tensor.__dict__.get(method)

            def counted(tensor, *a, _original=original, _method=method, **kw):
                self.ops[f"Tensor.{_method}"] += 1
                return _original(tensor, *a, **kw)
            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for method, saved in self._saved.items():
                if saved is None:
                    delattr(torch.Tensor, method)
                else:
                    setattr(torch.Tensor, method, saved)
            self._saved = {}
