"""Rank-side bodies of the document tests of the linear-attention family (run on every rank by
harness.run_ranks): linear_attention (LASP-2 and LASP-1, every decay form) and gated_delta_rule with
``cu_seqlens``, against the plain recurrence run on each document alone from a zero state.

Each call runs many cases in one task (every layout, decay form and document set at one world
size) and returns, per case, the largest relative errors of the output and every gradient, plus the
bytes sent with and without the documents.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_burst as mb
from linear_cases import B, DK, DV, H, LOCAL
from megatron_burst.masks.documents import check_cu_seqlens
from megatron_burst.linear import gated_delta_rule, linear_attention, naive_gated_delta_rule, naive_linear_attention

GFORMS = (None, "head", "token", "channel")
LAYOUTS = (("contiguous", 1), ("zigzag", 1), ("striped", 64))


def document_sets(seq: int, seg: int) -> dict:
    """Per-sample boundaries [[sample 0], [sample 1]] over ``seq`` tokens whose global segments are
    ``seg`` tokens long: starts inside segments, exactly on segment starts, single-token documents
    (also the first and last token), a document over every rank, and a chunk start (64)."""
    def clean(cuts):
        return [0] + sorted({c for c in cuts if 0 < c < seq}) + [seq]

    inside = clean([3, seg // 2, 64, 2 * seg + 5, seq - seg // 2])
    on_edges = clean([seg * i for i in range(1, seq // seg)] + [seg + 1, 2 * seg + 1, 2 * seg + 2])
    singles = clean([1, 2, seg - 1, seg, seg + 1, seq - 1])
    spanning = clean([1, seq - 1])  # [1, seq - 1) spans every rank
    return {"mixed": [inside, on_edges], "singles+spanning": [singles, spanning],
            "shared": [clean([seg + 1, seq - seg - 2])] * 2, "one_document": [[0, seq]] * 2}


def _per_document(fn, bounds: list, tensors: list, shared: list):
    """fn over every document of every sample alone (token-major [s, b, ...] tensors sliced, the
    ``shared`` ones passed whole), concatenated back to [s, b, ...]."""
    samples = []
    for j, cuts in enumerate(bounds):
        parts = [fn(*[t[a:c, j:j + 1] for t in tensors], *shared) for a, c in zip(cuts, cuts[1:])]
        samples.append(torch.cat(parts, dim=0))
    return torch.cat(samples, dim=1)


def _inputs(seq: int, gform, seed: int, b: int = B):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v, dout = mk(seq, b, H, DK), mk(seq, b, H, DK), mk(seq, b, H, DV), mk(seq, b, H, DV)
    g = {None: None, "head": lambda: -torch.rand(H, generator=gen) * 0.3,
         "token": lambda: -torch.rand(seq, b, H, generator=gen) * 0.3,
         "channel": lambda: -torch.rand(seq, b, H, DK, generator=gen) * 0.3}[gform]
    return q, k, v, (g() if g is not None else None), dout


def _errors(pairs) -> dict:
    return {name: ((got.double() - want).abs().max() / want.abs().max()).item() for name, got, want in pairs}


_REFERENCES: dict = {}  # (op, seq, gform, bounds, seed) -> (out, grads): layouts of one length share them


def _shared_reference(key, shapes, compute):
    """(out, grads) of a reference, computed once per task by one rank (in turn) and broadcast:
    every rank meets the same keys in the same order."""
    if key not in _REFERENCES:
        W = dist.get_world_size()
        owner = len(_REFERENCES) % W
        if dist.get_rank() == owner:
            want, grads = compute()
            flat = torch.cat([t.reshape(-1) for t in [want] + grads])
        else:
            flat = torch.empty(sum(torch.Size(x).numel() for x in shapes), dtype=torch.float64)
        if W > 1:
            dist.broadcast(flat, owner)
        parts = [p.view(x) for p, x in zip(flat.split([torch.Size(x).numel() for x in shapes]), shapes)]
        _REFERENCES[key] = (parts[0], parts[1:])
    return _REFERENCES[key]


def _linear_reference(seq, gform, bounds, seed):
    q, k, v, g, dout = _inputs(seq, gform, seed)

    def compute():
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        ref_g = None if g is None else g.double().requires_grad_()
        token_major = [] if g is None or g.dim() == 1 else [ref_g]
        shared = [] if g is None or g.dim() != 1 else [ref_g]
        want = _per_document(lambda q_, k_, v_, g_=None: naive_linear_attention(q_, k_, v_, g=g_), bounds,
                             ref + token_major, shared)
        want.backward(dout.double())
        return want.detach(), [t.grad for t in ref + ([ref_g] if g is not None else [])]

    shapes = [dout.shape, q.shape, k.shape, v.shape] + ([] if g is None else [g.shape])
    return _shared_reference(("linear", seq, gform, tuple(map(tuple, bounds)), seed), shapes, compute)


def _linear_case(algo, layout, stripe, gform, bounds, cu, seed) -> dict:
    W, r = dist.get_world_size(), dist.get_rank()
    seq = LOCAL[layout] * W
    q, k, v, g, dout = _inputs(seq, gform, seed)
    want, ref_grads = _linear_reference(seq, gform, bounds, seed)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
    g_local = None if g is None else (g.clone() if g.dim() == 1 else sh(g).clone()).requires_grad_()
    with mb.comm_counter() as counter:
        out = linear_attention(*leaves, g=g_local, layout=layout, stripe=stripe, algo=algo, cu_seqlens=cu)
        out.backward(sh(dout))
    sent = [counter.bytes("sent", phase=p) for p in ("forward", "backward")]
    pairs = [("out", out, sh(want))] + [(f"d{n}", t.grad, sh(w)) for n, t, w in zip("qkv", leaves, ref_grads)]
    if g is not None:
        dg = g_local.grad.double()
        if g.dim() == 1:  # shared by every rank's tokens: its gradient sums over ranks
            dist.all_reduce(dg)
        pairs.append(("dg", dg, ref_grads[3] if g.dim() == 1 else sh(ref_grads[3])))
    errs = _errors(pairs)
    fresh = [t.detach().requires_grad_() for t in leaves]
    with mb.comm_counter() as plain:  # the same call without documents: the traffic must not change
        linear_attention(*fresh, g=g_local, layout=layout, stripe=stripe, algo=algo).backward(sh(dout))
    errs["bytes"] = (sent, [plain.bytes("sent", phase=p) for p in ("forward", "backward")])
    return errs


def _gdn_inputs(seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    inputs = [mk(seq, B, H, DK), F.normalize(mk(seq, B, H, DK), dim=-1), mk(seq, B, H, DV),
              -torch.rand(seq, B, H, generator=gen) * 0.3, torch.rand(seq, B, H, generator=gen)]
    return inputs, mk(seq, B, H, DV)


def _gdn_reference(seq, bounds, seed):
    inputs, dout = _gdn_inputs(seq, seed)

    def compute():
        ref = [t.double().requires_grad_() for t in inputs]
        want = _per_document(naive_gated_delta_rule, bounds, ref, [])
        want.backward(dout.double())
        return want.detach(), [t.grad for t in ref]

    shapes = [dout.shape] + [t.shape for t in inputs]
    return _shared_reference(("gdn", seq, None, tuple(map(tuple, bounds)), seed), shapes, compute)


def _gdn_case(layout, stripe, bounds, cu, seed, qkv_format="sbhd") -> dict:
    W, r = dist.get_world_size(), dist.get_rank()
    seq = LOCAL[layout] * W
    inputs, dout = _gdn_inputs(seq, seed)
    want, ref_grads = _gdn_reference(seq, bounds, seed)
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    fmt = (lambda t: t.transpose(0, 1).contiguous()) if qkv_format == "bshd" else (lambda t: t)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in inputs]
    with mb.comm_counter() as counter:
        out = gated_delta_rule(*(fmt(t) for t in leaves), layout=layout, stripe=stripe, qkv_format=qkv_format,
                               cu_seqlens=cu)
        out.backward(fmt(sh(dout)))
    sent = [counter.bytes("sent", phase=p) for p in ("forward", "backward")]
    pairs = [("out", fmt(out), sh(want))] + [
        (f"d{n}", t.grad, sh(w)) for n, t, w in zip(("q", "k", "v", "g", "beta"), leaves, ref_grads)]
    errs = _errors(pairs)
    with mb.comm_counter() as plain:  # the same call without documents: the traffic must not change
        gated_delta_rule(*(fmt(t.detach().requires_grad_()) for t in leaves), layout=layout, stripe=stripe,
                         qkv_format=qkv_format).backward(fmt(sh(dout)))
    errs["bytes"] = (sent, [plain.bytes("sent", phase=p) for p in ("forward", "backward")])
    return errs


def _cu_forms(name: str, bounds: list, seq: int):
    """The boundaries in each form the API takes: one int32 tensor shared by the batch ("shared"),
    a plain list of ints ("one_document"), a validated Documents ("singles+spanning"), a list of
    per-sample int64 tensors ("mixed")."""
    if name == "shared":
        return torch.tensor(bounds[0], dtype=torch.int32)
    if name == "one_document":
        return list(bounds[0])
    if name == "singles+spanning":
        return check_cu_seqlens([torch.tensor(c) for c in bounds], seq, len(bounds))
    return [torch.tensor(c, dtype=torch.int64) for c in bounds]


def document_cases(lasp1: bool = True, gdn: bool = True) -> dict:
    """Every layout x decay form x document set of LASP-2 (and a LASP-1 subset, and the gated
    delta rule) at this world size: {case name: errors}."""
    W = dist.get_world_size()
    results = {}
    _REFERENCES.clear()
    for layout, stripe in LAYOUTS:
        seq = LOCAL[layout] * W
        # contiguous and zigzag share the documents (cut by zigzag's 35-token segments, which puts
        # some cuts inside and some on the edges of contiguous' 70-token ones) and the references
        seg = LOCAL[layout] // 2 if layout != "striped" else stripe
        for doc_name, bounds in document_sets(seq, seg).items():
            cu = _cu_forms(doc_name, bounds, seq)
            # every decay form on the two hard sets; the API forms of the other two with one form
            for i, gform in enumerate(GFORMS if doc_name in ("mixed", "singles+spanning") else ("channel",)):
                results[f"lasp2 {layout} g={gform} {doc_name}"] = _linear_case("lasp2", layout, stripe, gform, bounds,
                                                                              cu, seed=GFORMS.index(gform))
            if lasp1 and layout != "striped" and doc_name == "mixed":
                for gform in (None, "channel"):
                    results[f"lasp1 {layout} g={gform} {doc_name}"] = _linear_case("lasp1", layout, stripe, gform,
                                                                                  bounds, cu, seed=GFORMS.index(gform))
            if gdn:
                fmt = "bshd" if doc_name == "shared" else "sbhd"
                results[f"gdn {layout} {doc_name} {fmt}"] = _gdn_case(layout, stripe, bounds, cu, seed=3,
                                                                       qkv_format=fmt)
    return results


def refusals() -> dict:
    """Documents linear_attention / gated_delta_rule cannot take raise ValueError before any collective."""
    from megatron_burst.masks.documents import check_thd

    q, k, v = torch.randn(8, 1, 2, 4), torch.randn(8, 1, 2, 4), torch.randn(8, 1, 2, 3)
    g, beta = -torch.rand(8, 1, 2), torch.rand(8, 1, 2)
    W = dist.get_world_size()
    S = 8 * W
    cases = {
        "bidirectional": lambda: linear_attention(q, k, v, causal=False, cu_seqlens=torch.tensor([0, 3, S])),
        "last_bound": lambda: linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 3, 8])),
        "samples": lambda: linear_attention(q, k, v, cu_seqlens=[[0, S], [0, 2, S]]),
        "thd": lambda: linear_attention(q, k, v, cu_seqlens=check_thd([0, S], None, 8, W, 1)),
        "gdn_bounds": lambda: gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 9, 5, S])),
    }
    return refusal_messages(cases)


def refusal_messages(cases: dict) -> dict:
    """Run every call of ``cases`` (name -> callable) expecting a ValueError: {"messages": name -> its text
    (None: accepted), "moved": bytes sent or received meanwhile, "group_ok": the group still completes
    an all-reduce afterwards (nothing half-posted)}."""
    messages = {}
    with mb.comm_counter() as counter:
        for name, call in cases.items():
            try:
                call()
                messages[name] = None
            except ValueError as exc:
                messages[name] = str(exc)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"messages": messages, "moved": counter.bytes("sent") + counter.bytes("received"),
            "group_ok": t.item() == dist.get_world_size()}
