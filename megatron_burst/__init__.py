"""megatron-burst: context-parallel BurstAttention and memory optimizations for Megatron-Core.

Public API (functional, usable without Megatron):
  layout_indices, shard, unshard          -- sequence layouts (contiguous, zigzag, striped; balanced,
                                             placed by the documents: cu_seqlens or a plan)
  balanced_documents                      -- a batch's documents with its balanced placement, planned
                                             once (pass to cp_attention(layout="balanced", cu_seqlens=))
  cp_attention                            -- context-parallel attention (ring, burst, auto, allgather,
                                             ulysses, usp)
  linear_attention                        -- context-parallel (decayed) linear attention (LASP-2, LASP-1)
  gated_delta_rule                        -- context-parallel gated delta rule (Gated DeltaNet)
  build_cp_topology                       -- intra/inter-node rings for the topology-aware double ring
  build_usp_topology                      -- USP's 2-D groups (Ulysses groups x rings across them)
  comm_counter                            -- byte accounting of every CP transfer
  VerticalSlash, sparse_cp_attention      -- vertical-slash sparse patterns: cp_attention(pattern=...), composed
                                             with cu_seqlens and window; sparse_cp_attention wraps it
                                             (megatron_burst.sparse)
  fused_linear_cross_entropy               -- LM head + vocab-parallel CE without N x V logits
Megatron integration: megatron_burst.specs, megatron_burst.add_args, get_batch_on_this_cp_rank.

Where things live:
  megatron_burst.masks        every mask and placement as data: block (BlockMask), layout, dispatch
                              (balanced planner), documents, window, visible, vertical_slash (sparse
                              patterns and plans), dynamic (dynamic pattern), imbalance (analytics);
                              imports nothing from kernels or algorithms
  megatron_burst.kernels      local attention kernels on BlockMask rectangles
  megatron_burst.algorithms   the CP engine: cp_attention, validate, prepare, function (autograd),
                              auto (cost-model picks), schedule, ring, burst, allgather, ulysses
  megatron_burst.layout, .documents, .dispatch, .sparse_plan, .dynamic_pattern, .sparse
                              public aliases of megatron_burst.masks modules (sparse also holds the
                              sparse_cp_attention wrapper)
"""
from megatron_burst.masks.dispatch import DispatchPlan, plan_dispatch
from megatron_burst.masks.documents import balanced_documents
from megatron_burst.masks.layout import ENGINE_LAYOUTS, LAYOUTS, layout_indices, shard, unshard
from megatron_burst.masks.vertical_slash import VerticalSlash
from megatron_burst.comm import comm_counter
from megatron_burst.algorithms import CP_ALGOS, cp_attention
from megatron_burst.topology import build_cp_topology, build_usp_topology
from megatron_burst.linear import gated_delta_rule, linear_attention
from megatron_burst.sparse import sparse_cp_attention

__version__ = "0.1.0"

# public alias modules of megatron_burst.masks: ``megatron_burst.layout`` etc. stay attributes of the package
_MASK_ALIASES = ("layout", "documents", "dispatch", "sparse_plan", "dynamic_pattern")


def __getattr__(name):
    if name in _MASK_ALIASES:
        import importlib

        return importlib.import_module(f"megatron_burst.{name}")
    # Megatron-facing helpers import megatron.core lazily, so the engine works without it.
    if name == "add_args":
        from megatron_burst.megatron.flags import add_args
        return add_args
    if name == "fused_linear_cross_entropy":
        from megatron_burst.loss import fused_linear_cross_entropy
        return fused_linear_cross_entropy
    if name == "get_batch_on_this_cp_rank":
        from megatron_burst.megatron.batch import get_batch_on_this_cp_rank
        return get_batch_on_this_cp_rank
    raise AttributeError(f"module 'megatron_burst' has no attribute {name!r}")


__all__ = ["LAYOUTS", "ENGINE_LAYOUTS", "balanced_documents", "DispatchPlan", "plan_dispatch", "CP_ALGOS", "layout_indices", "shard", "unshard", "cp_attention", "linear_attention",
           "gated_delta_rule", "build_cp_topology", "build_usp_topology", "comm_counter", "VerticalSlash",
           "sparse_cp_attention",
           "add_args", "get_batch_on_this_cp_rank", "fused_linear_cross_entropy"]
