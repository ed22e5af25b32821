"""Load-balance analytics of masks: how evenly attention work spreads over CP ranks and ring steps.

* :func:`document_imbalance`: packed documents (``cu_seqlens``) under a layout (the fixed ones,
  THD with its padding, balanced, a :class:`~megatron_burst.masks.dispatch.DispatchPlan` or explicit
  per-rank index lists), with the K,V traffic documents need; O(S x W) from token ownership, no
  [S, S] mask. Public as ``megatron_burst.documents.imbalance``.
* :func:`pattern_imbalance`: a vertical-slash pattern's work on a flat or double ring (MTraining's
  worker- and step-level imbalance degrees), counted per line by :func:`pair_work`. Public as
  ``megatron_burst.sparse.imbalance``.

Both use the same names: ``worker`` (per ring step: sum over steps of the slowest rank / sum of
the mean), ``worker_total`` (max over ranks of the pass's work / the mean), ``step`` and
``work`` [rank][step]. Measurements only: nothing here is on the engine's path.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from megatron_burst.masks.dispatch import plan_dispatch
from megatron_burst.masks.documents import THD, checked_bounds
from megatron_burst.masks.layout import check_seq_len, layout_indices
from megatron_burst.masks.vertical_slash import VerticalSlash

__all__ = ["IMBALANCE_LAYOUTS", "document_imbalance", "pair_work", "pattern_imbalance", "rank_pair_work",
           "thd_padded"]


IMBALANCE_LAYOUTS = ("contiguous", "zigzag", "striped", THD, "balanced")


def thd_padded(bounds: Sequence[int], world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """TransformerEngine's THD padding: every sequence padded to a multiple of 2W. Returns
    (cu_seqlens_padded, document bounds with each padding tail as a document of its own)."""
    mult = 2 * world_size if world_size > 1 else 1
    padded, docs = [0], [0]
    for a, b in zip(bounds, bounds[1:]):
        length = b - a
        slot = -(-length // mult) * mult
        docs.append(padded[-1] + length)
        if slot != length:
            docs.append(padded[-1] + slot)
        padded.append(padded[-1] + slot)
    return tuple(padded), tuple(docs)


def _layout_owner(seq_len: int, world_size: int, layout: str, stripe: int):
    """int64 numpy [S]: the rank holding each token in a fixed layout (layout.layout_indices, vectorized)."""
    import numpy as np

    W, S = world_size, seq_len
    t = np.arange(S, dtype=np.int64)
    if W == 1:
        return np.zeros(S, dtype=np.int64)
    if layout == "contiguous":
        return t // (S // W)
    if layout == "zigzag":
        c = t // (S // (2 * W))
        return np.where(c < W, c, 2 * W - 1 - c)
    return (t // stripe) % W


def _thd_owner(padded: Sequence[int], world_size: int):
    """int64 numpy [S padded]: the rank holding each token under THD (layout.thd_indices, vectorized)."""
    import numpy as np

    W = world_size
    p = np.asarray(padded, dtype=np.int64)
    lens = np.diff(p)
    if W == 1:
        return np.zeros(int(p[-1]), dtype=np.int64)
    start = np.repeat(p[:-1], lens)
    chunk = np.repeat(lens // (2 * W), lens)
    c = (np.arange(int(p[-1]), dtype=np.int64) - start) // chunk
    return np.where(c < W, c, 2 * W - 1 - c)


def rank_pair_work(owner, bounds: Sequence[int], world_size: int, causal: bool = True) -> tuple:
    """Visible pairs between ranks under documents ``bounds``, given ``owner`` (int array [S]: the rank
    holding each global token). Returns (pairs, seen) as float64 numpy [W, W] arrays:
    pairs[r][o] = query-key pairs with the query on rank r and the key on rank o; seen[r][o] = how
    many of rank o's keys at least one query of rank r sees (the K,V tokens o must send r when
    traffic follows documents). O(S x W), no [S, S] mask."""
    import numpy as np

    owner = np.asarray(owner, dtype=np.int64)
    S, W = owner.size, world_size
    b = np.asarray(bounds, dtype=np.int64)
    lens = np.diff(b)
    end = np.repeat(b[1:], lens)
    first = np.repeat(b[:-1], lens)
    pairs = np.zeros((W, W))
    seen = np.zeros((W, W))
    cnt = np.zeros(S + 1, dtype=np.int64)
    for r in range(W):
        np.cumsum(owner == r, out=cnt[1:])
        # rank r's queries that see key k: at positions >= k (causal) or anywhere in k's document
        sees = cnt[end] - (cnt[:-1] if causal else cnt[first])
        pairs[r] = np.bincount(owner, weights=sees, minlength=W)
        seen[r] = np.bincount(owner, weights=sees > 0, minlength=W)
    return pairs, seen


def document_imbalance(cu_seqlens: Union[torch.Tensor, Sequence[int]], world_size: int, layout, *, stripe: int = 1,
              causal: bool = True) -> dict:
    """Load balance of the packed documents ``cu_seqlens`` ([0, ..., S]) on ``world_size`` CP ranks.

    ``layout``: ``"contiguous"``, ``"zigzag"``, ``"striped"`` (``stripe`` tokens per stripe),
    ``"thd"`` (TransformerEngine's per-sequence zigzag: every document padded to a multiple of 2W,
    each padding tail a document of its own, as the engine computes it), ``"balanced"``
    (:func:`megatron_burst.masks.dispatch.plan_dispatch`), a :class:`~megatron_burst.masks.dispatch.DispatchPlan`,
    or a list of W increasing index tensors (any layout).

    Work is visible query-key pairs, causal within each document (``causal=False``: full within it),
    computed from token ownership (O(S W); exact). At ring step t rank r computes its queries against
    the keys of rank (r - t) mod W. The names follow :func:`pattern_imbalance`:

    * ``worker_total``: max over ranks of the pass's work / the mean (the issue's "worker-level").
    * ``worker``: per ring step: sum over steps of the max over ranks / sum over steps of the mean (a
      synchronous ring waits for its slowest rank at every step).
    * ``step``: the mean over ranks of max / mean over that rank's steps.
    * ``work``: [rank][step] pairs (ints).
    * ``kv_sent``: per rank, K,V blocks it sends (one block = one rank's local K,V): W - 1 for the ring
      layouts (every block travels W - 1 hops, documents or not); for ``balanced`` (and explicit
      layouts) traffic follows documents: one block to each rank whose queries see one of its keys.
    * ``kv_needed``: that documents-following count for any layout (what an engine that skips
      unneeded blocks would send); ``kv_tokens_needed``: per rank, the K,V tokens other ranks' queries
      actually see, in local blocks (the finest traffic).
    * ``padding``: tokens THD adds (0 otherwise); ``seq_len``: the (padded) length measured.
    """
    import numpy as np

    if isinstance(cu_seqlens, torch.Tensor):
        bounds = [int(x) for x in cu_seqlens.tolist()]
    else:
        bounds = [int(x) for x in cu_seqlens]
    bounds = list(checked_bounds(tuple(bounds), bounds[-1] if bounds else 0, "cu_seqlens"))
    W, S = world_size, bounds[-1]
    if W < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    padding, ring = 0, True
    if isinstance(layout, str):
        if layout not in IMBALANCE_LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(IMBALANCE_LAYOUTS)}, a "
                             "DispatchPlan or a list of per-rank index tensors")
        if layout == THD:
            padded, bounds = thd_padded(bounds, W)
            owner = _thd_owner(padded, W)
            padding = padded[-1] - S
        elif layout == "balanced":
            owner, ring = plan_dispatch(bounds, W, causal=causal).owner(), False
        else:
            check_seq_len(S, W, layout, stripe)
            owner = _layout_owner(S, W, layout, stripe)
    else:
        ring = False
        if hasattr(layout, "owner"):
            owner = layout.owner()
        else:
            if len(layout) != W:
                raise ValueError(f"an explicit layout needs {W} index lists (one per rank), got {len(layout)}")
            owner = np.full(S, -1, dtype=np.int64)
            for r, idx in enumerate(layout):
                idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64)
                if idx.size != S // W or (owner[idx] >= 0).any():
                    raise ValueError("an explicit layout must give every rank S / W distinct tokens")
                owner[idx] = r
            if (owner < 0).any():
                raise ValueError("an explicit layout must cover every token of [0, S)")
    pairs, seen = rank_pair_work(owner, bounds, W, causal)
    r = np.arange(W)
    steps = (r[:, None] - r[None, :]) % W  # steps[r][t] = the kv rank of rank r at step t
    work = pairs[r[:, None], steps]
    total = work.sum()
    mean = total / W
    per_rank = work.sum(1)
    needed = [int(((seen[:, o] > 0).sum() - (seen[o, o] > 0))) for o in range(W)]
    local = owner.size // W
    tokens = [float((seen[:, o].sum() - seen[o, o]) / local) for o in range(W)]
    return {
        "worker": float(work.max(0).sum() / mean) if total else 1.0,
        "worker_total": float(per_rank.max() / mean) if total else 1.0,
        "step": float(np.mean([row.max() / (row.sum() / W) if row.sum() else 1.0 for row in work])),
        "work": work.astype(np.int64).tolist(),
        "kv_sent": [W - 1] * W if ring else needed,
        "kv_needed": needed,
        "kv_tokens_needed": tokens,
        "padding": padding,
        "seq_len": int(owner.size),
    }


def _correlate(q_in: torch.Tensor, kv_in: torch.Tensor) -> torch.Tensor:
    """c[o] = #{i : q_in[i] and kv_in[i - o]} for every offset o in [0, S) (exact, via an FFT)."""
    S = q_in.numel()
    n = 2 * S
    fq = torch.fft.rfft(q_in.double(), n)
    fk = torch.fft.rfft(kv_in.double(), n)
    return torch.fft.irfft(fq * fk.conj(), n)[:S].round().long()


def pair_work(pattern: VerticalSlash, seq_len: int, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> int:
    """Visible (head, query, key) pairs of queries at ``q_pos`` x keys at ``kv_pos``, counted per
    line (no [sq, sk] matrix): vertical hits + slash hits - pairs on both. On the pattern's device."""
    device = pattern.device
    q_pos, kv_pos = q_pos.to(device), kv_pos.to(device)
    q_in = torch.zeros(seq_len, dtype=torch.bool, device=device)
    q_in[q_pos] = True
    kv_in = torch.zeros(seq_len, dtype=torch.bool, device=device)
    kv_in[kv_pos] = True
    q_sorted = torch.sort(q_pos).values
    per_offset = _correlate(q_in, kv_in)  # query i = o + j sees key j on diagonal o
    total = 0
    for h in range(pattern.vertical.shape[0]):
        vert = torch.unique(pattern.vertical[h].long())
        vert = vert[kv_in[vert]]
        total += int((q_sorted.numel() - torch.searchsorted(q_sorted, vert)).sum())  # j seen by every i >= j
        offsets = torch.unique(pattern.slash[h].long())
        total += int(per_offset[offsets].sum())
        if vert.numel():
            on_vert = torch.zeros(seq_len, dtype=torch.bool, device=device)
            on_vert[vert] = True
            total -= int(_correlate(q_in, on_vert)[offsets].sum())
    return total


def pattern_imbalance(pattern: VerticalSlash, seq_len: int, world_size: int, layout: str, stripe: int = 1,
              ring: str = "flat", ranks_per_node: Optional[int] = None) -> dict:
    """MTraining's imbalance degrees of ``pattern``'s work on a ring (work = visible query-key pairs
    over all heads of a block pair; the ring visits pair (r, owner) at the step the schedule does).

    Returns {"worker": max/mean over ranks at each ring step, aggregated as the sum over steps of
    the max over ranks / the sum over steps of the mean (a ring waits for its slowest rank every
    step, so this is its time over the ideal); "worker_total": max/mean over ranks of the whole
    pass's work; "step": the mean over ranks of each rank's max/mean over its ring steps;
    "work": [rank][step] visible pairs}.
    ``ring="double"`` orders steps as the hierarchical (outer x inner) ring does, ``ranks_per_node`` per node.
    """
    check_seq_len(seq_len, world_size, layout, stripe)
    W = world_size
    R = ranks_per_node if ring == "double" else W
    if ring == "double" and (R is None or W % R):
        raise ValueError(f"ring='double' needs ranks_per_node dividing world_size={W}, got {ranks_per_node}")
    idx = [layout_indices(seq_len, r, W, layout, stripe) for r in range(W)]
    work = [[0] * W for _ in range(W)]
    for r in range(W):
        for step in range(W):
            if ring == "double":  # outer step T (node), inner step t (rank inside the node)
                T, t = divmod(step, R)
                node, local = divmod(r, R)
                owner = ((node - T) % (W // R)) * R + (local - t) % R
            else:
                owner = (r - step) % W
            work[r][step] = pair_work(pattern, seq_len, idx[r], idx[owner])
    per_step_max = sum(max(work[r][s] for r in range(W)) for s in range(W))
    total = sum(map(sum, work))
    worker = per_step_max / (total / W) if total else 1.0
    worker_total = max(map(sum, work)) / (total / W) if total else 1.0
    step = sum(max(w) / (sum(w) / W) if sum(w) else 1.0 for w in work) / W
    return {"worker": worker, "worker_total": worker_total, "step": step, "work": work}
