"""The activation store of sequence-level selective checkpointing (BurstEngine §3.2).

Activations kept between a checkpointed forward and its recompute, not model checkpoints (those
are :mod:`megatron_burst.train.checkpointing`).

Under causal masking, a query's attention cost grows with its position: the later half of a
sequence costs 3/4 of the attention FLOPs. With activation recompute on, core attention therefore
stores (out, lse) of the *later* ``stored_fraction`` of the global sequence during the first
(no-grad) forward, and in the recompute computes only the earlier part, taking the rest from the
store. Storing the later half (0.5) keeps half of what storing every attention output would
("selective++") and skips 3/4 of the recomputed attention FLOPs.

"Earlier/later" is by global token position, per rank: each rank stores its ``stored_fraction``
latest queries. Every layout keeps a rank's tokens in increasing global order, so those are the
last local rows and the recomputed ones a prefix, on every rank, in every layout; every rank
stores the same number of bytes. With zigzag and striped at 0.5 this is exactly the later half of
the global sequence; striped also gives every rank the same recompute work, while under zigzag the
rank holding the later early chunk recomputes more (rank r's earlier chunk costs ~ 2r + 1).

The store
---------
One :class:`SelectiveAttentionCache` per layer: a FIFO with one entry per micro-batch whose
recompute is pending. Megatron recomputes checkpointed regions in the order of their first
forwards (also under pipeline schedules), so a recompute is served by the head. Matching never
reads a device value on the host, so it adds no synchronisation to the step:

* Host key: shapes, strides, dtypes and devices of q, k, v and the call's options (CP configuration,
  stored fraction). A head whose key differs from the recompute's is stale (a first forward that
  was never recomputed): it is dropped (counted in ``dropped``, warned once per store) and the
  next entry is tried. An empty store is a miss: the recompute computes every row itself.
* Content: :func:`fingerprint` of q, k, v, computed on their device with position-dependent
  weights (so sequences, rows or columns in another order give another value; plain sums do not)
  is kept with the entry. When an entry is served, the recompute's fingerprint is compared with
  it on the device and a mismatch is added to a device counter. :meth:`~SelectiveAttentionCache.release`
  and :func:`end_iteration` read the counters (one sync per device, at a point where a trainer
  syncs anyway) and raise RuntimeError if any recompute was served another input's entry. This is
  the same on every device, CPU included: a mismatch never raises in the middle of a step.

Call ``end_iteration(model)`` after an iteration's last backward and before the optimizer step:
it verifies, drops entries whose recompute never came (so the next iteration cannot be served
them) and raises before wrong gradients reach the weights. A flow that never calls it keeps
working as long as every first forward that stores is recomputed (Megatron-LM's training loop
recomputes every training forward, and evaluation runs in eval mode, which stores nothing), but
then nothing reads the content check.

Byte cap: a first forward whose tail would take the store past ``max_bytes`` stores a
placeholder (the host key only) instead; its recompute then computes every row. The FIFO order is
unchanged, so reaching the cap costs recompute, never correctness (evicting the oldest entry would
hand its recompute the next micro-batch's entry).
"""
from __future__ import annotations

import math
import os
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_burst.algorithms.function import to_bhsd
from megatron_burst.algorithms.prepare import Prepared, prepare

__all__ = ["SelectiveAttentionCache", "selective_cp_attention", "end_iteration", "release_before_optimizer_steps",
           "stores_of", "fingerprint", "host_key", "recomputed_rows", "HostKey", "DEFAULT_MEMORY_FRACTION"]

# By default all stores of a process together hold at most this fraction of the device's memory.
DEFAULT_MEMORY_FRACTION = 0.25
# Elements upcast to fp32 at a time by the fingerprint: bounds its scratch memory.
_FINGERPRINT_CHUNK = 1 << 24
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0

_LIVE_STORES: "weakref.WeakSet[SelectiveAttentionCache]" = weakref.WeakSet()
_WEIGHTS: dict[tuple, torch.Tensor] = {}
_DEVICE_MEMORY: dict[torch.device, int] = {}

HostKey = tuple


@dataclass
class _Entry:
    """One pending recompute: its host key and (out, lse) of its later rows, or a placeholder
    (``out_tail`` None) for a first forward that did not fit under the byte cap."""

    key: HostKey
    rows: int
    fingerprint: Optional[torch.Tensor] = None  # [3] fp64 on the device
    out_tail: Optional[torch.Tensor] = None  # [b, hq, n - rows, d]
    lse_tail: Optional[torch.Tensor] = None  # [b, hq, n - rows] fp32

    @property
    def nbytes(self) -> int:
        """Bytes of the stored (out, lse) tail (the 24-byte fingerprint is not counted)."""
        if self.out_tail is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.out_tail, self.lse_tail))


class SelectiveAttentionCache:
    """Per-layer FIFO of (out, lse) tails from checkpointed first forwards (see module docstring).

    ``max_bytes`` caps the bytes held; None: an equal share, among the live stores of the process,
    of ``DEFAULT_MEMORY_FRACTION`` of the device's memory. ``name`` labels warnings and errors
    (:func:`end_iteration` uses the module path instead).

    Counters (cumulative): ``hits`` (recomputes served an entry), ``misses`` (recomputes that
    computed every row), ``dropped`` (entries discarded unserved: stale heads and entries left at a
    release), ``refused`` (first forwards over the byte cap); ``peak_nbytes`` is the most held at once.
    """

    def __init__(self, max_bytes: Optional[int] = None, name: str = "selective-checkpoint store") -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0 (or None for the default share of device memory)")
        self.max_bytes = max_bytes
        self.name = name
        self._entries: deque[_Entry] = deque()
        self._nbytes = 0
        self.peak_nbytes = 0
        self.hits = self.misses = self.dropped = self.refused = 0
        # Served entries whose fingerprint differed from the recompute's: counted on the device,
        # read at release. _served counts the comparisons behind them (host side).
        self._stale_counts: dict[torch.device, torch.Tensor] = {}
        self._served = 0
        self._warned: set[str] = set()
        _LIVE_STORES.add(self)

    def __len__(self) -> int:
        """Pending recomputes (entries and placeholders)."""
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes currently stored."""
        return self._nbytes

    def byte_cap(self, device: torch.device) -> int:
        """``max_bytes``, or the default share of ``device``'s memory."""
        if self.max_bytes is not None:
            return self.max_bytes
        return int(_device_memory(device) * DEFAULT_MEMORY_FRACTION) // max(1, len(_LIVE_STORES))

    def put(self, key: HostKey, fingerprint: torch.Tensor, rows: int, out_tail: torch.Tensor,
            lse_tail: torch.Tensor) -> None:
        """Append the entry of a first forward (copies of the tails), or a placeholder over the cap."""
        entry = _Entry(key, rows, fingerprint, out_tail, lse_tail)
        cap = self.byte_cap(out_tail.device)
        if self._nbytes + entry.nbytes > cap:
            self.refused += 1
            self._warn_once("full", f"{self.name} holds {self._nbytes} bytes; another {entry.nbytes} would pass "
                            f"its cap of {cap} bytes, so this micro-batch's recompute will compute every row. "
                            "Raise the cap (SelectiveAttentionCache(max_bytes=...)) or check that every first "
                            "forward that stores is recomputed (megatron_burst.activation_store.end_iteration(model) "
                            "drops the ones that are not).")
            self._entries.append(_Entry(key, rows))
            return
        entry.out_tail, entry.lse_tail = out_tail.clone(), lse_tail.clone()
        self._entries.append(entry)
        self._nbytes += entry.nbytes
        self.peak_nbytes = max(self.peak_nbytes, self._nbytes)

    def take(self, key: HostKey, fingerprint: torch.Tensor) -> Optional[_Entry]:
        """The head entry for a recompute with ``key``, dropping stale heads before it; None: a miss.

        The content check of a served entry is queued on the device (read by :meth:`release`)."""
        stale = 0
        while self._entries and self._entries[0].key != key:
            self._discard(self._entries.popleft())
            stale += 1
        if stale:
            self._warn_once("stale", f"{self.name} dropped {stale} entr{'y' if stale == 1 else 'ies'} at its "
                            "head whose inputs' shapes or call options differ from this recompute's: their "
                            "first forwards were never recomputed (a training forward without backward?). "
                            "Pass store=False to selective_cp_attention for forwards that will not be "
                            "recomputed, and call megatron_burst.activation_store.end_iteration(model) after each "
                            "iteration's last backward.")
        if not self._entries:
            self.misses += 1
            if not stale:
                self._warn_once("empty", f"{self.name} has no entry for this recompute, which computes every "
                                "row (its first forward stored nothing, or the store was released between the "
                                "forward and its recompute).")
            return None
        entry = self._entries.popleft()
        self._nbytes -= entry.nbytes
        if entry.out_tail is None:  # placeholder of a first forward over the cap (warned at put)
            self.misses += 1
            return None
        self.hits += 1
        self._count_if_stale(entry.fingerprint, fingerprint)
        return entry

    def release(self) -> int:
        """Verify the content checks since the last release and drop every entry.

        Returns the number of entries dropped (first forwards that were never recomputed). Raises
        RuntimeError if a recompute was served an entry stored for other inputs."""
        return _release([(self.name, self)])

    # ------------------------------------------------------------------------------ internals
    def _discard(self, entry: _Entry) -> None:
        self._nbytes -= entry.nbytes
        self.dropped += 1

    def _count_if_stale(self, stored: torch.Tensor, recomputed: torch.Tensor) -> None:
        # Bitwise comparison (NaN-safe): a recompute repeats the first forward exactly.
        differs = torch.ne(stored.view(torch.int64), recomputed.view(torch.int64)).any()
        count = self._stale_counts.get(differs.device)
        if count is None:
            count = self._stale_counts[differs.device] = torch.zeros((), dtype=torch.int64, device=differs.device)
        count.add_(differs)
        self._served += 1

    def _drop_all(self) -> tuple[int, list[torch.Tensor], int]:
        """Empty the store: (entries dropped, pending device counts, served entries they cover)."""
        left = len(self._entries)
        while self._entries:
            self._discard(self._entries.popleft())
        counts, served = list(self._stale_counts.values()), self._served
        self._stale_counts, self._served = {}, 0
        return left, counts, served

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def _device_memory(device: torch.device) -> int:
    if device not in _DEVICE_MEMORY:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            _DEVICE_MEMORY[device] = torch.cuda.get_device_properties(index).total_memory
        else:  # host memory
            _DEVICE_MEMORY[device] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _DEVICE_MEMORY[device]


def _release(named_stores: list[tuple[str, SelectiveAttentionCache]]) -> int:
    """Drop every entry of the stores, then read their stale counts (one sync per device) and
    raise if any is non-zero. Returns the number of entries dropped."""
    left = 0
    pending: list[tuple[str, torch.Tensor, int]] = []
    for name, store in named_stores:
        dropped, counts, served = store._drop_all()
        left += dropped
        pending += [(name, c, served) for c in counts]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, count, _) in enumerate(pending):
        by_device.setdefault(count.device, []).append(i)
    stale_counts = [0] * len(pending)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([pending[i][1] for i in indices]).tolist()):
            stale_counts[i] = value
    stale = [(name, n, served) for (name, _, served), n in zip(pending, stale_counts) if n]
    if stale:
        where = "; ".join(f"{name}: {n} of {served} recomputes" for name, n, served in stale)
        raise RuntimeError(
            f"selective checkpointing served recomputes an (out, lse) stored for other q, k, v ({where} since "
            "the last release), so this iteration's gradients are wrong; if this runs before the optimizer "
            "step they have not been applied. Every first forward that stores must be recomputed, in order, "
            "before the next release: pass store=False to selective_cp_attention for forwards that will not "
            "be recomputed (eval, a forward without backward), call megatron_burst.activation_store.end_iteration("
            "model) after each iteration's last backward, and keep the recompute deterministic (bitwise the "
            "same q, k, v as the first forward).")
    return left


def stores_of(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> list[tuple[str, SelectiveAttentionCache]]:
    """(module path, store) of every SelectiveAttentionCache held as an attribute by a module of
    ``model`` (a module, or a list of model chunks as with virtual pipeline stages)."""
    roots = [model] if isinstance(model, torch.nn.Module) else list(model)
    found: list[tuple[str, SelectiveAttentionCache]] = []
    seen: set[int] = set()
    for i, root in enumerate(roots):
        prefix = f"[{i}]." if len(roots) > 1 else ""
        for path, module in root.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, SelectiveAttentionCache) and id(value) not in seen:
                    seen.add(id(value))
                    found.append((prefix + (f"{path}.{attr}" if path else attr), value))
    return found


def end_iteration(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> int:
    """Release every selective-checkpoint store of ``model``: call after an iteration's last
    backward and before the optimizer step. Returns the entries dropped (first forwards that were
    never recomputed); raises RuntimeError naming the layers if a recompute was served a stale entry.
    Reads one value per store from the device, in one transfer per device."""
    return _release(stores_of(model))


_RELEASED_BEFORE_STEP: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_STEP_HOOK = None


def release_before_optimizer_steps(model: torch.nn.Module) -> None:
    """Call :func:`end_iteration` on ``model`` before every optimizer step of this process.

    For training loops that do not call end_iteration themselves (Megatron-LM's): a global
    ``torch.optim`` step pre-hook (registered once) releases the stores of every model registered
    here, so a stale entry served this iteration is reported before its gradients are applied.
    Several optimizer steps per iteration (chained optimizers) release again at no cost.
    """
    global _STEP_HOOK
    if not stores_of(model):
        return
    _RELEASED_BEFORE_STEP.add(model)
    if _STEP_HOOK is None:
        def release_all(optimizer, args, kwargs) -> None:
            for registered in list(_RELEASED_BEFORE_STEP):
                end_iteration(registered)

        _STEP_HOOK = register_optimizer_step_pre_hook(release_all)


def fingerprint(*tensors: torch.Tensor) -> torch.Tensor:
    """[len(tensors)] fp64 on the tensors' device: per tensor, a sum of its elements weighted by a
    fixed pseudo-random weight per index along every dimension (a product of per-dimension weights).

    Reordered sequences, rows or columns change it (plain sums do not); computing it reads nothing
    back to the host. The last dimension is contracted in fp32 (fp64 for fp64 inputs), in chunks of
    at most 2**24 elements, the others in fp64.
    """
    with torch.no_grad():
        return torch.stack([_fingerprint_one(t.detach()) for t in tensors])


def _fingerprint_one(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 2:
        t = t.unsqueeze(0)
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    w = _position_weights(t.shape[-1], 0, acc, t.device)
    step = max(1, _FINGERPRINT_CHUNK // max(1, math.prod(t.shape[1:])))
    parts = [chunk.to(acc) @ w for chunk in t.split(step)]
    y = (parts[0] if len(parts) == 1 else torch.cat(parts)).double()
    level = 1
    while y.dim():
        y = y @ _position_weights(y.shape[-1], level, torch.float64, t.device)
        level += 1
    return y


def _position_weights(n: int, level: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Weights in [0.5, 1.5) for the n indices of one dimension: the golden-ratio sequence
    (distinct, spread out), offset per dimension; built on the device (no transfer, no RNG)."""
    key = (n, level, dtype, device)
    if key not in _WEIGHTS:
        i = torch.arange(n, dtype=torch.float64, device=device) + (1 + 7919 * level)
        _WEIGHTS[key] = (torch.frac(i * _GOLDEN) + 0.5).to(dtype)
    return _WEIGHTS[key]


def host_key(p: Prepared, rows: int, *tensors: torch.Tensor) -> HostKey:
    """What a recompute must share with its first forward, known on the host: the tensors' shapes,
    strides, dtypes and devices, the CP configuration, the backward scheme, the format and the rows
    recomputed."""
    cfg = p.cfg
    return (tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors),
            cfg.topology.group, cfg.topology.ranks_per_node, cfg.ring, cfg.layout, cfg.stripe, cfg.causal,
            cfg.scale, cfg.kernel, p.backward_algo, p.qkv_format, rows)


def recomputed_rows(local_len: int, stored_fraction: float) -> int:
    """Local rows recomputed: all but this rank's ``stored_fraction`` latest queries (a prefix)."""
    if not 0.0 <= stored_fraction <= 1.0:
        raise ValueError(f"stored fraction {stored_fraction} must be within [0, 1] (--seq-selective-ckpt-ratio)")
    return local_len - int(round(stored_fraction * local_len))


def selective_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cache: SelectiveAttentionCache,
                           stored_fraction: float, store: bool = True, **cp_kwargs) -> torch.Tensor:
    """cp_attention with sequence-level selective checkpointing; same arguments and result.

    For calls inside an activation checkpoint. Without grad (the checkpoint's first forward) it
    computes every row and, with ``store``, puts (out, lse) of the later ``stored_fraction`` in
    ``cache``; pass ``store=False`` when no recompute will follow (eval, a forward without
    backward), which makes the call plain cp_attention. With grad (the recompute) it computes only
    the earlier rows and takes the rest from the head of ``cache``; with no matching entry (a
    miss) it computes every row. Never reads a device value on the host.
    """
    p = prepare(q, k, v, **cp_kwargs)
    if not p.supports_row_cache:  # Ulysses/USP compute every row: a plain recompute
        return p.apply()
    rows = recomputed_rows(to_bhsd(p.q, p.qkv_format).shape[2], stored_fraction)
    entry = None
    if store:
        key, fp = host_key(p, rows, q, k, v), fingerprint(q, k, v)
        if not torch.is_grad_enabled():
            out, out_h, lse = p.forward_no_grad()
            cache.put(key, fp, rows, out_h[:, :, rows:], lse[:, :, rows:])
            return out
        entry = cache.take(key, fp)
    return p.apply(entry.rows, entry.out_tail, entry.lse_tail) if entry is not None else p.apply()
