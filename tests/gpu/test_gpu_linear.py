"""Linear attention (LASP-2, every decay form) and the gated delta rule on one GPU with
flash-linear-attention's kernels behind them (megatron_burst.linear.kernel_choice), bf16.

* W = 1: kernel "auto" takes fla after its self-check (the decision line says so); out and every
  gradient within ``BOUND`` x fla's own kernel's error (same inputs, same fp32 reference: our torch
  path in fp32 on the bf16-rounded inputs) and under ``SANITY``;
* W = 2 ranks on one GPU (host-staged transport): the reassembled out and gradients as close to the
  fp32 reference as W = 1 (the exchange adds no error beyond fp32 rounding);
* documents (cu_seqlens), W = 1 zigzag (two segments: a row cut into pieces, the exchanged state
  entering the second segment's first piece): fla's varlen kernels behind our ops, out and every
  gradient vs our fp32 torch path with the same documents within ``BOUND`` x fla's own varlen
  kernel's error (called directly with the documents as cu_seqlens) and under ``SANITY``;
* a packed THD batch at W = 2 ranks on one GPU (layout "thd": a rank's runs as fla's varlen rows):
  out and every gradient within ``BOUND`` x fla's own varlen kernel's error on the same documents;
* no plain-torch path on CUDA (a SlowKernelWarning is an error here, as in the rest of tests/gpu);
  forms fla itself refuses on this machine (gated backward on Hopper with 3.4 <= Triton < 3.7.1,
  ``kernel_choice.fla_refusal``) are skipped with that reason.

Needs fla on the GPU machine (scripts/gpu_linear.sh installs the wheels from .whl/). Dry run on CPU
(MEGATRON_BURST_GPU_TESTS_ON_CPU=1): tiny sizes, fp32, the torch path (fla's Triton kernels need a
GPU), errors against the fp32 reference held to CPU_FP32_BOUND; the fla assertions are skipped.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import megatron_burst as mb
from megatron_burst.bench.linear_gpu import (GRAD_NAMES, errors, fla_direct_fn, leaves_of, make_inputs, reference,
                                             run_ours)
from megatron_burst.kernels.choice import SlowKernelWarning
from megatron_burst.linear import kernel_choice

from gpu import linear_ranks
from gpu.common import CPU_FP32_BOUND, DEV, DTYPE, L, ON_CPU, rank_failures, run_on_ranks

SEQ, HEADS, D = L(2048), 4, (128 if not ON_CPU else 32)
CASES = [("lasp2", "none"), ("lasp2", "head"), ("lasp2", "token"), ("lasp2", "channel"), ("gdn", "token")]
BOUND = 1.5  # ours <= BOUND x fla's own kernel's error (+ ABS_FLOOR), as the attention suite holds SDPA
ABS_FLOOR = 1e-4
SANITY = 5e-2  # and never above this (bf16; out, dq, dk, dv)


def _bar_failures(what: str, ours: dict, fla: dict | None) -> list[str]:
    fails = []
    for name, err in ours.items():
        if ON_CPU:
            if not err <= CPU_FP32_BOUND:
                fails.append(f"{what}: {name} error {err:.2e} > {CPU_FP32_BOUND:.0e} (fp32 dry run)")
            continue
        bar = BOUND * fla[name] + ABS_FLOOR
        if not err <= bar or (name in ("out", "dq", "dk", "dv") and not err <= SANITY):
            fails.append(f"{what}: {name} error {err:.3e} > {BOUND} x fla's {fla[name]:.3e} (or > {SANITY})")
    return fails


def _skip_where_fla_refuses(op: str, form: str) -> None:
    """fla's own refusal on this machine (the engine then runs torch, loudly: tested on CPU)."""
    refusal = None if ON_CPU else kernel_choice.fla_refusal(op, form)
    if refusal:
        pytest.skip(f"{refusal}; fix: {kernel_choice.GATED_FIX}")


def _assert_fla_decided(op: str) -> None:
    """Every decision line of ``op`` so far took fla after its self-check."""
    decided = [line for line in kernel_choice.report() if line.startswith(f"linear kernels: {op} ")]
    assert decided and all("fla " in line and "self-checked" in line for line in decided), decided


def _fla_errors(op: str, form: str, x: dict, ref: list) -> dict:
    direct = fla_direct_fn(op, form)
    leaves = leaves_of(op, form, x)
    o = direct(x, leaves)
    o.backward(x["dout"])
    return errors(op, [o.detach()] + [t.grad for t in leaves], ref, HEADS)


@pytest.mark.parametrize("op,form", CASES)
def test_linear_op_through_fla_on_one_gpu(op, form):
    _skip_where_fla_refuses(op, form)
    x = make_inputs(op, form, SEQ, HEADS, D, DTYPE, DEV)
    ref = reference(op, form, x, HEADS)
    leaves = leaves_of(op, form, x)
    o = (mb.gated_delta_rule(*leaves) if op == "gdn" else
         mb.linear_attention(*leaves[:3], g=leaves[3] if len(leaves) > 3 else x["g"]))
    o.backward(x["dout"])
    ours = errors(op, [o.detach()] + [t.grad for t in leaves], ref, HEADS)
    fla = None
    if not ON_CPU:
        _assert_fla_decided(op)
        fla = _fla_errors(op, form, x, ref)
    fails = _bar_failures(f"{op} {form} W=1", ours, fla)
    assert not fails, "\n".join(fails) + f"\nours {ours}\nfla {fla}"


@pytest.mark.parametrize("world_size", [2])
def test_two_ranks_on_one_gpu_match_the_fp32_reference(world_size):
    cases = [c for c in CASES if ON_CPU or kernel_choice.fla_refusal(*c) is None]  # see the W = 1 test's skip
    per_rank = run_on_ranks(world_size, linear_ranks.linear_cases, cases, SEQ, HEADS, D)
    fails = []
    for rank, res in enumerate(per_rank):
        if res["slow"]:
            fails.append(f"rank {rank} ran plain-torch kernels: {res['slow']}")
        fails += [f"{case} raised on rank {rank}:\n{tb}" for case, tb in res["errors"].items()]
        if not ON_CPU:
            fails += [f"rank {rank}: {line}" for line in res["kernels"] if "fla " not in line]
    for op, form in cases:
        if any((op, form) not in res["results"] for res in per_rank):
            continue  # reported above
        x = make_inputs(op, form, SEQ, HEADS, D, DTYPE, DEV)
        ref = reference(op, form, x, HEADS)
        n = len(per_rank[0]["results"][(op, form)])
        got = [torch.cat([res["results"][(op, form)][i] for res in per_rank], 0).to(DEV) for i in range(n)]
        ours = errors(op, got, ref, HEADS)
        assert set(ours) <= {"out", *GRAD_NAMES[op]}
        fails += _bar_failures(f"{op} {form} W={world_size}", ours, None if ON_CPU else _fla_errors(op, form, x, ref))
    assert not fails, "\n".join(fails[:30])


# starts inside both zigzag segments (W = 1: [0, SEQ/2) and [SEQ/2, SEQ)), a single-token document,
# and none at SEQ / 2: the second segment's first piece enters with the first segment's state
DOC_BOUNDS = [0, SEQ // 8 + 3, SEQ // 8 + 4, 3 * SEQ // 4 + 1, SEQ]


def _fla_varlen_errors(op: str, form: str, x: dict, ref: list, bounds: list = DOC_BOUNDS) -> dict:
    """fla's own kernel on the documents (the sequence as [1, SEQ, h, d], cu_seqlens the
    documents): its errors against the same fp32 reference, the bar ours is held to."""
    fn = kernel_choice.load_fla(op, form)
    leaves = leaves_of(op, form, x)
    rows = [t.transpose(0, 1) for t in leaves]  # [SEQ, 1, h, ...] -> [1, SEQ, h, ...]
    cu = torch.tensor(bounds, dtype=torch.int64, device=DEV)
    varlen = dict(scale=D ** -0.5, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    if op == "gdn":
        o, _ = fn(*rows, **varlen)
    elif form == "channel":
        o, _ = fn(*rows, **varlen)
    elif form == "token":
        o, _ = fn(*rows[:3], g=rows[3], **varlen)
    else:
        o, _ = fn(*rows, g_gamma=x["g"], **varlen)
    o.transpose(0, 1).backward(x["dout"])
    return errors(op, [o.transpose(0, 1).detach()] + [t.grad for t in leaves], ref, HEADS)


@pytest.mark.parametrize("op,form", CASES)
def test_documents_through_fla_on_one_gpu(op, form):
    _skip_where_fla_refuses(op, form)
    kernel_choice.reset()  # a fresh decision line for this call with documents
    x = make_inputs(op, form, SEQ, HEADS, D, DTYPE, DEV)
    cu = torch.tensor(DOC_BOUNDS)
    ref_leaves = leaves_of(op, form, x, HEADS)  # fp32 copies of the (bf16-rounded) inputs
    o = run_ours(op, form, "torch", x, ref_leaves, HEADS, layout="zigzag", cu_seqlens=cu)
    o.backward(x["dout"].float())
    ref = [o.detach()] + [t.grad for t in ref_leaves]
    leaves = leaves_of(op, form, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)  # documents must not send CUDA to the torch path
        o = run_ours(op, form, "auto", x, leaves, layout="zigzag", cu_seqlens=cu)
    o.backward(x["dout"])
    ours = errors(op, [o.detach()] + [t.grad for t in leaves], ref, HEADS)
    fla = None
    if not ON_CPU:
        _assert_fla_decided(op)
        fla = _fla_varlen_errors(op, form, x, ref)
    fails = _bar_failures(f"{op} {form} documents W=1 zigzag", ours, fla)
    assert not fails, "\n".join(fails) + f"\nours {ours}\nfla {fla}"


# a packed THD batch at W = 2 (TransformerEngine's partitioning, chunks of SEQ / 16 and SEQ / 8 tokens):
# three sequences, two with padding tails (documents of their own), one of a single real token
THD_PADDED = [0, SEQ // 4, 3 * SEQ // 4, SEQ]
THD_REAL = [0, SEQ // 4 - 3, 3 * SEQ // 4 - 3, 3 * SEQ // 4 - 2]


@pytest.mark.parametrize("world_size", [2])
def test_packed_thd_batch_on_two_ranks_through_fla(world_size):
    """linear_attention / gated_delta_rule in layout "thd" (a rank's runs as fla's varlen rows, the
    runs' states exchanged) on two ranks sharing the GPU: the reassembled out and gradients within the
    bar of fla's own varlen kernel on the same documents, against our fp32 torch path."""
    from megatron_burst.masks.documents import check_thd

    cases = [c for c in CASES if ON_CPU or kernel_choice.fla_refusal(*c) is None]  # see the W = 1 test's skip
    per_rank = run_on_ranks(world_size, linear_ranks.linear_cases, cases, SEQ, HEADS, D, thd=(THD_REAL, THD_PADDED))
    fails = rank_failures(per_rank, "thd")
    if not ON_CPU:
        fails += [f"rank {rank}: {line}" for rank, res in enumerate(per_rank) for line in res["kernels"]
                  if "fla " not in line]
    one = check_thd(THD_REAL, THD_PADDED, SEQ, 1, 1)  # the same documents on one rank (padding tails included)
    for op, form in cases:
        if any((op, form) not in res["results"] for res in per_rank):
            continue  # reported above
        x = make_inputs(op, form, SEQ, HEADS, D, DTYPE, DEV)
        ref_leaves = leaves_of(op, form, x, HEADS)
        o = run_ours(op, form, "torch", x, ref_leaves, HEADS, layout="thd", cu_seqlens=one)
        o.backward(x["dout"].float())
        ref = [o.detach()] + [t.grad for t in ref_leaves]
        n = len(per_rank[0]["results"][(op, form)])
        got = []
        for i in range(n):
            parts = [res["results"][(op, form)][i] for res in per_rank]
            if parts[0].dim() == 1:  # a per-head decay shared by every rank: its gradient sums
                got.append(sum(parts).to(DEV))
                continue
            full = torch.empty((SEQ,) + tuple(parts[0].shape[1:]), dtype=parts[0].dtype)
            for res, part in zip(per_rank, parts):
                full[res["positions"]] = part
            got.append(full.to(DEV))
        ours = errors(op, got, ref, HEADS)
        bounds = list(one.groups[0][2])
        fails += _bar_failures(f"{op} {form} THD W={world_size}", ours,
                               None if ON_CPU else _fla_varlen_errors(op, form, x, ref, bounds))
    assert not fails, "\n".join(fails[:30])
