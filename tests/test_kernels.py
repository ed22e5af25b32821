"""Local kernels against the naive reference; the fp32 lse merge; the D stand-in trick."""
import pytest
import torch

from megatron_burst import kernels
from megatron_burst.kernels import cpu_flash, cuda_flash, reference, tiled
from megatron_burst.masks.block import BlockMask

CASES = [("full", 1), ("causal", 1), ("block_causal", 3)]


def _inputs(dtype, hq=4, hkv=4, sq=37, sk=37, d=48, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s: torch.randn(b, h, s, d, generator=g).to(dtype)  # noqa: E731
    return mk(hq, sq), mk(hkv, sk), mk(hkv, sk), mk(hq, sq)


@pytest.mark.parametrize("kind,block", CASES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_reference_backward_is_autograd(kind, block, hq, hkv):
    q, k, v, do = _inputs(torch.float64, hq, hkv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference.forward(*leaves, kind, block, 0.3)
    out.backward(do)
    D = (do * out.detach()).sum(-1)
    got = reference.backward(do, q, k, v, D, lse, kind, block, 0.3)
    for g, leaf in zip(got, leaves):
        torch.testing.assert_close(g.double(), leaf.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", [tiled, cpu_flash], ids=["tiled", "cpu_flash"])
@pytest.mark.parametrize("kind,block", CASES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_fast_kernels_match_reference_fp32(impl, kind, block, hq, hkv, monkeypatch):
    monkeypatch.setattr(tiled, "TILE_Q", 16)  # several tiles, incl. partial and skipped ones
    monkeypatch.setattr(tiled, "TILE_K", 8)
    q, k, v, do = _inputs(torch.float32, hq, hkv)
    ref_out, ref_lse = reference.forward(q, k, v, kind, block, 0.3)
    D = (do * ref_out).sum(-1)
    ref_grads = reference.backward(do, q, k, v, D, ref_lse, kind, block, 0.3)
    out, lse = impl.forward(q, k, v, kind, block, 0.3)
    assert lse.dtype == torch.float32 and out.dtype == torch.float32  # unrounded block outputs
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    for g, r in zip(impl.backward(do, q, k, v, D, ref_lse, kind, block, 0.3), ref_grads):
        assert g.shape == r.shape
        torch.testing.assert_close(g.float(), r, rtol=0, atol=1e-5)


def _sdpa_bf16_errors(q, k, v, do, ref):
    """Errors of torch's own bf16 SDPA (with autograd) against ``ref``: the single-device bar."""
    import torch.nn.functional as F

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(g, 1),
                                         leaves[2].repeat_interleave(g, 1), is_causal=True, scale=0.3)
    out.backward(do)
    return [(a.double() - r).abs().max().item() for a, r in zip([out] + [t.grad for t in leaves], ref)]


@pytest.mark.parametrize("impl", [tiled, cpu_flash], ids=["tiled", "cpu_flash"])
def test_bf16_inputs(impl):
    """bf16 inputs against the fp64 reference on the same (rounded) inputs. Forward: fp32 output
    computed in fp32, so within 1e-5 x max |ref| (a bf16 output would be ~4e-3 off). Backward:
    tiled computes in fp32 (1e-5 again); cpu_flash's bf16 backward is torch's own bf16 kernel, so it
    must stay within 1.05 x torch's single-device bf16 SDPA error. All within the documented
    2e-2 x max |ref|."""
    q, k, v, do = _inputs(torch.bfloat16, 8, 2)
    wide = [t.double() for t in (q, k, v, do)]
    ref_out, ref_lse = reference.forward(*wide[:3], "causal", 1, 0.3)
    D = (wide[3] * ref_out).sum(-1)
    ref_grads = reference.backward(wide[3], *wide[:3], D, ref_lse, "causal", 1, 0.3)
    base = _sdpa_bf16_errors(q, k, v, do, [ref_out, *ref_grads])
    out, lse = impl.forward(q, k, v, "causal", 1, 0.3)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max() <= 1e-5 * ref_out.abs().max()
    assert (lse.double() - ref_lse).abs().max() <= 1e-5 * ref_lse.abs().max()
    grads = impl.backward(do, q, k, v, D.float(), ref_lse.float(), "causal", 1, 0.3)
    for g, r, b in zip(grads, ref_grads, base[1:]):
        err = (g.double() - r).abs().max().item()
        bound = 1e-5 * r.abs().max().item() if impl is tiled else 1.05 * b
        assert err <= bound, (impl.__name__, err, bound)
        assert err <= 2e-2 * r.abs().max()


def test_stand_in_output_reproduces_D():
    _, _, _, do = _inputs(torch.float32)
    do[0, 0, 3] = 0  # a zero row must give a zero stand-in, not NaN
    D = torch.randn(do.shape[:-1])
    D[0, 0, 3] = 0
    o = cpu_flash.stand_in_output(do, D)
    assert torch.isfinite(o).all()
    torch.testing.assert_close((do * o).sum(-1), D, rtol=1e-5, atol=1e-6)


def test_merge_of_two_halves_equals_whole():
    q, k, v, _ = _inputs(torch.float32, sk=40)
    whole_out, whole_lse = reference.forward(q, k, v, "full", 1, 0.3)
    out = torch.zeros(whole_out.shape)
    lse = torch.full(whole_lse.shape, float("-inf"))
    for part in (slice(0, 13), slice(13, 40)):
        o, l = reference.forward(q, k[:, :, part], v[:, :, part], "full", 1, 0.3)
        kernels.merge_into(out, lse, o, l)
    torch.testing.assert_close(out, whole_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-5)


def test_block_helpers_use_the_rectangle():
    q, k, v, do = _inputs(torch.float32, sq=10, sk=10)
    m = BlockMask("causal", 1, 10, 0, 9)  # a striped later-rank block: shifted causal
    out, lse = kernels.block_forward(q, k, v, m, 0.3)
    ref_out, ref_lse = reference.forward(q[:, :, 1:], k[:, :, :9], v[:, :, :9], "causal", 1, 0.3)
    assert out.shape == ref_out.shape == (2, 4, 9, 48)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    dq, dk, dv = kernels.block_backward(do, q, k, v, (do * 0.5).sum(-1), torch.zeros(2, 4, 10), m, 0.3)
    assert dq.shape == (2, 4, 9, 48) and dk.shape == dv.shape == (2, 4, 9, 48)


def test_selection_and_override(monkeypatch):
    q32, q16 = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    assert kernels.select(q32, "causal", "backward") is cpu_flash
    assert kernels.select(q16, "causal", "forward") is cpu_flash
    assert kernels.select(q16, "causal", "backward") is tiled
    monkeypatch.setenv("MEGATRON_BURST_KERNEL", "reference")
    assert kernels.select(q32, "causal", "forward") is reference
    with pytest.raises(ValueError, match="unknown attention kernel"):
        kernels.select(q32, "causal", "forward", "fast")


