"""(a) Every local kernel and mask kind at W=1, through megatron_burst.kernels.block_forward /
block_backward with explicit BlockMasks, against the fp32 reference; and which kernel the choice picks."""
from __future__ import annotations

import zlib

import pytest
import torch

from megatron_burst.kernels import block_backward, block_forward, row_dot
from megatron_burst.kernels.choice import choose
from megatron_burst.masks.block import BlockMask

from gpu.common import DEV, DTYPE, EXPECTED_KERNELS, L, ON_CPU, WINDOW, check, doc_bounds, errors, \
    kernel_failures, reference, sdpa_errors

B, HQ, HKV = 2, 8, 2
HEAD_DIMS = (64, 128) if not ON_CPU else (16, 32)


def _positions(sq: int, sk: int, docs: bool, band: tuple, striped: bool = False) -> BlockMask:
    """A ``positions`` rectangle over the whole q and kv: global positions (striped: q of rank 1 and
    kv of rank 0 of a 2-rank token-striped layout), document ids from doc_bounds, and ``band``."""
    if striped:
        q_pos, kv_pos = torch.arange(sq) * 2 + 1, torch.arange(sk) * 2
    else:
        q_pos, kv_pos = torch.arange(sq), torch.arange(sk)
    q_doc = kv_doc = None
    if docs:
        cu = torch.tensor(doc_bounds(max(sq, sk)))
        q_doc = torch.searchsorted(cu, q_pos, right=True) - 1
        kv_doc = torch.searchsorted(cu, kv_pos, right=True) - 1
    return BlockMask("positions", 0, sq, 0, sk, 1, q_pos, kv_pos, q_doc, kv_doc, band=band)


N = L(1536)
S64 = L(64) if ON_CPU else 64  # block size / offsets of the block-causal rectangles
CASES = {
    # name: (sq, sk, mask)
    "full": (L(1000), L(1488), lambda sq, sk: BlockMask("full", 0, sq, 0, sk)),
    "full_inner": (L(1000), L(1200), lambda sq, sk: BlockMask("full", L(64), sq, L(16), L(1100))),
    "causal_square": (N, N, lambda sq, sk: BlockMask("causal", 0, sq, 0, sk)),
    "causal_tall": (L(1200), L(704), lambda sq, sk: BlockMask("causal", 0, sq, 0, sk)),
    "causal_wide": (L(704), L(1200), lambda sq, sk: BlockMask("causal", 0, sq, 0, sk)),
    "causal_inner": (L(1000), L(1000), lambda sq, sk: BlockMask("causal", L(100), L(900), L(52), L(852))),
    "block_causal": (N, N, lambda sq, sk: BlockMask("block_causal", 0, sq, 0, sk, S64)),
    "block_causal_offset": (N, N, lambda sq, sk: BlockMask("block_causal", S64, sq, 0, sk - S64, S64)),
    "positions_documents": (N, N, lambda sq, sk: _positions(sq, sk, True, (None, 0))),
    "positions_window": (N, N, lambda sq, sk: _positions(sq, sk, False, (WINDOW, 0))),
    "positions_documents_window": (N, N, lambda sq, sk: _positions(sq, sk, True, (L(300), 0))),
    "positions_striped": (N, N, lambda sq, sk: _positions(sq, sk, False, (None, 0), striped=True)),
    "positions_documents_noncausal": (N, N, lambda sq, sk: _positions(sq, sk, True, (None, None))),
}


def _sub_visibility(mask: BlockMask, sq: int, sk: int) -> torch.Tensor:
    return mask.dense(sq, sk)[mask.q_slice, mask.kv_slice]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("case", list(CASES))
def test_block_kernel_against_fp32(case, d):
    """One BlockMask (full; causal square, taller and wider than square, inside a larger block;
    block_causal, also off the diagonal as striped layouts make it; positions with documents, a
    window, both, striped positions, documents without causality) at head dim 64 and 128, GQA 8/2,
    bf16: forward (output rounded to bf16, as the engine does) and backward against the fp32
    reference on the rectangle, within 1.5x torch's bf16 SDPA error; the kernel the choice picks
    for the mask kind is the fused one (cudnn/cuda_flash for full and causal, varlen_or_triton for
    positions, triton_masked else)."""
    sq, sk, build = CASES[case]
    mask = build(sq, sk)
    g = torch.Generator().manual_seed(zlib.crc32(f"{case} {d}".encode()))
    mk = lambda h, s: torch.randn(B, h, s, d, generator=g).to(DTYPE).to(DEV)  # noqa: E731  [b, h, s, d]
    q, k, v, dout = mk(HQ, sq), mk(HKV, sk), mk(HKV, sk), mk(HQ, sq)
    scale = d ** -0.5
    choice = choose(DEV, DTYPE, d, (mask.kind,))
    fails = kernel_failures(choice.kernels, f"{case} d={d}")

    o, lse = block_forward(q, k, v, mask, scale, choice)
    o = o.to(DTYPE)  # the engine rounds the merged output to the input dtype once
    out_full = torch.zeros(B, HQ, sq, d, dtype=DTYPE, device=DEV)
    out_full[:, :, mask.q_slice] = o
    lse_full = torch.zeros(B, HQ, sq, dtype=torch.float32, device=DEV)
    lse_full[:, :, mask.q_slice] = lse
    D = row_dot(dout, out_full)
    dq, dk, dv = block_backward(dout, q, k, v, D, lse_full, mask, scale, choice, out=out_full)

    # the reference and SDPA on the visible rectangle (sbhd views of the sliced tensors)
    sb = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731  [b, h, s, d] -> [s, b, h, d]
    qs, ks, vs, dos = sb(q[:, :, mask.q_slice]), sb(k[:, :, mask.kv_slice]), sb(v[:, :, mask.kv_slice]), \
        sb(dout[:, :, mask.q_slice])
    vis = _sub_visibility(mask, sq, sk)
    full_rect = bool(vis.all())
    square_causal = vis.shape[0] == vis.shape[1] and torch.equal(vis, torch.ones_like(vis).tril())
    ref_mask = None if (full_rect or square_causal) else vis
    ref = reference(qs, ks, vs, dos, causal=square_causal, mask=ref_mask, scale=scale)
    engine = errors([sb(o), sb(dq), sb(dk), sb(dv)], ref)
    sdpa = sdpa_errors(qs, ks, vs, dos, square_causal, ref_mask, ref)
    fails += check(engine, sdpa, f"{case} d={d} ({choice.describe()})")
    assert not fails, "\n".join(fails) + f"\nengine {engine}\nsdpa {sdpa}"


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_choice_picks_fused_kernels_for_every_dense_kind(d):
    """choose() over all dense mask kinds at once, bf16: full/causal on cudnn or cuda_flash,
    block_causal on triton_masked, positions on varlen_or_triton (never the plain-torch kernel)."""
    if ON_CPU:
        pytest.skip("CUDA kernel choice (dry run on CPU)")
    choice = choose(DEV, DTYPE, d, ("full", "causal", "block_causal", "positions"))
    assert [k for k, _, _ in choice.kernels] == ["full", "causal", "block_causal", "positions"]
    fails = kernel_failures(choice.kernels, f"d={d}")
    assert not fails, "\n".join(fails) + f"\n{choice.describe()}\nexpected {EXPECTED_KERNELS}"


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("case", ["block_causal", "block_causal_offset"])
def test_block_causal_split_against_fp32(case, d):
    """A block_causal block as the engine runs it on CUDA (masks.block.split_block_causal): a causal
    block (cuDNN / flash) plus the pairs above the diagonal inside each stripe (a positions block:
    Triton, every stripe's last row seeing nothing there), merged like any blocks of a pair: against
    the fp32 reference of the whole block_causal rectangle, within 1.5x torch's bf16 SDPA error."""
    from megatron_burst.kernels import empty_accumulator, merge_into
    from megatron_burst.masks.block import split_block_causal

    sq, sk, build = CASES[case]
    mask = build(sq, sk)
    parts = split_block_causal(mask)
    assert [p.kind for p in parts] == ["causal", "positions"]
    g = torch.Generator().manual_seed(zlib.crc32(f"split {case} {d}".encode()))
    mk = lambda h, s: torch.randn(B, h, s, d, generator=g).to(DTYPE).to(DEV)  # noqa: E731
    q, k, v, dout = mk(HQ, sq), mk(HKV, sk), mk(HKV, sk), mk(HQ, sq)
    scale = d ** -0.5
    choice = choose(DEV, DTYPE, d, ("causal", "positions"))
    fails = kernel_failures(choice.kernels, f"split {case} d={d}")
    acc, lse = empty_accumulator(q, d)
    for part in parts:
        o, l = block_forward(q, k, v, part, scale, choice)
        merge_into(acc[:, :, part.q_slice], lse[:, :, part.q_slice], o, l)
    out = acc.to(DTYPE)
    D = row_dot(dout, out)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=DEV)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=DEV)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=DEV)
    for part in parts:
        gq, gk, gv = block_backward(dout, q, k, v, D, lse, part, scale, choice, out=out)
        dq[:, :, part.q_slice] += gq
        part.add_kv_grad(dk, gk)
        part.add_kv_grad(dv, gv)
    sb = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
    qs, ks, vs, dos = sb(q[:, :, mask.q_slice]), sb(k[:, :, mask.kv_slice]), sb(v[:, :, mask.kv_slice]), \
        sb(dout[:, :, mask.q_slice])
    vis = _sub_visibility(mask, sq, sk)
    ref = reference(qs, ks, vs, dos, causal=False, mask=vis, scale=scale)
    engine = errors([sb(out[:, :, mask.q_slice]), sb(dq[:, :, mask.q_slice]), sb(dk[:, :, mask.kv_slice]),
                     sb(dv[:, :, mask.kv_slice])], ref)
    sdpa = sdpa_errors(qs, ks, vs, dos, False, vis, ref)
    fails += check(engine, sdpa, f"split {case} d={d} ({choice.describe()})")
    assert not fails, "\n".join(fails) + f"\nengine {engine}\nsdpa {sdpa}"
