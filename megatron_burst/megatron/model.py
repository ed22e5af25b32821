"""``BurstGPTModel``: Megatron-Core's GPTModel with RoPE that follows the CP sequence layout."""
from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_burst.megatron.rope import use_layout_rope


class BurstGPTModel(GPTModel):
    """GPTModel whose rotary embedding slices positions with the CP layout's ``layout_indices``.

    Takes GPTModel's arguments plus ``cp_layout`` and ``cp_stripe``, which must match the layer
    spec's and the batch slicing's. The CP group is ``pg_collection.cp`` (GPTModel resolves
    ``pg_collection=None`` from megatron.core.parallel_state). Parameters and state dict are
    GPTModel's: checkpoints are interchangeable with a plain GPTModel.
    """

    def __init__(self, *args: Any, cp_layout: str = "zigzag", cp_stripe: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cp_layout = cp_layout
        self.cp_stripe = cp_stripe
        use_layout_rope(self, cp_layout, self.pg_collection.cp, cp_stripe)
