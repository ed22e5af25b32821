"""Rank-side bodies of the selective checkpointing tests."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst import kernels
from megatron_burst.activation_store import SelectiveAttentionCache, end_iteration, selective_cp_attention
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


def _sharder(layout="zigzag", stripe=1):
    W, r = dist.get_world_size(), dist.get_rank()
    return lambda t: mb.shard(t, 0, r, W, layout, stripe).clone()  # noqa: E731


def _first_forward(cache, q, k, v, fraction=0.5, **kw):
    """The no-grad first forward of a checkpointed region (stores into ``cache``)."""
    with torch.no_grad():
        return selective_cp_attention(q, k, v, cache=cache, stored_fraction=fraction, **kw)


def _recompute(cache, q, k, v, fraction=0.5, **kw):
    """The recompute (grad enabled): output and leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return selective_cp_attention(*leaves, cache=cache, stored_fraction=fraction, **kw), leaves


def _max_err(a, b):
    return (a - b).abs().max().item()


def selective_vs_plain(layout, algo, stored_fraction, local_len=8, heads=(4, 2), d=8, stripe=1):
    W = dist.get_world_size()
    q, k, v, dout = full_inputs(local_len * W, 2, heads[0], heads[1], d, torch.float32, seed=3)
    sh = _sharder(layout, stripe)
    kw = dict(algo=algo, layout=layout, stripe=stripe)

    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    ref_out, full_area = _attention_area(lambda: mb.cp_attention(*leaves, **kw))
    ref_out.backward(sh(dout))
    ref_grads = [t.grad for t in leaves]

    cache = SelectiveAttentionCache()
    first = _first_forward(cache, sh(q), sh(k), sh(v), stored_fraction, **kw)
    stored = cache.nbytes
    with mb.comm_counter() as counter:
        (out, leaves), recompute_area = _attention_area(lambda: _recompute(cache, sh(q), sh(k), sh(v),
                                                                           stored_fraction, **kw))
    recompute_fwd_bytes = counter.bytes("sent", phase="forward")
    out.backward(sh(dout))
    errs = {
        "first": _max_err(first, ref_out),
        "out": _max_err(out, ref_out),
        **{f"d{n}": _max_err(l.grad, g) for n, l, g in zip("qkv", leaves, ref_grads)},
    }
    all_bytes = ref_out.numel() * 4 + ref_out.shape[0] * ref_out.shape[1] * ref_out.shape[2] * 4  # out + lse
    full_fwd_bytes = (W - 1) * 2 * ref_out.shape[1] * local_len * heads[1] * d * 4  # K,V of the whole block
    return dict(errs=errs, left=len(cache), hits=cache.hits, stored=stored, all_bytes=all_bytes,
                recompute_area=recompute_area, full_area=full_area, recompute_fwd_bytes=recompute_fwd_bytes,
                full_fwd_bytes=full_fwd_bytes, released=cache.release())


def stale_entry_is_never_served(change: str):
    """An entry stored for other shapes (or other call options) is dropped, never served."""
    W = dist.get_world_size()
    sh = _sharder()
    a = full_inputs(8 * W, 1, 2, 2, 8, torch.float32, seed=1)
    seq_b = 12 * W if change == "shape" else 8 * W
    b = full_inputs(seq_b, 1, 2, 2, 8, torch.float32, seed=2)
    kw_b = dict(causal=False) if change == "options" else {}
    cache = SelectiveAttentionCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _first_forward(cache, sh(a[0]), sh(a[1]), sh(a[2]))
        out, _ = _recompute(cache, sh(b[0]), sh(b[1]), sh(b[2]), **kw_b)
    ref = mb.cp_attention(sh(b[0]), sh(b[1]), sh(b[2]), **kw_b)
    return dict(err=_max_err(out, ref), hits=cache.hits, misses=cache.misses, dropped=cache.dropped,
                left=len(cache), nbytes=cache.nbytes, warnings=[str(w.message) for w in caught],
                released=cache.release())


def _integer_valued(seq, b, hq, hkv, d, seed):
    """q, k, v with small multiples of 1/4: every fp64 sum of them is exact in any order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, (seq, b, h, d), generator=g).float() / 4 for h in (hq, hkv, hkv)]


def reordered_batch(swap: str):
    """First forward on a micro-batch, recompute on the same micro-batch reordered (its two
    sequences swapped, or its last two local tokens): same host key, so the entry is served,
    and the content check must catch it at release."""
    W = dist.get_world_size()
    sh = _sharder()
    q, k, v = (sh(t) for t in _integer_valued(8 * W, 2, 4, 2, 8, seed=5))
    if swap == "sequences":  # dim 1 of [s, b, h, d]
        q2, k2, v2 = (t[:, [1, 0]].contiguous() for t in (q, k, v))
    else:  # the last two local tokens (rows of the stored tail)
        q2, k2, v2 = (torch.cat([t[:-2], t[-1:], t[-2:-1]]) for t in (q, k, v))
    plain_sums = lambda *ts: torch.stack([t.sum(dtype=torch.float64) for t in ts])  # noqa: E731  (the old fingerprint)
    cache = SelectiveAttentionCache()
    _first_forward(cache, q, k, v)
    out, _ = _recompute(cache, q2, k2, v2)
    served_stale = _max_err(out, mb.cp_attention(q2, k2, v2))
    hits, left_before = cache.hits, len(cache)
    try:
        cache.release()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return dict(plain_sums_equal=bool(torch.equal(plain_sums(q, k, v), plain_sums(q2, k2, v2))),
                fingerprints_equal=bool(torch.equal(mb.activation_store.fingerprint(q, k, v),
                                                    mb.activation_store.fingerprint(q2, k2, v2))),
                served_stale=served_stale, hits=hits, left_before=left_before, error=error,
                left_after=len(cache), released_again=cache.release())


def misses_warn_once():
    """Two recomputes whose heads are stale by host key: both miss, both heads dropped, one warning.
    Then a stale head of other shapes in front of the right entry: dropped, and the entry serves."""
    W = dist.get_world_size()
    sh = _sharder()
    small = [sh(t) for t in full_inputs(8 * W, 1, 2, 2, 8, torch.float32, seed=1)[:3]]
    large = [sh(t) for t in full_inputs(12 * W, 1, 2, 2, 8, torch.float32, seed=2)[:3]]
    cache = SelectiveAttentionCache()
    errs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _first_forward(cache, *small)
            out, _ = _recompute(cache, *large)
            errs.append(_max_err(out, mb.cp_attention(*large)))
        after_misses = dict(misses=cache.misses, dropped=cache.dropped, hits=cache.hits, left=len(cache))
        _first_forward(cache, *small)  # never recomputed
        _first_forward(cache, *large)
        out, _ = _recompute(cache, *large)
        errs.append(_max_err(out, mb.cp_attention(*large)))
    return dict(errs=errs, after_misses=after_misses, hits=cache.hits, dropped=cache.dropped, left=len(cache),
                warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                released=cache.release())


def eval_step_in_between():
    """First forward (stores), then an evaluation forward (no grad, store=False) and a grad-enabled
    call outside any checkpoint (store=False), then the recompute: it must be served its own entry."""
    W = dist.get_world_size()
    sh = _sharder()
    q, k, v, dout = (sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=3))
    e = [sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=4)[:3]]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mb.cp_attention(*ref_leaves)
    ref.backward(dout)
    cache = SelectiveAttentionCache()
    _first_forward(cache, q, k, v)
    with torch.no_grad():
        eval_out = selective_cp_attention(*e, cache=cache, stored_fraction=0.5, store=False)
    plain_out = selective_cp_attention(*(t.clone().requires_grad_() for t in e), cache=cache,
                                       stored_fraction=0.5, store=False)
    left_between = len(cache)
    out, leaves = _recompute(cache, q, k, v)
    out.backward(dout)
    e_ref = mb.cp_attention(*e)
    return dict(errs=[_max_err(eval_out, e_ref), _max_err(plain_out, e_ref), _max_err(out, ref)]
                + [_max_err(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)],
                left_between=left_between, hits=cache.hits, misses=cache.misses, released=cache.release())


def skipped_backward_then_release(release: bool):
    """Iteration 1's first forward is never recomputed (no backward). With a release at the end of
    iteration 1, iteration 2's recompute is served its own entry; without, it is served iteration
    1's (same shapes) and the release after iteration 2 raises."""
    W = dist.get_world_size()
    sh = _sharder()
    a = [sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=1)[:3]]
    q, k, v, dout = (sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=2))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mb.cp_attention(*ref_leaves)
    ref.backward(dout)
    cache = SelectiveAttentionCache()
    _first_forward(cache, *a)  # iteration 1: forward only
    released_1 = cache.release() if release else None
    left_1 = len(cache)
    _first_forward(cache, q, k, v)  # iteration 2
    out, leaves = _recompute(cache, q, k, v)
    out.backward(dout)
    errs = [_max_err(out, ref)] + [_max_err(x.grad, y.grad) for x, y in zip(leaves, ref_leaves)]
    try:
        released_2, error = cache.release(), None
    except RuntimeError as exc:
        released_2, error = None, str(exc)
    return dict(released_1=released_1, left_1=left_1, errs=errs, hits=cache.hits, dropped=cache.dropped,
                released_2=released_2, error=error, left=len(cache))


def byte_cap_keeps_order():
    """A cap of one entry: the second first forward stores a placeholder; each recompute gets its
    own entry or a miss (never the other's), and the release finds nothing stale."""
    W = dist.get_world_size()
    sh = _sharder()
    batches = [[sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=s)[:3]] for s in (1, 2, 3)]
    probe = SelectiveAttentionCache(max_bytes=None)
    _first_forward(probe, *batches[0])
    one_entry = probe.nbytes
    probe.release()
    cache = SelectiveAttentionCache(max_bytes=one_entry)
    errs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _first_forward(cache, *batches[0])
        _first_forward(cache, *batches[1])  # over the cap: a placeholder
        held = (len(cache), cache.nbytes)
        out, _ = _recompute(cache, *batches[0])  # served batch 0's entry
        errs.append(_max_err(out, mb.cp_attention(*batches[0])))
        _first_forward(cache, *batches[2])  # fits again
        for b in batches[1:]:
            out, _ = _recompute(cache, *b)
            errs.append(_max_err(out, mb.cp_attention(*b)))
    return dict(one_entry=one_entry, held=held, errs=errs, hits=cache.hits, misses=cache.misses,
                refused=cache.refused, peak=cache.peak_nbytes, left=len(cache),
                warnings=[str(w.message) for w in caught], released=cache.release())


_SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


def no_host_sync_in_put_and_take():
    """The first forward (put) and the recompute (take, content check) read no tensor value on the
    host: every Tensor method that would (a device sync on GPU) raises while they run."""
    W = dist.get_world_size()
    sh = _sharder()
    q, k, v, dout = (sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=3))
    mb.cp_attention(q, k, v)  # warm-up outside the check (lazy imports, caches)
    cache = SelectiveAttentionCache()
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}

    def forbid(name):
        def raising(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"Tensor.{name} called inside put/take: a host sync")
        return raising

    for name in _SYNCING:
        setattr(torch.Tensor, name, forbid(name))
    try:
        _first_forward(cache, q, k, v)
        out, leaves = _recompute(cache, q, k, v)
    except AssertionError as exc:
        out, leaves = None, str(exc)
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    return dict(calls=calls, failure=leaves if out is None else None, hits=cache.hits,
                released=cache.release())


def end_iteration_releases_every_store():
    """Two stores in a module tree: end_iteration finds both (with their paths), drops what is
    left, and names the store whose recompute was served a stale entry."""
    sh = _sharder()
    W = dist.get_world_size()
    x = [sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=1)[:3]]
    y = [sh(t) for t in full_inputs(8 * W, 2, 4, 2, 8, torch.float32, seed=2)[:3]]

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.selective_cache = SelectiveAttentionCache()

    model = torch.nn.Sequential(Attn(), torch.nn.Sequential(torch.nn.Identity(), Attn()))
    stores = [s for _, s in mb.activation_store.stores_of(model)]
    paths = [p for p, _ in mb.activation_store.stores_of(model)]
    _first_forward(stores[0], *x)  # never recomputed
    _first_forward(stores[1], *x)
    _recompute(stores[1], *y)  # served x's entry
    try:
        end_iteration(model)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    _first_forward(stores[0], *x)
    dropped = end_iteration([model])  # a list of model chunks works too
    return dict(paths=paths, error=error, left=[len(s) for s in stores], dropped=dropped)
