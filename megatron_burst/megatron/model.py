"""``BurstGPTModel``: Megatron-Core's GPTModel with RoPE that follows the CP sequence layout and,
optionally, the fused LM head + cross-entropy loss."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_burst.activation_store import release_before_optimizer_steps
from megatron_burst.megatron.attention import CPCoreAttention, FollowsModelLayout
from megatron_burst.masks.layout import BALANCED
from megatron_burst.megatron.rope import LayoutRotaryEmbedding, use_layout_rope


class BurstGPTModel(GPTModel):
    """GPTModel whose rotary embedding slices positions with the CP layout's ``layout_indices``.

    Takes GPTModel's arguments plus ``cp_layout`` and ``cp_stripe``, which must match the layer
    spec's and the batch slicing's, and ``fused_lm_loss``: while training with labels, the
    per-token loss [b, s] comes from :func:`megatron_burst.fused_linear_cross_entropy` over the
    decoder's hidden states, never building the [s, b, V/tp] logits (evaluation, inference and
    calls without labels still return logits). Pass ``loss_mask`` to ``forward`` (as Megatron-LM's
    pretrain_gpt does) so the fused backward can reuse the gradients formed in the forward.
    The CP group is ``pg_collection.cp`` (GPTModel resolves ``pg_collection=None`` from
    megatron.core.parallel_state). Parameters and state dict are GPTModel's: checkpoints are
    interchangeable with a plain GPTModel.
    """

    def __init__(self, *args: Any, cp_layout: Optional[str] = "zigzag", cp_stripe: int = 1,
                 fused_lm_loss: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup_burst(cp_layout, cp_stripe, fused_lm_loss)

    def _setup_burst(self, cp_layout: Optional[str], cp_stripe: int, fused_lm_loss: bool) -> None:
        """Everything BurstGPTModel adds to a built GPTModel -- no parameters:

        * RoPE rows follow ``cp_layout``, and every megatron-burst core attention and linear
          attention layer uses that same layout (one whose spec left it unset adopts it; a
          disagreeing one is a ValueError).
          ``cp_layout=None``: Megatron's RoPE and attention are left as they are (``--cp-algo none``).
        * A forward pre-hook tells each core attention whether this pass will be recomputed
          (training with grad), so sequence-level selective checkpointing stores only then.
        * Selective-checkpoint stores are released (and verified) before every optimizer step.
        """
        if fused_lm_loss:
            if not self.post_process:
                raise ValueError("fused_lm_loss needs the output layer: it applies to the last pipeline stage only; "
                                 "construct with post_process=True there")
            if getattr(self.output_layer, "bias", None) is not None:
                raise ValueError("fused_lm_loss does not support an output-layer bias: build the model without it "
                                 "(add_bias_linear only affects hidden layers; the GPT output layer has none)")
            if getattr(self, "mtp_process", False):
                raise ValueError("fused_lm_loss with multi-token prediction is not supported: unset --mtp-num-layers "
                                 "or --fused-lm-loss")
        self.cp_layout = cp_layout
        self.cp_stripe = cp_stripe
        self.fused_lm_loss = fused_lm_loss
        if cp_layout is None:
            return
        use_layout_rope(self, cp_layout, self.pg_collection.cp, cp_stripe)
        for layer in self.modules():  # softmax core attention and linear attention alike
            if isinstance(layer, FollowsModelLayout):
                layer.bind_layout(cp_layout, cp_stripe)
        attentions = [m for m in self.modules() if isinstance(m, CPCoreAttention)]
        if attentions and not getattr(self, "_burst_pass_hook", None):
            self._burst_pass_hook = self.register_forward_pre_hook(_tell_attention_whether_recompute_follows)
        release_before_optimizer_steps(self)

    def forward(self, *args: Any, **kwargs: Any):
        """GPTModel's forward. Under ``cp_layout="balanced"`` the batch's placement travels with it:
        the plan of ``packed_seq_params`` (from ``get_batch_on_this_cp_rank(..., layout="balanced")``)
        is handed to the rotary embedding for this call only; every attention layer reads the same
        Documents from the params. A balanced forward without them is a ValueError."""
        if self.cp_layout != BALANCED:
            return super().forward(*args, **kwargs)
        from megatron_burst.megatron.packed import balanced_documents_of

        documents = balanced_documents_of(kwargs.get("packed_seq_params"))
        if documents is None:
            raise ValueError("--cp-layout balanced: the model forward needs the batch's plan, carried by "
                             "packed_seq_params=... (keyword) from get_batch_on_this_cp_rank(..., layout='balanced') "
                             "or get_thd_batch_on_this_cp_rank(..., layout='balanced'); got "
                             f"{type(kwargs.get('packed_seq_params')).__name__}")
        rope = getattr(self, "rotary_pos_emb", None)
        placed = rope.placed_by(documents.plan) if isinstance(rope, LayoutRotaryEmbedding) else contextlib.nullcontext()
        with placed:
            return super().forward(*args, **kwargs)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args: Any, **kwargs: Any):
        use_fused = (self.fused_lm_loss and self.training and labels is not None
                     and kwargs.get("inference_context") is None and not kwargs.get("mtp_in_postprocess"))
        if not use_fused:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        from megatron_burst.loss import fused_linear_cross_entropy

        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        loss_mask = kwargs.get("loss_mask")
        loss = fused_linear_cross_entropy(
            hidden_states, weight, labels.transpose(0, 1),  # [b, s] -> [s, b] like hidden_states
            tp_group=self.pg_collection.tp, sequence_parallel=self.config.sequence_parallel,
            accumulate_into_main_grad=self.config.gradient_accumulation_fusion,  # as the output layer would
            loss_mask=None if loss_mask is None else loss_mask.transpose(0, 1))
        return loss.transpose(0, 1).contiguous()  # [b, s], as GPTModel's compute_language_model_loss


def _tell_attention_whether_recompute_follows(model: torch.nn.Module, inputs: Any) -> None:
    """Forward pre-hook: a pass's checkpointed regions are recomputed only when it trains with grad
    (a no-grad scoring pass in training mode runs Megatron's checkpoint forward all the same)."""
    follows = model.training and torch.is_grad_enabled()
    for module in model.modules():
        if isinstance(module, CPCoreAttention):
            module.recompute_follows = follows


def as_burst_gpt_model(model: GPTModel, *, cp_layout: Optional[str], cp_stripe: int = 1,
                       fused_lm_loss: bool = False) -> BurstGPTModel:
    """Turn a GPTModel built elsewhere (Megatron-LM's ``gpt_builder``) into a BurstGPTModel, in place.

    BurstGPTModel adds behaviour only (no parameters or buffers), so the object keeps its weights,
    state dict and identity; only its class and the RoPE module change. Subclasses of GPTModel
    other than BurstGPTModel are refused: their own overrides would be lost.
    """
    if type(model) not in (GPTModel, BurstGPTModel):
        raise TypeError(f"megatron-burst can only extend megatron.core's GPTModel, got {type(model).__name__}: "
                        "build a megatron.core GPTModel, or keep the model as it is with --cp-algo none and "
                        "without --fused-lm-loss")
    model.__class__ = BurstGPTModel
    model._setup_burst(cp_layout, cp_stripe, fused_lm_loss)
    return model
