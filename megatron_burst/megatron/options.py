"""The options megatron-burst's Megatron layers run with, as data.

They are built once at the flag boundary -- :func:`megatron_burst.megatron.from_args.options_from_args`
for Megatron-LM's parsed args (the patched ``pretrain_gpt.py``, :mod:`megatron_burst.megatron.megatron_lm`)
and for :mod:`megatron_burst.train` -- and handed down through the layer specs' params
(``cp_options=`` of :func:`megatron_burst.specs.get_gpt_layer_spec` / ``swap_core_attention``).
The layers never read Megatron-LM's global args.

* :class:`CPOptions` -- the softmax core attention's (algorithm, layout, ring, selective
  checkpointing, USP size, sparse pattern, per-layer comm types); :func:`make_cp_options`
  validates and resolves them.
* :class:`LinearCPOptions` -- a linear-attention layer's CP options (:func:`make_linear_cp_options`).
* :class:`LinearAttentionOptions` -- which layers are linear, and of which variant.
* :class:`BurstOptions` -- all of the above for one model, what the flag boundary builds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from megatron_burst.masks.layout import BALANCED, LAYOUTS, check_layout
from megatron_burst.megatron.comm_types import DEFAULT_CP_ALGO, PER_LAYER, STOCK_ATTENTION, resolve_cp_algo
from megatron_burst.topology import RING_SHAPES, check_ranks_per_node

DEFAULT_CP_LAYOUT = "zigzag"  # what stock Megatron-LM slices batches and RoPE in
# What --cp-layout takes: the fixed layouts, and "balanced", placed per batch by its packed documents
# (the batch slicing plans it, and the plan travels to every layer and RoPE in packed_seq_params).
CP_LAYOUTS = LAYOUTS + (BALANCED,)
# Linear attention's CP algorithms (megatron_burst.linear_attention's ``algo``) and the narrowest
# stripe its chunked op accepts for --cp-layout striped.
LINEAR_CP_ALGOS = ("lasp2", "lasp1")
DEFAULT_LINEAR_CP_ALGO = "lasp2"
LINEAR_MIN_STRIPE = 64

__all__ = ["DEFAULT_CP_ALGO", "STOCK_ATTENTION", "PER_LAYER", "DEFAULT_CP_LAYOUT", "CP_LAYOUTS", "LINEAR_CP_ALGOS",
           "DEFAULT_LINEAR_CP_ALGO", "LINEAR_MIN_STRIPE", "CPOptions", "make_cp_options", "LinearCPOptions",
           "make_linear_cp_options", "LinearAttentionOptions", "linear_attention_pattern", "BurstOptions"]


@dataclass(frozen=True)
class CPOptions:
    """Resolved context-parallel attention options (what the core attention and the data use)."""

    algo: str
    layout: str
    stripe: int = 1
    ring: Optional[str] = None  # flat | double | None (double when the CP group spans nodes)
    ranks_per_node: Optional[int] = None  # CP ranks per node; None: from the launcher
    selective_ckpt_ratio: Optional[float] = None  # fraction of (out, lse) stored under recompute
    ulysses_size: Optional[int] = None  # USP's Ulysses group size (Megatron's hierarchical CP sizes[0])
    # MTraining's dynamic vertical-slash pattern (--sparse-attention vertical_slash): (p_v, p_s, last_q)
    sparse: Optional[tuple] = None
    # Megatron's per-layer --cp-comm-type list (algo is PER_LAYER then): layer L runs entry L - 1
    layer_comm_types: Optional[tuple] = None
    # --cp-algo as given (None: ``algo`` came from --cp-comm-type or the default). Provenance, not an
    # option: a layer spec may fix another algorithm unless the user typed this one.
    requested_algo: Optional[str] = field(default=None, compare=False)


def make_cp_options(cp_algo: Optional[str] = None, cp_layout: Optional[str] = None,
                    cp_stripe: Optional[int] = None,
                    cp_comm_type: Union[str, Sequence[str], None] = None, cp_ring: Optional[str] = None,
                    cp_ranks_per_node: Optional[int] = None,
                    seq_selective_ckpt_ratio: Optional[float] = None,
                    hierarchical_cp_sizes: Optional[Sequence[int]] = None,
                    ulysses_size: Optional[int] = None, *, sparse: Optional[Sequence] = None,
                    layer_comm_types: Optional[Sequence[str]] = None) -> CPOptions:
    """Validate and resolve CP options; ``None`` means "the default".

    ``hierarchical_cp_sizes`` is Megatron's ``--hierarchical-context-parallel-sizes`` [a2a, p2p]:
    for usp its first entry is the Ulysses group size (``ulysses_size`` gives it directly).
    ``sparse``: (p_v, p_s, last_q) of the dynamic vertical-slash pattern. A ``cp_comm_type`` list
    naming several algorithms (Megatron's per-layer form) is kept as ``layer_comm_types``.
    """
    if cp_ring is not None and cp_ring not in RING_SHAPES:
        raise ValueError(f"cp_ring={cp_ring!r}: choose one of {', '.join(RING_SHAPES)} (--cp-ring)")
    if cp_ranks_per_node is not None:
        check_ranks_per_node(None, cp_ranks_per_node)
    if seq_selective_ckpt_ratio is not None and not 0.0 < seq_selective_ckpt_ratio <= 1.0:
        raise ValueError(f"seq_selective_ckpt_ratio={seq_selective_ckpt_ratio}: the stored fraction must be in "
                         "(0, 1] (--seq-selective-ckpt-ratio; 0.5 stores the later half of each sequence)")
    algo = resolve_cp_algo(cp_algo, cp_comm_type)
    layout = cp_layout if cp_layout is not None else DEFAULT_CP_LAYOUT
    stripe = 1 if cp_stripe is None else cp_stripe
    if layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout={layout!r} is not a layout: choose one of {', '.join(CP_LAYOUTS)} "
                         "(--cp-layout)")
    try:
        check_layout(layout, stripe)
    except ValueError as exc:
        raise ValueError(f"{exc} (--cp-stripe applies to --cp-layout striped only)") from None
    if ulysses_size is not None and (not isinstance(ulysses_size, int) or ulysses_size < 1):
        raise ValueError(f"cp_ulysses_size={ulysses_size!r} must be a positive int")
    if hierarchical_cp_sizes and ulysses_size is None:
        sizes = [int(x) for x in hierarchical_cp_sizes]
        if len(sizes) != 2 or min(sizes) < 1:
            raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: give two sizes, "
                             "the all-to-all (Ulysses) group and the ring across those groups (a2a+p2p / usp)")
        ulysses_size = sizes[0]
    if algo == "usp" and ulysses_size is None:
        raise ValueError("--cp-comm-type a2a+p2p (--cp-algo usp) needs --hierarchical-context-parallel-sizes U R: "
                         "U ranks per all-to-all group, R = CP / U groups in the ring")
    if sparse is not None:
        sparse = tuple(sparse)
        if len(sparse) not in (3, 4):
            raise ValueError(f"cp_sparse={sparse!r}: give (p_v, p_s, last_q[, slash_lines]) of the vertical-slash "
                             "pattern (--sparse-budget P_V P_S, --sparse-last-q N, --sparse-slash-lines)")
    if layer_comm_types is None and algo == PER_LAYER:
        layer_comm_types = cp_comm_type
    if layer_comm_types is not None:
        layer_comm_types = tuple(layer_comm_types)
    return CPOptions(algo=algo, layout=layout, stripe=stripe, ring=cp_ring, ranks_per_node=cp_ranks_per_node,
                     selective_ckpt_ratio=seq_selective_ckpt_ratio, ulysses_size=ulysses_size, sparse=sparse,
                     layer_comm_types=layer_comm_types, requested_algo=cp_algo)


@dataclass(frozen=True)
class LinearCPOptions:
    """Resolved options of a linear-attention layer under context parallelism."""

    algo: str  # lasp2 | lasp1
    layout: str
    stripe: int = 1


def make_linear_cp_options(linear_cp_algo: Optional[str] = None, cp_layout: Optional[str] = None,
                           cp_stripe: Optional[int] = None) -> LinearCPOptions:
    """Validate and resolve a linear layer's CP options; ``None`` means "the default"."""
    algo = DEFAULT_LINEAR_CP_ALGO if linear_cp_algo is None else linear_cp_algo
    if algo not in LINEAR_CP_ALGOS:
        raise ValueError(f"linear_cp_algo={algo!r}: choose one of {', '.join(LINEAR_CP_ALGOS)} (--linear-cp-algo)")
    opts = make_cp_options(None, cp_layout, cp_stripe)  # the layout rules are the softmax layers'
    return LinearCPOptions(algo=algo, layout=opts.layout, stripe=opts.stripe)


@dataclass(frozen=True)
class LinearAttentionOptions:
    """Resolved linear-attention flags (``--linear-attention-type/-freq``, ``--linear-cp-algo``)."""

    type: str  # a variant of megatron_burst.megatron.linear_variants
    pattern: tuple  # one entry per decoder layer: 1 = linear attention, 0 = softmax
    cp_algo: str  # lasp2 | lasp1


def linear_attention_pattern(num_layers: int, freq: Union[int, Sequence[int], None]) -> list:
    """Per-layer pattern, 1 = linear attention, 0 = softmax, from ``linear_attention_freq`` with
    Megatron-Core's meaning (``get_linear_attention_pattern``): int N -> every N-th layer softmax
    ([1,1,1,0,...] for N = 4); a list -> itself (one entry per layer); None -> every layer linear."""
    if freq is None:
        return [1] * num_layers
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--linear-attention-freq {freq}: N must be >= 1 (every N-th layer is softmax "
                             "attention; 1 means none is linear)")
        return [0 if (i + 1) % freq == 0 else 1 for i in range(num_layers)]
    pattern = list(freq)
    if len(pattern) != num_layers:
        raise ValueError(f"--linear-attention-freq has {len(pattern)} entries but the model has --num-layers "
                         f"{num_layers}: give one 0 (softmax) or 1 (linear) per layer")
    if any(p not in (0, 1) for p in pattern):
        raise ValueError(f"--linear-attention-freq {pattern}: entries must be 0 (softmax) or 1 (linear)")
    return pattern


@dataclass(frozen=True)
class BurstOptions:
    """Everything megatron-burst's flags decide for one model: built once at the flag boundary
    (:func:`megatron_burst.megatron.from_args.options_from_args`), then passed down as data.

    ``cp`` goes to every softmax core attention (the layer spec's ``cp_options``), ``linear`` says
    which layers become linear attention (None: none), ``fused_lm_loss`` switches the model's loss,
    ``te_free_fusions`` installs :mod:`megatron_burst.megatron.te_free` before the model is built.
    """

    cp: CPOptions
    linear: Optional[LinearAttentionOptions] = None
    fused_lm_loss: bool = False
    te_free_fusions: bool = False

    @property
    def stock_attention(self) -> bool:
        """``--cp-algo none``: Megatron's own attention, RoPE and slicing stay."""
        return self.cp.algo == STOCK_ATTENTION
