"""Rank-side bodies of the selective checkpointing tests."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst import kernels
from megatron_burst.checkpoint import SelectiveAttentionCache, selective_cp_attention
from attention_cases import full_inputs


def _attention_area(fn):
    """Run ``fn`` counting the q x kv rectangle area handed to forward kernels."""
    area = [0]
    original = kernels.block_forward

    def counting(q, k, v, mask, scale, kernel=None):
        area[0] += (mask.q_stop - mask.q_start) * (mask.kv_stop - mask.kv_start)
        return original(q, k, v, mask, scale, kernel)

    import megatron_burst.algorithms.ring as ring_mod
    ring_mod.block_forward = counting
    try:
        result = fn()
    finally:
        ring_mod.block_forward = original
    return result, area[0]


def selective_vs_plain(layout, algo, stored_fraction, local_len=8, heads=(4, 2), d=8, stripe=1):
    W, r = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = full_inputs(local_len * W, 2, heads[0], heads[1], d, torch.float32, seed=3)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe).clone()  # noqa: E731
    kw = dict(algo=algo, layout=layout, stripe=stripe)

    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    ref_out, full_area = _attention_area(lambda: mb.cp_attention(*leaves, **kw))
    ref_out.backward(sh(dout))
    ref_grads = [t.grad for t in leaves]

    cache = SelectiveAttentionCache()
    with torch.no_grad():  # first forward of a checkpointed region
        first = selective_cp_attention(sh(q), sh(k), sh(v), cache=cache, stored_fraction=stored_fraction, **kw)
    stored = cache.nbytes
    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    with mb.comm_counter() as counter:
        out, recompute_area = _attention_area(
            lambda: selective_cp_attention(*leaves, cache=cache, stored_fraction=stored_fraction, **kw))
    recompute_fwd_bytes = counter.bytes("sent", phase="forward")
    out.backward(sh(dout))
    errs = {
        "first": (first - ref_out).abs().max().item(),
        "out": (out - ref_out).abs().max().item(),
        **{f"d{n}": (l.grad - g).abs().max().item() for n, l, g in zip("qkv", leaves, ref_grads)},
    }
    all_bytes = ref_out.numel() * 4 + ref_out.shape[0] * ref_out.shape[1] * ref_out.shape[2] * 4  # out + lse
    full_fwd_bytes = (W - 1) * 2 * ref_out.shape[1] * local_len * heads[1] * d * 4  # K,V of the whole block
    return dict(errs=errs, left=len(cache), hits=cache.hits, stored=stored, all_bytes=all_bytes,
                recompute_area=recompute_area, full_area=full_area, recompute_fwd_bytes=recompute_fwd_bytes,
                full_fwd_bytes=full_fwd_bytes)


def stale_entry_is_never_served():
    W, r = dist.get_world_size(), dist.get_rank()
    cache = SelectiveAttentionCache()
    a = full_inputs(8 * W, 1, 2, 2, 8, torch.float32, seed=1)
    b = full_inputs(8 * W, 1, 2, 2, 8, torch.float32, seed=2)
    sh = lambda t: mb.shard(t, 0, r, W, "zigzag").clone()  # noqa: E731
    with torch.no_grad():
        selective_cp_attention(sh(a[0]), sh(a[1]), sh(a[2]), cache=cache, stored_fraction=0.5)
    # recompute with other inputs: must miss and compute everything itself
    out = selective_cp_attention(*(sh(t).requires_grad_() for t in b[:3]), cache=cache, stored_fraction=0.5)
    ref = mb.cp_attention(sh(b[0]), sh(b[1]), sh(b[2]))
    return (out - ref).abs().max().item(), cache.hits, cache.misses
