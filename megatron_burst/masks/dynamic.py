"""MTraining's dynamic vertical-slash pattern (Algorithm 1), estimated under context parallelism.

From the last ``last_q`` queries of the global sequence (wherever the layout puts them) the
attention A = softmax(Q_last K^T / sqrt(d) + causal) is estimated over all keys; per query head:

* vertical budget k_v = the fewest keys whose column mass reaches ``p_v`` of the total (top-p),
  lines = the k_v keys of largest column mass;
* slash budget k_s = 64 x the fewest 64-offset pools (``pool``) whose diagonal mass reaches
  ``p_s`` (top-p over pooled sums), lines = the k_s diagonal offsets of largest mass
  (``slash_lines="offsets"``, Algorithm 1 as written), or every offset of those pools
  (``slash_lines="pools"``: the granularity MTraining's kernel computes at; runs of 64 offsets,
  which the engine runs as dense blocks on CUDA, see megatron_burst.masks.vertical_slash).

Under CP each rank scores the gathered last queries against its own keys; the softmax max and
sum and the column/diagonal masses are all-reduced, so every rank computes the same pattern from
the same numbers. Recomputed per call (per step), under no_grad: the pattern is not
differentiated through. Everything stays on q's device (the pattern too, so its plans are built
there); the host reads back three sizes: how many local queries are among the last, and the
largest vertical and slash line counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_burst import comm
from megatron_burst.masks.layout import layout_indices_on
from megatron_burst.masks.vertical_slash import VerticalSlash

__all__ = ["Dynamic", "estimate", "top_p_count"]


@dataclass(frozen=True)
class Dynamic:
    """Budgets of a dynamic pattern: top-p of the vertical (p_v) and slash (p_s) attention mass,
    estimated from the last ``last_q`` queries; slash offsets pooled in groups of ``pool``."""

    p_v: float = 0.9
    p_s: float = 0.9
    last_q: int = 64
    pool: int = 64
    slash_lines: str = "offsets"  # "offsets": the top k_s offsets; "pools": every offset of the top pools

    def check(self, seq_len: int) -> None:
        for name in ("p_v", "p_s"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Dynamic.{name}={value}: a top-p budget must be in (0, 1]")
        if not 1 <= self.last_q <= seq_len:
            raise ValueError(f"Dynamic.last_q={self.last_q} must be in [1, {seq_len}] (the global sequence length)")
        if self.pool < 1:
            raise ValueError(f"Dynamic.pool={self.pool} must be >= 1")
        if self.slash_lines not in ("offsets", "pools"):
            raise ValueError(f"Dynamic.slash_lines={self.slash_lines!r}: 'offsets' (the top offsets) or 'pools' "
                             "(every offset of the top pools)")


def top_p_count(mass: torch.Tensor, p: float) -> torch.Tensor:
    """Per row of ``mass`` [h, n] (>= 0): the fewest largest entries whose sum reaches p x the row sum."""
    srt = torch.sort(mass, dim=-1, descending=True).values
    cum = srt.cumsum(-1)
    need = p * cum[:, -1:]
    return ((cum < need * (1 - 1e-9)).sum(-1) + 1).clamp(max=mass.shape[-1])


def _lines(mass: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[h, max(counts)] indices of each row's counts[h] largest entries (rows padded with their first)."""
    k = int(counts.max())
    idx = torch.topk(mass, k, dim=-1).indices
    keep = torch.arange(k, device=mass.device)[None, :] < counts[:, None]
    return torch.where(keep, idx, idx[:, :1])


@torch.no_grad()
def estimate(q: torch.Tensor, k: torch.Tensor, budgets: Dynamic, *, group=None, layout: str = "striped",
             stripe: int = 64, softmax_scale: float | None = None) -> VerticalSlash:
    """The dynamic pattern of this call, on q's device. q [b, hq, n, d], k [b, hkv, n, d]: this
    rank's tokens in ``layout`` (any dtype). Collectives over ``group`` (a process group; None =
    default / single)."""
    import torch.distributed as dist

    b, hq, n, d = q.shape
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    W, rank = (dist.get_world_size(group), dist.get_rank(group)) if multi else (1, 0)
    S = n * W
    budgets.check(S)
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    device = q.device
    pos = layout_indices_on(S, rank, W, layout, stripe if layout == "striped" else 1, device)
    first = S - budgets.last_q
    mine = (pos >= first).nonzero().squeeze(1)
    q_last = torch.zeros(b, hq, budgets.last_q, d, dtype=torch.float32, device=device)
    q_last[:, :, pos[mine] - first] = q[:, :, mine].float()
    if multi:  # every rank holds some (or none) of the last queries: the sum assembles them
        comm.all_reduce(q_last, group, "forward", label="dynamic pattern: last queries").wait()
    # GQA: each kv head's query heads as one [group * last_q] block (no copy of k per query head)
    hkv = k.shape[1]
    scores = (q_last.view(b, hkv, -1, d) @ k.float().transpose(-1, -2)).view(b, hq, budgets.last_q, n) * scale
    q_pos = torch.arange(first, S, device=device)
    kv_pos = pos
    visible = kv_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(-1).clamp_min(-1e30)  # rows of no local key: -inf -> a finite floor
    if multi:
        comm.all_reduce(row_max, group, "forward", op="max", label="dynamic pattern: max").wait()
    probs = torch.exp(scores - row_max[..., None])
    row_sum = probs.sum(-1)
    if multi:
        comm.all_reduce(row_sum, group, "forward", label="dynamic pattern: sum").wait()
    probs = probs / row_sum[..., None]
    masses = torch.zeros(2, hq, S, dtype=torch.float32, device=device)  # [vertical, slash] by position/offset
    masses[0].index_add_(1, kv_pos, probs.sum((0, 2)))
    # slash mass by offset q - kv: the offsets [last_q, n] are every head's and sample's (none of
    # the b x hq copies of an index the size of the scores)
    offsets = (q_pos[:, None] - kv_pos[None, :]).clamp_min(0).reshape(-1)
    masses[1].index_add_(1, offsets, (probs[0] if b == 1 else probs.sum(0)).reshape(hq, -1))
    if multi:
        comm.all_reduce(masses, group, "forward", label="dynamic pattern: masses").wait()
    masses = masses.double()
    vertical = _lines(masses[0], top_p_count(masses[0], budgets.p_v))
    P = budgets.pool
    pooled = torch.nn.functional.pad(masses[1], (0, (-S) % P)).view(hq, -1, P).sum(-1)
    n_pools = top_p_count(pooled, budgets.p_s)
    if budgets.slash_lines == "pools":
        pools = _lines(pooled, n_pools)  # [h, most pools] (rows padded with their first)
        slash = (pools[:, :, None] * P + torch.arange(P, device=device)).reshape(hq, -1)
        slash = torch.where(slash < S, slash, pools[:, :1] * P)  # the last pool's offsets past the sequence
    else:
        slash = _lines(masses[1], (n_pools * P).clamp(max=S))
    return VerticalSlash(vertical, slash)
