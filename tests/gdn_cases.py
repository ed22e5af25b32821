"""Rank-side bodies of the gated-delta-rule tests (run on every rank by harness.run_ranks).

Every rank builds the same full-sequence inputs (same seed; k l2-normalized and beta in (0, 1) as
Gated DeltaNet feeds them), computes the token-by-token reference over the whole sequence in fp64
with autograd, runs gated_delta_rule on its shard, and returns the largest errors of out and of
every gradient (relative to the reference's largest magnitude), plus the bytes it sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fla_standin
import megatron_burst as mb
from linear_cases import relative_errors
from megatron_burst.linear import gated_delta_rule, naive_gated_delta_rule

B, H, DK, DV = 2, 2, 8, 4
NAMES = ("q", "k", "v", "g", "beta")


def full_inputs(seq: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = mk(seq, B, H, DK), F.normalize(mk(seq, B, H, DK), dim=-1), mk(seq, B, H, DV)
    g = -torch.rand(seq, B, H, generator=gen) * 0.3
    beta = torch.rand(seq, B, H, generator=gen)
    return [t.to(dtype) for t in (q, k, v)] + [g, beta], mk(seq, B, H, DV).to(dtype)


def fake_fla(q, k, v, g, beta, **kwargs):
    """flash-linear-attention's chunk_gated_delta_rule API ([N, T, H, d] rows, initial_state and
    final states [N, H, dk, dv], varlen cu_seqlens) computed token by token by tests/fla_standin.py:
    stands in for fla's Triton kernel on CPU, so the kernel='fla' plumbing (rows, the wide call's
    maps, their gradients) is tested here."""
    return _STANDIN_GDN(q, k, v, g, beta, **kwargs)


_STANDIN_GDN = fla_standin.make_tree()["fla.ops.gated_delta_rule"].chunk_gated_delta_rule


def run_gdn_case(layout: str, local_len: int, dtype=torch.float32, stripe: int = 1, seed: int = 0,
                 qkv_format: str = "sbhd", kernel: str = "torch") -> dict:
    from megatron_burst.linear import delta

    real = delta.fla_chunk_gated_delta_rule
    if kernel == "fla":  # no fla on CPU: its API, by the reference (the pool's workers are reused: restored)
        delta.fla_chunk_gated_delta_rule = lambda: fake_fla
    try:
        return _gdn_case(layout, local_len, dtype, stripe, seed, qkv_format, kernel)
    finally:
        delta.fla_chunk_gated_delta_rule = real


def _gdn_case(layout, local_len, dtype, stripe, seed, qkv_format, kernel) -> dict:
    W, r = dist.get_world_size(), dist.get_rank()
    seq = local_len * W
    inputs, dout = full_inputs(seq, dtype, seed)
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    ref_out = naive_gated_delta_rule(*ref_leaves)
    ref_out.backward(dout.double())
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in inputs]
    fmt = (lambda t: t.transpose(0, 1).contiguous()) if qkv_format == "bshd" else (lambda t: t)  # noqa: E731
    with mb.comm_counter() as counter:
        out = gated_delta_rule(*(fmt(t) for t in leaves), group=None, layout=layout, stripe=stripe,
                               qkv_format=qkv_format, kernel=kernel)
        out.backward(fmt(sh(dout)))
    pairs = [("out", fmt(out), ref_out)] + [(f"d{n}", l.grad, rl.grad) for n, l, rl in zip(NAMES, leaves, ref_leaves)]
    errs = relative_errors(pairs, sh)
    errs["dtype"] = str(out.dtype)
    errs["bytes"] = {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}
    return errs


def bad_input_messages() -> tuple:
    """Each bad input raises ValueError locally, before any collective; the group still works."""
    s = 8
    q, k, v = torch.randn(s, 1, 2, 4), torch.randn(s, 1, 2, 4), torch.randn(s, 1, 2, 3)
    g, beta = -torch.rand(s, 1, 2), torch.rand(s, 1, 2)
    cases = {
        "token_stripes": dict(layout="striped", stripe=1),
        "g_shape": dict(g=-torch.rand(2)),
        "beta_shape": dict(beta=torch.rand(s, 1, 2, 4)),
        "seq": dict(layout="zigzag", q=torch.randn(7, 1, 2, 4), k=torch.randn(7, 1, 2, 4), v=torch.randn(7, 1, 2, 3),
                    g=-torch.rand(7, 1, 2), beta=torch.rand(7, 1, 2)),
        "kv_mismatch": dict(k=torch.randn(s, 1, 2, 5)),
        "format": dict(qkv_format="thd"),
        "kernel": dict(kernel="triton"),
    }
    messages = {}
    with mb.comm_counter() as counter:
        for name, kw in cases.items():
            args = dict(q=q, k=k, v=v, g=g, beta=beta)
            args.update({key: kw.pop(key) for key in NAMES if key in kw})
            try:
                gated_delta_rule(*(args[n] for n in NAMES), **kw)
                messages[name] = None
            except ValueError as exc:
                messages[name] = str(exc)
    t = torch.ones(1)
    dist.all_reduce(t)
    return messages, counter.bytes("sent") + counter.bytes("received"), t.item() == dist.get_world_size()


def previous_tokens_case(layout: str, local_len: int, width: int, stripe: int = 1) -> dict:
    """previous_tokens on every rank's segments vs the global sequence shifted by one segment:
    halo values, the gradient reaching each token, and the bytes sent."""
    from megatron_burst.linear.checks import segment_order, segments_per_rank
    from megatron_burst.linear.exchange import SegmentMap, previous_tokens

    W, r = dist.get_world_size(), dist.get_rank()
    seq = local_len * W
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(seq, 2, 3, generator=gen)
    dhalo_full = torch.randn(seq, width, 2, 3, generator=gen)  # a gradient per (token, halo slot)
    per_rank = segments_per_rank(layout, local_len, stripe)
    L = local_len // per_rank
    smap = SegmentMap(None, r, W, tuple(segment_order(layout, W, q, per_rank) for q in range(W)), True)
    local = mb.shard(x, 0, r, W, layout, stripe).clone().requires_grad_()
    with mb.comm_counter() as counter:
        halo = previous_tokens(local.view(per_rank, L, 2, 3), width, smap)
        starts = [gi * L for gi in smap.order[r]]  # global position of each local segment's start
        dh = torch.stack([dhalo_full[p] for p in starts])
        halo.backward(dh)
    want = torch.stack([x[p - width:p] if p else torch.zeros(width, 2, 3) for p in starts])
    # token t's gradient: from every segment start p with p - width <= t < p, slot t - p + width
    grad_full = torch.zeros_like(x)
    for p in range(L, seq, L):
        grad_full[p - width:p] += dhalo_full[p, torch.arange(width)]
    err_grad = (local.grad - mb.shard(grad_full, 0, r, W, layout, stripe)).abs().max().item()
    return {"halo": (halo - want).abs().max().item(), "grad": err_grad,
            "bytes": {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}}
