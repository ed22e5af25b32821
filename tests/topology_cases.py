"""Rank-side bodies of the topology tests: double vs flat rings on an emulated node split."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_burst as mb
from attention_cases import run_case

def topology(ranks_per_node: int):
    """A topology for this task (the harness destroys every task's process groups afterwards)."""
    return mb.build_cp_topology(None, ranks_per_node)


def run_topology_matrix(ranks_per_node: int, ring: str, algo: str, layouts=("contiguous", "zigzag", "striped"),
                        heads=("mha", "gqa4")):
    topo = topology(ranks_per_node)
    out = {}
    for layout in layouts:
        for causal in (True, False):
            for h in heads:
                out[(layout, causal, h)] = run_case(algo, layout, causal, h, group=topo, ring=ring)
    return out


def link_bytes(ranks_per_node: int, ring: str, algo: str):
    topo = topology(ranks_per_node)
    errs = run_case(algo, "zigzag", True, "mha", group=topo, ring=ring)
    return errs["links"], topo.rank, topo.ranks_per_node


def construction_error(ranks_per_node):
    """The ValueError message (or None), and whether the world group still works afterwards."""
    try:
        mb.build_cp_topology(None, ranks_per_node)
        msg = None
    except ValueError as e:
        msg = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)  # would hang or fail if a rank had entered a collective the others skipped
    return msg, t.item() == dist.get_world_size()
