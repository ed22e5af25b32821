"""CP topology: which CP ranks share a node, and the rings and communicators built from that.

The CP group's ranks are taken node-major: CP rank g sits on node g // R (R = ranks per node) at
local index g % R, which is how launchers number ranks and how Megatron lays out CP groups inside
a node when CP <= GPUs per node. From that:

* ``flat``: one ring over all CP ranks; a hop is "inter" when it crosses a node boundary.
* ``inner``: the ring of the R ranks of this node (intra-node links only).
* ``outer``: the ring of the ranks with this local index on every node (inter-node links only).

Activations and gradients get separate communicators on the inner and outer rings (a second
process group of the same ranks), so on NCCL the two rings proceed on separate streams; on gloo the
messages are additionally told apart by tag.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_burst.comm import RingComm
from megatron_burst.world import group_timeout

RING_SHAPES = ("flat", "double")


@dataclass
class Ring:
    """A ring of ranks with one communicator for activations and one for gradients."""

    act: RingComm
    grad: RingComm

    @property
    def size(self) -> int:
        return len(self.act.ring)

    @property
    def pos(self) -> int:
        return self.act.pos


@dataclass
class CPTopology:
    """This rank's view of the CP group split into nodes (see module docstring)."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    ranks_per_node: int
    flat: Optional[Ring]
    inner: Optional[Ring] = None
    outer: Optional[Ring] = None
    # rings over the CP group in another order (ring_in_order), by order: built once each
    _ordered_rings: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def ring_in_order(self, order: Sequence[int]) -> Ring:
        """The flat CP group as a ring whose position p is CP rank ``order[p]`` (a permutation of the
        CP ranks), one communicator for activations and gradients as :attr:`flat` has, links classed
        by :meth:`link_of`. Built on first use and kept (no collective: the communicator is the CP
        group's; the identity order is :attr:`flat` itself)."""
        order = tuple(int(r) for r in order)
        if sorted(order) != list(range(self.world_size)):
            raise ValueError(f"order={order} is not a permutation of the {self.world_size} CP ranks")
        if order == tuple(range(self.world_size)):
            return self.flat
        ring = self._ordered_rings.get(order)
        if ring is None:
            comm = RingComm(self.group, link_of=self.link_of, ranks=order)
            ring = self._ordered_rings[order] = Ring(comm, comm)
        return ring

    def node_of(self, cp_rank: int) -> int:
        return cp_rank // self.ranks_per_node

    def link_of(self, cp_rank: int) -> str:
        return "intra" if self.node_of(cp_rank) == self.node_of(self.rank) else "inter"

    @property
    def default_ring(self) -> str:
        return "double" if self.num_nodes > 1 else "flat"


def check_ranks_per_node(world_size: Optional[int], ranks_per_node: int) -> None:
    """Raise ValueError unless ``ranks_per_node`` is a positive int dividing the CP size
    (``world_size`` None: only the first check). The one place this is validated."""
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} must be a positive int (--cp-ranks-per-node)")
    if world_size is not None and world_size % ranks_per_node:
        raise ValueError(f"CP size {world_size} is not divisible by ranks_per_node={ranks_per_node}: set "
                         f"--cp-ranks-per-node to a divisor of the context-parallel size")


def single_node_topology(group: Optional[dist.ProcessGroup]) -> CPTopology:
    """Topology of a plain CP group: one node, a flat ring, no new communicators (no collective)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return CPTopology(None, 0, 1, 1, None)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ring = None
    if world > 1:
        comm = RingComm(group)
        ring = Ring(comm, comm)
    return CPTopology(group, rank, world, world, ring)


def build_cp_topology(cp_group: Optional[dist.ProcessGroup], ranks_per_node: int) -> CPTopology:
    """Split ``cp_group`` into nodes of ``ranks_per_node`` ranks and build the rings' communicators.

    Collective over the default (world) group: every rank of the job must call it, once, with the
    same ``ranks_per_node`` (creating process groups is a world-wide operation in torch.distributed).
    Raises ValueError before any collective if the CP size is not divisible by ``ranks_per_node``.
    """
    world = dist.get_world_size(cp_group)
    check_ranks_per_node(world, ranks_per_node)
    rank = dist.get_rank(cp_group)
    # Every rank learns every CP group (as global ranks), so all create the same groups in order.
    mine = [dist.get_global_rank(cp_group, r) if cp_group is not None else r for r in range(world)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, ranks_per_node))
    settings = {tuple(m) for m, _ in everyone}
    if len({len(m) for m in settings}) != 1 or len({r for _, r in everyone}) != 1:
        raise ValueError(f"build_cp_topology needs equal CP sizes and the same ranks_per_node on every rank; "
                         f"got CP groups {sorted(settings)} and ranks_per_node {sorted({r for _, r in everyone})}")
    R, nodes = ranks_per_node, world // ranks_per_node
    node, local = divmod(rank, R)
    inner_groups: dict[str, dist.ProcessGroup] = {}
    outer_groups: dict[str, dist.ProcessGroup] = {}
    for ranks in sorted(settings):
        for n in range(nodes):
            members = list(ranks[n * R:(n + 1) * R])
            for purpose in ("act", "grad"):
                g = dist.new_group(members, timeout=group_timeout())
                if tuple(ranks) == tuple(mine) and n == node:
                    inner_groups[purpose] = g
        for l in range(R):
            members = list(ranks[l::R])
            for purpose in ("act", "grad"):
                g = dist.new_group(members, timeout=group_timeout())
                if tuple(ranks) == tuple(mine) and l == local:
                    outer_groups[purpose] = g
    topo = CPTopology(cp_group, rank, world, R, None)
    if world > 1:
        flat = RingComm(cp_group, link_of=topo.link_of)
        topo.flat = Ring(flat, flat)
    if R > 1:
        topo.inner = Ring(*(RingComm(inner_groups[p], link_of=lambda peer: "intra") for p in ("act", "grad")))
    if nodes > 1:
        topo.outer = Ring(*(RingComm(outer_groups[p], link_of=lambda peer: "inter") for p in ("act", "grad")))
    return topo


# The node topologies built so far, by the global ranks of their CP group: built once, collectively,
# where the process groups are made (megatron_burst.megatron.groups.setup_cp_topology), and looked
# up -- never built -- by the attention layers, so a layer's constructor never runs a collective.
_REGISTERED: dict[tuple[int, ...], CPTopology] = {}


def _group_key(cp_group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    if cp_group is None:
        return tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
    return tuple(dist.get_process_group_ranks(cp_group))


def register_cp_topology(topology: CPTopology) -> CPTopology:
    """Make ``topology`` the one :func:`registered_cp_topology` returns for its CP group."""
    _REGISTERED[_group_key(topology.group)] = topology
    return topology


def registered_cp_topology(cp_group: Optional[dist.ProcessGroup]) -> Optional[CPTopology]:
    """The topology registered for ``cp_group`` (by its ranks), or None. No collective."""
    return _REGISTERED.get(_group_key(cp_group))


def clear_registered_cp_topologies() -> None:
    """Forget every registered topology (their process groups stay; for tests and re-initialization)."""
    _REGISTERED.clear()
    _REGISTERED_USP.clear()


# ------------------------------------------------------------------------- 2-D (Ulysses x ring)


@dataclass
class USPTopology:
    """The CP group as a 2-D grid for USP: ``ulysses_size`` (U) consecutive CP ranks form a Ulysses
    group (all-to-all of heads, usually inside a node); the ranks with the same index in every
    Ulysses group form a ring over the W / U groups (``ring``: flat, or double across nodes).

    CP rank g sits in Ulysses group g // U at index g % U; ``ring.rank`` is g // U.
    """

    cp_group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    ulysses_size: int
    ulysses_group: Optional[dist.ProcessGroup]
    ring: CPTopology
    ranks_per_node: int  # of the CP group (the ring's nodes hold ranks_per_node / U groups)

    def ulysses_link(self, peer: int) -> str:
        """Link class to ``peer`` (its index in this rank's Ulysses group): CP ranks are node-major."""
        first = self.rank - self.rank % self.ulysses_size
        same = (first + peer) // self.ranks_per_node == self.rank // self.ranks_per_node
        return "intra" if same else "inter"

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node


def check_ulysses_size(world_size: int, ulysses_size: int, ranks_per_node: Optional[int] = None) -> None:
    """Raise ValueError unless U divides the CP size (and nests with the node size, when given)."""
    if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size < 1:
        raise ValueError(f"ulysses_size={ulysses_size!r} must be a positive int")
    if world_size % ulysses_size:
        raise ValueError(f"ulysses_size={ulysses_size} does not divide the CP size {world_size}: choose a divisor "
                         f"of {world_size} (Megatron: --hierarchical-context-parallel-sizes U {world_size}/U)")
    if ranks_per_node is not None and ranks_per_node % ulysses_size and ulysses_size % ranks_per_node:
        raise ValueError(f"ulysses_size={ulysses_size} and ranks_per_node={ranks_per_node} do not nest: a Ulysses "
                         "group must fit in a node (U divides ranks_per_node) or span whole nodes")


def build_usp_topology(cp_group: Optional[dist.ProcessGroup], ulysses_size: int,
                       ranks_per_node: Optional[int] = None) -> USPTopology:
    """Build (collectively, over the world group) the Ulysses groups and the rings across them.

    Every rank of the job calls it once with the same arguments; the result is registered
    (:func:`registered_usp_topology`) so layers look it up without a collective. Raises
    ValueError before any collective when U does not divide the CP size.
    """
    world = dist.get_world_size(cp_group)
    check_ulysses_size(world, ulysses_size, ranks_per_node)
    if ranks_per_node is not None:
        check_ranks_per_node(world, ranks_per_node)
    U = ulysses_size
    rank = dist.get_rank(cp_group)
    mine = [dist.get_global_rank(cp_group, r) if cp_group is not None else r for r in range(world)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, U, ranks_per_node))
    if len({(len(m), u, r) for m, u, r in everyone}) != 1:
        raise ValueError(f"build_usp_topology needs equal CP sizes, ulysses_size and ranks_per_node on every "
                         f"rank; got {sorted({(len(m), u, r) for m, u, r in everyone})}")
    ulysses_group = ring_group = None
    for ranks in sorted({tuple(m) for m, _, _ in everyone}):
        for g in range(world // U):
            pg = dist.new_group(list(ranks[g * U:(g + 1) * U]), timeout=group_timeout())
            if ranks == tuple(mine) and g == rank // U:
                ulysses_group = pg
        for j in range(U):
            pg = dist.new_group(list(ranks[j::U]), timeout=group_timeout())
            if ranks == tuple(mine) and j == rank % U:
                ring_group = pg
    R = ranks_per_node or world
    if U == world:
        ring = CPTopology(None, 0, 1, 1, None)
    elif ranks_per_node is None or R >= world:
        ring = single_node_topology(ring_group)
    else:
        ring = build_cp_topology(ring_group, max(1, R // U))
    topo = USPTopology(cp_group, rank, world, U, ulysses_group, ring, R)
    _REGISTERED_USP[(_group_key(cp_group), U)] = topo
    return topo


_REGISTERED_USP: dict[tuple, USPTopology] = {}


def registered_usp_topology(cp_group: Optional[dist.ProcessGroup], ulysses_size: int) -> Optional[USPTopology]:
    """The USP topology built for ``cp_group`` with ``ulysses_size``, or None. No collective."""
    return _REGISTERED_USP.get((_group_key(cp_group), ulysses_size))
