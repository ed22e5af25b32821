"""Calls into flash-linear-attention's chunk kernels for one rank's segments (the local work of
LASP-2 / LASP-1 and of the CP gated delta rule); the exchange between ranks stays ours.

Layouts. Our ops hold a rank's s local tokens as ``nseg`` segments of L consecutive global
positions (:mod:`megatron_burst.linear.checks`). fla's kernels take rows ``[N, T, H, d]`` (each row
an independent causal sequence). :func:`to_rows` makes every (segment, sample) a row, segment-major:
row ``i * b + j`` is segment i of sample j, so ``N = nseg * b`` and ``T = L``. fla is causal within
a row and includes the current token, exactly as our segments' zero-start outputs.

Which fla family computes which decay form (all take natural-log decays, <= 0; fla rescales them
to base 2 inside):

=========  ==========================  =====================================================
decay      our g                       fla call
=========  ==========================  =====================================================
none       None                        ``chunk_simple_gla(q, k, v)`` (no g, no g_gamma)
head       [h]                         ``chunk_simple_gla(..., g_gamma=g)``; when g needs a
                                       gradient, ``g=`` the same value per token [N, L, h]
                                       (fla returns no gradient for ``g_gamma``)
token      [s, b, h]                   ``chunk_simple_gla(..., g=[N, L, h])``
channel    [s, b, h, dk]               ``chunk_gla(..., g=[N, L, h, dk])``
gdn        g, beta [s, b, h]           ``chunk_gated_delta_rule(..., initial_state=S_in)``
=========  ==========================  =====================================================

Scale: fla's ``o = scale * q S`` with S including the current token -- ours; we always pass the
op's scale explicitly (fla's default is also dk ** -0.5, but an explicit value cannot drift).
Final states come back as [N, h, dk, dv] (fla's default ``state_v_first=False``); we use them as
the segments' zero-start states M, differentiable (fla's backward takes their gradient ``dht``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# fla's GLA kernel asserts an fp32 initial state; our exchanged states are fp32 anyway
STATE_DTYPE = torch.float32


def to_rows(t: torch.Tensor, nseg: int, sbhd: bool) -> torch.Tensor:
    """A rank-local tensor [s, b, h, ...] (``sbhd``) or [b, s, h, ...] -> fla rows [nseg * b, L, h, ...]
    (segment-major: row i * b + j is segment i of sample j; L = s / nseg)."""
    t = t.transpose(0, 1) if sbhd else t  # [b, s, ...]
    b, s = t.shape[0], t.shape[1]
    rest = tuple(t.shape[2:])
    return t.reshape((b, nseg, s // nseg) + rest).transpose(0, 1).reshape((nseg * b, s // nseg) + rest)


def rows_to_segments(o: torch.Tensor, nseg: int) -> torch.Tensor:
    """fla rows [nseg * b, L, h, d] -> our segment layout [nseg, b, h, L, d]."""
    n, L, h, d = o.shape
    return o.reshape(nseg, n // nseg, L, h, d).permute(0, 1, 3, 2, 4)


def rows_to_local(o: torch.Tensor, nseg: int, sbhd: bool) -> torch.Tensor:
    """fla rows [nseg * b, L, h, d] -> the rank-local layout [s, b, h, d] (``sbhd``) or [b, s, h, d]."""
    n, L, h, d = o.shape
    b = n // nseg
    o = o.reshape(nseg, b, L, h, d).transpose(0, 1).reshape(b, nseg * L, h, d)
    return o.transpose(0, 1) if sbhd else o


def decay_rows(g: Optional[torch.Tensor], form: str, nseg: int, b: int, L: int, sbhd: bool) -> Optional[torch.Tensor]:
    """Our log-decay in ``form`` -> what fla's ``g`` argument takes (fp32): None for "none" and for a
    per-head decay passed as ``g_gamma``; [N, L, h] for "token" (and "head" needing a gradient);
    [N, L, h, dk] for "channel". ``g`` [s, b, h(, dk)] is in sbhd order when ``sbhd`` (else [b, s, ...])."""
    if form == "none":
        return None
    if form == "head":
        if not g.requires_grad:
            return None
        # the same decay for every token: autograd sums fla's per-token dg back to [h]
        return g.float().view(1, 1, -1).expand(nseg * b, L, g.shape[0])
    return to_rows(g.float(), nseg, sbhd)


def lasp2_segments(fla_fn: Callable, form: str, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                   g: Optional[torch.Tensor], g_rows: Optional[torch.Tensor], scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, M) of every segment by fla: o [N, L, h, dv] (q's dtype) the output from a zero entering
    state, M [N, h, dk, dv] (fp32) the state the segment leaves. ``fla_fn``: ``chunk_simple_gla``
    for forms none / head / token, ``chunk_gla`` for "channel"; ``g`` our decay as given (used for
    the per-head ``g_gamma``), ``g_rows`` from :func:`decay_rows`."""
    if form == "channel":
        o, M = fla_fn(q_rows, k_rows, v_rows, g_rows, scale=scale, initial_state=None, output_final_state=True)
    elif form == "head" and g_rows is None:
        o, M = fla_fn(q_rows, k_rows, v_rows, g=None, g_gamma=g.float(), scale=scale, initial_state=None,
                      output_final_state=True)
    else:
        o, M = fla_fn(q_rows, k_rows, v_rows, g=g_rows, scale=scale, initial_state=None, output_final_state=True)
    if M is None:
        raise RuntimeError(f"{getattr(fla_fn, '__module__', '?')}.{getattr(fla_fn, '__name__', fla_fn)} returned no "
                           "final state with output_final_state=True: LASP needs each segment's state")
    return o, M.to(STATE_DTYPE)


def gdn_rows(fla_fn: Callable, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
             g_rows: torch.Tensor, beta_rows: torch.Tensor, scale: float,
             initial_state: Optional[torch.Tensor]) -> torch.Tensor:
    """Outputs [N, L, h, dv] of fla's ``chunk_gated_delta_rule`` on rows entering with
    ``initial_state`` [N, h, dk, dv] (fp32; None: zero). g fp32 log-decay, beta [N, L, h]."""
    init = None if initial_state is None else initial_state.to(STATE_DTYPE)
    o, _ = fla_fn(q_rows, k_rows, v_rows, g_rows.float(), beta_rows, scale=scale, initial_state=init,
                  output_final_state=False)
    return o
