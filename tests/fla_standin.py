"""A stand-in for flash-linear-attention's ``fla.ops`` on CPU: the same call signatures, computed
token by token in plain torch (fp32, autograd), from the recurrences alone (fla's Triton kernels do
not import on a machine without a GPU driver, so CPU tests never import real fla).

Each function takes rows ``[N, T, H, d]`` and natural-log decays, as fla 0.6 documents them:

* ``fla.ops.simple_gla.chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
  output_final_state=False)``: S_t = exp(g_t) S_{t-1} + k_t^T v_t (g [N, T, H] or g_gamma [H] or no
  decay), o_t = scale * q_t S_t;
* ``fla.ops.gla.chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False)``: the
  same with a decay per key channel (g [N, T, H, dk]);
* ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
  output_final_state=False)``: S <- exp(g_t) S, u_t = beta_t (v_t - S^T k_t), S <- S + k_t u_t^T,
  o_t = scale * S^T q_t.

Returns (o in q's dtype, final state [N, H, dk, dv] fp32 or None).

Varlen, as fla 0.6 documents it: ``cu_seqlens`` (int64 [n + 1], on q's device, 0 = c_0 < ... <
c_n = T) with inputs of batch 1 makes [1, T, ...] n independent sequences [c_i, c_{i+1});
``initial_state`` is then [n, H, dk, dv] (sequence i enters with row i) and the final states are
[n, H, dk, dv]; a batch other than 1, or a number of initial states other than n, is a ValueError
as in fla. ``cu_seqlens_cpu``, when given, must hold the same boundaries (fla sizes its launch grid
from it: a mismatch would silently mis-index there, so the stand-in refuses it). Each sequence runs
the same token loop alone.

``install(monkeypatch, fault)``
puts the tree in ``sys.modules``; ``fault`` makes every function wrong in one way (the self-check
must catch it): "scale2" doubles the output, "raise" raises like a Triton launch with a wrong
index dtype, "exclusive" leaves the current token out of its own output, "no_state" returns no
final state, "varlen_carry" (varlen only) lets each sequence after the first enter with the state
the one before it left instead of its initial state (a varlen mode that does not reset),
"state_tail_no_grad" returns final states whose value columns past the first half take no
gradient (a backward that drops dht beyond its first value tile: for the delta rule's wide call,
the identity columns that carry the maps A). ``calls`` counts the calls of each function (tests that fla was or was not consulted).
"""
from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter
from typing import Optional

import torch

FAULTS = (None, "scale2", "raise", "exclusive", "no_state", "varlen_carry", "state_tail_no_grad")
calls: Counter = Counter()


def _recurrence(q, k, v, decay, beta, scale, initial_state, output_final_state, fault, name):
    """The shared token loop. q, k [N, T, H, dk], v [N, T, H, dv]; decay None, [N, T, H] (scalar
    per token) or [N, T, H, dk] (per key channel); beta None (linear attention) or [N, T, H] (delta rule)."""
    calls[name] += 1
    if fault == "raise":
        raise RuntimeError("expected int32 for argument 'cu_seqlens' but got int64 (stand-in fault)")
    N, T, H, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    qf, kf, vf = q.float(), k.float(), v.float()
    S = torch.zeros(N, H, dk, dv, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        S = S + initial_state.float()
    outs = []
    for t in range(T):
        if decay is not None:
            d = decay[:, t].float()  # [N, H] or [N, H, dk]
            S = torch.exp(d)[..., None, None] * S if d.dim() == 2 else torch.exp(d)[..., None] * S
        kt, vt = kf[:, t], vf[:, t]  # [N, H, dk], [N, H, dv]
        before = S
        if beta is None:
            S = S + kt[..., :, None] * vt[..., None, :]
        else:
            u = beta[:, t].float()[..., None] * (vt - (kt[..., None, :] @ S)[..., 0, :])
            S = S + kt[..., :, None] * u[..., None, :]
        seen = before if fault == "exclusive" else S
        outs.append(scale * (qf[:, t, :, None, :] @ seen)[..., 0, :])
    o = torch.stack(outs, dim=1)  # [N, T, H, dv]
    if fault == "scale2":
        o = 2 * o
    final = S if (output_final_state and fault != "no_state") else None
    if final is not None and fault == "state_tail_no_grad":  # the value columns past the first half
        half = final.shape[-1] // 2
        final = torch.cat([final[..., :half], final[..., half:].detach()], dim=-1)
    return o.to(q.dtype), final


def _checked_cuts(q: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_cpu, initial_state) -> list[int]:
    """fla's varlen preconditions (and ours on the boundaries); the boundaries as ints."""
    if q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    if cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be a 1-D LongTensor on {q.device}, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}")
    cuts = [int(c) for c in cu_seqlens.tolist()]
    if cuts[0] != 0 or cuts[-1] != q.shape[1] or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"cu_seqlens {cuts} must rise strictly from 0 to T = {q.shape[1]}")
    if cu_seqlens_cpu is not None and [int(c) for c in cu_seqlens_cpu.tolist()] != cuts:
        raise ValueError(f"cu_seqlens_cpu {cu_seqlens_cpu.tolist()} differs from cu_seqlens {cuts}")
    if initial_state is not None and initial_state.shape[0] != len(cuts) - 1:
        raise ValueError(f"The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {len(cuts) - 1} rather than {initial_state.shape[0]}.")
    return cuts


def _varlen(q, k, v, decay, beta, scale, initial_state, output_final_state, fault, name, cu_seqlens,
            cu_seqlens_cpu):
    """The token loop over each varlen sequence alone (fla's cu_seqlens semantics, see the module
    docstring); without cu_seqlens, the plain batched loop."""
    if cu_seqlens is None:
        return _recurrence(q, k, v, decay, beta, scale, initial_state, output_final_state, fault, name)
    cuts = _checked_cuts(q, cu_seqlens, cu_seqlens_cpu, initial_state)
    outs, finals = [], []
    for i, (a, c) in enumerate(zip(cuts, cuts[1:])):
        piece = lambda t: None if t is None else t[:, a:c]  # noqa: E731
        h0 = None if initial_state is None else initial_state[i:i + 1]
        if fault == "varlen_carry" and finals:
            h0 = finals[-1]
        o, final = _recurrence(piece(q), piece(k), piece(v), piece(decay), piece(beta), scale, h0,
                               output_final_state or fault == "varlen_carry", fault, name)
        outs.append(o)
        finals.append(final)
    final = torch.cat(finals, dim=0) if output_final_state and finals[0] is not None else None  # [n, H, dk, dv]
    return torch.cat(outs, dim=1), final


def make_tree(fault: Optional[str] = None) -> dict[str, types.ModuleType]:
    """Module objects for fla, fla.ops, fla.ops.simple_gla, fla.ops.gla, fla.ops.gated_delta_rule."""
    if fault not in FAULTS:
        raise ValueError(f"unknown stand-in fault {fault!r}: one of {FAULTS}")

    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                         state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        if g is not None and g_gamma is not None:
            raise ValueError("only one of g or g_gamma")
        assert not state_v_first, "the stand-in keeps fla's default [K, V] states"
        decay = g if g is not None else (None if g_gamma is None else g_gamma.view(1, 1, -1).expand(q.shape[:3]))
        return _varlen(q, k, v, decay, None, scale, initial_state, output_final_state, fault, "chunk_simple_gla",
                       cu_seqlens, cu_seqlens_cpu)

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                  cu_seqlens=None, cu_seqlens_cpu=None):
        assert q.shape == k.shape == g.shape, "q, k, g must have the same shape."
        assert not state_v_first, "the stand-in keeps fla's default [K, V] states"
        if initial_state is not None:
            assert initial_state.dtype == torch.float32, "initial_state must be in float32."
        return _varlen(q, k, v, g, None, scale, initial_state, output_final_state, fault, "chunk_gla", cu_seqlens,
                       cu_seqlens_cpu)

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        assert not state_v_first, "the stand-in keeps fla's default [K, V] states"
        return _varlen(q, k, v, g, beta, scale, initial_state, output_final_state, fault, "chunk_gated_delta_rule",
                       cu_seqlens, cu_seqlens_cpu)

    tree = {name: types.ModuleType(name) for name in
            ("fla", "fla.ops", "fla.ops.simple_gla", "fla.ops.gla", "fla.ops.gated_delta_rule")}
    for name, fn in (("fla.ops.simple_gla", chunk_simple_gla), ("fla.ops.gla", chunk_gla),
                     ("fla.ops.gated_delta_rule", chunk_gated_delta_rule)):
        fn.__module__ = name
        setattr(tree[name], fn.__name__, fn)
    tree["fla"].__path__ = []  # packages, so "from fla.ops.gla import chunk_gla" resolves through sys.modules
    tree["fla.ops"].__path__ = []
    tree["fla"].ops = tree["fla.ops"]
    for leaf in ("simple_gla", "gla", "gated_delta_rule"):
        setattr(tree["fla.ops"], leaf, tree[f"fla.ops.{leaf}"])
    return tree


def install(monkeypatch, fault: Optional[str] = None) -> None:
    """Put the stand-in tree into sys.modules for one test (monkeypatch restores the real state)."""
    for name, module in make_tree(fault).items():
        monkeypatch.setitem(sys.modules, name, module)
    calls.clear()


def uninstall(monkeypatch) -> None:
    """Make ``import fla`` fail as on a machine without flash-linear-attention (for one test)."""
    for name in ("fla.ops.gated_delta_rule", "fla.ops.gla", "fla.ops.simple_gla", "fla.ops"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "fla", None)


@contextlib.contextmanager
def installed(fault: Optional[str] = None):
    """The stand-in in sys.modules and the CUDA decision path on CPU ("cpu" in
    FUSED_DEVICE_TYPES), with fresh kernel decisions, for a block of code run outside pytest (a
    rank process of tests/harness.run_ranks); everything is restored on exit."""
    from megatron_burst.kernels import choice as attention_choice
    from megatron_burst.linear import kernel_choice

    saved = {name: sys.modules.get(name, _ABSENT) for name in make_tree()}
    fused = attention_choice.FUSED_DEVICE_TYPES
    try:
        sys.modules.update(make_tree(fault))
        attention_choice.FUSED_DEVICE_TYPES = ("cuda", "cpu")
        kernel_choice.reset()
        calls.clear()
        yield
    finally:
        attention_choice.FUSED_DEVICE_TYPES = fused
        for name, module in saved.items():
            if module is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        kernel_choice.reset()


_ABSENT = object()
