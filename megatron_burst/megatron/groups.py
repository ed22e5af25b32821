"""The CP node topology, built once where Megatron's process groups are made.

The double ring needs intra- and inter-node process groups; creating them is a collective over the
whole job. It therefore happens in :func:`setup_cp_topology`, which every rank calls once after
``initialize_model_parallel`` and before building the model (megatron_burst.train does, and so does
the Megatron-LM glue in :mod:`megatron_burst.megatron.megatron_lm`). The attention layers only look
the topology up (:func:`megatron_burst.topology.registered_cp_topology`): a layer constructor never
communicates, so a pipeline stage without our attention cannot leave the others waiting.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megatron_burst.megatron.args import CPOptions, default_cp_ranks_per_node
from megatron_burst.topology import (CPTopology, build_cp_topology, build_usp_topology, check_ranks_per_node,
                                     check_ulysses_size, register_cp_topology, registered_cp_topology,
                                     registered_usp_topology)

__all__ = ["resolve_cp_ranks_per_node", "needs_node_topology", "setup_cp_topology", "needs_usp_topology"]


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


def needs_node_topology(opts: CPOptions, cp_size: int, per_node: int) -> bool:
    """Whether this configuration runs on a node topology (the CP group spans nodes, or the double
    ring is asked for); raises ValueError for a double ring that has no second node."""
    if opts.ring == "double" and per_node >= cp_size:
        raise ValueError(f"--cp-ring double needs the CP group to span nodes, but its {cp_size} rank(s) are "
                         f"{per_node} per node: use --cp-ring flat, or set --cp-ranks-per-node to the CP "
                         "ranks each node holds")
    return cp_size > 1 and per_node < cp_size


def setup_cp_topology(opts: CPOptions, cp_group: Optional[dist.ProcessGroup], cp_size: int,
                      tp_size: int) -> Optional[CPTopology]:
    """Build and register the node topology these options need, or return None (single node).

    Collective over the whole job when a topology is needed: call it on every rank, once, where
    the process groups are made. Validation errors are raised before any collective.
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
    if usp and registered_usp_topology(cp_group, opts.ulysses_size) is None:
        # the 2-D groups of usp (registered by build_usp_topology); a collective like the above
        build_usp_topology(cp_group, opts.ulysses_size, per_node if per_node < cp_size else None)
    return topo
