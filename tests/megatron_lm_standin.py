"""A stand-in for Megatron-LM core_v0.16.1's ``gpt_builders.gpt_builder``.

Megatron-LM's training package is not installable here, so this module reproduces what its
gpt_builder does with the flags that choose the layer spec (``--spec``, ``--num-experts``,
``--qk-layernorm``, ``--mtp-num-layers``, ``--multi-latent-attention``, local implementation):
the same megatron.core spec functions, called the same way, and a ``GPTModel`` constructed by that
global name -- which is what ``megatron_burst.megatron.megatron_lm.wrap_gpt_builder`` intercepts.
``examples/check_megatron_lm.py`` runs the real one against a Megatron-LM checkout.
"""
from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs,
                                                      get_gpt_layer_local_spec, get_gpt_mtp_block_spec)
from megatron.core.transformer.spec_utils import import_module


def _layer_spec(args, config):
    return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                    args.multi_latent_attention, None, normalization=args.normalization)


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM's gpt_builder, local implementation (``args.make_config()`` stands in for
    core_transformer_config_from_args)."""
    if config is None:
        config = args.make_config()
    if args.spec is not None:
        transformer_layer_spec = import_module(args.spec)
    elif args.num_experts:
        transformer_layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                            normalization=args.normalization, qk_l2_norm=False,
                                                            vp_stage=vp_stage)
    else:
        transformer_layer_spec = _layer_spec(args, config)
    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        if hasattr(transformer_layer_spec, "layer_specs") and len(transformer_layer_spec.layer_specs) == 0:
            layer_for_mtp = _layer_spec(args, config)
        else:
            layer_for_mtp = get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                                        normalization=args.normalization, qk_l2_norm=False,
                                                        vp_stage=vp_stage)[-1]
        mtp_block_spec = get_gpt_mtp_block_spec(config, layer_for_mtp, use_transformer_engine=False,
                                                vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=transformer_layer_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, mtp_block_spec=mtp_block_spec, vp_stage=vp_stage, pg_collection=pg_collection)
