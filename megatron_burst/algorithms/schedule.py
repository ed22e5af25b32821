"""The ring schedule every ring-style algorithm shares, on a flat ring or a double (node) ring.

A set of tensors (K,V in the forward; K,V or Q,dO,D,lse in the backward) travels around a ring:
at step t, the rank at ring position p holds the copy owned by position (p - t) mod size. The next
copy is posted before the current one is used, so transfers overlap compute (double buffering).

Optionally a gradient travels with it, one step behind: the gradient of the block owned by
position s is started at s+1 (step 1, after a warm-up compute round on the home block), accumulated
by every rank that sees the block, and after size-1 hops arrives back at s, where it is added to
s's own (step 0) contribution. Every block's gradient crosses as many links as its activations.

NCCL safety. Every step posts ONE batch per communicator in which each rank sends to its next and
receives from its previous neighbour: the activations for the next step and the gradient finished
in the previous step. All ranks post the same sequence of batches with the same shapes, so the
k-th batch of a rank always meets the k-th batch of its neighbours; no send waits for a receive
queued behind another send. (Posting a gradient send alone and its receive in a later batch -- what
gloo tolerates because it buffers -- deadlocks under NCCL once messages exceed its buffers.)
``tests/test_nccl_schedule.py`` replays every algorithm's recorded schedule under NCCL's rules.

The double ring nests this schedule: the outer ring (across nodes) carries a block to the next node,
and visiting it there is a whole inner ring (inside the node). The outer transfer of the next block
is posted before the inner ring starts, so it hides behind the inner ring's compute and intra-node
transfers; the node's summed gradient for a block then travels the outer ring one step behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron_burst.comm import PendingExchange
from megatron_burst.documents import Documents, visible_blocks
from megatron_burst.layout import BlockMask
from megatron_burst.topology import CPTopology, Ring

# gloo tags of the two rings when they share no batch (separate communicators); NCCL ignores tags
ACTIVATION_STREAM = 0
GRADIENT_STREAM = 1


@dataclass
class CPConfig:
    """Everything a CP algorithm needs besides tensors: the topology, ring shape and mask geometry."""

    topology: CPTopology
    ring: str  # "flat" | "double"
    layout: str
    stripe: int
    causal: bool
    scale: float
    kernel: Optional[str] = None
    documents: Optional[Documents] = None  # packed documents (cu_seqlens); None: one sequence
    # >1 under USP/Ulysses: each ring member holds the sequences of ``ulysses_size`` consecutive CP
    # ranks (after the all-to-all), so a block of the ring is a U x U grid of CP-rank blocks
    ulysses_size: int = 1

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def blocks(self, q_member: int, kv_member: int, member_len: int, q_rows: Optional[int] = None
               ) -> list[tuple[slice, BlockMask]]:
        """(batch slice, visible rectangle) pairs of a block pair; [] means skip it (no kernel call).

        The pair is (queries of ring member ``q_member``) x (keys of ``kv_member``), each block
        ``member_len`` tokens. Without Ulysses (``ulysses_size`` U = 1) a member is a CP rank; with
        it, a member's block is U CP-rank shards of member_len / U tokens in CP-rank order (after
        the all-to-all) and the pair is the U x U grid of shard pairs, each shifted into place.
        Document masks (``documents``) apply the same way per shard pair.
        """
        U = self.ulysses_size
        if U == 1:
            return visible_blocks(self.documents, self.layout, q_member, kv_member, self.world_size, member_len,
                                  self.causal, self.stripe, q_rows)
        if q_rows is not None:
            raise ValueError("selective row recompute (q_rows) is not available under Ulysses/USP")
        n, cp_world = member_len // U, self.world_size * U
        out = []
        for a in range(U):
            for b in range(U):
                for bs, m in visible_blocks(self.documents, self.layout, q_member * U + a, kv_member * U + b,
                                            cp_world, n, self.causal, self.stripe):
                    out.append((bs, m.shifted(a * n, b * n)))
        return out


Visit = Callable[[int, Sequence[torch.Tensor]], Optional[torch.Tensor]]


class _StepExchange:
    """One step's posted transfers: activations for the next step and/or one gradient block."""

    def __init__(self, ring: Ring, activations: Sequence[torch.Tensor], gradient: Optional[torch.Tensor],
                 phase: str, label: str) -> None:
        act_recv = [torch.empty_like(t) for t in activations]
        grad_send = [] if gradient is None else [gradient]
        grad_recv = [torch.empty_like(t) for t in grad_send]
        self._n_act = len(act_recv)
        if ring.act is ring.grad:  # one communicator: one batch for both
            both = ring.act.exchange(list(activations) + grad_send, act_recv + grad_recv, phase, label=label)
            self._act: PendingExchange = both
            self._grad: PendingExchange = both
        else:
            self._act = ring.act.exchange(activations, act_recv, phase, stream=ACTIVATION_STREAM,
                                          label=label + " act")
            self._grad = ring.grad.exchange(grad_send, grad_recv, phase, stream=GRADIENT_STREAM,
                                            label=label + " grad")

    def activations(self) -> list[torch.Tensor]:
        return self._act.wait()[:self._n_act]

    def gradient(self) -> torch.Tensor:
        return self._grad.wait()[-1]

    def wait(self) -> None:
        self._act.wait()
        self._grad.wait()


def ring_pass(ring: Optional[Ring], travel: Sequence[torch.Tensor], visit: Visit, phase: str,
              grad_like: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Circulate ``travel`` around ``ring`` (None = a single rank) calling ``visit(owner_pos, tensors)``.

    Without ``grad_like`` the visits' return values are ignored and None is returned. With it
    (a tensor giving the travelling gradient's shape and dtype), ``visit`` returns a fresh tensor,
    the gradient contribution for the owner's block (same shape as ``grad_like``); the
    contributions are summed around the ring and the total for this rank's own block is returned.
    """
    size, pos = (ring.size, ring.pos) if ring is not None else (1, 0)
    travel = list(travel)
    home_grad: Optional[torch.Tensor] = None
    finished: Optional[torch.Tensor] = None  # the gradient accumulated last step, to pass on now
    for step in range(size):
        owner = (pos - step) % size
        outgoing = travel if step < size - 1 else []
        posted = None
        if outgoing or finished is not None:
            posted = _StepExchange(ring, outgoing, finished, phase, f"{phase} step {step}")
        contribution = visit(owner, travel)
        if grad_like is not None:
            if step == 0:
                home_grad = contribution
            else:
                if finished is not None:  # the previous rank's sum for this owner's block
                    contribution.add_(posted.gradient())
                finished = contribution
        if outgoing:
            travel = posted.activations()
        elif posted is not None:
            posted.wait()
    if grad_like is not None and size > 1:
        home_grad.add_(_StepExchange(ring, [], finished, phase, f"{phase} gradient home").gradient())
    return home_grad


def cp_ring_pass(cfg: CPConfig, travel: Sequence[torch.Tensor], visit: Visit, phase: str,
                 grad_like: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """:func:`ring_pass` over the CP group in ``cfg.ring``'s shape; ``visit`` gets owner CP ranks."""
    topo = cfg.topology
    if cfg.ring == "flat" or topo.num_nodes == 1:
        return ring_pass(topo.flat, travel, visit, phase, grad_like)
    R = topo.ranks_per_node

    def visit_node(owner_node: int, tensors: Sequence[torch.Tensor]):
        return ring_pass(topo.inner, tensors, lambda owner_local, t: visit(owner_node * R + owner_local, t),
                         phase, grad_like)

    return ring_pass(topo.outer, travel, visit_node, phase, grad_like)
