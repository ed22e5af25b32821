"""The chunked local work of linear attention (megatron_burst.linear.chunked.segment_output and
segment_state) on one segment of many chunks: every chunk's own scores at once and the states entering
the chunks by one scan. Against the token-by-token recurrence run on each document alone -- output
and gradients, every decay form, documents starting mid-chunk, at chunk starts and spanning chunks,
different per sample, a tail shorter than a chunk. (The multi-rank document tests hold segments of at
most two chunks; a chunk's reset flag only matters from the third chunk on.)"""
from __future__ import annotations

import pytest
import torch

from megatron_burst.linear.chunked import CHUNK, segment_output, segment_state
from megatron_burst.linear.reference import naive_linear_attention

L, B, H, DK, DV = 5 * CHUNK + 13, 2, 2, 4, 3
BOUNDS = ([0, 7, 70, 128, 200, 250, L], [0, 64, 65, 190, L])  # per sample: mid-chunk, chunk starts, spans
FORMS = (None, "head", "token", "channel")


def _inputs(form, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = mk(L, B, H, DK), mk(L, B, H, DK), mk(L, B, H, DV)
    g = {None: None, "head": -torch.rand(H, generator=gen, dtype=torch.float64) * 0.2,
         "token": -torch.rand(L, B, H, generator=gen, dtype=torch.float64) * 0.2,
         "channel": -torch.rand(L, B, H, DK, generator=gen, dtype=torch.float64) * 0.2}[form]
    return q, k, v, g


def _reference(q, k, v, g, scale):
    """Each sample's documents alone, token by token."""
    out = torch.zeros(L, B, H, DV, dtype=q.dtype)
    for j, bounds in enumerate(BOUNDS):
        for a, c in zip(bounds, bounds[1:]):
            gd = None if g is None else (g if g.dim() == 1 else g[a:c, j:j + 1])
            out[a:c, j:j + 1] = naive_linear_attention(q[a:c, j:j + 1], k[a:c, j:j + 1], v[a:c, j:j + 1], gd,
                                                        scale=scale)
    return out


def _doc_index() -> torch.Tensor:
    doc = torch.zeros(B, L, dtype=torch.long)
    for j, bounds in enumerate(BOUNDS):
        for i, a in enumerate(bounds[1:-1], 1):
            doc[j, a:] = i
    return doc.view(1, B, 1, L)


@pytest.mark.parametrize("form,block", [(f, None) for f in FORMS] + [("channel", 2)])
def test_segment_output_over_many_chunks_equals_each_document_alone(form, block, monkeypatch):
    """(block: a decay per key channel builds its weights a few chunks at a time -- 2 here, so the
    6 chunks go in 3 blocks.)"""
    if block is not None:
        from megatron_burst.linear import chunked
        monkeypatch.setattr(chunked, "CHANNEL_BLOCK", block)
    q, k, v, g = _inputs(form)
    leaves = [t.requires_grad_() for t in (q, k, v) + (() if g is None else (g,))]
    scale = DK ** -0.5
    ref = _reference(q, k, v, g, scale)
    bhsd = lambda t: t.permute(1, 2, 0, 3).unsqueeze(0)  # noqa: E731  [s, b, h, d] -> [1, b, h, s, d]
    gs = None
    if g is not None:
        full = g.view(1, 1, H).expand(L, B, H) if g.dim() == 1 else g
        gs = bhsd(full.unsqueeze(-1) if full.dim() == 3 else full)
    out = segment_output(bhsd(q), bhsd(k), bhsd(v), gs, scale, _doc_index())[0].permute(2, 0, 1, 3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(ref)
    want = torch.autograd.grad(ref, leaves, dout)
    got = torch.autograd.grad(out, leaves, dout)
    for name, a, b in zip(("dq", "dk", "dv", "dg"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("form", FORMS)
def test_segment_state_keeps_the_last_document(form):
    """The state a segment leaves from a zero start = the recurrence over its last document alone."""
    q, k, v, g = _inputs(form, seed=1)
    bhsd = lambda t: t.permute(1, 2, 0, 3).unsqueeze(0)  # noqa: E731
    gs = None
    if g is not None:
        full = g.view(1, 1, H).expand(L, B, H) if g.dim() == 1 else g
        gs = bhsd(full.unsqueeze(-1) if full.dim() == 3 else full)
    M = segment_state(bhsd(k), bhsd(v), gs, _doc_index())[0][0]  # [b, h, dk, dv]
    for j, bounds in enumerate(BOUNDS):
        start = bounds[-2]
        want = torch.zeros(H, DK, DV, dtype=torch.float64)
        for t in range(start, L):
            if gs is not None:
                want = torch.exp(gs[0, j, :, t]).unsqueeze(-1) * want
            want = want + k[t, j].unsqueeze(-1) * v[t, j].unsqueeze(-2)
        torch.testing.assert_close(M[j], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("decay", [None, "token", "channel"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_entering_term_keeps_only_its_inputs(dtype, decay, masked):
    """scale * ((a * exp(G) * mask) @ S) in fp32 (fp64 stays fp64) with autograd's gradients for a,
    S and G (summed where G broadcasts), keeping for the backward only a's elements in its dtype
    (a view into a fused tensor: not that tensor), S, G and the mask: no fp32 copy of a, no exp(G),
    no decayed rows (a bf16 a costs 2 bytes per element)."""
    from megatron_burst.linear.chunked import entering_term

    gen = torch.Generator().manual_seed(0)
    acc = torch.promote_types(dtype, torch.float32)
    n, h, L, dk, dv = 3, 2, 37, 8, 5
    a = torch.randn(n, h, L, dk, generator=gen).to(dtype).requires_grad_()
    S = torch.randn(n, h, dk, dv, generator=gen).to(acc).requires_grad_()
    G = None if decay is None else (-torch.rand(n, h, L, 1 if decay == "token" else dk, generator=gen).cumsum(-2)
                                    ).to(acc).requires_grad_()
    mask = (torch.arange(L) < 20).to(acc).view(1, 1, L, 1).expand(n, 1, L, 1) if masked else None
    if masked:  # a as a view into a larger tensor (q out of a fused QKV): only its elements are kept
        fused = torch.randn(n, h, L, 3 * dk, generator=gen).to(dtype).requires_grad_()
        a = fused[..., dk:2 * dk]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = entering_term(a, S, G, mask, 0.3)
    assert out.dtype == acc
    kept = a.numel() * a.element_size() + sum(t.untyped_storage().nbytes() for t in (S, G, mask) if t is not None)
    assert sum(t.untyped_storage().nbytes() for t in saved) == kept
    leaves = [t for t in (fused if masked else a, S, G) if t is not None]
    ref_leaves = [t.detach().to(acc).requires_grad_() for t in leaves]
    ref_a = ref_leaves[0][..., dk:2 * dk] if masked else ref_leaves[0]
    rows = ref_a * (1 if G is None else torch.exp(ref_leaves[2])) * (1 if mask is None else mask)
    want_out = 0.3 * (rows @ ref_leaves[1])
    cot = torch.randn(out.shape, generator=gen).to(acc)
    got = torch.autograd.grad(out, leaves, cot)
    want = torch.autograd.grad(want_out, ref_leaves, cot)
    torch.testing.assert_close(out, want_out.detach())
    for x, g_got, g_want in zip(leaves, got, want):
        assert g_got.dtype == x.dtype and g_got.shape == x.shape
        torch.testing.assert_close(g_got, g_want.to(x.dtype))

