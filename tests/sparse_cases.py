"""Rank-side bodies of the vertical-slash tests (run on every rank by harness.run_ranks).

The reference is window_cases.dense_masked_reference under the pattern's dense per-head mask,
built here from the definition (query i sees key j <= i iff j is a vertical line or i - j a
slash offset), not from megatron_burst.sparse.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import megatron_burst as mb
from window_cases import dense_masked_reference


def make_pattern(seq: int, heads: int, n_vertical: int, n_slash: int, seed: int = 0, diagonal: bool = True):
    """A random vertical-slash pattern: vertical lines anywhere (one head also at 0), slash offsets
    (0 first unless ``diagonal`` is False, so that some rows see nothing)."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.randint(0, seq, (heads, n_vertical), generator=g)
    slash = torch.randint(1, seq, (heads, n_slash), generator=g)
    if diagonal:
        slash[:, 0] = 0
    return mb.VerticalSlash(vertical, slash)


def definition_mask(pattern, seq: int) -> torch.Tensor:
    """Boolean [h, seq, seq] straight from the definition."""
    h = pattern.vertical.shape[0]
    vis = torch.zeros(h, seq, seq, dtype=torch.bool)
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    for head in range(h):
        vert = torch.isin(j, pattern.vertical[head])
        sl = torch.isin(i - j, pattern.slash[head])
        vis[head] = (j <= i) & (vert | sl)
    return vis


def run_sparse_case(algo: str, layout: str, heads: tuple, local_len: int, *, stripe: int = 1, b: int = 2, d: int = 8,
                    n_vertical: int = 6, n_slash: int = 5, seed: int = 0, ranks_per_node: Optional[int] = None,
                    ring: Optional[str] = None, diagonal: bool = True) -> dict:
    """Max abs errors of out, dq, dk, dv on this rank vs the dense masked reference."""
    group = mb.build_cp_topology(None, ranks_per_node) if ranks_per_node else None
    W, r = dist.get_world_size(), dist.get_rank()
    hq, hkv = heads
    seq = local_len * W
    gen = torch.Generator().manual_seed(seed + 1)
    mk = lambda h: torch.randn(seq, b, h, d, generator=gen)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    pattern = make_pattern(seq, hq, n_vertical, n_slash, seed, diagonal)
    vis = definition_mask(pattern, seq)
    ref = dense_masked_reference(q, k, v, dout, vis, d ** -0.5)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    out = mb.sparse_cp_attention(ql, kl, vl, pattern, group=group, layout=layout, stripe=stripe, algo=algo, ring=ring)
    out.backward(sh(dout))
    got = (out, ql.grad, kl.grad, vl.grad)
    res = {name: (a.double() - sh(e)).abs().max().item() for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
    res["sparsity"] = 1 - vis.sum().item() / (hq * seq * (seq + 1) / 2)
    res["empty_rows"] = int((~vis.any(-1)).sum())
    return res


def run_dynamic_case(layout: str, stripe: int, local_len: int, heads=(4, 2), algo: str = "burst", last_q: int = 24,
                     b: int = 2, d: int = 8, seq: Optional[int] = None, slash_lines: str = "offsets", pool: int = 4,
                     runs_apart: bool = False) -> dict:
    """The dynamic pattern on every rank (to compare), the single-process estimate over the whole
    sequence, and the attention's errors vs the dense reference under the estimated pattern.
    ``runs_apart``: planned as on CUDA (long slash runs as per-head dense blocks)."""
    from megatron_burst.masks import vertical_slash
    from megatron_burst.masks.dynamic import Dynamic, estimate

    if runs_apart:
        vertical_slash._RUNS_OVERRIDE = True

    W, r = dist.get_world_size(), dist.get_rank()
    hq, hkv = heads
    seq = seq or local_len * W
    local_len = seq // W
    gen = torch.Generator().manual_seed(5)
    mk = lambda h: torch.randn(seq, b, h, d, generator=gen)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    q = q * 3  # peaky attention, as trained models have: top-p keeps few lines
    budgets = Dynamic(p_v=0.5, p_s=0.5, last_q=last_q, pool=pool, slash_lines=slash_lines)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    pattern = estimate(bhsd(sh(q)), bhsd(sh(k)), budgets, layout=layout, stripe=stripe)
    whole = estimate(bhsd(q), bhsd(k), budgets, layout="contiguous", stripe=1) if W == 1 else None
    vis = definition_mask(pattern, seq)
    ref = dense_masked_reference(q, k, v, dout, vis, d ** -0.5)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    out = mb.sparse_cp_attention(ql, kl, vl, budgets, layout=layout, stripe=stripe, algo=algo)
    out.backward(sh(dout))
    got = (out, ql.grad, kl.grad, vl.grad)
    res = {name: (a.double() - sh(e)).abs().max().item() for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
    res["scale"] = {name: e.abs().max().item() for name, e in zip(("out", "dq", "dk", "dv"), ref)}
    as_sets = lambda p: [(sorted(set(p.vertical[h].tolist())), sorted(set(p.slash[h].tolist())))  # noqa: E731
                         for h in range(hq)]
    res["pattern"] = as_sets(pattern)
    res["whole"] = as_sets(whole) if whole is not None else None
    res["sparsity"] = 1 - vis.sum().item() / (hq * seq * (seq + 1) / 2)
    return res
