"""The linear-attention variants of :class:`~megatron_burst.megatron.linear_attention.LinearSelfAttention`,
as data, and their fixed decay schedules.

Every variant runs the same recurrence (per head, global token order; see
:func:`megatron_burst.linear.reference.naive_linear_attention`)::

    S_t = diag(exp(g_t)) S_{t-1} + phi(k_t)^T psi(v_t),    o_t = scale * phi(q_t) S_t

and then ``y = W_O (gate(x) * Norm_head(o))``. What differs is the data below. Head sizes follow
Megatron's config for every variant (``--kv-channels`` for keys and values), so softmax and linear
layers of one model share one head dimension; the papers' own key/value expansions (GLA 0.5x
keys, RetNet 2x values) are not reproduced. The output norm is per head with a per-channel affine
(RetNet's GroupNorm), so under tensor parallelism it stays local to a rank's heads.

Definitions implemented (and where they come from):

* ``basic`` -- Katharopoulos et al. 2020, "Transformers are RNNs" (arXiv:2006.16236), eq. 7 with
  their feature map phi(x) = elu(x) + 1 (sec. 3.2.1) on q and k; without the denominator
  phi(q_t) sum_j phi(k_j): like LASP-2's "basic linear attention" (O = Q K^T V under the causal
  mask) and flash-linear-attention's ``LinearAttention`` (normalize=False, output_norm='rmsnorm'),
  a per-head RMSNorm normalizes the output instead. Scale 1/sqrt(dk), no decay, no output gate.
* ``lightning`` -- Lightning Attention / TNL (Qin et al. 2024, arXiv:2405.17381; TransNormerLLM,
  arXiv:2307.14995): q, k, v through SiLU, no scale (scale 1), per-head constant decay
  lambda_h = exp(-s_h) with s_h ALiBi's slopes times a layer factor (:func:`lightning_log_decay`,
  as OpenNLPLab's reference module ``lightning-attention/examples/module/tnl_attn.py`` builds it),
  LayerNorm on the output, and a sigmoid output gate from a low-rank projection
  hidden -> head_dim -> hidden. TNL normalizes over all heads at once; here per head (see above).
* ``retention`` -- RetNet (Sun et al. 2023, arXiv:2307.08621), sec. 2.2 "Gated Multi-Scale
  Retention": gamma_h = 1 - 2^(-5-h) per head (:func:`retention_log_decay`), rotary rotation of q
  and k (Theta: the model's RoPE rows, so it follows the CP layout), keys scaled by 1/sqrt(dk),
  GroupNorm over heads, swish output gate: MSR(X) = (swish(X W_G) * GroupNorm(Y)) W_O.
* ``gla`` -- Gated Linear Attention (Yang et al. 2024, arXiv:2312.06635), sec. 4.4: per key
  channel gates alpha_t = sigmoid(x_t W_a1 W_a2 + b_a)^(1/tau), tau = 16, through a rank-16
  projection (so g_t = logsigmoid(.) / 16), no feature map, scale 1/sqrt(dk), per-head norm and
  swish output gate: y = (swish(x W_r) * Norm_head(o)) W_O. The norm is RMSNorm as in the authors'
  flash-linear-attention ``GatedLinearAttention`` (the paper writes a per-head LayerNorm).

Key/value heads: ``basic``, ``retention`` and ``gla`` share them GQA-style (``--num-query-groups``
heads, repeated to the query heads; GLA's gates with its keys), as flash-linear-attention's layers
do with ``num_kv_heads``; TNL defines no sharing, so ``lightning`` uses one key/value head per query
head whatever ``--num-query-groups`` says for the softmax layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

GLA_GATE_RANK = 16  # GLA's low-rank gate projection (sec. 4.4)
GLA_GATE_TEMPERATURE = 16.0  # tau: alpha = sigmoid(.)^(1/tau)


@dataclass(frozen=True)
class LinearAttentionVariant:
    """What distinguishes one linear-attention variant (see the module docstring for sources)."""

    name: str
    qk_feature_map: Optional[str]  # None | "elu+1" | "silu": phi on q and k
    v_feature_map: Optional[str]  # None | "silu": psi on v
    decay: Optional[str]  # None | "lightning" | "retention" (per head, fixed) | "gla" (per key channel, learned)
    scale: Optional[float]  # None: 1/sqrt(dk)
    shared_kv_heads: bool  # keys/values (and GLA's gates) use --num-query-groups heads
    output_norm: str  # per head: "rmsnorm" | "layernorm"
    output_gate: Optional[str]  # None | "swish" (full rank, fused into linear_qkv) | "sigmoid_low_rank"
    rotary: bool  # rotate q and k with the model's RoPE rows (RetNet's Theta)

    def low_rank_dim(self, head_dim: int) -> Optional[int]:
        """Inner size of this variant's low-rank projection (None: it has none)."""
        if self.decay == "gla":
            return GLA_GATE_RANK
        if self.output_gate == "sigmoid_low_rank":
            return head_dim  # TNL: hidden -> head_dim -> hidden
        return None


VARIANTS: Dict[str, LinearAttentionVariant] = {
    v.name: v for v in (
        LinearAttentionVariant("basic", qk_feature_map="elu+1", v_feature_map=None, decay=None, scale=None,
                               shared_kv_heads=True, output_norm="rmsnorm", output_gate=None, rotary=False),
        LinearAttentionVariant("lightning", qk_feature_map="silu", v_feature_map="silu", decay="lightning",
                               scale=1.0, shared_kv_heads=False, output_norm="layernorm",
                               output_gate="sigmoid_low_rank", rotary=False),
        LinearAttentionVariant("retention", qk_feature_map=None, v_feature_map=None, decay="retention", scale=None,
                               shared_kv_heads=True, output_norm="layernorm", output_gate="swish", rotary=True),
        LinearAttentionVariant("gla", qk_feature_map=None, v_feature_map=None, decay="gla", scale=None,
                               shared_kv_heads=True, output_norm="rmsnorm", output_gate="swish", rotary=False),
    )
}
GATED_DELTA_NET = "gated_delta_net"  # Megatron-Core's GatedDeltaNet layer (megatron_burst.megatron.gated_delta_net)
LINEAR_ATTENTION_TYPES = tuple(VARIANTS) + (GATED_DELTA_NET,)


def get_variant(name: str) -> LinearAttentionVariant:
    """The variant called ``name``; ValueError naming the choices otherwise."""
    if name not in VARIANTS:
        raise ValueError(f"linear_attention={name!r} is not a linear-attention variant: choose one of "
                         f"{', '.join(VARIANTS)} (--linear-attention-type)")
    return VARIANTS[name]


def alibi_slopes(num_heads: int) -> List[float]:
    """ALiBi's head slopes (Press et al. 2022), which Lightning Attention uses as decay rates:
    2^(-8 i / n) for i = 1..n when n is a power of two; otherwise those of the power of two below
    n, then every other slope of twice that power."""
    def power_of_two(n: int) -> List[float]:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    if num_heads & (num_heads - 1) == 0:
        return power_of_two(num_heads)
    below = 2 ** int(math.floor(math.log2(num_heads)))
    return power_of_two(below) + power_of_two(2 * below)[0::2][: num_heads - below]


def lightning_log_decay(num_heads: int, layer_index: int, num_layers: int) -> torch.Tensor:
    """Lightning/TNL per-head log-decay [num_heads] (fp32): -s_h * (1 - l / (L - 1) + 1e-5).

    ``layer_index`` l is 0-based over all L = ``num_layers`` decoder layers (softmax ones
    included): the first layer decays fastest, the last barely (factor 1e-5), as TNL's module
    builds it. We keep this layer factor (Linear-MoE drops it) because it is part of the published
    model. With a single layer the factor is 1 + 1e-5.
    """
    factor = 1.0 + 1e-5 if num_layers <= 1 else 1.0 - layer_index / (num_layers - 1) + 1e-5
    return -torch.tensor(alibi_slopes(num_heads), dtype=torch.float32) * factor


def retention_log_decay(num_heads: int) -> torch.Tensor:
    """RetNet's per-head log-decay [num_heads] (fp32): log(1 - 2^(-5 - h)), h = 0..num_heads-1."""
    h = torch.arange(num_heads, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -5.0 - h)).to(torch.float32)
