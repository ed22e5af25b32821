"""Megatron-Core integration of megatron-burst.

* :mod:`.attention` -- :class:`BurstCoreAttention`, a drop-in ``core_attention`` for Megatron's
  ``SelfAttention`` that runs :func:`megatron_burst.cp_attention` over the context-parallel group.
* :mod:`.rope` -- rotary embeddings that follow any sequence layout (Megatron's slice zigzag only).
* :mod:`.batch` -- :func:`get_batch_on_this_cp_rank` for every layout.
* :mod:`.packed` -- documents: ``--reset-attention-mask`` boundaries from EOD tokens and packed THD
  batches (TransformerEngine's partitioning), handed to the attention as ``packed_seq_params``.
* :mod:`.args` -- ``--cp-algo/--cp-layout/--cp-stripe`` flags and their resolution.
* :mod:`.model` -- :class:`BurstGPTModel`, Megatron's GPTModel with layout-aware RoPE.
* :mod:`.megatron_lm` -- glue used by ``patches/pretrain_gpt.patch`` for Megatron-LM.

Layer specs live in :mod:`megatron_burst.specs`, the training entry point in
:mod:`megatron_burst.train`. Submodules import megatron.core; this package file does not.
"""
