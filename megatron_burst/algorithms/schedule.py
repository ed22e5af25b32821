"""The ring schedule every ring-style algorithm shares, on a flat ring or a double (node) ring.

A set of tensors (K,V in the forward; K,V or Q,dO,D,lse in the backward) travels around a ring:
at step t, the rank at ring position p holds the copy owned by position (p - t) mod size. The next
copy is posted before the current one is used, so transfers overlap compute (double buffering).

Optionally a gradient travels with it, one step behind: the gradient of the block owned by
position s is started at s+1 (step 1, after a warm-up compute round on the home block), accumulated
by every rank that sees the block, and after size-1 hops arrives back at s, where it is added to
s's own (step 0) contribution. Every block's gradient crosses as many links as its activations.

The double ring nests this schedule: the outer ring (across nodes) carries a block to the next node,
and visiting it there is a whole inner ring (inside the node). The outer transfer of the next block
is posted before the inner ring starts, so it hides behind the inner ring's compute and intra-node
transfers; the node's summed gradient for a block then travels the outer ring one step behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron_burst.topology import CPTopology, Ring

ACTIVATION_STREAM = 0
GRADIENT_STREAM = 1


@dataclass
class RingPlan:
    """Everything an algorithm needs besides tensors: the topology, ring shape and mask geometry."""

    topology: CPTopology
    ring: str  # "flat" | "double"
    layout: str
    stripe: int
    causal: bool
    scale: float
    kernel: Optional[str] = None

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size


Visit = Callable[[int, Sequence[torch.Tensor]], Optional[torch.Tensor]]


def ring_pass(ring: Optional[Ring], travel: Sequence[torch.Tensor], visit: Visit, phase: str,
              grad_like: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Circulate ``travel`` around ``ring`` (None = a single rank) calling ``visit(owner_pos, tensors)``.

    Without ``grad_like`` the visits' return values are ignored and None is returned. With it
    (a tensor giving the travelling gradient's shape and dtype), ``visit`` returns the gradient
    contribution for the owner's block (same shape as ``grad_like``); the contributions are summed
    around the ring and the total for this rank's own block is returned.
    """
    size, pos = (ring.size, ring.pos) if ring is not None else (1, 0)
    travel = list(travel)
    home_grad: Optional[torch.Tensor] = None
    sends = []
    for step in range(size):
        owner = (pos - step) % size
        # Post the gradient receive before the activation exchange: every rank then posts its
        # messages to a given neighbour in the order that neighbour sends them.
        incoming = None
        if grad_like is not None and step >= 2:
            incoming = ring.grad.recv([grad_like], phase, stream=GRADIENT_STREAM)
        pending = ring.act.send_to_next(travel, phase, stream=ACTIVATION_STREAM) if step < size - 1 else None
        contribution = visit(owner, travel)
        if grad_like is not None:
            if step == 0:
                home_grad = contribution
            else:
                if incoming is not None:
                    contribution = contribution + incoming.wait()[0]
                sends.append(ring.grad.send([contribution], phase, stream=GRADIENT_STREAM))
        if pending is not None:
            travel = pending.wait()
    if grad_like is not None and size > 1:
        home_grad = home_grad + ring.grad.recv([grad_like], phase, stream=GRADIENT_STREAM).wait()[0]
    for s in sends:
        s.wait()
    return home_grad


def cp_ring_pass(plan: RingPlan, travel: Sequence[torch.Tensor], visit: Visit, phase: str,
                 grad_like: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """:func:`ring_pass` over the CP group in ``plan.ring``'s shape; ``visit`` gets owner CP ranks."""
    topo = plan.topology
    if plan.ring == "flat" or topo.num_nodes == 1:
        return ring_pass(topo.flat, travel, visit, phase, grad_like)
    R = topo.ranks_per_node

    def visit_node(owner_node: int, tensors: Sequence[torch.Tensor]):
        return ring_pass(topo.inner, tensors, lambda owner_local, t: visit(owner_node * R + owner_local, t),
                         phase, grad_like)

    return ring_pass(topo.outer, travel, visit_node, phase, grad_like)
