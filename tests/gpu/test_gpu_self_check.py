"""(e) The kernel self-check (megatron_burst.kernels.choice) runs and passes on the GPU for every fused
kernel, every mask kind it covers, head dims 64 and 128, bf16 and fp16."""
from __future__ import annotations

import pytest
import torch

from megatron_burst.kernels import choice

from gpu.common import DEV, ON_CPU

FUSED = {  # kernel: the dense mask kinds it runs (choice.GPU_CANDIDATES)
    "cudnn": ("full", "causal"),
    "cuda_flash": ("full", "causal"),
    "triton_masked": ("full", "causal", "block_causal", "positions"),
    "varlen_or_triton": ("positions",),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _cuda_only():
    if ON_CPU:
        pytest.skip("the fused kernels' self-checks need CUDA (dry run on CPU)")


def test_candidates_cover_the_table():
    """Every fused dense candidate of choice.GPU_CANDIDATES is exercised below."""
    names = {n for kind in choice.DENSE_KINDS for n in choice.GPU_CANDIDATES[kind]}
    assert names == set(FUSED), (names, set(FUSED))
    for name, kinds in FUSED.items():
        assert set(kinds) == {k for k in choice.DENSE_KINDS if name in choice.GPU_CANDIDATES[k]}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_kernel_self_check(name, head_dim, dtype):
    """choice.self_check(name, cuda, dtype, head_dim, kinds) for each kind the kernel covers: forward
    and backward against the fp32 reference (GQA 4/2, odd and unequal lengths); it must raise nothing.
    The kernel must also be installed here and cover the (dtype, head dim, kind)."""
    dt = DTYPES[dtype]
    for kind in FUSED[name]:
        why = choice._kind_supported(name, dt, head_dim, kind)
        assert why is None, f"{name} does not run {kind} / {dtype} / head dim {head_dim} here: {why}"
        choice.self_check(name, DEV, dt, head_dim, (kind,))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sparse_kernel_self_check(dtype):
    """triton_block_sparse (vertical-slash tiles) passes its self-check against block_sparse."""
    choice.checked("triton_block_sparse", DEV, DTYPES[dtype], 128, ("sparse",))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_choice_after_self_checks_is_fused(head_dim, dtype):
    """choose() for every dense kind (each candidate self-checked on first use) picks fused kernels:
    full/causal on cudnn or cuda_flash, block_causal on triton_masked, positions on varlen_or_triton
    (torch's varlen flash op where a block allows it, else triton_masked)."""
    choice.reset()
    got = choice.choose(DEV, DTYPES[dtype], head_dim, choice.DENSE_KINDS)
    rows = {kind: (fwd, bwd) for kind, fwd, bwd in got.kernels}
    for kind in ("full", "causal"):
        assert set(rows[kind]) <= {"cudnn", "cuda_flash"}, got.describe()
    assert rows["block_causal"] == ("triton_masked", "triton_masked"), got.describe()
    assert rows["positions"] == ("varlen_or_triton", "varlen_or_triton"), got.describe()
