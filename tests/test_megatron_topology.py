"""The double ring's node topology is built once where the process groups are made; attention
layer constructors only look it up and never communicate."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from harness import run_ranks


def _construct(cp: int, ranks_per_node: int, setup: bool, ring=None) -> dict:
    """BurstCoreAttention at CP = ``cp`` with ``ranks_per_node``; collectives are forbidden
    while the layer is constructed. Returns what happened."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_burst.megatron.args import make_cp_options
    from megatron_burst.megatron.attention import BurstCoreAttention
    from megatron_burst.megatron.groups import setup_cp_topology
    from megatron_burst.topology import CPTopology

    ps.initialize_model_parallel(1, 1, context_parallel_size=cp, create_gloo_process_groups=False)
    opts = make_cp_options(cp_ring=ring, cp_ranks_per_node=ranks_per_node)
    if setup:
        setup_cp_topology(opts, ps.get_context_parallel_group(), cp, 1)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=cp,
                            attention_dropout=0.0, use_cpu_initialization=True)

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran inside the layer constructor")

    saved = {name: getattr(dist, name) for name in ("new_group", "all_gather_object", "barrier", "all_reduce")}
    for name in saved:
        setattr(dist, name, forbidden)
    try:
        attn = [BurstCoreAttention(cfg, i + 1, AttnMaskType.causal, "self", cp_ring=ring,
                                   cp_ranks_per_node=ranks_per_node) for i in range(2)]
        result = {"error": None, "nodes": attn[0].cp_target.num_nodes
                  if isinstance(attn[0].cp_target, CPTopology) else 1,
                  "shared": attn[0].cp_target is attn[1].cp_target}
    except ValueError as exc:
        result = {"error": str(exc)}
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return result


def test_layers_use_the_topology_built_at_setup():
    for res in run_ranks(4, _construct, 4, 2, True):
        assert res == {"error": None, "nodes": 2, "shared": True}


def test_a_layer_without_the_topology_refuses_instead_of_communicating():
    for res in run_ranks(4, _construct, 4, 2, False):
        assert res["error"] is not None and "setup_cp_topology" in res["error"]
        assert "--cp-ring flat" in res["error"]


def test_single_node_needs_no_topology():
    for res in run_ranks(2, _construct, 2, None, False):
        assert res == {"error": None, "nodes": 1, "shared": True}


def test_double_ring_on_one_node_is_refused():
    from megatron_burst.megatron.args import make_cp_options
    from megatron_burst.megatron.groups import setup_cp_topology

    with pytest.raises(ValueError, match="--cp-ring double needs the CP group to span nodes"):
        setup_cp_topology(make_cp_options(cp_ring="double", cp_ranks_per_node=4), None, 4, 1)
    with pytest.raises(ValueError, match="--context-parallel-size > 1"):
        setup_cp_topology(make_cp_options(cp_ring="double"), None, 1, 1)
    with pytest.raises(ValueError, match="not divisible by ranks_per_node=3"):
        setup_cp_topology(make_cp_options(cp_ranks_per_node=3), None, 4, 1)


def test_no_launcher_information_warns_once(monkeypatch):
    from megatron_burst.megatron.args import default_cp_ranks_per_node

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.warns(UserWarning, match="no LOCAL_WORLD_SIZE"):
        assert default_cp_ranks_per_node(cp_size=4, tp_size=1) == 4
