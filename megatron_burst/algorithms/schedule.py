"""The ring schedule every ring-style algorithm shares.

A set of tensors (K,V in the forward; K,V or Q,dO,D,lse in the backward) travels around the ring:
at step t, rank r holds the copy that rank (r - t) mod W owns. The next copy is posted before the
current one is used, so transfers overlap compute (double buffering).

Optionally a gradient travels with it, one step behind: the gradient of the block owned by rank s
is started at rank s+1 (step 1), accumulated by every rank that sees the block, and after W-1 hops
arrives back at s, where it is added to s's own (step 0) contribution. Every block's gradient thus
crosses W-1 links, the same count as its activations. Gradient messages use their own stream so
they never match activation messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron_burst.comm import RingComm

ACTIVATION_STREAM = 0
GRADIENT_STREAM = 1


@dataclass
class RingPlan:
    """Everything an algorithm needs besides tensors: the ring and the mask geometry."""

    comm: Optional[RingComm]  # None for a single rank
    rank: int
    world_size: int
    layout: str
    stripe: int
    causal: bool
    scale: float
    kernel: Optional[str] = None


Visit = Callable[[int, Sequence[torch.Tensor]], Optional[torch.Tensor]]


def ring_pass(plan: RingPlan, travel: Sequence[torch.Tensor], visit: Visit, phase: str,
              grad_like: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Circulate ``travel`` around the ring and call ``visit(owner, tensors)`` on each copy.

    Without ``grad_like`` the visits' return values are ignored and None is returned. With it
    (a tensor giving the travelling gradient's shape and dtype), ``visit`` returns the gradient
    contribution for the owner's block (same shape as ``grad_like``); the contributions are summed
    around the ring and the total for this rank's own block is returned.
    """
    W, r = plan.world_size, plan.rank
    travel = list(travel)
    home_grad: Optional[torch.Tensor] = None
    sends = []
    for step in range(W):
        owner = (r - step) % W
        # Post the gradient receive before the activation exchange: every rank then posts its
        # messages to a given neighbour in the order that neighbour sends them.
        incoming = None
        if grad_like is not None and step >= 2:
            incoming = plan.comm.recv([grad_like], phase, stream=GRADIENT_STREAM)
        pending = plan.comm.send_to_next(travel, phase, stream=ACTIVATION_STREAM) if step < W - 1 else None
        contribution = visit(owner, travel)
        if grad_like is not None:
            if step == 0:
                home_grad = contribution
            else:
                if incoming is not None:
                    contribution = contribution + incoming.wait()[0]
                sends.append(plan.comm.send([contribution], phase, stream=GRADIENT_STREAM))
        if pending is not None:
            travel = pending.wait()
    if grad_like is not None and W > 1:
        home_grad = home_grad + plan.comm.recv([grad_like], phase, stream=GRADIENT_STREAM).wait()[0]
    for s in sends:
        s.wait()
    return home_grad
