"""Rank-side bodies of the CP attention tests (run on every rank by harness.run_ranks).

Each case builds the same full-sequence inputs on every rank (same seed), computes a
single-process reference over the whole sequence with the naive kernel and autograd, runs
cp_attention on this rank's shard and returns the largest errors of out, dq, dk, dv against the
reference's shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.kernels import reference

HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}  # GQA 4:1 is 8 query heads over 2 kv heads


def full_inputs(seq, b, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(seq, b, h, d, generator=g).to(dtype)  # noqa: E731  [s, b, h, d]
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def reference_attention(q, k, v, dout, causal, scale):
    """Full-sequence reference in fp32 with autograd: returns out, dq, dk, dv as [s, b, h, d]."""
    qh, kh, vh = (t.float().permute(1, 2, 0, 3).detach().requires_grad_() for t in (q, k, v))
    out, _ = reference.forward(qh, kh, vh, "causal" if causal else "full", 1, scale)
    out.backward(dout.float().permute(1, 2, 0, 3))
    back = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
    return back(out.detach()), back(qh.grad), back(kh.grad), back(vh.grad)


def run_case(algo, layout, causal, heads, local_len=6, b=2, d=8, dtype=torch.float32, stripe=1, seed=0,
             kernel=None, group=None, ring=None, **cp_kw):
    """Errors (max abs) of cp_attention vs the reference for one configuration, on this rank.

    ``group`` may be a process group, a CPTopology (then ``ring`` picks flat/double) or a
    USPTopology; ``cp_kw`` go to cp_attention (ulysses_size, ring_backward).
    """
    pg = group.group if isinstance(group, mb.topology.CPTopology) else group
    pg = group.cp_group if isinstance(group, mb.topology.USPTopology) else pg
    W, r = dist.get_world_size(pg), dist.get_rank(pg)
    hq, hkv = HEADS[heads] if isinstance(heads, str) else heads
    seq = local_len * W
    q, k, v, dout = full_inputs(seq, b, hq, hkv, d, dtype, seed)
    scale = d ** -0.5
    ref = reference_attention(q, k, v, dout, causal, scale)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    with mb.comm_counter() as counter:
        out = mb.cp_attention(ql, kl, vl, group=group, algo=algo, layout=layout, causal=causal,
                              softmax_scale=scale, kernel=kernel, stripe=stripe, ring=ring, **cp_kw)
        out.backward(sh(dout))
    got = (out, ql.grad, kl.grad, vl.grad)
    errs = {name: (g.float() - sh(e)).abs().max().item() for name, g, e in zip(("out", "dq", "dk", "dv"), got, ref)}
    # squared-error sums (RMS over all ranks = sqrt(sum / numel)): rounding noise averages out, a
    # systematic extra rounding (e.g. accumulating in bf16) does not
    errs["sq"] = {name: (((g.double() - sh(e).double()) ** 2).sum().item(), g.numel()) for name, g, e in
                  zip(("out", "dq", "dk", "dv"), got, ref)}
    errs["scale"] = max(sh(e).abs().max().item() for e in ref)
    errs["bytes"] = {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}
    errs["received"] = counter.bytes("received")
    errs["links"] = {(p, l): counter.bytes("sent", phase=p, link=l) for p in ("forward", "backward")
                     for l in ("intra", "inter")}
    return errs


def single_device_errors(seq, b, hq, hkv, d, dtype, seed, causal=True):
    """Max abs errors of torch's own single-device SDPA in ``dtype`` (with autograd) against the fp32
    reference on the same rounded inputs: the error a user gets without CP, the bar CP must meet."""
    import torch.nn.functional as F

    q, k, v, dout = full_inputs(seq, b, hq, hkv, d, dtype, seed)
    scale = d ** -0.5
    ref = reference_attention(q, k, v, dout, causal, scale)
    bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    g = hq // hkv
    out = F.scaled_dot_product_attention(bhsd(leaves[0]), bhsd(leaves[1]).repeat_interleave(g, 1),
                                         bhsd(leaves[2]).repeat_interleave(g, 1), is_causal=causal, scale=scale)
    out.permute(2, 0, 1, 3).backward(dout)
    got = (out.permute(2, 0, 1, 3), leaves[0].grad, leaves[1].grad, leaves[2].grad)
    errs = {name: (a.float() - e).abs().max().item() for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
    errs["rms"] = {name: (a.double() - e.double()).pow(2).mean().sqrt().item()
                   for name, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
    return errs


def run_matrix(algo, layout, world_size_check=None, **kw):
    """All {causal, full} x {mha, gqa4, mqa} cases for one (algo, layout); returns {case: errors}."""
    results = {}
    for causal in (True, False):
        for heads in HEADS:
            results[(causal, heads)] = run_case(algo, layout, causal, heads, **kw)
    return results


def bad_input_errors():
    """Each bad input must raise ValueError locally; afterwards the group must still work."""
    good = lambda s=6, h=4, hk=2, d=8: torch.randn(s, 1, h, d)  # noqa: E731
    cases = {
        "seq_not_divisible": dict(q=good(5), k=good(5, 2), v=good(5, 2), layout="zigzag"),
        "striped_stripe": dict(q=good(6), k=good(6, 2), v=good(6, 2), layout="striped", stripe=4),
        "heads_not_divisible": dict(q=good(6, 3), k=good(6, 2), v=good(6, 2)),
        "unknown_algo": dict(q=good(), k=good(6, 2), v=good(6, 2), algo="p2p"),
        "unknown_layout": dict(q=good(), k=good(6, 2), v=good(6, 2), layout="spiral"),
        "kv_mismatch": dict(q=good(), k=good(6, 2), v=good(6, 4)),
        "seq_mismatch": dict(q=good(), k=good(4, 2), v=good(4, 2)),
        "dtype_mismatch": dict(q=good(), k=good(6, 2).double(), v=good(6, 2).double()),
        "head_dim_mismatch": dict(q=good(d=16), k=good(6, 2), v=good(6, 2)),
        "dropout": dict(q=good(), k=good(6, 2), v=good(6, 2), dropout_p=0.1),
        "bias": dict(q=good(), k=good(6, 2), v=good(6, 2), attn_bias=torch.zeros(1)),
        "format": dict(q=good(), k=good(6, 2), v=good(6, 2), qkv_format="thd"),
    }
    return refusal_messages(cases)


def refusal_messages(cases: dict) -> tuple:
    """cp_attention on each case's kwargs (q, k, v among them): ({name: ValueError text or None},
    bytes moved by all of them, whether the group still works afterwards)."""
    messages = {}
    with mb.comm_counter() as counter:
        for name, kw in cases.items():
            try:
                mb.cp_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
                messages[name] = None
            except ValueError as e:
                messages[name] = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is still usable: nothing was left half-posted
    return messages, counter.bytes("sent") + counter.bytes("received"), t.item() == dist.get_world_size()


def run_case_split_block_causal(algo, layout, stripe, local_len):
    """run_case with block_causal blocks split into a causal block + the rest of their diagonal
    stripes (CPConfig.splits_block_causal, on CUDA only by default: forced here on CPU) and the kinds
    of the blocks that ran."""
    from megatron_burst import kernels
    from megatron_burst.algorithms import schedule

    saved = schedule.CPConfig.splits_block_causal
    kinds = set()
    real = kernels.block_forward

    def counting(q, k, v, mask, *a, **kw):
        kinds.add(mask.kind)
        return real(q, k, v, mask, *a, **kw)

    import megatron_burst.algorithms.ring as ring_mod
    import megatron_burst.algorithms.allgather as allgather_mod

    schedule.CPConfig.splits_block_causal = property(lambda self: self.stripe > 1)
    ring_mod.block_forward = allgather_mod.block_forward = counting
    try:
        errs = run_case(algo, layout, True, (4, 2), local_len=local_len, stripe=stripe)
    finally:
        schedule.CPConfig.splits_block_causal = saved
        ring_mod.block_forward = allgather_mod.block_forward = real
    errs["kinds"] = sorted(kinds)
    return errs
