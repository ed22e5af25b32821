"""Rank-side bodies of the fused LM-head + cross-entropy tests (run on every rank by run_ranks).

Every rank builds the same full inputs from one seed -- hidden [s, b, d], the full output weight
[V, d], labels with some ``ignore_index`` entries, a loss mask -- takes its vocabulary shard of
the weight (and, under sequence parallelism, its sequence shard of the hidden states) and runs

* the fused op,
* Megatron's path: ``ColumnParallelLinear`` (gather_output=False, the GPT output layer) and
  ``vocab_parallel_cross_entropy``, with parallel_state initialized for the TP size,
* the plain fp32 reference (:mod:`megatron_burst.loss.reference`),

each followed by the same objective ``sum(loss * r) * scale`` and autograd. It returns the largest
errors of the loss and of the hidden and weight gradients against both, the largest magnitudes
(for relative bounds) and which backward path the fused op took.

Run as a script (``python tests/fused_loss_cases.py triton``) it checks the Triton kernels under
``TRITON_INTERPRET=1``, which must be set before triton is first imported (see
megatron_burst/loss/triton_kernels.py), so the tests start it as a fresh subprocess.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from megatron_burst.bench.loss import LargestTensor
from megatron_burst.loss import (FusedLossRecomputeWarning, backward_paths, fused_linear_cross_entropy,
                                 recompute_linear_cross_entropy, reference_linear_cross_entropy)

IGNORE = -100


def make_inputs(s, b, d, V, seed, dtype, n_ignored=2, mask_kind="binary"):
    """Full-problem inputs, identical on every rank: hidden [s, b, d], weight [V, d], labels, mask [s, b]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, d, generator=g).to(dtype)
    weight = (torch.randn(V, d, generator=g) * d ** -0.5 * 2).to(dtype)
    labels = torch.randint(0, V, (s, b), generator=g)
    flat = labels.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:n_ignored]] = IGNORE
    if mask_kind == "binary":
        mask = (torch.rand(s, b, generator=g) > 0.25).float()
    else:  # arbitrary positive per-token weights
        mask = torch.rand(s, b, generator=g) + 0.5
    mask[labels == IGNORE] = 0.0  # Megatron's loss mask covers padding
    return hidden, weight, labels, mask


def objective_weights(kind, labels, mask, seed):
    """(r, scale, loss_mask hint) for the objective sum(loss * r) * scale.

    binary/weights: the Megatron case, r = loss mask, hint = the same mask -> scaled path.
    mean: loss.mean() over all tokens (ignored ones too, their loss is 0), no hint -> scaled path.
    mismatch: r random, hint = the mask -> g not proportional to the hint -> recompute path.
    """
    if kind in ("binary", "weights"):
        return mask, 1.0 / float(mask.sum()), mask
    if kind == "mean":
        return torch.ones_like(mask), 1.0 / mask.numel(), None
    if kind == "mismatch":
        g = torch.Generator().manual_seed(seed + 1)
        return torch.randn(mask.shape, generator=g), 1.0, mask
    raise ValueError(kind)


def _init_tp(tp):
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    return ps


def megatron_losses(hidden, weight, labels, tp):
    """Megatron's GPT output layer + vocab_parallel_cross_entropy on the full hidden [s, b, d]."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                              perform_initialization=False, params_dtype=weight.dtype)
    layer = ColumnParallelLinear(hidden.shape[-1], weight.shape[0] * tp, config=cfg, init_method=lambda w: None,
                                 bias=False, gather_output=False, skip_weight_param_allocation=True)
    logits, _ = layer(hidden, weight=weight)
    return vocab_parallel_cross_entropy(logits, labels)


def leaf(t, dtype=None):
    """A fresh autograd leaf copy of t (optionally cast); never t itself."""
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _errs(prefix, got, ref):
    return {f"{prefix}_{k}": (g.float() - r.float()).abs().max().item() for k, g, r in zip(("dh", "dw"), got, ref)}


def run_case(s=12, b=3, d=24, V=50, dtype=torch.float32, kind="binary", seed=0, token_chunk=5, vocab_chunk=16,
             sequence_parallel=False, impl="torch", with_megatron=True):
    """Fused vs Megatron vs reference on this rank; returns a dict of errors, scales and paths."""
    tp = dist.get_world_size()
    rank = dist.get_rank()
    group = dist.group.WORLD if tp > 1 else None
    ps = _init_tp(tp) if with_megatron else None
    hidden, weight, labels, mask = make_inputs(s, b, d, V, seed, dtype,
                                               mask_kind="weights" if kind == "weights" else "binary")
    r, scale, hint = objective_weights(kind, labels, mask, seed)
    valid = labels != IGNORE
    vl = V // tp
    w_shard = weight[rank * vl:(rank + 1) * vl]
    sl = s // tp
    h_local = hidden[rank * sl:(rank + 1) * sl] if sequence_parallel else hidden
    out = {}

    h_f, w_f = leaf(h_local), leaf(w_shard)
    before = dict(backward_paths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedLossRecomputeWarning)
        loss_f = fused_linear_cross_entropy(h_f, w_f, labels, tp_group=group, ignore_index=IGNORE, loss_mask=hint,
                                            sequence_parallel=sequence_parallel, token_chunk=token_chunk,
                                            vocab_chunk=vocab_chunk, impl=impl)
        ((loss_f * r).sum() * scale).backward()
    out["paths"] = {k: backward_paths[k] - before.get(k, 0) for k in ("scaled", "recompute")}
    out["ignored_loss"] = loss_f[~valid].abs().max().item()
    out["loss_dtype"] = str(loss_f.dtype)
    shard = (lambda t: t[rank * sl:(rank + 1) * sl]) if sequence_parallel else (lambda t: t)

    # Plain fp32 reference on the same (rounded) inputs.
    h_r, w_r = leaf(h_local, torch.float32), leaf(w_shard, torch.float32)
    loss_r = reference_linear_cross_entropy(h_r, w_r, labels, tp_group=group, ignore_index=IGNORE,
                                            sequence_parallel=sequence_parallel)
    ((loss_r * r).sum() * scale).backward()
    out["ref_loss"] = (loss_f - loss_r).abs().max().item()
    out.update(_errs("ref", (h_f.grad, w_f.grad), (h_r.grad, w_r.grad)))
    out["scale_loss"] = loss_r.abs().max().item()
    out["scale_dh"] = h_r.grad.abs().max().item()
    out["scale_dw"] = w_r.grad.abs().max().item()

    if with_megatron:
        # Megatron knows no ignore_index: its loss mask (r * valid) removes those tokens instead.
        h_m, w_m = leaf(hidden), leaf(w_shard)
        loss_m = megatron_losses(h_m, w_m, labels, tp)
        ((loss_m * (r * valid)).sum() * scale).backward()
        out["meg_loss"] = (loss_f - loss_m)[valid].abs().max().item()
        out.update(_errs("meg", (h_f.grad, w_f.grad), (shard(h_m.grad), w_m.grad)))
        # Megatron's own error against the fp32 reference: the yardstick for bf16.
        out["megref_loss"] = (loss_m - loss_r)[valid].abs().max().item()
        out.update(_errs("megref", (shard(h_m.grad), w_m.grad), (h_r.grad, w_r.grad)))
        ps.destroy_model_parallel()
    return out


def run_recompute_variant(s=12, b=3, d=24, V=50, seed=3, token_chunk=5, vocab_chunk=16):
    """recompute_linear_cross_entropy (the benchmark's baseline) vs the reference, fp32."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD if tp > 1 else None
    hidden, weight, labels, mask = make_inputs(s, b, d, V, seed, torch.float32)
    vl = V // tp
    w_shard = weight[rank * vl:(rank + 1) * vl]
    r = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    res = []
    for fn in (recompute_linear_cross_entropy, reference_linear_cross_entropy):
        h, w = leaf(hidden), leaf(w_shard)
        kw = dict(token_chunk=token_chunk, vocab_chunk=vocab_chunk) if fn is recompute_linear_cross_entropy else {}
        loss = fn(h, w, labels, tp_group=group, ignore_index=IGNORE, **kw)
        (loss * r).sum().backward()
        res.append((loss, h.grad, w.grad))
    return [(a - b).abs().max().item() for a, b in zip(*res)]


def run_tied(s=8, b=2, d=16, V=40, seed=5, dtype=torch.float32):
    """Embedding and output layer share one weight (Megatron's tied embeddings); fused vs Megatron.

    Returns (max |grad_fused - grad_megatron| of the shared weight, max |grad|, max |output-layer
    contribution alone|, max |embedding contribution alone|): the last two show both paths feed it.
    """
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    tp, rank = dist.get_world_size(), dist.get_rank()
    ps = _init_tp(tp)
    group = dist.group.WORLD if tp > 1 else None
    _, weight, labels, mask = make_inputs(s, b, d, V, seed, dtype)
    tokens = torch.randint(0, V, (s, b), generator=torch.Generator().manual_seed(seed + 7))
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                              perform_initialization=False, params_dtype=dtype)
    vl = V // tp
    grads = {}
    for path in ("fused", "megatron", "output_only", "embedding_only"):
        emb = VocabParallelEmbedding(V, d, init_method=lambda w: None, config=cfg)
        with torch.no_grad():
            emb.weight.copy_(weight[rank * vl:(rank + 1) * vl])
        hidden = torch.tanh(emb(tokens)) * 1.5  # [s, b, d]; the gradient reaches the embedding too
        if path == "output_only":
            hidden = hidden.detach()
        if path in ("fused", "output_only"):
            loss = fused_linear_cross_entropy(hidden, emb.weight, labels, tp_group=group, ignore_index=IGNORE,
                                              loss_mask=mask, token_chunk=3, vocab_chunk=7)
        elif path == "megatron":
            loss = megatron_losses(hidden, emb.weight, labels, tp)
        else:
            loss = megatron_losses(hidden, emb.weight.detach(), labels, tp)
        ((loss * mask).sum() / mask.sum()).backward()
        grads[path] = emb.weight.grad.clone()
    ps.destroy_model_parallel()
    return ((grads["fused"] - grads["megatron"]).abs().max().item(), grads["megatron"].abs().max().item(),
            grads["output_only"].abs().max().item(), grads["embedding_only"].abs().max().item(),
            (grads["output_only"] + grads["embedding_only"] - grads["fused"]).abs().max().item())


def largest_tensor(fn_name, s=16, b=4, d=8, V=96, token_chunk=16, vocab_chunk=32, kind="binary"):
    """Largest tensor produced during forward + backward of one path ("fused", "recompute", "megatron")."""
    hidden, weight, labels, mask = make_inputs(s, b, d, V, 11, torch.float32)
    r, scale, hint = objective_weights(kind, labels, mask, 11)
    h, w = leaf(hidden), leaf(weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedLossRecomputeWarning)
        with LargestTensor() as probe:
            if fn_name == "fused":
                loss = fused_linear_cross_entropy(h, w, labels, loss_mask=hint, token_chunk=token_chunk,
                                                  vocab_chunk=vocab_chunk)
            elif fn_name == "recompute":
                loss = recompute_linear_cross_entropy(h, w, labels, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
            else:
                loss = reference_linear_cross_entropy(h, w, labels)
            ((loss * r).sum() * scale).backward()
    return probe.numel


def bad_input_errors_tp():
    """Errors that need a TP group: sequence-parallel shape, labels beyond the sharded vocabulary."""
    group = dist.group.WORLD
    h, w = torch.randn(4, 2, 8), torch.randn(5, 8)  # V = 10 over 2 ranks
    msgs = []
    for kw, labels in ((dict(sequence_parallel=True), torch.zeros(4, 2, dtype=torch.long)),
                       ({}, torch.zeros(8, 2, dtype=torch.long)),
                       ({}, torch.full((4, 2), 10))):
        try:
            fused_linear_cross_entropy(h, w, labels, tp_group=group, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


# ------------------------------------------------------------------ Triton under the interpreter


def _triton_case(dtype, kind, token_chunk):
    """fused(impl='triton') vs fused(impl='torch') and vs the reference, one process."""
    hidden, weight, labels, mask = make_inputs(13, 3, 24, 50, 2, dtype)
    r, scale, hint = objective_weights(kind, labels, mask, 2)
    res = {}
    for impl in ("triton", "torch", "reference"):
        if impl == "reference":
            h, w = leaf(hidden, torch.float32), leaf(weight, torch.float32)
            loss = reference_linear_cross_entropy(h, w, labels)
        else:
            h, w = leaf(hidden), leaf(weight)
            loss = fused_linear_cross_entropy(h, w, labels, loss_mask=hint, token_chunk=token_chunk, impl=impl)
        ((loss * r).sum() * scale).backward()
        res[impl] = (loss, h.grad, w.grad)
    errs = {}
    for other in ("torch", "reference"):
        for name, a, b in zip(("loss", "dh", "dw"), res["triton"], res[other]):
            errs[f"{other}_{name}"] = (a.float() - b.float()).abs().max().item()
    for name, t in zip(("loss", "dh", "dw"), res["reference"]):
        errs[f"scale_{name}"] = t.abs().max().item()
    return errs


def triton_tp_case():
    """Triton path at TP=2 (its own max/sum-exp combine) vs the reference, fp32; on each rank."""
    return run_case(impl="triton", with_megatron=False, kind="binary")


def triton_main():
    """Print a JSON dict {case: errors} for the Triton kernels; needs TRITON_INTERPRET=1 at startup."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    warnings.simplefilter("ignore", FusedLossRecomputeWarning)
    torch.set_num_threads(1)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("binary", "mismatch"):
            # 39 tokens in chunks of 8 (partial last chunk); 50 vocabulary rows in tiles of 16.
            results[f"{str(dtype)[6:]}-{kind}"] = _triton_case(dtype, kind, 8)
    import fused_loss_cases  # not __main__: the ranks must unpickle the function by its module name
    from harness import run_ranks, shutdown_pools
    try:
        results["tp2"] = run_ranks(2, fused_loss_cases.triton_tp_case, timeout=300)
    finally:
        shutdown_pools(stop_forkserver=True)
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:] == ["triton"]:
        triton_main()
    else:
        sys.exit("usage: TRITON_INTERPRET=1 python tests/fused_loss_cases.py triton")
