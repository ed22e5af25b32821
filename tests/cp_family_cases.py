"""Rank-side bodies of the all-gather / Ulysses / USP tests (run by harness.run_ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_burst as mb
from attention_cases import HEADS, run_case
from megatron_burst.topology import build_usp_topology


def run_family_matrix(algo, layout, heads_list=tuple(HEADS), ulysses_size=None, ranks_per_node=None, **kw):
    """{causal, full} x heads for one algorithm; usp builds its 2-D groups first (collectively)."""
    group = None
    if algo == "usp":
        group = build_usp_topology(None, ulysses_size, ranks_per_node)
    results = {}
    for causal in (True, False):
        for heads in heads_list:
            results[(causal, heads)] = run_case(algo, layout, causal, heads, group=group, **kw)
    return results
