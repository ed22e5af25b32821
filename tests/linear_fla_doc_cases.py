"""Rank-side bodies of tests/test_linear_fla_documents.py (run on every rank by harness.run_ranks):
linear_attention (LASP-2, every decay form) and gated_delta_rule with documents, through the
stand-in fla (tests/fla_standin.py, its varlen mode) on the CUDA decision path, against our torch
path on the same shard -- output and every local gradient.

The document sets make every piece rule matter: starts strictly inside segments (a row cut into
pieces; the segment's M is its last piece's state), starts exactly on segment starts (a row's
first piece enters with zero, not the exchanged state), single-token documents, a document
spanning every rank (the exchanged state enters), and different boundaries per sample (pieces
differ between the rows of one segment).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fla_standin
import megatron_burst as mb
from megatron_burst.linear import gated_delta_rule, linear_attention

B, H, DK, DV = 2, 2, 8, 4
LOCAL = {"contiguous": 40, "zigzag": 40, "striped": 128}  # striped: two 64-token stripes per rank
LAYOUTS = (("contiguous", 1), ("zigzag", 1), ("striped", 64))
FORMS = ("none", "head", "head_fixed", "token", "channel")


def document_sets(seq: int, seg: int) -> dict:
    """Per-sample boundaries over ``seq`` tokens in global segments of ``seg`` tokens."""
    def clean(cuts):
        return [0] + sorted({c for c in cuts if 0 < c < seq}) + [seq]

    # sample 0: starts inside segments, on the second segment's start, a single-token document;
    # sample 1: one document from token 1 to the last token (spans every rank), on another start
    mixed = [clean([3, seg // 2, seg, seg + 7, seg + 8, 2 * seg + 5, seq - seg // 2]), clean([1, 2 * seg, seq - 1])]
    return {"mixed": mixed, "edges": [clean([seg * i for i in range(1, seq // seg)])] * 2}


def _inputs(op: str, form: str, seq: int, seed: int) -> tuple[list, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    if op == "gdn":
        return [mk(seq, B, H, DK), F.normalize(mk(seq, B, H, DK), dim=-1), mk(seq, B, H, DV),
                -torch.rand(seq, B, H, generator=gen) * 0.3, torch.rand(seq, B, H, generator=gen)], mk(seq, B, H, DV)
    q, k, v = mk(seq, B, H, DK), mk(seq, B, H, DK), mk(seq, B, H, DV)
    g = {"none": None, "head": -torch.rand(H, generator=gen) * 0.3, "head_fixed": -torch.rand(H, generator=gen) * 0.3,
         "token": -torch.rand(seq, B, H, generator=gen) * 0.3,
         "channel": -torch.rand(seq, B, H, DK, generator=gen) * 0.3}[form]
    return [q, k, v] + ([] if g is None else [g]), mk(seq, B, H, DV)


def _run(op: str, form: str, kernel: str, layout: str, stripe: int, local: list, dout: torch.Tensor, cu) -> list:
    leaves = [t.clone().requires_grad_(not (form == "head_fixed" and t.dim() == 1)) for t in local]
    if op == "gdn":
        out = gated_delta_rule(*leaves, layout=layout, stripe=stripe, cu_seqlens=cu, kernel=kernel)
    else:
        out = linear_attention(*leaves[:3], g=leaves[3] if len(leaves) > 3 else None, layout=layout, stripe=stripe,
                               cu_seqlens=cu, kernel=kernel)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def fla_document_cases(layouts=LAYOUTS) -> dict:
    """{case: {tensor name: relative error of the fla path vs the torch path}} for every layout x
    (LASP-2 decay form, gdn) x document set at this world size; plus {"fla_calls": ...} counts."""
    with fla_standin.installed():  # once per task: each form's self-check runs once (kernel="torch" never looks)
        results = _cases(layouts)
        results["fla_calls"] = sum(fla_standin.calls.values())
    return results


def _cases(layouts) -> dict:
    W, r = dist.get_world_size(), dist.get_rank()
    results: dict = {}
    for layout, stripe in layouts:
        seq = LOCAL[layout] * W
        seg = LOCAL[layout] // (2 if layout == "zigzag" else (LOCAL[layout] // stripe if layout == "striped" else 1))
        for doc_name, bounds in document_sets(seq, seg).items():
            cu = [torch.tensor(c) for c in bounds]
            cases = [("lasp2", f) for f in FORMS] + [("gdn", "token")]
            if doc_name != "mixed":  # the simple set: one form of each family
                cases = [("lasp2", "channel"), ("gdn", "token")]
            for op, form in cases:
                full, dout = _inputs(op, form, seq, seed=FORMS.index(form) if op == "lasp2" else 7)
                sh = lambda t: t if t.dim() == 1 else mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
                local = [sh(t) for t in full]
                want = _run(op, form, "torch", layout, stripe, local, sh(dout), cu)
                got = _run(op, form, "auto", layout, stripe, local, sh(dout), cu)
                names = ["out"] + [f"d{i}" for i in range(len(got) - 1)]
                results[f"{op} {form} {layout} {doc_name}"] = {
                    n: (_relative(a, b) if a.shape == b.shape else float("inf")) for n, a, b in zip(names, got, want)}
    return results
