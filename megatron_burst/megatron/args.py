"""Compatibility module: megatron-burst's flags and options, re-exported from where they live now.

The former contents are split by concept:

* :mod:`megatron_burst.megatron.flags` -- the argparse group (:func:`add_args`);
* :mod:`megatron_burst.megatron.options` -- the option dataclasses (:class:`CPOptions`,
  :class:`LinearCPOptions`, :class:`LinearAttentionOptions`, :class:`BurstOptions`) and their
  validation (:func:`make_cp_options`, :func:`make_linear_cp_options`);
* :mod:`megatron_burst.megatron.comm_types` -- Megatron's ``--cp-comm-type`` values and the
  algorithm each selects (:func:`resolve_cp_algo`);
* :mod:`megatron_burst.megatron.validate` -- refusals of combinations that cannot be honoured;
* :mod:`megatron_burst.megatron.from_args` -- the flag boundary: parsed args to options
  (:func:`options_from_args`, :func:`cp_options_from_args` ...);
* :mod:`megatron_burst.megatron.groups` -- CP ranks per node from the launcher
  (:func:`default_cp_ranks_per_node`).

Nothing here (or there) reads Megatron-LM's global args: the entry points hand their parsed args
to :mod:`~megatron_burst.megatron.from_args`.
"""
from megatron_burst.megatron.comm_types import (COMM_TYPE_ALGOS, DEFAULT_CP_ALGO, GDN_COMM_REFUSED, PER_LAYER,
                                                STOCK_ATTENTION, _TE_RING_NAME, check_gated_delta_net_comm_type,
                                                resolve_cp_algo)
from megatron_burst.megatron.flags import add_args, linear_attention_freq_type
from megatron_burst.megatron.from_args import (check_sparse_flags, cp_options_from_args, cp_ranks_per_node_from_args,
                                               linear_options_from_args, options_from_args, sparse_from_args)
from megatron_burst.megatron.groups import default_cp_ranks_per_node
from megatron_burst.megatron.options import (DEFAULT_CP_LAYOUT, DEFAULT_LINEAR_CP_ALGO, LINEAR_CP_ALGOS,
                                             LINEAR_MIN_STRIPE, BurstOptions, CPOptions, LinearAttentionOptions,
                                             LinearCPOptions, linear_attention_pattern, make_cp_options,
                                             make_linear_cp_options)
from megatron_burst.megatron.validate import (check_cp_dropout, check_cp_heads, check_hierarchical_cp_sizes,
                                              check_selective_ckpt_algo, check_selective_recompute)

_check_sparse_flags = check_sparse_flags

__all__ = ["COMM_TYPE_ALGOS", "DEFAULT_CP_ALGO", "GDN_COMM_REFUSED", "PER_LAYER", "STOCK_ATTENTION",
           "check_gated_delta_net_comm_type", "resolve_cp_algo", "add_args", "linear_attention_freq_type",
           "check_sparse_flags", "cp_options_from_args", "cp_ranks_per_node_from_args", "linear_options_from_args",
           "options_from_args", "sparse_from_args", "default_cp_ranks_per_node", "DEFAULT_CP_LAYOUT",
           "DEFAULT_LINEAR_CP_ALGO", "LINEAR_CP_ALGOS", "LINEAR_MIN_STRIPE", "BurstOptions", "CPOptions",
           "LinearAttentionOptions", "LinearCPOptions", "linear_attention_pattern", "make_cp_options",
           "make_linear_cp_options", "check_cp_dropout", "check_cp_heads", "check_hierarchical_cp_sizes",
           "check_selective_ckpt_algo", "check_selective_recompute"]
