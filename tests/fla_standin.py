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

Returns (o in q's dtype, final state [N, H, dk, dv] fp32 or None). ``install(monkeypatch, fault)``
puts the tree in ``sys.modules``; ``fault`` makes every function wrong in one way (the self-check
must catch it): "scale2" doubles the output, "raise" raises like a Triton launch with a wrong
index dtype, "exclusive" leaves the current token out of its own output, "no_state" returns no
final state. ``calls`` counts the calls of each function (tests that fla was or was not consulted).
"""
from __future__ import annotations

import sys
import types
from collections import Counter
from typing import Optional

import torch

FAULTS = (None, "scale2", "raise", "exclusive", "no_state")
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
    return o.to(q.dtype), final


def make_tree(fault: Optional[str] = None) -> dict[str, types.ModuleType]:
    """Module objects for fla, fla.ops, fla.ops.simple_gla, fla.ops.gla, fla.ops.gated_delta_rule."""
    if fault not in FAULTS:
        raise ValueError(f"unknown stand-in fault {fault!r}: one of {FAULTS}")

    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                         **kwargs):
        if g is not None and g_gamma is not None:
            raise ValueError("only one of g or g_gamma")
        decay = g if g is not None else (None if g_gamma is None else g_gamma.view(1, 1, -1).expand(q.shape[:3]))
        return _recurrence(q, k, v, decay, None, scale, initial_state, output_final_state, fault, "chunk_simple_gla")

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, **kwargs):
        assert q.shape == k.shape == g.shape, "q, k, g must have the same shape."
        if initial_state is not None:
            assert initial_state.dtype == torch.float32, "initial_state must be in float32."
        return _recurrence(q, k, v, g, None, scale, initial_state, output_final_state, fault, "chunk_gla")

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               **kwargs):
        return _recurrence(q, k, v, g, beta, scale, initial_state, output_final_state, fault,
                           "chunk_gated_delta_rule")

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
