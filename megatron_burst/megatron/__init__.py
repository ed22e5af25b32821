"""Megatron-Core integration of megatron-burst (all the Megatron glue lives here).

Layers (options arrive as data, through the layer specs; none reads Megatron-LM's global args):

* :mod:`.attention` -- :class:`CPCoreAttention` (formerly ``BurstCoreAttention``, still an alias),
  the ``core_attention`` for Megatron's ``SelfAttention`` that runs every megatron-burst CP
  algorithm (:func:`megatron_burst.cp_attention`) over the context-parallel group.
* :mod:`.linear_attention`, :mod:`.gated_delta_net`, :mod:`.linear_variants` -- linear-attention
  layers (LASP-2H hybrids) and Megatron's GatedDeltaNet under CP.
* :mod:`.specs` -- layer specs with those layers (public path ``megatron_burst.specs``).
* :mod:`.model` -- :class:`BurstGPTModel`, Megatron's GPTModel with layout-aware RoPE.
* :mod:`.rope`, :mod:`.batch`, :mod:`.packed` -- RoPE, batch slicing and documents in any layout.
* :mod:`.groups` -- process groups: Megatron's ``pg_collection`` (cp, hcp) where it has them, the
  double ring's (and USP's across nodes) built once where the process groups are made.

Flags and options, one concept per module:

* :mod:`.flags` -- the argparse group (``--cp-algo`` ...; :func:`megatron_burst.add_args`).
* :mod:`.options` -- the option dataclasses (:class:`CPOptions`, :class:`BurstOptions` ...).
* :mod:`.comm_types` -- Megatron's ``--cp-comm-type`` values and the algorithm each selects.
* :mod:`.validate` -- refusals of what cannot be honoured.
* :mod:`.from_args` -- the flag boundary: parsed args -> options.
* :mod:`.args` -- the former home of all of these (a re-export).

Entry points (the flag boundaries): :mod:`.megatron_lm` (glue used by
``patches/pretrain_gpt.patch`` for Megatron-LM, the only module reading Megatron-LM's globals) and
:mod:`megatron_burst.train`. Submodules import megatron.core; this package file does not.
"""
