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

import collections
import contextlib
import functools
import json
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_burst.bench.loss import LargestTensor
from megatron_burst.loss import (FusedLossRecomputeWarning, backward_paths, fused_linear_cross_entropy,
                                 recompute_linear_cross_entropy, reference_linear_cross_entropy)

IGNORE = -100
QUANTITIES = ("loss", "dh", "dw")


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


def _errs(prefix, got, ref, names=("dh", "dw")):
    """{prefix_q: max |got - ref|, prefix_rms_q: root-mean-square of got - ref} per quantity q."""
    out = {}
    for q, g, r in zip(names, got, ref):
        diff = g.float() - r.float()
        out[f"{prefix}_{q}"] = diff.abs().max().item()
        out[f"{prefix}_rms_{q}"] = diff.square().mean().sqrt().item()
    return out


def run_case(s=12, b=3, d=24, V=50, dtype=torch.float32, kind="binary", seed=0, token_chunk=5, vocab_chunk=16,
             sequence_parallel=False, impl="torch", with_megatron=True, weight_grad="forward"):
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
                                            vocab_chunk=vocab_chunk, impl=impl, weight_grad=weight_grad)
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
    out.update(_errs("ref", (loss_f[valid], h_f.grad, w_f.grad), (loss_r[valid], h_r.grad, w_r.grad), QUANTITIES))
    for q, t in zip(QUANTITIES, (loss_r[valid], h_r.grad, w_r.grad)):
        out[f"scale_{q}"] = t.abs().max().item()
        out[f"scale_rms_{q}"] = t.square().mean().sqrt().item()

    if with_megatron:
        # Megatron knows no ignore_index: its loss mask (r * valid) removes those tokens instead.
        h_m, w_m = leaf(hidden), leaf(w_shard)
        loss_m = megatron_losses(h_m, w_m, labels, tp)
        ((loss_m * (r * valid)).sum() * scale).backward()
        out.update(_errs("meg", (loss_f[valid], h_f.grad, w_f.grad), (loss_m[valid], shard(h_m.grad), w_m.grad),
                         QUANTITIES))
        # Megatron's own error against the fp32 reference: the yardstick for bf16.
        out.update(_errs("megref", (loss_m[valid], shard(h_m.grad), w_m.grad), (loss_r[valid], h_r.grad, w_r.grad),
                         QUANTITIES))
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


def run_tied(s=8, b=2, d=16, V=40, seed=5, dtype=torch.float32, impl="torch"):
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
                                              loss_mask=mask, token_chunk=3, vocab_chunk=7, impl=impl)
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


class LargestStorage(TorchDispatchMode):
    """Records the largest storage (in bytes) behind any tensor an op produces while active. Under
    Triton's interpreter a launch copies each tensor argument's whole storage to and from the host
    (as a byte tensor): never more bytes than the op itself allocated, so bytes are the fair count."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def largest_tensor(fn_name, s=16, b=4, d=8, V=96, token_chunk=16, vocab_chunk=32, kind="binary", impl="torch",
                   dtype=torch.float32, probe_cls=None):
    """Largest tensor produced during forward + backward of one path ("fused", "recompute", "megatron"):
    its number of elements (LargestTensor), or with ``probe_cls=LargestStorage`` its storage's bytes."""
    hidden, weight, labels, mask = make_inputs(s, b, d, V, 11, dtype)
    r, scale, hint = objective_weights(kind, labels, mask, 11)
    h, w = leaf(hidden), leaf(weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedLossRecomputeWarning)
        with (probe_cls or LargestTensor)() as probe:
            if fn_name == "fused":
                loss = fused_linear_cross_entropy(h, w, labels, loss_mask=hint, token_chunk=token_chunk,
                                                  vocab_chunk=vocab_chunk, impl=impl)
            elif fn_name == "recompute":
                loss = recompute_linear_cross_entropy(h, w, labels, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
            else:
                loss = reference_linear_cross_entropy(h, w, labels)
            ((loss * r).sum() * scale).backward()
    return probe.nbytes if probe_cls is LargestStorage else probe.numel


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


# --------------------------------------------------- what the op keeps, reads and communicates


class OpProbe(TorchDispatchMode):
    """While active: host reads of tensor values and ops with data-dependent output shapes (both
    sync a GPU), and the tensors ops produce (shape, dtype, data_ptr), in order."""

    DATA_DEPENDENT = ("nonzero", "masked_select", "unique", "repeat_interleave", "_assert_async")

    def __init__(self):
        super().__init__()
        self.host_reads = 0
        self.data_dependent = []
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":  # .item(), bool(t), int(t), float(t)
            self.host_reads += 1
        if any(k in name for k in self.DATA_DEPENDENT):
            self.data_dependent.append(name)
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.outputs.append((tuple(t.shape), t.dtype, t.data_ptr()))
        return out


@contextlib.contextmanager
def host_reads_outside_dispatch():
    """Count Tensor.tolist / numpy / cpu calls (host reads that bypass the dispatcher on CPU)."""
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def counting(orig):
        def wrapper(self, *a, **k):
            counts["n"] += 1
            return orig(self, *a, **k)
        return wrapper

    for name, orig in originals.items():
        setattr(torch.Tensor, name, counting(orig))
    try:
        yield counts
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)


@contextlib.contextmanager
def count_collectives():
    """Count the torch.distributed collectives the op calls (it calls them through the module)."""
    counts = collections.Counter()
    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce_scatter",
             "broadcast")
    originals = {name: getattr(dist, name) for name in names}

    def counting(name, orig):
        def wrapper(*a, **k):
            counts[name] += 1
            return orig(*a, **k)
        return wrapper

    for name, orig in originals.items():
        setattr(dist, name, counting(name, orig))
    try:
        yield counts
    finally:
        for name, orig in originals.items():
            setattr(dist, name, orig)


def _setup(s, b, d, V, seed, dtype, sequence_parallel, kind="binary"):
    tp, rank = dist.get_world_size(), dist.get_rank()
    hidden, weight, labels, mask = make_inputs(s, b, d, V, seed, dtype)
    r, scale, hint = objective_weights(kind, labels, mask, seed)
    vl, sl = V // tp, s // tp
    h_local = hidden[rank * sl:(rank + 1) * sl] if sequence_parallel else hidden
    return dict(group=dist.group.WORLD if tp > 1 else None, h=leaf(h_local), w=leaf(weight[rank * vl:(rank + 1) * vl]),
                labels=labels, r=r, scale=scale, hint=hint)


def saved_and_retained(s=8, b=2, d=12, V=20, sequence_parallel=False, dtype=torch.float32, kind="binary"):
    """Shapes and dtypes of every tensor the fused op saves for backward (saved_tensors_hooks), and
    the tensors new to the backward of at least min(N, V/tp) x d elements: (shape, dtype) list each."""
    x = _setup(s, b, d, V, 0, dtype, sequence_parallel, kind)
    saved = []  # (shape, dtype, data_ptr, bytes): holding the tensors would keep them alive

    def pack(t):
        saved.append((tuple(t.shape), str(t.dtype), t.data_ptr(), t.numel() * t.element_size()))
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedLossRecomputeWarning)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fused_linear_cross_entropy(x["h"], x["w"], x["labels"], tp_group=x["group"], ignore_index=IGNORE,
                                              loss_mask=x["hint"], sequence_parallel=sequence_parallel, token_chunk=5,
                                              vocab_chunk=7)
        objective = (loss * x["r"]).sum() * x["scale"]
        grad_ptrs = {}
        x["h"].register_hook(lambda g: grad_ptrs.__setitem__("dh", g.data_ptr()))
        x["w"].register_hook(lambda g: grad_ptrs.__setitem__("dw", g.data_ptr()))
        known = {ptr for _, _, ptr, _ in saved}
        with OpProbe() as probe:
            objective.backward()
    big = min(x["labels"].numel(), x["w"].shape[0]) * d
    new_big = {}
    for shape, dt, ptr in probe.outputs:
        if math.prod(shape) >= big and ptr not in known:
            new_big.setdefault(ptr, (shape, str(dt)))  # an out= op reports the buffer again
    inputs = (x["h"].data_ptr(), x["w"].data_ptr())
    saved_ptr = {ptr for _, _, ptr, _ in saved if ptr not in inputs}
    return {"saved": sorted((shape, dt) for shape, dt, _, _ in saved),
            "saved_bytes": sum(nbytes for _, _, _, nbytes in saved),
            "new_in_backward": sorted(new_big.values()),
            # the gradients handed to autograd are the saved D and A themselves (scaled in place)
            "dh_is_saved": grad_ptrs.get("dh") in saved_ptr,
            "dw_is_saved": grad_ptrs.get("dw") in saved_ptr}


def reads_and_collectives(s=10, b=2, d=8, V=20, sequence_parallel=False, kind="binary", token_chunk=4,
                          dtype=torch.float32, impl="torch", weight_grad="forward"):
    """Per phase (forward with grad, backward, forward without grad): host reads, data-dependent
    ops and collectives of the fused op; plus its gradients' errors against the reference. (Under
    Triton's interpreter a kernel launch reads its arguments on the host: count collectives only.)"""
    x = _setup(s, b, d, V, 1, dtype, sequence_parallel, kind)
    kw = dict(tp_group=x["group"], ignore_index=IGNORE, loss_mask=x["hint"], sequence_parallel=sequence_parallel,
              token_chunk=token_chunk, vocab_chunk=3, impl=impl, weight_grad=weight_grad)
    out = {}

    def phase(name, fn):
        with count_collectives() as coll, host_reads_outside_dispatch() as other, OpProbe() as probe:
            result = fn()
        out[name] = {"host_reads": probe.host_reads + other["n"], "data_dependent": probe.data_dependent,
                     "collectives": dict(coll)}
        return result

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedLossRecomputeWarning)
        loss = phase("forward", lambda: fused_linear_cross_entropy(x["h"], x["w"], x["labels"], **kw))
        objective = (loss * x["r"]).sum() * x["scale"]
        phase("backward", objective.backward)
        with torch.no_grad():
            phase("inference", lambda: fused_linear_cross_entropy(x["h"], x["w"], x["labels"], **kw))
    h_r, w_r = leaf(x["h"]), leaf(x["w"])
    loss_r = reference_linear_cross_entropy(h_r, w_r, x["labels"], tp_group=x["group"], ignore_index=IGNORE,
                                            sequence_parallel=sequence_parallel)
    ((loss_r * x["r"]).sum() * x["scale"]).backward()
    out["err_dh"] = (x["h"].grad - h_r.grad).abs().max().item() / h_r.grad.abs().max().item()
    out["err_dw"] = (x["w"].grad - w_r.grad).abs().max().item() / w_r.grad.abs().max().item()
    out["chunks"] = -(-x["labels"].numel() // token_chunk)
    return out


def main_grad_case(dtype=torch.float32, kind="binary", ddp_attrs=True, zero_out_wgrad=False, s=9, b=2, d=12, V=30,
                   impl="torch", weight_grad="forward"):
    """accumulate_into_main_grad=True on a weight given a pre-filled fp32 main_grad by hand (as
    Megatron's DDP does). Returns the main_grad increment's error against the unfused gradient
    (fp32 reference, and Megatron's bf16 path for bf16), the returned weight gradient and flags."""
    tp = dist.get_world_size()
    x = _setup(s, b, d, V, 2, dtype, False, kind)
    w = x["w"]
    prefill = torch.randn(w.shape, generator=torch.Generator().manual_seed(9))
    w.main_grad = prefill.clone()
    if ddp_attrs:
        w.grad_added_to_main_grad = False
    if zero_out_wgrad:
        w.zero_out_wgrad = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedLossRecomputeWarning)
        before = dict(backward_paths)
        loss = fused_linear_cross_entropy(x["h"], w, x["labels"], tp_group=x["group"], ignore_index=IGNORE,
                                          loss_mask=x["hint"], accumulate_into_main_grad=True, token_chunk=4,
                                          vocab_chunk=8, impl=impl, weight_grad=weight_grad)
        ((loss * x["r"]).sum() * x["scale"]).backward()
    h_r, w_r = leaf(x["h"], torch.float32), leaf(w, torch.float32)
    loss_r = reference_linear_cross_entropy(h_r, w_r, x["labels"], tp_group=x["group"], ignore_index=IGNORE)
    ((loss_r * x["r"]).sum() * x["scale"]).backward()
    res = {"main_grad_dtype": str(w.main_grad.dtype),
           "err_vs_ref": (w.main_grad - prefill - w_r.grad).abs().max().item(),
           "scale": w_r.grad.abs().max().item(),
           "grad": None if w.grad is None else (tuple(w.grad.shape), str(w.grad.dtype), bool((w.grad == 0).all())),
           "grad_added_to_main_grad": getattr(w, "grad_added_to_main_grad", None),
           "paths": {k: backward_paths[k] - before.get(k, 0) for k in ("scaled", "recompute")}}
    if dtype != torch.float32:  # Megatron's unfused bf16 weight gradient, against the same reference
        ps = _init_tp(tp)
        h_m, w_m = leaf(x["h"]), leaf(w)
        loss_m = megatron_losses(h_m, w_m, x["labels"], tp)
        ((loss_m * (x["r"] * (x["labels"] != IGNORE))).sum() * x["scale"]).backward()
        res["megatron_err_vs_ref"] = (w_m.grad.float() - w_r.grad).abs().max().item()
        ps.destroy_model_parallel()
    return res


# ------------------------------------------------------------------ Triton under the interpreter


def unfused_linear_cross_entropy(hidden, weight, labels):
    """Megatron's unfused computation at TP = 1 in plain torch: logits in the input dtype (its output
    layer's GEMM), cross-entropy in fp32 on them (vocab_parallel_cross_entropy); autograd then runs
    the gradient GEMMs in the input dtype too. The bf16 yardstick where Megatron cannot run."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    loss = torch.nn.functional.cross_entropy(logits.float(), labels.reshape(-1), ignore_index=IGNORE,
                                             reduction="none")
    return loss.view(labels.shape)


def _triton_case(dtype, kind, token_chunk):
    """fused(impl='triton') vs fused(impl='torch'), vs the reference, and the unfused path's own
    error against the reference (megref_*), one process."""
    hidden, weight, labels, mask = make_inputs(13, 3, 24, 50, 2, dtype)
    r, scale, hint = objective_weights(kind, labels, mask, 2)
    valid = labels != IGNORE
    res = {}
    for impl in ("triton", "torch", "reference", "unfused"):
        if impl == "reference":
            h, w = leaf(hidden, torch.float32), leaf(weight, torch.float32)
            loss = reference_linear_cross_entropy(h, w, labels)
        elif impl == "unfused":
            h, w = leaf(hidden), leaf(weight)
            loss = unfused_linear_cross_entropy(h, w, labels)
        else:
            h, w = leaf(hidden), leaf(weight)
            loss = fused_linear_cross_entropy(h, w, labels, loss_mask=hint, token_chunk=token_chunk, impl=impl)
        ((loss * r).sum() * scale).backward()
        res[impl] = (loss[valid], h.grad, w.grad)
    errs = {}
    for prefix, got, ref in (("torch", "triton", "torch"), ("reference", "triton", "reference"),
                             ("megref", "unfused", "reference")):
        errs.update(_errs(prefix, res[got], res[ref], QUANTITIES))
    for name, t in zip(QUANTITIES, res["reference"]):
        errs[f"scale_{name}"] = t.abs().max().item()
        errs[f"scale_rms_{name}"] = t.square().mean().sqrt().item()
    return errs


def triton_tp_case():
    """Triton path at TP=2 (its own max/sum-exp combine) vs the reference, fp32; on each rank."""
    return run_case(impl="triton", with_megatron=False, kind="binary")


def triton_tp_more():
    """TP=2 on the fast path, each rank: recompute backward with sequence parallelism (fp32, vs the
    reference), and bf16 with Megatron's unfused bf16 error as the yardstick (megref_*), in both
    weight_grad modes."""
    return {"sp_mismatch": run_case(impl="triton", with_megatron=False, kind="mismatch", sequence_parallel=True),
            "sp_binary": run_case(impl="triton", with_megatron=False, kind="binary", sequence_parallel=True),
            "bf16": run_case(impl="triton", dtype=torch.bfloat16, kind="binary"),
            # weight_grad="backward": the one-read forward (each rank's own reference, combined over
            # TP) and the vocabulary pass with the objective's factor in its GEMMs
            "bf16_lean_sp": run_case(impl="triton", dtype=torch.bfloat16, kind="binary", sequence_parallel=True,
                                     weight_grad="backward"),
            "lean_sp_collectives": reads_and_collectives(sequence_parallel=True, dtype=torch.bfloat16, impl="triton",
                                                         weight_grad="backward")}


def triton_main_grad_and_tied():
    """main_grad accumulation (scaled and recompute paths, fp32 and bf16) and a tied embedding /
    output weight on the fast path; on each rank."""
    return {"main_grad_binary": main_grad_case(impl="triton"),
            "main_grad_mismatch": main_grad_case(impl="triton", kind="mismatch"),
            "main_grad_bf16": main_grad_case(impl="triton", dtype=torch.bfloat16),
            "tied": run_tied(impl="triton")}


def auto_case():
    """impl="auto" with the CPU counted as a fast-path device: the self-check runs (the interpreted
    kernel), passes, the log line names the implementation, and the call runs the fast walk."""
    import logging

    from megatron_burst.loss import choice, fast

    choice.FAST_DEVICE_TYPES = ("cuda", "cpu")
    records = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("megatron_burst.loss")
    handler, level = _Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    walks = {"n": 0}
    orig = fast.chunked_forward

    def counting(*a, **k):
        walks["n"] += 1
        return orig(*a, **k)

    fast.chunked_forward = counting
    try:
        hidden, weight, labels, mask = make_inputs(6, 2, 8, 20, 4, torch.float32)
        before = dict(backward_paths)
        h, w = leaf(hidden), leaf(weight)
        loss = fused_linear_cross_entropy(h, w, labels, loss_mask=mask, token_chunk=5)  # impl="auto"
        ((loss * mask).sum() / mask.sum()).backward()
        paths = {k: backward_paths[k] - before.get(k, 0) for k in ("scaled", "recompute")}
        h_r, w_r = leaf(hidden), leaf(weight)
        loss_r = reference_linear_cross_entropy(h_r, w_r, labels)
        ((loss_r * mask).sum() / mask.sum()).backward()
    finally:
        fast.chunked_forward = orig
        log.removeHandler(handler)
        log.setLevel(level)
    return {"logged": records, "walks": walks["n"], "paths": paths,
            "verdicts": {f"{dev} {dt}": v is True for (dev, dt), v in choice._VERDICTS.items()},
            "err": max((loss - loss_r).abs().max().item(), (h.grad - h_r.grad).abs().max().item(),
                       (w.grad - w_r.grad).abs().max().item())}


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
    # 64 tokens x 96 vocabulary rows in chunks of 16 tokens: bytes of the largest storage any op
    # produced (the reference path's shows that the probe sees N x V).
    largest = functools.partial(largest_tensor, probe_cls=LargestStorage)
    results["largest"] = {"reference": largest("reference"),
                          "binary": largest("fused", impl="triton"),
                          "mismatch": largest("fused", impl="triton", kind="mismatch"),
                          "bf16": largest("fused", impl="triton", dtype=torch.bfloat16),
                          "bf16_mismatch": largest("fused", impl="triton", dtype=torch.bfloat16, kind="mismatch")}
    try:
        results["auto"] = auto_case()
    except Exception as e:  # reported, so that the assertions on the other cases still run first
        results["auto"] = {"error": f"{type(e).__name__}: {e}"}
    import fused_loss_cases  # not __main__: the ranks must unpickle the function by its module name
    from harness import run_ranks, shutdown_pools
    try:
        results["tp2"] = run_ranks(2, fused_loss_cases.triton_tp_case, timeout=300)
        results["tp2_more"] = run_ranks(2, fused_loss_cases.triton_tp_more, timeout=300)
        results["extras"] = {str(tp): run_ranks(tp, fused_loss_cases.triton_main_grad_and_tied, timeout=300)
                             for tp in (1, 2)}
    finally:
        shutdown_pools(stop_forkserver=True)
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:] == ["triton"]:
        triton_main()
    else:
        sys.exit("usage: TRITON_INTERPRET=1 python tests/fused_loss_cases.py triton")



class CreatedTensors(TorchDispatchMode):
    """Records (dtype, numel) of every tensor an op returns in new storage: views of an argument and
    in-place results are no allocation and are skipped, and so are uint8 results (Triton's
    interpreter copies kernel arguments as bytes: no allocation of the op)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(t.dtype, t.numel()) for t in new_storage_tensors(args, kwargs, out)]
        return out


def new_storage_tensors(args, kwargs, out) -> list:
    """The tensors among an op's outputs ``out`` whose storage none of its arguments has (an
    allocation of the op: not a view, not an in-place result), uint8 ones left out (Triton's
    interpreter copies kernel arguments as bytes)."""
    flat = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    flat += [x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
    old = {a.untyped_storage().data_ptr() for a in flat}
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in old and t.dtype != torch.uint8]
