"""Rotary position embeddings that follow the context-parallel sequence layout.

Megatron's ``RotaryEmbedding.forward`` builds the full-length frequency table and keeps this
rank's part with ``get_pos_emb_on_this_cp_rank``, which assumes zigzag (and moves tensors to
CUDA, so it fails on CPU). :class:`LayoutRotaryEmbedding` keeps rows
``layout_indices(s, cp_rank, cp_size, layout)`` instead: exactly the global positions of this
rank's tokens as sliced by :func:`megatron_burst.get_batch_on_this_cp_rank`.

Under ``--cp-layout balanced`` those positions are the current batch's plan rows, so the plan is
data of the forward pass: the model hands it over for the duration of its forward
(:meth:`LayoutRotaryEmbedding.placed_by`, see megatron_burst.megatron.model), and a balanced
forward without it is an error, never a silent fallback to another layout.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_burst.masks.dispatch import DispatchPlan
from megatron_burst.masks.layout import BALANCED, check_layout, layout_indices_on, plan_rows


class LayoutRotaryEmbedding(RotaryEmbedding):
    """A :class:`RotaryEmbedding` whose CP slicing follows ``layout`` (any of ENGINE_LAYOUTS; for
    "balanced", the plan of the batch in flight, see :meth:`placed_by`).

    Built from an existing RotaryEmbedding (``source``), whose frequencies (rotary percent,
    base, llama-3 scaling) are reused as they are. ``inv_freq`` becomes a non-persistent fp32
    buffer: ``model.cuda()`` moves it, ``model.bfloat16()`` leaves it fp32, checkpoints are
    unchanged.
    """

    def __init__(self, source: RotaryEmbedding, layout: str, cp_group: Optional[dist.ProcessGroup],
                 stripe: int = 1) -> None:
        # RotaryEmbedding.__init__ recomputes inv_freq from constructor arguments GPTModel does
        # not keep; copying the finished tensor is exact and version-independent.
        torch.nn.Module.__init__(self)
        check_layout(layout, stripe)
        self.register_buffer("inv_freq", source.inv_freq.detach().clone(), persistent=False)
        self.rotary_interleaved = source.rotary_interleaved
        self.seq_len_interpolation_factor = source.seq_len_interpolation_factor
        self.cp_group = cp_group
        self.layout = layout
        self.stripe = stripe
        # Every layer asks for the same rows every step: build them once (Megatron's RotaryEmbedding
        # caches its forward the same way). Cleared when the module moves.
        self._rows_cache: dict[tuple, torch.Tensor] = {}
        # layout "balanced": the plan of the batch whose forward is running (set by placed_by only)
        self._batch_plan: Optional[DispatchPlan] = None
        # its rows ((plan, ...) key, [S/W, 1, 1, dim]); one entry: every batch has its own plan
        self._balanced_rows: Optional[tuple] = None

    @contextlib.contextmanager
    def placed_by(self, plan: Optional[DispatchPlan]) -> Iterator[None]:
        """For the duration of a model forward, take RoPE rows from ``plan`` (this batch's balanced
        placement, ``Documents.plan`` from its packed_seq_params). Layout "balanced" only."""
        if self.layout != BALANCED:
            raise ValueError(f"placed_by(plan) is for --cp-layout balanced; this RoPE slices in {self.layout!r}")
        if not isinstance(plan, DispatchPlan):
            raise ValueError("--cp-layout balanced: the model forward got no balanced plan (packed_seq_params "
                             f"carries {plan!r}): slice the batch with get_batch_on_this_cp_rank(..., "
                             "layout='balanced') and pass its packed_seq_params to the model")
        previous, self._batch_plan = self._batch_plan, plan
        try:
            yield
        finally:
            self._batch_plan = previous

    def _apply(self, fn, recurse: bool = True):
        # Follow device moves (model.cuda()), but never dtype casts: Megatron-LM's Float16Module
        # calls .bfloat16() on the whole model, and bf16 angles are wrong beyond a few hundred
        # positions. Megatron's own RotaryEmbedding avoids this by not registering inv_freq.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device)
        self._rows_cache.clear()
        self._balanced_rows = None
        return self

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
        """Embedding rows for this CP rank's tokens: [max_seq_len / cp_size, 1, 1, dim] (cached).

        ``packed_seq`` (THD batches): the whole table [max_seq_len, 1, 1, dim], as Megatron's
        RotaryEmbedding returns it; Megatron's THD RoPE picks each sequence's zigzag rows itself,
        which is the partitioning megatron_burst.megatron.packed slices THD batches with.
        """
        if packed_seq:
            key = (max_seq_len, offset, "thd", self.inv_freq.device)
            if key not in self._rows_cache:
                self._rows_cache[key] = self._rows(max_seq_len, offset, None)
            return self._rows_cache[key]
        group = cp_group if cp_group is not None else self.cp_group
        cp = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        if self.layout == BALANCED:
            return self._balanced(max_seq_len, offset, group, cp)
        key = (max_seq_len, offset, cp, self.inv_freq.device)
        if key not in self._rows_cache:
            if len(self._rows_cache) >= 32:
                self._rows_cache.clear()
            self._rows_cache[key] = self._rows(max_seq_len, offset, group)
        return self._rows_cache[key]

    def _balanced(self, max_seq_len: int, offset: int, group: Optional[dist.ProcessGroup], cp: tuple) -> torch.Tensor:
        """Rows of the batch in flight: its plan's global positions for this rank, [S/W, 1, 1, dim]."""
        plan = self._batch_plan
        if plan is None:
            raise ValueError("--cp-layout balanced: RoPE was asked for rows outside a forward that handed it the "
                             "batch's plan: call the BurstGPTModel (its forward passes packed_seq_params' plan "
                             "here), with packed_seq_params from get_batch_on_this_cp_rank(..., layout='balanced')")
        if (plan.seq_len, plan.world_size) != (max_seq_len, cp[1]):
            raise ValueError(f"--cp-layout balanced: the batch's plan places {plan.seq_len} tokens on "
                             f"{plan.world_size} ranks, but RoPE is asked for {max_seq_len} positions on {cp[1]} "
                             "CP ranks: plan the batch for this sequence length and CP group")
        key = (plan, max_seq_len, offset, cp, self.inv_freq.device)
        if self._balanced_rows is None or self._balanced_rows[0] != key:
            self._balanced_rows = (key, self._rows(max_seq_len, offset, group, plan))
        return self._balanced_rows[1]

    def _rows(self, max_seq_len: int, offset: int, group: Optional[dist.ProcessGroup],
              plan: Optional[DispatchPlan] = None) -> torch.Tensor:
        """The frequency table for positions [offset, offset + max_seq_len), this rank's rows."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, None, :]
        if group is not None and dist.get_world_size(group) > 1:
            if plan is not None:  # a per-batch placement: one copy of its rows, not a device cache entry
                idx = plan_rows(plan)[dist.get_rank(group)].to(emb.device)
            else:
                idx = layout_indices_on(max_seq_len, dist.get_rank(group), dist.get_world_size(group),
                                        self.layout, self.stripe, emb.device)
            emb = emb.index_select(0, idx)
        return emb


def use_layout_rope(model: torch.nn.Module, layout: str, cp_group: Optional[dist.ProcessGroup],
                    stripe: int = 1) -> torch.nn.Module:
    """Make ``model.rotary_pos_emb`` (a GPTModel's RoPE) follow ``layout``; returns ``model``.

    A model without RoPE (learned_absolute / none position embeddings) is returned unchanged:
    its positions come from the sliced ``position_ids``. YaRN and multimodal RoPE keep Megatron's
    zigzag slicing, so they are accepted only without CP.
    """
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return model
    if type(rope) is RotaryEmbedding or isinstance(rope, LayoutRotaryEmbedding):
        model.rotary_pos_emb = LayoutRotaryEmbedding(rope, layout, cp_group, stripe)
    elif cp_group is not None and dist.get_world_size(cp_group) > 1:
        raise ValueError(f"{type(rope).__name__} is not supported with context parallelism under "
                         "megatron-burst: use --position-embedding-type rope, learned_absolute or "
                         "none")
    return model
