"""cuda_varlen (torch's varlen flash ops) on the device: forward and backward of the "positions"
blocks it plans (documents, sliding windows, both, a window over an offset range, documents
without causality) at GQA 8/2 and b=2 against the fp32 reference, within 1.5x torch's bf16 SDPA
error; the dispatcher sends these blocks to it and striped ones to Triton. CUDA only (the op has
no CPU kernel; the CPU suite checks plans, schemas and an emulation: tests/test_cuda_varlen.py)."""
from __future__ import annotations

import zlib

import pytest
import torch

from megatron_burst.kernels import cuda_varlen, row_dot, varlen_dispatch
from megatron_burst.masks.block import BlockMask

from gpu.common import DEV, DTYPE, ON_CPU, check, doc_bounds, errors, reference, sdpa_errors

pytestmark = pytest.mark.skipif(ON_CPU, reason="torch's varlen flash op runs on CUDA only (no CPU dry run)")

B, HQ, HKV = 2, 8, 2


def _block(sq: int, sk: int, q0: int, docs: bool, band: tuple) -> BlockMask:
    """Queries at positions [q0, q0 + sq), keys at [0, sk), documents from doc_bounds, ``band``."""
    q_pos, kv_pos = torch.arange(q0, q0 + sq), torch.arange(sk)
    q_doc = kv_doc = None
    if docs:
        cu = torch.tensor(doc_bounds(q0 + sq))
        q_doc = torch.searchsorted(cu, q_pos, right=True) - 1
        kv_doc = torch.searchsorted(cu, kv_pos, right=True) - 1
    return BlockMask("positions", 0, sq, 0, sk, 1, q_pos, kv_pos, q_doc, kv_doc, band=band)


CASES = {
    "documents": (2048, 2048, 0, True, (None, 0)),
    "many_documents": (4096, 4096, 0, "many", (None, 0)),
    "window": (2048, 2048, 0, False, (193, 0)),
    "documents_window": (2048, 2048, 0, True, (300, 0)),
    "window_offset": (1024, 2048, 1024, False, (700, 0)),
    "documents_noncausal": (2048, 2048, 0, True, (None, None)),
}


def _mask(case: str) -> BlockMask:
    sq, sk, q0, docs, band = CASES[case]
    if docs == "many":  # 64 documents of 64 tokens on the diagonal: one varlen call
        pos = torch.arange(sq)
        return BlockMask("positions", 0, sq, 0, sk, 1, pos, pos, pos // 64, pos // 64, band=band)
    return _block(sq, sk, q0, docs, band)


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_against_fp32(case, d):
    mask = _mask(case)
    sq, sk = mask.q_stop, mask.kv_stop
    g = torch.Generator().manual_seed(zlib.crc32(f"varlen {case} {d}".encode()))
    # sbhd storage viewed as [b, h, s, d], as the engine hands Megatron's tensors to the kernels
    mk = lambda h, s: torch.randn(s, B, h, d, generator=g).to(DTYPE).to(DEV).permute(1, 2, 0, 3)  # noqa: E731
    q, k, v, dout = mk(HQ, sq), mk(HKV, sk), mk(HKV, sk), mk(HQ, sq)
    assert isinstance(cuda_varlen.block_plan(mask.mask_data, sq, sk), cuda_varlen.VarlenPlan)
    assert varlen_dispatch.route(q, k, mask.mask_data) is cuda_varlen
    scale = d ** -0.5
    o, lse = cuda_varlen.forward(q, k, v, "positions", 1, scale, positions=mask.mask_data)
    assert o.dtype == DTYPE and lse.dtype == torch.float32 and torch.isfinite(lse).all()
    D = row_dot(dout, o)
    dq, dk, dv = cuda_varlen.backward(dout, q, k, v, D, lse, "positions", 1, scale, positions=mask.mask_data, out=o)
    dq2, _, _ = cuda_varlen.backward(dout, q, k, v, D, lse, "positions", 1, scale, positions=mask.mask_data)
    sb = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731  [b, h, s, d] -> [s, b, h, d]
    vis = mask.dense(sq, sk).to(DEV)
    ref = reference(sb(q), sb(k), sb(v), sb(dout), causal=False, mask=vis, scale=scale)
    engine = errors([sb(o), sb(dq), sb(dk), sb(dv)], ref)
    sdpa = sdpa_errors(sb(q), sb(k), sb(v), sb(dout), False, vis, ref)
    fails = check(engine, sdpa, f"cuda_varlen {case} d={d}")
    fails += check(errors([sb(o), sb(dq2), sb(dk), sb(dv)], ref), sdpa, f"cuda_varlen {case} d={d} (stand-in O)")
    assert not fails, "\n".join(fails) + f"\nengine {engine}\nsdpa {sdpa}"


def test_striped_blocks_route_to_triton():
    pos = torch.arange(0, 512, 2)
    q = torch.zeros(1, HQ, 256, 64, dtype=DTYPE, device=DEV)
    data = (pos, pos, None, None, (None, 0))
    assert varlen_dispatch.route(q, q[:, :HKV], data).__name__.endswith("triton_masked")
