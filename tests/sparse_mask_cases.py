"""Rank-side bodies of the sparse-pattern x documents x window tests (run by harness.run_ranks).

The reference is window_cases.dense_masked_reference under a dense [h, S, S] mask built from the
definitions, not from megatron_burst: the pattern's (sparse_cases.definition_mask: j <= i and j a
vertical line or i - j a slash offset) AND the sliding window's and documents'
(window_cases.window_mask: i - left <= j <= i, same document).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.comm import record_schedule
from megatron_burst.masks.documents import check_cu_seqlens
from megatron_burst.nccl_check import check_on_all_ranks
from sparse_cases import definition_mask
from window_cases import dense_masked_reference, expected_sends, last_steps_from_mask, window_mask

# (name, documents, window): documents as fractions of S (boundaries placed off the stripes and
# chunks), "per_sample" = a different list for each of the two samples
MASKS = (
    ("documents", (0.3, 0.34, 0.62), None),
    ("window", None, 0.18),
    ("documents_window", (0.3, 0.34, 0.62), 0.18),
    ("per_sample_documents_window", "per_sample", 0.25),
)


def bounds_of(seq: int, fractions) -> list[int]:
    cuts = sorted({max(1, min(seq - 1, int(round(f * seq)))) for f in fractions})
    return [0] + cuts + [seq]


def mask_pattern(seq: int, heads: int, seed: int = 0) -> mb.VerticalSlash:
    """A sink and random vertical lines; a band of slash offsets (a run longer than LONG_RUN, so
    its range is cut by the floor) and isolated offsets. The last head's band starts at 1: its
    rows at a document start can see nothing."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.cat([torch.zeros(heads, 1, dtype=torch.long), torch.randint(0, seq, (heads, 5), generator=g)], 1)
    band = torch.arange(20).expand(heads, 20).clone()
    band[-1] += 1
    slash = torch.cat([band, torch.randint(20, seq, (heads, 6), generator=g)], 1)
    return mb.VerticalSlash(vertical, slash)


def shared_runs_pattern(seq: int, heads: int, seed: int = 0) -> mb.VerticalSlash:
    """Lines every head shares, as MTraining picks them (slash offsets in pools): random vertical
    lines (one in the middle), the band 1..12, two pools of 8 offsets and one isolated offset (a
    run of one). Pairs on both a vertical line and a run must count once; rows before the first
    vertical line see nothing (no offset 0)."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.cat([torch.tensor([seq // 2]), torch.randint(seq // 8, seq, (5,), generator=g)])
    pools = torch.randint(2, seq // 8 - 1, (2,), generator=g) * 8
    slash = torch.cat([1 + torch.arange(12), pools[0] + torch.arange(8), pools[1] + torch.arange(8),
                       torch.tensor([seq // 3 + 1])])
    return mb.VerticalSlash(vertical.expand(heads, -1).contiguous(), slash.expand(heads, -1).contiguous())


def _documents(name, docs, seq: int, b: int):
    """(cu_seqlens argument, per-sample boundaries list or None)."""
    if docs is None:
        return None, None
    if docs == "per_sample":
        per = [bounds_of(seq, (0.2, 0.5)), bounds_of(seq, (0.41, 0.45, 0.8))][:b]
        return [torch.tensor(x, dtype=torch.int32) for x in per], per
    bounds = bounds_of(seq, docs)
    return torch.tensor(bounds, dtype=torch.int32), [bounds] * b


def reference_mask(pattern_vis: torch.Tensor, seq: int, window, bounds: Optional[list[int]]) -> torch.Tensor:
    """[h, S, S] pattern AND causal AND window AND documents."""
    return pattern_vis & window_mask(seq, window, True, bounds)[None]


def run_mask_cases(layout: str, stripe: int, local_len: int, algos=("burst", "ring"), masks=MASKS, b: int = 2,
                   d: int = 8, seed: int = 0, dynamic: bool = False, ranks_per_node: Optional[int] = None,
                   ring: Optional[str] = None, replay: bool = False, shared_runs: bool = False,
                   runs_apart: bool = False) -> list[dict]:
    """For each algo x mask: max abs errors of out, dq, dk, dv on this rank against the dense
    reference; bytes sent per phase and those of a ring pruned by the dense window/document mask;
    sparsity; rows seeing nothing; (``replay``) the NCCL replays. ``runs_apart``: planned as on
    CUDA (slash runs as dense positions blocks: shared by every head, or per head, with the rest in
    sparse tiles; the blocks' kinds in res["kinds"], "positions per head" for per-head bands);
    ``shared_runs``: that and the pattern of :func:`shared_runs_pattern`."""
    from megatron_burst.masks import vertical_slash
    from megatron_burst.masks.block import HeadBands

    if shared_runs or runs_apart:
        vertical_slash._RUNS_OVERRIDE = True
    group = mb.build_cp_topology(None, ranks_per_node) if ranks_per_node else None
    W, r = dist.get_world_size(), dist.get_rank()
    seq = local_len * W
    heads = {"burst": (4, 2), "ring": (2, 2), "auto": (4, 4)}
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    out_rows = []
    for algo in algos:
        hq, hkv = heads[algo]
        gen = torch.Generator().manual_seed(seed + hq)
        mk = lambda h: torch.randn(seq, b, h, d, generator=gen)  # noqa: E731
        q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
        if dynamic:
            from megatron_burst.masks.dynamic import Dynamic, estimate

            q = q * 3  # peaky attention: top-p keeps few lines
            pattern = Dynamic(p_v=0.5, p_s=0.5, last_q=24, pool=4)
            bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
            used = estimate(bhsd(sh(q)), bhsd(sh(k)), pattern, layout=layout, stripe=stripe)
        elif shared_runs:
            pattern = used = shared_runs_pattern(seq, hq, seed)
        else:
            pattern = used = mask_pattern(seq, hq, seed)
        pattern_vis = definition_mask(used, seq)
        for name, docs, frac in masks:
            window = None if frac is None else (int(frac * seq), 0)
            cu, per_sample = _documents(name, docs, seq, b)
            ref_parts, vis_parts = [], []
            for s in range(b):  # the reference per sample (documents may differ between samples)
                vis = reference_mask(pattern_vis, seq, window, None if per_sample is None else per_sample[s])
                vis_parts.append(vis)
                sl = slice(s, s + 1)
                ref_parts.append(dense_masked_reference(q[:, sl], k[:, sl], v[:, sl], dout[:, sl], vis, d ** -0.5))
            ref = [torch.cat([p[i] for p in ref_parts], 1) for i in range(4)]
            ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
            with mb.comm_counter() as counter, record_schedule() as trace:
                out = mb.cp_attention(ql, kl, vl, pattern=pattern, group=group, algo=algo, layout=layout,
                                      stripe=stripe, ring=ring, cu_seqlens=cu, window=window)
                out.backward(sh(dout))
            got = (out, ql.grad, kl.grad, vl.grad)
            res = {n: (a.double() - sh(e)).abs().max().item() for n, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
            res["scale"] = {n: e.abs().max().item() for n, e in zip(("out", "dq", "dk", "dv"), ref)}
            res.update(algo=algo, mask=name, finite=all(bool(torch.isfinite(t).all()) for t in got))
            pair_blocks = [vertical_slash.pattern_blocks(used, layout, q_rank, kv_rank, W, local_len, stripe,
                                                         documents=None if cu is None else check_cu_seqlens(cu, seq, b),
                                                         window=window)
                           for q_rank in range(W) for kv_rank in range(W)]
            res["kinds"] = sorted({m.kind + (" per head" if isinstance(m.band, HeadBands) else "")
                                   + (" gathered" if m.kv_index is not None else "")
                                   + (" holes" if isinstance(m.band, HeadBands) and m.band.holes is not None else "")
                                   for blocks in pair_blocks for _, m in blocks})
            # gathered (vertical-line) blocks per pair and sample group: one, its runs cut out as holes
            res["gathered_per_pair"] = max((sum(1 for bs2, m in blocks if m.kv_index is not None and bs2 == bs)
                                            for blocks in pair_blocks for bs, _ in blocks), default=0)
            vis_all = torch.stack(vis_parts)
            res["sparsity"] = 1 - vis_all.sum().item() / (b * hq * seq * (seq + 1) / 2)
            res["empty_rows"] = int((~vis_all.any(-1)).sum())
            res["bytes"] = {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}
            dense = torch.stack([window_mask(seq, window, True, None if per_sample is None else per_sample[s])
                                 for s in range(b)])  # what the pruned ring follows
            kv_blk, q_blk = 2 * b * hkv * local_len * d * 4, b * hq * local_len * d * 4
            fa, fg = expected_sends(last_steps_from_mask(dense, W, layout, stripe, True), r)
            ba, bg = expected_sends(last_steps_from_mask(dense, W, layout, stripe, False), r)
            res["expected"] = {"forward": fa * kv_blk,
                               "backward": (fa + fg) * kv_blk if algo == "ring"
                               else ba * (2 * q_blk + 2 * b * hq * local_len * 4) + bg * q_blk}
            res["full_ring_forward"] = (W - 1) * kv_blk
            if replay:
                reports = [check_on_all_ranks(trace, serialize_communicators=s) for s in (False, True)]
                res["replay"] = [(rep.ok, str(rep), rep.total) for rep in reports]
            out_rows.append(res)
    return out_rows
