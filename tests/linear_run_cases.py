"""Rank-side bodies of the data-derived layout tests of the linear-attention family (run on every rank
by harness.run_ranks): linear_attention (LASP-2, every decay form; torch kernels) and gated_delta_rule
on packed THD batches and in the balanced layout, against the plain recurrence run on each document
alone from a zero state (linear_doc_cases' references), output and every gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_burst as mb
from linear_cases import DK, DV, H
from linear_doc_cases import GFORMS, _errors, _inputs, _per_document, refusal_messages
from megatron_burst.masks.documents import balanced_documents, check_thd, rank_positions
from megatron_burst.linear import gated_delta_rule, linear_attention, naive_gated_delta_rule, naive_linear_attention
from megatron_burst.linear.runs import rank_runs


def thd_batch(W: int):
    """Documents of a packed batch on W ranks (TransformerEngine's partitioning): five sequences whose
    chunks are 5, 1, 9, 3 and 70 tokens (one-token chunks; runs in different 64-token chunk groups of
    the batched kernels), four with padding tails."""
    chunks = (5, 1, 9, 3, 70)
    padded, real = [0], [0]
    for i, c in enumerate(chunks):
        length = 2 * W * c
        real.append(real[-1] + length - (0, 1, 3, 2 * W - 1, 2)[i])
        padded.append(padded[-1] + length)
    local = padded[-1] // W
    return check_thd(real, padded, local, W, 1), real


def balanced_batch(W: int, batch: int = 2):
    """Per-sample documents of a [b, S] batch, S = 48 W, placed by the balanced planner: a long document
    (split over ranks), short ones (placed whole), single tokens."""
    S = 48 * W
    cuts = [[0, 1, 2, 9, S // 2 + 3, S - 5, S], [0, 3 * S // 4, S - 1, S]][:batch]
    return balanced_documents(cuts, S, batch, W), cuts


def _bounds(documents, b: int) -> list:
    """Per-sample boundaries of the reference (THD: the padding tails are documents of their own)."""
    out = [None] * b
    for first, end, bounds in documents.groups:
        for j in range(first, end):
            out[j] = list(bounds)
    return out


def _shard(documents, layout: str):
    W, r = dist.get_world_size(), dist.get_rank()
    pos = rank_positions(layout, r, W, documents.seq_len // W, partition=documents.partition)
    return lambda t: t[pos]


def _linear_case(layout: str, documents, cu, gform, seed: int, qkv_format: str = "sbhd", algo: str = "lasp2") -> dict:
    b = documents.groups[-1][1]
    seq = documents.seq_len
    q, k, v, g, dout = _inputs(seq, gform, seed, b)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_g = None if g is None else g.double().requires_grad_()
    token_major = [] if g is None or g.dim() == 1 else [ref_g]
    shared = [] if g is None or g.dim() != 1 else [ref_g]
    want = _per_document(lambda q_, k_, v_, g_=None: naive_linear_attention(q_, k_, v_, g=g_), _bounds(documents, b),
                         ref + token_major, shared)
    want.backward(dout.double())
    sh = _shard(documents, layout)
    fmt = (lambda t: t.transpose(0, 1).contiguous()) if qkv_format == "bshd" else (lambda t: t)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
    g_local = None if g is None else (g.clone() if g.dim() == 1 else sh(g).clone()).requires_grad_()
    with mb.comm_counter() as counter:
        out = fmt(linear_attention(*(fmt(t) for t in leaves), g=g_local if g is None or g.dim() == 1 else fmt(g_local),
                                   layout=layout, cu_seqlens=cu, kernel="torch", qkv_format=qkv_format, algo=algo))
        out.backward(sh(dout))
    pairs = [("out", out, sh(want.detach()))] + [(f"d{n}", t.grad, sh(w.grad)) for n, t, w in zip("qkv", leaves, ref)]
    if g is not None:
        dg = g_local.grad.double()
        if g.dim() == 1:  # shared by every rank's tokens: its gradient sums over ranks
            dist.all_reduce(dg)
        pairs.append(("dg", dg, ref_g.grad if g.dim() == 1 else sh(ref_g.grad)))
    errs = _errors(pairs)
    errs["sent"] = counter.bytes("sent", phase="forward"), counter.bytes("sent", phase="backward")
    return errs


def _gdn_case(layout: str, documents, cu, seed: int, qkv_format: str = "sbhd") -> dict:
    b = documents.groups[-1][1]
    seq = documents.seq_len
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    inputs = [mk(seq, b, H, DK), F.normalize(mk(seq, b, H, DK), dim=-1), mk(seq, b, H, DV),
              -torch.rand(seq, b, H, generator=gen) * 0.3, torch.rand(seq, b, H, generator=gen)]
    dout = mk(seq, b, H, DV)
    ref = [t.double().requires_grad_() for t in inputs]
    want = _per_document(naive_gated_delta_rule, _bounds(documents, b), ref, [])
    want.backward(dout.double())
    sh = _shard(documents, layout)
    fmt = (lambda t: t.transpose(0, 1).contiguous()) if qkv_format == "bshd" else (lambda t: t)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in inputs]
    out = gated_delta_rule(*(fmt(t) for t in leaves), layout=layout, qkv_format=qkv_format, cu_seqlens=cu,
                           kernel="torch")
    out.backward(fmt(sh(dout)))
    return _errors([("out", fmt(out), sh(want.detach()))] + [
        (f"d{n}", t.grad, sh(w.grad)) for n, t, w in zip(("q", "k", "v", "g", "beta"), leaves, ref)])


def run_layout_cases() -> dict:
    """LASP-2 (every decay form) and the gated delta rule on a THD batch and a balanced [2, S] batch at
    this world size: {case name: errors (and, LASP-2, the bytes sent forward / backward)}."""
    W = dist.get_world_size()
    thd, thd_real = thd_batch(W)
    bal, bal_cuts = balanced_batch(W)
    results = {}
    for layout, documents, raw in (("thd", thd, None), ("balanced", bal, bal_cuts)):
        for i, gform in enumerate(GFORMS):
            # the Documents the batch was sliced with; on one rank once the raw boundaries (W > 1 refuses
            # them for balanced: the plan depends on the topology's nodes, see run_layout_refusals)
            cu = raw if (gform == "token" and layout == "balanced" and W == 1) else documents
            results[f"lasp2 {layout} g={gform}"] = _linear_case(layout, documents, cu, gform, seed=i)
        results[f"gdn {layout} sbhd"] = _gdn_case(layout, documents, documents, seed=7)
    results["gdn balanced bshd"] = _gdn_case("balanced", bal, bal, seed=8, qkv_format="bshd")
    results["lasp2 balanced g=channel bshd"] = _linear_case("balanced", bal, bal, "channel", seed=9, qkv_format="bshd")
    if W == 1:  # one rank holds the sequence in order: LASP-1 takes these layouts there
        results["lasp1 thd g=token"] = _linear_case("thd", thd, thd, "token", seed=2, algo="lasp1")
    results["runs"] = {"thd": [len(r) for r in rank_runs(thd, W).per_rank] if W > 1 else None,
                       "balanced": [len(r) for r in rank_runs(bal, W).per_rank] if W > 1 else None}
    return results


def run_layout_refusals() -> dict:
    """What the data-derived layouts refuse, before any collective."""
    W = dist.get_world_size()
    thd, _ = thd_batch(W)
    s = thd.seq_len // W
    q, k, v = torch.randn(s, 1, H, DK), torch.randn(s, 1, H, DK), torch.randn(s, 1, H, DV)
    g, beta = -torch.rand(s, 1, H), torch.rand(s, 1, H)
    cases = {
        "no_documents": lambda: linear_attention(q, k, v, layout="thd"),
        "lasp1": lambda: linear_attention(q, k, v, layout="thd", algo="lasp1", cu_seqlens=thd),
        "wrong_layout": lambda: linear_attention(q, k, v, layout="contiguous", cu_seqlens=thd),
        "thd_as_balanced": lambda: gated_delta_rule(q, k, v, g, beta, layout="balanced", cu_seqlens=thd),
        "not_divisible": lambda: linear_attention(q, k, v, layout="thd", cu_seqlens=[0, 1, s * W]),
        "balanced_raw": lambda: linear_attention(q, k, v, layout="balanced", cu_seqlens=[0, 5, s * W]),
        "thd_other_cp": lambda: linear_attention(q, k, v, layout="thd",
                                                 cu_seqlens=check_thd([0, 6, s * W], None, s * W, 1, 1)),
    }
    return refusal_messages(cases)


def fla_run_layout_cases() -> dict:
    """THD and balanced through the stand-in fla (tests/fla_standin.py, fla 0.6's varlen semantics) on
    the CUDA decision path against our torch path on the same shard: {case: {tensor: relative error}}
    for every LASP-2 decay form (learned and fixed per-head decays) and the gated delta rule."""
    import fla_standin
    from linear_fla_doc_cases import FORMS, _inputs as fla_inputs, _relative, _run

    W = dist.get_world_size()
    results: dict = {}
    with fla_standin.installed():
        bal, _ = balanced_batch(W)
        for layout, documents in (("thd", thd_batch(W)[0]), ("balanced", bal)):
            sh = _shard(documents, layout)
            for op, form in [("lasp2", f) for f in FORMS] + [("gdn", "token")]:
                full, dout = fla_inputs(op, form, documents.seq_len, seed=FORMS.index(form) if op == "lasp2" else 7)
                b = documents.groups[-1][1]
                full, dout = [t if t.dim() == 1 else t[:, :b] for t in full], dout[:, :b]
                local = [t if t.dim() == 1 else sh(t) for t in full]
                want = _run(op, form, "torch", layout, 1, local, sh(dout), documents)
                before = sum(fla_standin.calls.values())
                got = _run(op, form, "auto", layout, 1, local, sh(dout), documents)
                names = ["out"] + [f"d{i}" for i in range(len(got) - 1)]
                results[f"{op} {form} {layout}"] = {
                    n: (_relative(a, w) if a.shape == w.shape else float("inf")) for n, a, w in zip(names, got, want)}
                # each case through fla, or it would compare the torch path with itself
                results[f"{op} {form} {layout}"]["fla_calls"] = sum(fla_standin.calls.values()) - before
    return results


def run_halo_case(width: int = 3) -> dict:
    """previous_tokens over a THD batch's runs (one-token chunks: a halo reaching several runs back) vs
    the global sequence: every run's ``width`` preceding tokens (zeros before the sequence), and the
    gradient reaching each token."""
    from megatron_burst.linear.exchange import previous_tokens
    from megatron_burst.linear.runs import run_map

    W, r = dist.get_world_size(), dist.get_rank()
    thd, _ = thd_batch(W)
    runs = rank_runs(thd, W)
    seq = thd.seq_len
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(seq, 2, 3, generator=gen)
    dhalo_full = torch.randn(seq, width, 2, 3, generator=gen)  # a gradient per (token, halo slot)
    sh = _shard(thd, "thd")
    local = sh(x).clone().requires_grad_()
    starts = [a for a, _ in runs.per_rank[r]]
    with mb.comm_counter() as counter:
        halo = previous_tokens(local, width, run_map(None, r, W, runs), runs.starts)
        halo.backward(torch.stack([dhalo_full[p] for p in starts]))
    padded = torch.cat([torch.zeros(width, 2, 3), x])
    want = torch.stack([padded[p:p + width] for p in starts])
    grad_full = torch.zeros_like(x)
    for p, _ in runs.starts:  # every run start p: token p - width + j got slot j's gradient
        for j in range(width):
            if p - width + j >= 0:
                grad_full[p - width + j] += dhalo_full[p, j]
    return {"halo": (halo - want).abs().max().item(), "grad": (local.grad - sh(grad_full)).abs().max().item(),
            "shortest": min(n for _, n in runs.starts), "sent": counter.bytes("sent", phase="forward"),
            "slots": max(len(o) for o in runs.order)}


def exchange_saved_states() -> dict:
    """What a LASP-2 call over a THD batch's runs keeps for the backward: the largest number of
    [b, h, dk, dv] states in one saved tensor, against this rank's runs and all ranks' (T)."""
    W, r = dist.get_world_size(), dist.get_rank()
    thd, _ = thd_batch(W)
    runs = rank_runs(thd, W)
    q, k, v, g, _ = _inputs(thd.seq_len, "token", 0, 1)
    sh = _shard(thd, "thd")
    most = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal most
        if t.dim() == 5 and tuple(t.shape[-2:]) == (DK, DV):
            most = max(most, t.shape[0])
        return t

    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_attention(*leaves, g=sh(g), layout="thd", cu_seqlens=thd, kernel="torch")
    return {"saved_states": most, "mine": len(runs.order[r]), "total": sum(map(len, runs.order))}
