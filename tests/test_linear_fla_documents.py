"""Documents (cu_seqlens) through flash-linear-attention's varlen kernels: linear_attention (LASP-2,
decay forms none / head (learned and fixed) / token / channel) and gated_delta_rule with the
stand-in fla (tests/fla_standin.py, fla 0.6's cu_seqlens semantics in plain torch) on the CUDA
decision path equal our torch path -- output and every gradient, fp32, relative 1e-5 -- at W = 1,
2 and 3 in the contiguous, zigzag and striped layouts (tests/linear_fla_doc_cases.py has the
document sets: starts inside segments and on segment starts, single-token documents, a document
over every rank, per-sample boundaries).

Also: the pieces themselves (row_pieces) on a small hand-checked case, documents taking fla with
no SlowKernelWarning, fla's varlen mode self-checked before documents use it (a varlen mode that
does not reset fails it loudly), and the loud refusal that remains for an op not wired to it.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fla_standin
from harness import run_ranks
from linear_fla_doc_cases import fla_document_cases
from megatron_burst.kernels import choice as attention_choice
from megatron_burst.kernels.choice import KernelSelfCheckError, SlowKernelWarning
from megatron_burst.linear import fla_adapter, gated_delta_rule, kernel_choice, linear_attention
from megatron_burst.masks.documents import check_cu_seqlens

REL = 1e-5  # relative Frobenius error per tensor (fp32: the stand-in's token loop against the chunked path)


pytestmark = pytest.mark.usefixtures("fresh_kernel_choices")  # tests/conftest.py


@pytest.mark.parametrize("world_size", [1, 3])
def test_documents_through_fla_equal_the_torch_path(world_size):
    results = run_ranks(world_size, fla_document_cases)
    failures = []
    for rank, res in enumerate(results):
        assert res.pop("fla_calls") > 0, f"rank {rank}: the stand-in fla was never called"
        assert len(res) == 3 * (6 + 2), sorted(res)  # 3 layouts x (5 LASP-2 forms + gdn, then 2 on the edge set)
        failures += [f"rank {rank} {case}: {name} relative error {err:.2e} > {REL:.0e}"
                     for case, errs in res.items() for name, err in errs.items() if not err <= REL]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


def test_row_pieces_cut_rows_at_document_starts():
    """Zigzag, W = 2, rank 0: segments 0 and 3 of 4 (8 tokens each), b = 2, rows segment-major."""
    docs = check_cu_seqlens([torch.tensor([0, 3, 24, 26, 32]), torch.tensor([0, 8, 32])], 32, 2)
    p = fla_adapter.row_pieces(docs, 2, (0, 3), 4, torch.device("cpu"))
    # row 0: seg 0 of sample 0 (start at 3); row 1: seg 0 of sample 1; row 2: seg 3 of sample 0 (start
    # at its first token 24, and at 26); row 3: seg 3 of sample 1 (continues the document from 8)
    assert p.cu_seqlens.tolist() == [0, 3, 8, 16, 18, 24, 32] == p.cu_seqlens_cpu.tolist()
    assert p.row.tolist() == [0, 0, 1, 2, 2, 3]
    assert p.last.tolist() == [1, 2, 4, 5]
    assert p.carried.tolist() == [0, 0, 0, 0, 0, 1]
    assert fla_adapter.row_pieces(docs, 2, (0, 3), 4, torch.device("cpu")) is p  # cached: one tensor per batch


def test_documents_take_fla_without_a_slow_warning(monkeypatch):
    fla_standin.install(monkeypatch)
    monkeypatch.setattr(attention_choice, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    q, k, v = (torch.randn(90, 2, 3, d) for d in (8, 8, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)
        linear_attention(q, k, v, g=-torch.rand(90, 2, 3) * 0.3, cu_seqlens=torch.tensor([0, 40, 90]))
        linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 40, 90]), kernel="fla")
    assert fla_standin.calls["chunk_simple_gla"] > 0
    assert any("chunk_simple_gla" in line and "self-checked" in line for line in kernel_choice.report())


def test_an_op_not_wired_for_documents_is_refused_loudly(monkeypatch):
    """The refusal kept for ops outside FLA_DOCUMENT_OPS: "auto" warns naming the op, "fla" raises."""
    fla_standin.install(monkeypatch)
    monkeypatch.setattr(attention_choice, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernel_choice, "FLA_DOCUMENT_OPS", frozenset({("lasp2", "none")}))
    q, k, v = (torch.randn(90, 2, 3, d) for d in (8, 8, 5))
    g = -torch.rand(90, 2, 3) * 0.3
    with pytest.warns(SlowKernelWarning, match=r"documents are not wired to fla's varlen kernels for lasp2 "
                                               r"\(per-token decay\)"):
        linear_attention(q, k, v, g=g, cu_seqlens=torch.tensor([0, 40, 90]))
    with pytest.raises(ValueError, match=r"kernel='fla' for lasp2 \(per-token decay\) with documents"):
        linear_attention(q, k, v, g=g, cu_seqlens=torch.tensor([0, 40, 90]), kernel="fla")
    assert not fla_standin.calls


def test_a_varlen_mode_that_does_not_reset_fails_the_self_check(monkeypatch):
    """Documents run fla's varlen mode: it is self-checked on its own (a stand-in whose sequences
    carry the state across cu_seqlens passes the plain check and fails the varlen one, loudly)."""
    fla_standin.install(monkeypatch, "varlen_carry")
    monkeypatch.setattr(attention_choice, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    q, k, v = (torch.randn(90, 2, 3, d) for d in (8, 8, 5))
    g, beta = -torch.rand(90, 2, 3) * 0.3, torch.rand(90, 2, 3)
    linear_attention(q, k, v, g=g)  # whole rows: fine
    for call, name in ((lambda: linear_attention(q, k, v, g=g, cu_seqlens=torch.tensor([0, 40, 90])),
                        "chunk_simple_gla"),
                       (lambda: gated_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v, g, beta,
                                                 cu_seqlens=torch.tensor([0, 40, 90])), "chunk_gated_delta_rule")):
        with pytest.raises(KernelSelfCheckError, match=rf"{name} .* documents \(varlen cu_seqlens\).* out is off"):
            call()
