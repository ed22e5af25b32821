"""The process groups megatron-burst's attention runs over: from Megatron where Megatron makes them,
built once where the process groups are made where it does not.

From Megatron (``pg_collection``, which Megatron's TransformerLayer hands every attention module):

* ``pg_collection.cp`` -- the context-parallel group (else ``parallel_state``'s);
* ``pg_collection.hcp`` -- the hierarchical CP groups ``initialize_model_parallel`` makes for
  ``--hierarchical-context-parallel-sizes A P``: [the A consecutive CP ranks (all-to-all), the P
  ranks at stride A (ring)]. USP (``a2a+p2p``) runs on them as they are when its ring stays inside
  one node (:func:`usp_topology_from_pg_collection`: no new group, no collective, no registry).
  :func:`make_hierarchical_cp_groups` makes the same groups for :mod:`megatron_burst.train`, which
  puts them in its own ``pg_collection``.

Built here, because Megatron has no such groups (:func:`setup_cp_topology`, registered in
:mod:`megatron_burst.topology` by the CP group's ranks and looked up by the layers):

* the double ring's intra- and inter-node groups (a CP group spanning nodes, ``--cp-ring``);
* USP's groups when its ring spans nodes (a double ring across the all-to-all groups), when
  ``pg_collection`` has no ``hcp`` of that shape, and for ``--cp-algo auto`` (the cost model looks
  its candidate USP sizes up in the registry).

Creating process groups is a collective over the whole job, so :func:`setup_cp_topology` runs on
every rank once, after ``initialize_model_parallel`` and before building the model
(megatron_burst.train does, and so does the Megatron-LM glue in
:mod:`megatron_burst.megatron.megatron_lm`): a layer constructor never communicates, so a pipeline
stage without our attention cannot leave the others waiting.

Environment: :func:`default_cp_ranks_per_node` reads the launcher's ``LOCAL_WORLD_SIZE`` (torchrun
sets it) when neither ``--cp-ranks-per-node`` nor the hierarchical sizes say how many CP ranks share
a node; it is the only environment read of the Megatron integration.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

from megatron_burst.megatron.options import CPOptions
from megatron_burst.topology import (CPTopology, USPTopology, build_cp_topology, build_usp_topology,
                                     check_ranks_per_node, check_ulysses_size, register_cp_topology,
                                     registered_cp_topology, registered_usp_topology, single_node_topology)
from megatron_burst.world import group_timeout

__all__ = ["resolve_cp_ranks_per_node", "layers_ranks_per_node", "balanced_batch_ranks_per_node", "needs_node_topology", "setup_cp_topology", "needs_usp_topology",
           "default_cp_ranks_per_node", "usp_topology_from_pg_collection", "make_hierarchical_cp_groups",
           "cp_group_from", "cp_rank_and_size"]


def cp_group_from(pg_collection: Any) -> Optional[dist.ProcessGroup]:
    """The CP group: ``pg_collection.cp``, else ``parallel_state``'s when it is initialized, else
    None (plain single-process use: cp_attention treats None as the size-1 world)."""
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_context_parallel_group()
    return None


def cp_rank_and_size(cp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(rank, size) in ``cp_group``, else in ``parallel_state``'s CP group (ValueError when Megatron's
    groups are not initialized either)."""
    if cp_group is not None:
        return dist.get_rank(cp_group), dist.get_world_size(cp_group)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("cp_group=None needs megatron.core.parallel_state to be initialized "
                         "(initialize_model_parallel); otherwise pass cp_group explicitly")
    return parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def default_cp_ranks_per_node(cp_size: int, tp_size: int) -> int:
    """CP ranks per node from the launcher (torchrun's LOCAL_WORLD_SIZE): Megatron orders ranks
    tensor-parallel fastest, then context-parallel, so a node holds LOCAL_WORLD_SIZE / TP CP ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local <= 0:
        if cp_size > 1:
            warnings.warn(f"megatron-burst: the launcher sets no LOCAL_WORLD_SIZE, so the {cp_size} CP ranks "
                          "are taken to share one node (a flat ring); if they span nodes, pass "
                          "--cp-ranks-per-node (or --hierarchical-context-parallel-sizes) for the double ring")
        return cp_size
    per_node = max(1, local // max(1, tp_size))
    if per_node >= cp_size:
        return cp_size
    if cp_size % per_node:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} with TP={tp_size} gives {per_node} CP ranks per node, "
                         f"which does not divide CP={cp_size}: set --cp-ranks-per-node")
    return per_node


def needs_usp_topology(opts: CPOptions, cp_size: int) -> bool:
    """Whether USP's 2-D groups are needed: a Ulysses size strictly between 1 and the CP size
    (given for usp or a per-layer a2a+p2p). U = CP is Ulysses and U = 1 the ring: no new groups."""
    U = opts.ulysses_size
    return U is not None and 1 < U < cp_size and opts.algo in ("usp", "auto", "per-layer")


def resolve_cp_ranks_per_node(opts: CPOptions, cp_size: int, tp_size: int) -> int:
    """CP ranks per node: ``--cp-ranks-per-node`` / Megatron's hierarchical CP sizes (in ``opts``),
    else the launcher's LOCAL_WORLD_SIZE / TP (one node, with a warning, when it gives none)."""
    per_node = opts.ranks_per_node or default_cp_ranks_per_node(cp_size, tp_size)
    check_ranks_per_node(cp_size, per_node)
    return per_node


def layers_ranks_per_node(opts: CPOptions, cp_size: int, tp_size: int) -> int:
    """The CP ranks per node of the topology the attention layers run on with these options
    (:func:`resolve_cp_ranks_per_node`; ``cp_size`` itself for CP <= 1). Batch slicing of the
    balanced layout passes it, so the batch is planned for the same nodes as the layers' plans."""
    return resolve_cp_ranks_per_node(opts, cp_size, tp_size) if cp_size > 1 else max(cp_size, 1)


def balanced_batch_ranks_per_node(cp_group: Optional[dist.ProcessGroup], cp_size: int,
                                  ranks_per_node: Optional[int] = None) -> int:
    """The ranks per node a balanced batch is planned for: ``ranks_per_node`` when given (checked to
    divide ``cp_size``), else as the layers resolve their topology without options: the node
    topology registered for the CP group (:func:`setup_cp_topology`, which the layers look up),
    else one node. ``cp_group`` None: parallel_state's CP group. No collective."""
    if ranks_per_node is not None:
        check_ranks_per_node(cp_size, ranks_per_node)
        return ranks_per_node
    if cp_size <= 1 or not dist.is_initialized():
        return max(cp_size, 1)
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    topo = registered_cp_topology(cp_group)
    return topo.ranks_per_node if topo is not None and topo.world_size == cp_size else cp_size


def needs_node_topology(opts: CPOptions, cp_size: int, per_node: int) -> bool:
    """Whether this configuration runs on a node topology (the CP group spans nodes, or the double
    ring is asked for); raises ValueError for a double ring that has no second node."""
    if opts.ring == "double" and per_node >= cp_size:
        raise ValueError(f"--cp-ring double needs the CP group to span nodes, but its {cp_size} rank(s) are "
                         f"{per_node} per node: use --cp-ring flat, or set --cp-ranks-per-node to the CP "
                         "ranks each node holds")
    return cp_size > 1 and per_node < cp_size


def _ranks(group: Optional[dist.ProcessGroup]) -> Optional[List[int]]:
    return None if group is None else list(dist.get_process_group_ranks(group))


def usp_topology_from_pg_collection(pg_collection: Any, cp_group: Optional[dist.ProcessGroup], ulysses_size: int,
                                    ranks_per_node: int) -> Optional[USPTopology]:
    """USP's 2-D groups taken from Megatron's hierarchical CP groups (``pg_collection.hcp``), without
    a collective, when they are [U consecutive CP ranks, the CP/U ranks at stride U] for
    ``ulysses_size`` U and the ring across the Ulysses groups stays inside one node; else None."""
    hcp = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    if not hcp or len(hcp) != 2 or cp_group is None or not dist.is_initialized():
        return None
    cp_ranks = _ranks(cp_group)
    world, U = len(cp_ranks), ulysses_size
    if not 1 < U < world or world % U or ranks_per_node < world:
        return None  # a ring across nodes is a double ring: its node groups come from setup_cp_topology
    rank = dist.get_rank(cp_group)
    first = rank - rank % U
    a2a, ring = hcp
    if _ranks(a2a) != cp_ranks[first:first + U] or _ranks(ring) != cp_ranks[rank % U::U]:
        return None
    return USPTopology(cp_group, rank, world, U, a2a, single_node_topology(ring), world)


def make_hierarchical_cp_groups(cp_group: Optional[dist.ProcessGroup], sizes: Sequence[int]) -> Optional[list]:
    """Megatron's hierarchical CP groups for ``sizes`` [A, P] (A x P = CP), as
    ``initialize_model_parallel(hierarchical_context_parallel_sizes=...)`` lays them out: [this
    rank's A consecutive CP ranks, its P ranks at stride A]. Collective over the whole job (every rank
    creates every group, in the same order); None when there is no CP group to split."""
    if cp_group is None or not dist.is_initialized():
        return None
    sizes = [int(x) for x in sizes]
    mine = _ranks(cp_group)
    if len(sizes) != 2 or sizes[0] * sizes[1] != len(mine):
        raise ValueError(f"hierarchical CP sizes {sizes} must be two sizes multiplying to the CP size {len(mine)} "
                         "(--hierarchical-context-parallel-sizes A P)")
    A = sizes[0]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rank = mine.index(dist.get_rank())
    a2a = ring = None
    for ranks in sorted({tuple(r) for r in everyone}):
        for start in range(0, len(ranks), A):
            group = dist.new_group(list(ranks[start:start + A]), timeout=group_timeout())
            if list(ranks) == mine and start == rank - rank % A:
                a2a = group
        for offset in range(A):
            group = dist.new_group(list(ranks[offset::A]), timeout=group_timeout())
            if list(ranks) == mine and offset == rank % A:
                ring = group
    return [a2a, ring]


def setup_cp_topology(opts: CPOptions, cp_group: Optional[dist.ProcessGroup], cp_size: int,
                      tp_size: int, pg_collection: Any = None) -> Optional[CPTopology]:
    """Build and register the node topology these options need, or return None (single node).

    USP's groups are built (and registered) only where ``pg_collection.hcp`` cannot serve (see the
    module docstring). Collective over the whole job when anything is built: call it on every rank,
    once, where the process groups are made. Validation errors are raised before any collective.
    """
    if cp_size <= 1:
        if opts.ring == "double":
            raise ValueError("--cp-ring double needs --context-parallel-size > 1")
        return None
    per_node = resolve_cp_ranks_per_node(opts, cp_size, tp_size)
    usp = needs_usp_topology(opts, cp_size)
    if usp:
        check_ulysses_size(cp_size, opts.ulysses_size, per_node)
    topo = None
    if needs_node_topology(opts, cp_size, per_node):
        topo = registered_cp_topology(cp_group)
        if topo is None or topo.ranks_per_node != per_node:
            topo = register_cp_topology(build_cp_topology(cp_group, per_node))
    from_megatron = (usp and opts.algo != "auto"
                     and usp_topology_from_pg_collection(pg_collection, cp_group, opts.ulysses_size, per_node))
    if usp and not from_megatron and registered_usp_topology(cp_group, opts.ulysses_size) is None:
        # the 2-D groups of usp (registered by build_usp_topology); a collective like the above
        build_usp_topology(cp_group, opts.ulysses_size, per_node if per_node < cp_size else None)
    return topo
