"""Sequence-level selective checkpointing (BurstEngine §3.2).

Under causal masking, a query's attention cost grows with its position: the later half of a
sequence costs 3/4 of the attention FLOPs. With activation recompute on, core attention therefore
stores (out, lse) of the *later* ``stored_fraction`` of the global sequence during the first
(no-grad) forward, and in the recompute computes only the earlier part, taking the rest from the
store. Storing the later half (0.5) keeps half of what storing every attention output would
("selective++") and skips 3/4 of the recomputed attention FLOPs.

"Earlier/later" is by global token position. Every layout keeps a rank's tokens in increasing
global order, so the earlier tokens are a prefix of the local rows, on every rank, in every layout.

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

from megatron_burst.algorithms import _CPAttention, prepare
from megatron_burst.algorithms.ring import kv_ring_forward
from megatron_burst.layout import rows_before


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


def stored_rows(seq_len: int, stored_fraction: float, rank: int, world_size: int, layout: str, stripe: int) -> int:
    """Local rows recomputed (those before the stored later part): a prefix of the local tokens."""
    if not 0.0 <= stored_fraction <= 1.0:
        raise ValueError(f"stored fraction {stored_fraction} must be within [0, 1] (--seq-selective-ckpt-ratio)")
    boundary = seq_len - int(round(stored_fraction * seq_len))
    return rows_before(boundary, seq_len, rank, world_size, layout, stripe)


def selective_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cache: SelectiveAttentionCache,
                           stored_fraction: float, **cp_kwargs) -> torch.Tensor:
    """cp_attention with sequence-level selective checkpointing; same arguments and result.

    Without grad (the first forward of a checkpointed region) it computes everything and stores the
    later ``stored_fraction`` of (out, lse) in ``cache``; with grad (the recompute) it computes only
    the earlier rows and reuses the stored ones. With grad and no stored entry it is plain
    cp_attention.
    """
    p = prepare(q, k, v, **cp_kwargs)
    topo, plan = p.plan.topology, p.plan
    n = p.q.shape[2]
    rows = stored_rows(n * topo.world_size, stored_fraction, topo.rank, topo.world_size, plan.layout, plan.stripe)
    key = fingerprint(q, k, v)
    if not torch.is_grad_enabled():
        out, lse = kv_ring_forward(p.q.contiguous(), p.k.contiguous(), p.v.contiguous(), plan)
        cache.put(_Entry(key, rows, out[:, :, rows:].clone(), lse[:, :, rows:].clone()))
        return p.restore(out)
    entry = cache.take(key)
    if entry is None:
        return p.restore(_CPAttention.apply(p.q, p.k, p.v, plan, p.backward_algo))
    return p.restore(_CPAttention.apply(p.q, p.k, p.v, plan, p.backward_algo, entry.rows, entry.out_tail,
                                        entry.lse_tail))
