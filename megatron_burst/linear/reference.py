"""Linear attention, token by token: the obviously-correct reference the chunked op is tested against.

The recurrence (one head; q_t, k_t [dk], v_t [dv], state S [dk, dv], log-decay g_t [dk], g <= 0):

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,    o_t = scale * q_t S_t,    S_0 = 0

over the whole sequence in global order (the current token is included). Without a decay
(``g=None``) it is plain causal linear attention; ``causal=False`` is o_t = scale * q_t sum_j k_j^T v_j
over every token (no decay allowed). Everything in fp32 (fp64 for fp64 inputs); differentiable by
autograd, so it also gives the reference gradients of q, k, v and g.
"""
from __future__ import annotations

from typing import Optional

import torch


def expand_log_decay(g: Optional[torch.Tensor], b: int, h: int, n: int, dk: int) -> Optional[torch.Tensor]:
    """A log-decay in any accepted form -> [b, h, n, dk'] (dk' = dk for per-channel, 1 otherwise).

    Forms: None; [h] (per head, constant over tokens); [n, b, h] (per token and head); [n, b, h, dk]
    (per key channel). Token-major forms are given in Megatron's [s, b, ...] order.
    """
    if g is None:
        return None
    if g.dim() == 1:
        return g.view(1, h, 1, 1).expand(b, h, n, 1)
    if g.dim() == 3:
        return g.permute(1, 2, 0).unsqueeze(-1)  # [n, b, h] -> [b, h, n, 1]
    return g.permute(1, 2, 0, 3)  # [n, b, h, dk] -> [b, h, n, dk]


def naive_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None,
                           causal: bool = True, scale: Optional[float] = None) -> torch.Tensor:
    """The reference. q, k [s, b, h, dk], v [s, b, h, dv] for the WHOLE sequence; g as
    :func:`expand_log_decay`. Returns o [s, b, h, dv] in q's dtype."""
    s, b, h, dk = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = dk ** -0.5 if scale is None else scale
    qh, kh, vh = (t.permute(1, 2, 0, 3).to(acc) for t in (q, k, v))  # [b, h, s, d]
    if not causal:
        if g is not None:
            raise ValueError("a decay g needs causal=True: bidirectional linear attention has no order to decay along")
        state = torch.einsum("bhsk,bhsv->bhkv", kh, vh)
        return (scale * qh @ state).permute(2, 0, 1, 3).to(q.dtype)
    decay = expand_log_decay(g, b, h, s, dk)
    state = torch.zeros(b, h, dk, vh.shape[-1], dtype=acc, device=q.device)
    outs = []
    for t in range(s):
        if decay is not None:
            state = torch.exp(decay[:, :, t].to(acc))[..., None] * state
        state = state + kh[:, :, t, :, None] * vh[:, :, t, None, :]
        outs.append(scale * (qh[:, :, t, None, :] @ state)[:, :, 0])
    return torch.stack(outs, dim=0).to(q.dtype)  # [s, b, h, dv]


def naive_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """The gated delta rule, token by token (flash-linear-attention's recurrence). q, k [s, b, h, dk],
    v [s, b, h, dv], g (log-decay <= 0) and beta [s, b, h], for the WHOLE sequence; S [dk, dv], S_0 = 0
    (or ``initial_state`` [b, h, dk, dv]):

        S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = scale * S^T q_t

    Returns o [s, b, h, dv] in q's dtype; fp32 state (fp64 for fp64 inputs)."""
    s, b, h, dk = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = dk ** -0.5 if scale is None else scale
    qh, kh, vh = (t.permute(1, 2, 0, 3).to(acc) for t in (q, k, v))  # [b, h, s, d]
    gh, bh = (t.permute(1, 2, 0).to(acc) for t in (g, beta))  # [b, h, s]
    state = torch.zeros(b, h, dk, vh.shape[-1], dtype=acc, device=q.device)
    if initial_state is not None:
        state = state + initial_state.to(acc)
    outs = []
    for t in range(s):
        state = torch.exp(gh[:, :, t])[..., None, None] * state
        kt = kh[:, :, t]
        u = bh[:, :, t, None] * (vh[:, :, t] - (kt[..., None, :] @ state)[..., 0, :])
        state = state + kt[..., :, None] * u[..., None, :]
        outs.append(scale * (qh[:, :, t, None, :] @ state)[:, :, 0])
    return torch.stack(outs, dim=0).to(q.dtype)  # [s, b, h, dv]
