"""Sequence-level selective checkpointing (BurstEngine §3.2).

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

The store is one :class:`SelectiveAttentionCache` per layer: a FIFO of entries, one per
micro-batch in flight, matched on recompute by a fingerprint of (q, k, v). Recompute runs in the
order of the first forwards, so the match is the oldest entry; older unmatched entries can never be
used again and are dropped; a miss falls back to a full forward. An entry is never served for
inputs other than its own.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_burst.algorithms import prepare, to_bhsd


@dataclass
class _Entry:
    key: tuple
    rows: int
    out_tail: torch.Tensor
    lse_tail: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.out_tail.numel() * self.out_tail.element_size() + self.lse_tail.numel() * 4


class SelectiveAttentionCache:
    """Per-layer store of (out, lse) tails from checkpointed first forwards (see module docstring)."""

    def __init__(self, max_entries: int = 64) -> None:
        self._entries: deque[_Entry] = deque()
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self.dropped = 0
        self.peak_nbytes = 0  # the most this cache held at once (the stored-activation cost)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes currently stored."""
        return sum(e.nbytes for e in self._entries)

    def put(self, entry: _Entry) -> None:
        if len(self._entries) >= self.max_entries:  # a first forward that was never recomputed
            self._entries.popleft()
            self.dropped += 1
        self._entries.append(entry)
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def take(self, key: tuple) -> Optional[_Entry]:
        """The entry for ``key``, dropping older ones (they can no longer be recomputed), or None."""
        for i, e in enumerate(self._entries):
            if e.key == key:
                for _ in range(i):
                    self._entries.popleft()
                    self.dropped += 1
                self.hits += 1
                return self._entries.popleft()
        self.misses += 1
        return None

    def clear(self) -> None:
        self._entries.clear()


def fingerprint(*tensors: torch.Tensor) -> tuple:
    """Exact identity of recomputed inputs: shapes, dtypes and fp64 sums (a recompute is bitwise equal)."""
    sums = torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors]).tolist()
    return tuple((tuple(t.shape), t.dtype) for t in tensors) + tuple(sums)


def stored_rows(local_len: int, stored_fraction: float) -> int:
    """Local rows recomputed: all but this rank's ``stored_fraction`` latest queries (a prefix)."""
    if not 0.0 <= stored_fraction <= 1.0:
        raise ValueError(f"stored fraction {stored_fraction} must be within [0, 1] (--seq-selective-ckpt-ratio)")
    return local_len - int(round(stored_fraction * local_len))


def selective_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cache: SelectiveAttentionCache,
                           stored_fraction: float, **cp_kwargs) -> torch.Tensor:
    """cp_attention with sequence-level selective checkpointing; same arguments and result.

    Without grad (the first forward of a checkpointed region) it computes everything and stores the
    later ``stored_fraction`` of (out, lse) in ``cache``; with grad (the recompute) it computes only
    the earlier rows and reuses the stored ones. With grad and no stored entry it is plain
    cp_attention.
    """
    p = prepare(q, k, v, **cp_kwargs)
    rows = stored_rows(to_bhsd(p.q, p.qkv_format).shape[2], stored_fraction)
    key = fingerprint(q, k, v)
    if not torch.is_grad_enabled():
        out, out_h, lse = p.forward_no_grad()
        cache.put(_Entry(key, rows, out_h[:, :, rows:].clone(), lse[:, :, rows:].clone()))
        return out
    entry = cache.take(key)
    if entry is None:
        return p.apply()
    return p.apply(entry.rows, entry.out_tail, entry.lse_tail)
