"""Masks and placements as data: the one home of what each context-parallel rank holds and what
each of its (query block, key block) pairs may see.

Modules, one concept each (lower ones first; each imports only the ones above it):

  block           BlockMask: a block pair's visible rectangle and the mask inside it (empty, full,
                  causal, block_causal, positions, sparse, gather), and its operations
  dispatch        the balanced placement planner: plan_dispatch -> DispatchPlan (documents placed
                  by attention work)
  layout          placements: layout_indices, shard, unshard for contiguous, zigzag, striped and
                  balanced; THD's thd_indices; block_mask, the causal/full mask of a fixed layout's
                  block pair
  documents       packed documents (cu_seqlens): Documents, check_cu_seqlens, balanced_documents,
                  check_thd, document_blocks (a block pair's per-document rectangles)
  window          sliding windows: check_window, window_blocks
  visible         visible_blocks: a block pair's layout mask x documents x window (the dense masks)
  vertical_slash  vertical-slash sparse patterns (VerticalSlash) and their tile plans (plan_pair,
                  pattern_blocks), composed with documents and windows
  dynamic         MTraining's dynamic vertical-slash pattern, estimated from q and k (Dynamic, estimate)
  imbalance       load-balance analytics: document_imbalance (documents under a layout),
                  pattern_imbalance and pair_work (a sparse pattern on a ring)

Invariants: masks import nothing from kernels, algorithms or the Megatron glue (only torch, numpy
and, for the dynamic estimate's all-reduces, :mod:`megatron_burst.comm`); no submodule imports
this package face, so the face may import them all. Everything here is data and planning:
deterministic, the same on every rank given the same inputs, no collective except
:func:`~megatron_burst.masks.dynamic.estimate`. Patch module attributes on these home modules (e.g.
``megatron_burst.masks.dynamic.estimate``): the engine calls through them. The former top-level
modules (``megatron_burst.layout``, ``.documents``, ``.dispatch``, ``.sparse_plan``,
``.dynamic_pattern``, and ``.sparse``'s data) are public aliases of these.
"""
from megatron_burst.masks.block import BlockMask
from megatron_burst.masks.dispatch import DispatchPlan, plan_dispatch
from megatron_burst.masks.layout import (BALANCED, ENGINE_LAYOUTS, LAYOUTS, block_mask, layout_indices, shard,
                                         thd_indices, unshard)
from megatron_burst.masks.documents import (THD, Documents, balanced_documents, check_cu_seqlens, check_thd,
                                            document_blocks)
from megatron_burst.masks.window import check_window, window_blocks
from megatron_burst.masks.visible import visible_blocks
from megatron_burst.masks.vertical_slash import VerticalSlash, pattern_blocks, plan_pair
from megatron_burst.masks.dynamic import Dynamic
from megatron_burst.masks.imbalance import document_imbalance, pair_work, pattern_imbalance

__all__ = ["BlockMask", "DispatchPlan", "plan_dispatch", "BALANCED", "ENGINE_LAYOUTS", "LAYOUTS", "block_mask",
           "layout_indices", "shard", "thd_indices", "unshard", "THD", "Documents", "balanced_documents",
           "check_cu_seqlens", "check_thd", "document_blocks", "check_window", "window_blocks", "visible_blocks",
           "VerticalSlash", "pattern_blocks", "plan_pair", "Dynamic", "document_imbalance", "pair_work",
           "pattern_imbalance"]
