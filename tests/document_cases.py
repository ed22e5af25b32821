"""Rank-side bodies of the document-mask tests (run on every rank by harness.run_ranks).

The reference is a dense masked softmax over the whole packed sequence (fp64, autograd): token t
sees u iff both lie in one document (and u <= t when causal). Nothing of the engine is reused.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.algorithms import burst, ring as ring_mod

DTYPE = torch.float32  # the engine keeps lse in fp32: errors are fp32 rounding (a wrong mask is O(1))


def dense_reference(q, k, v, dout, bounds_per_sample, causal, scale):
    """out, dq, dk, dv [s, b, h, d] of softmax attention restricted to documents (per sample)."""
    s = q.shape[0]
    pos = torch.arange(s)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in leaves)  # [b, h, s, d]
    g = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    masks = []
    for bounds in bounds_per_sample:
        doc = torch.bucketize(pos, torch.tensor(bounds[1:-1]), right=True)
        vis = doc[:, None] == doc[None, :]
        if causal:
            vis &= pos[None, :] <= pos[:, None]
        masks.append(vis)
    vis = torch.stack(masks)[:, None]  # [b, 1, s, s]
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))
    out = torch.softmax(scores, -1) @ vh
    out.permute(2, 0, 1, 3).backward(dout)
    return out.permute(2, 0, 1, 3).detach(), leaves[0].grad, leaves[1].grad, leaves[2].grad


def run_doc_case(algo: str, layout: str, heads: tuple, bounds, local_len: int, *, causal: bool = True,
                 stripe: int = 1, b: int = 2, d: int = 8, seed: int = 0, per_sample: Optional[list] = None,
                 ranks_per_node: Optional[int] = None, ring: Optional[str] = None, kernel: Optional[str] = None,
                 with_documents: bool = True, **cp_kw):
    """Max abs errors of out, dq, dk, dv vs the dense reference on this rank, and the bytes sent.

    ``bounds``: cu_seqlens shared by the batch; ``per_sample``: a list of b of them instead.
    ``ranks_per_node``: run on an emulated node split (``ring`` flat or double).
    ``cp_kw``: more cp_attention arguments (usp's ulysses_size).
    """
    group = mb.build_cp_topology(None, ranks_per_node) if ranks_per_node else None
    W, r = dist.get_world_size(), dist.get_rank()
    hq, hkv = heads
    seq = local_len * W
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(seq, b, h, d, generator=gen, dtype=DTYPE)  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    scale = d ** -0.5
    all_bounds = per_sample if per_sample is not None else [bounds] * b
    if not with_documents:
        all_bounds = [[0, seq]] * b
    ref = dense_reference(q, k, v, dout, all_bounds, causal, scale)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    if not with_documents:
        cu = None
    elif per_sample is not None:
        cu = [torch.tensor(x, dtype=torch.int32) for x in per_sample]
    else:
        cu = torch.tensor(bounds, dtype=torch.int32)
    with mb.comm_counter() as counter:
        out = mb.cp_attention(ql, kl, vl, group=group, algo=algo, layout=layout, causal=causal, softmax_scale=scale,
                              stripe=stripe, ring=ring, kernel=kernel, cu_seqlens=cu, **cp_kw)
        out.backward(sh(dout))
    got = (out, ql.grad, kl.grad, vl.grad)
    errs = {name: (a - sh(e)).abs().max().item() for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
    errs["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
    errs["bytes"] = {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}
    return errs


def run_doc_matrix(algo: str, layout: str, bounds, local_len: int, stripe: int = 1):
    """causal and full-within-document x MHA and GQA 4:1 (and per-sample documents for one case)."""
    out = {}
    for causal in (True, False):
        for heads in ((4, 4), (8, 2)):
            out[(causal, heads)] = run_doc_case(algo, layout, heads, bounds, local_len, causal=causal, stripe=stripe)
    seq = local_len * dist.get_world_size()
    other = [0, 1, seq // 2 + 1, seq]  # a one-token document, then two more
    out["per_sample"] = run_doc_case(algo, layout, (4, 2), None, local_len, stripe=stripe,
                                     per_sample=[list(bounds), other])
    return out


class KernelCalls:
    """Counts block kernel calls of ring/burst (forward and backward), as (q_rows, kv_rows) lists."""

    def __init__(self):
        self.forward: list = []
        self.backward: list = []

    def __enter__(self):
        self._saved = (ring_mod.block_forward, ring_mod.block_backward, burst.block_backward)
        fwd, bwd, bbwd = self._saved

        def count_fwd(q, k, v, mask, *a, **kw):
            self.forward.append((mask.q_stop - mask.q_start, mask.kv_stop - mask.kv_start))
            return fwd(q, k, v, mask, *a, **kw)

        def count_bwd(original):
            def wrapped(dout, q, k, v, D, lse, mask, *a, **kw):
                self.backward.append((mask.q_stop - mask.q_start, mask.kv_stop - mask.kv_start))
                return original(dout, q, k, v, D, lse, mask, *a, **kw)
            return wrapped

        ring_mod.block_forward = count_fwd
        ring_mod.block_backward = count_bwd(bwd)
        burst.block_backward = count_bwd(bbwd)
        return self

    def __exit__(self, *exc):
        ring_mod.block_forward, ring_mod.block_backward, burst.block_backward = self._saved


def expected_calls(bounds, layout: str, local_len: int, q_rank: int, W: int, stripe: int = 1) -> int:
    """Independent count of (kv rank, document) pairs where some query of ``q_rank`` sees a key:
    from the dense document mask and the layout's positions, not from the engine's block logic."""
    seq = local_len * W
    pos = torch.arange(seq)
    doc = torch.bucketize(pos, torch.tensor(bounds[1:-1]), right=True)
    vis = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    qp = mb.masks.layout.layout_indices(seq, q_rank, W, layout, stripe)
    count = 0
    for j in range(W):
        kp = mb.masks.layout.layout_indices(seq, j, W, layout, stripe)
        sub = vis[qp][:, kp]
        count += len(set(doc[qp][sub.any(1)].tolist()))
    return count


def count_kernel_calls(algo: str, layout: str, bounds, local_len: int, stripe: int = 1, merge_rows: int = 0):
    """Kernel calls made by this rank with documents, and the independent expectation per pass
    (one call per (kv rank, document) with something visible: exact when ``merge_rows`` = 0)."""
    from megatron_burst.masks import documents  # the merge limits are read there per call

    W, r = dist.get_world_size(), dist.get_rank()
    saved = documents.MERGE_ROWS, documents.CPU_MERGE_ROWS
    documents.MERGE_ROWS = documents.CPU_MERGE_ROWS = merge_rows
    try:
        with KernelCalls() as calls:
            errs = run_doc_case(algo, layout, (4, 2), bounds, local_len, stripe=stripe, b=1)
    finally:
        documents.MERGE_ROWS, documents.CPU_MERGE_ROWS = saved
    fwd_expected = expected_calls(bounds, layout, local_len, r, W, stripe)
    # burst computes the backward of the visiting queries against our keys: count those pairs too
    if algo == "burst":
        bwd_expected = sum(_pairs(bounds, layout, local_len, i, r, W, stripe) for i in range(W))
    else:
        bwd_expected = fwd_expected
    return len(calls.forward), fwd_expected, len(calls.backward), bwd_expected, errs


def _pairs(bounds, layout, local_len, q_rank, kv_rank, W, stripe) -> int:
    """Documents in which some query of q_rank sees some key of kv_rank (dense, independent)."""
    seq = local_len * W
    pos = torch.arange(seq)
    doc = torch.bucketize(pos, torch.tensor(bounds[1:-1]), right=True)
    vis = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    qp = mb.masks.layout.layout_indices(seq, q_rank, W, layout, stripe)
    kp = mb.masks.layout.layout_indices(seq, kv_rank, W, layout, stripe)
    return len(set(doc[qp][vis[qp][:, kp].any(1)].tolist()))


def bad_cu_seqlens_messages(local_len: int = 4):
    """Each bad cu_seqlens raises ValueError locally; afterwards the group must still work."""
    W = dist.get_world_size()
    S = local_len * W
    q = torch.randn(local_len, 1, 4, 8)
    kv = torch.randn(local_len, 1, 2, 8)
    cases = {
        "not_starting_at_0": torch.tensor([1, 3, S], dtype=torch.int32),
        "not_ending_at_S": torch.tensor([0, 3, S - 1], dtype=torch.int32),
        "past_S": torch.tensor([0, 3, S + 2], dtype=torch.int32),
        "not_increasing": torch.tensor([0, 3, 3, S], dtype=torch.int32),
        "decreasing": torch.tensor([0, 3, 2, S], dtype=torch.int32),
        "float_dtype": torch.tensor([0.0, 3.0, float(S)]),
        "two_dims": torch.tensor([[0, S]], dtype=torch.int32),
        "wrong_sample_count": [torch.tensor([0, S]), torch.tensor([0, S]), torch.tensor([0, S])],
    }
    messages = {}
    with mb.comm_counter() as counter:
        for name, cu in cases.items():
            try:
                mb.cp_attention(q, kv, kv, algo="burst", layout="zigzag", cu_seqlens=cu)
                messages[name] = None
            except ValueError as e:
                messages[name] = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    return messages, counter.bytes("sent") + counter.bytes("received"), t.item() == W, S


def selective_checkpoint_with_documents(algo: str = "burst", layout: str = "striped", fraction: float = 0.5):
    """Sequence-level selective checkpointing with documents: the first (no-grad) forward stores the
    later rows, the recompute computes the earlier ones (only the K,V prefix they can see travels),
    and forward and gradients still equal the dense reference."""
    from megatron_burst.activation_store import SelectiveAttentionCache, selective_cp_attention

    W, r = dist.get_world_size(), dist.get_rank()
    local_len, b, d = 8, 2, 8
    seq = local_len * W
    bounds = [0, 3, 4, seq // 2 + 3, seq]
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(seq, b, h, d, generator=gen) for h in (4, 2, 2, 4))
    scale = d ** -0.5
    ref = dense_reference(q, k, v, dout, [bounds] * b, True, scale)
    sh = lambda t: mb.shard(t, 0, r, W, layout).clone()  # noqa: E731
    kw = dict(algo=algo, layout=layout, softmax_scale=scale, cu_seqlens=torch.tensor(bounds))
    cache = SelectiveAttentionCache()
    with torch.no_grad():
        selective_cp_attention(sh(q), sh(k), sh(v), cache=cache, stored_fraction=fraction, **kw)
    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    out = selective_cp_attention(*leaves, cache=cache, stored_fraction=fraction, **kw)
    out.backward(sh(dout))
    got = (out, *(t.grad for t in leaves))
    return cache.hits, max((a - sh(e)).abs().max().item() for a, e in zip(got, ref))


def run_thd_case(algo: str, seqlens: list, padded: list, heads=(8, 2), d: int = 8, seed: int = 1):
    """A packed THD batch (qkv_format "thd", layout "thd"): sequences of ``seqlens`` real tokens in
    slots of ``padded`` tokens, partitioned as TransformerEngine does. The reference is the dense
    masked softmax per real sequence; padding rows get no output gradient (as a loss mask does),
    and only real rows' outputs are compared."""
    W, r = dist.get_world_size(), dist.get_rank()
    hq, hkv = heads
    cu_pad = [0]
    for p in padded:
        cu_pad.append(cu_pad[-1] + p)
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    T = cu_pad[-1]
    real = torch.zeros(T, dtype=torch.bool)
    doc = torch.full((T,), -1, dtype=torch.long)
    for i, n in enumerate(seqlens):
        real[cu_pad[i]:cu_pad[i] + n] = True
        doc[cu_pad[i]:cu_pad[i] + n] = i
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(T, h, d, generator=gen)  # noqa: E731  [t, h, d]
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    dout = dout * real[:, None, None]
    # reference: real token t sees real u of its own sequence with u <= t
    pos = torch.arange(T)
    vis = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0) & (pos[None, :] <= pos[:, None])
    vis |= torch.diag(~real)  # padding rows see themselves only (their output is not compared)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.permute(1, 0, 2) for t in leaves)
    g = hq // hkv
    scale = d ** -0.5
    scores = (qh @ kh.repeat_interleave(g, 0).transpose(-1, -2) * scale).masked_fill(~vis, float("-inf"))
    out_ref = (torch.softmax(scores, -1) @ vh.repeat_interleave(g, 0)).permute(1, 0, 2)
    out_ref.backward(dout)
    idx = mb.masks.layout.thd_indices(cu_pad, r, W)
    ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
    with mb.comm_counter() as counter:
        out = mb.cp_attention(ql, kl, vl, algo=algo, layout="thd", qkv_format="thd", softmax_scale=scale,
                              cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                              cu_seqlens_padded=torch.tensor(cu_pad, dtype=torch.int32))
        out.backward(dout[idx])
    keep = real[idx]
    errs = {"out": (out[keep] - out_ref.detach()[idx][keep]).abs().max().item()}
    for name, got, leaf in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), leaves):
        errs[name] = (got - leaf.grad[idx]).abs().max().item()
    errs["finite"] = bool(torch.isfinite(out).all())
    errs["shape"] = tuple(out.shape)
    errs["bytes"] = counter.bytes("sent")
    return errs


def thd_error(cu):
    """The ValueError message of a THD call with (padded) boundaries ``cu`` on this world, or None."""
    W = dist.get_world_size()
    n = cu[-1] // W
    try:
        mb.cp_attention(torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8), layout="thd",
                        qkv_format="thd", cu_seqlens=torch.tensor(cu))
    except ValueError as e:
        return str(e)
    return None
