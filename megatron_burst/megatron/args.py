"""Command-line flags of megatron-burst and how they resolve into attention options.

``add_args`` works as Megatron-LM's ``extra_args_provider`` and in :mod:`megatron_burst.train`.
This module is the flag boundary: it is the only place that reads Megatron-LM's global args
(:func:`megatron_lm_cp_flags`); everything below it takes explicit values.
"""
from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from megatron_burst.algorithms import CP_ALGOS
from megatron_burst.layout import LAYOUTS, check_layout, check_seq_len
from megatron_burst.megatron.linear_variants import GATED_DELTA_NET, LINEAR_ATTENTION_TYPES, get_variant
from megatron_burst.topology import RING_SHAPES, check_ranks_per_node

DEFAULT_CP_ALGO = "burst"
# --cp-algo none: keep Megatron's own core attention (and its zigzag slicing); the opt-out
STOCK_ATTENTION = "none"
DEFAULT_CP_LAYOUT = "zigzag"  # what stock Megatron-LM slices batches and RoPE in
# Linear attention's CP algorithms (megatron_burst.linear_attention's ``algo``) and the narrowest
# stripe its chunked op accepts for --cp-layout striped.
LINEAR_CP_ALGOS = ("lasp2", "lasp1")
DEFAULT_LINEAR_CP_ALGO = "lasp2"
LINEAR_MIN_STRIPE = 64

# Megatron-LM's --cp-comm-type values (Transformer Engine's CP implementations) and ours for them.
# "p2p" (Megatron-LM's default, also what you get when you never typed the flag) is TE's ring
# exchange of KV blocks, so it maps to our "ring"; "a2a" is Ulysses, "allgather"/"all_gather"
# (Megatron's / TE's spelling) the all-gather CP, "a2a+p2p" USP with Megatron's
# --hierarchical-context-parallel-sizes [a2a size, p2p size].
_TE_RING_NAME = "p2p"
COMM_TYPE_ALGOS = {"a2a": "ulysses", "allgather": "allgather", "all_gather": "allgather", "a2a+p2p": "usp"}
# a --cp-comm-type list naming different algorithms per layer: each layer resolves its own
PER_LAYER = "per-layer"


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


def resolve_cp_algo(cp_algo: Optional[str], cp_comm_type: Union[str, Sequence[str], None]) -> str:
    """The attention algorithm from our ``--cp-algo`` and Megatron's ``--cp-comm-type``.

    Rules, in order:
      * ``cp_comm_type`` naming one of ``CP_ALGOS`` selects it; an explicit ``cp_algo`` must agree.
      * ``cp_comm_type="p2p"`` (Megatron-LM's default) is TE's ring: it means ``ring`` unless
        ``cp_algo`` is given, which then wins (the default is indistinguishable from a typed p2p).
      * Megatron's other values: ``a2a`` -> ulysses, ``allgather``/``all_gather`` -> allgather,
        ``a2a+p2p`` -> usp (an explicit ``cp_algo`` must agree); anything else raises ValueError.
      * otherwise ``cp_algo``, or ``"burst"`` when neither is set.
    A per-layer list (Megatron's form) naming one value is that value; naming several returns
    ``PER_LAYER`` (each layer then resolves its own entry) after checking every entry.
    """
    if cp_algo == STOCK_ATTENTION:  # Megatron's own attention handles --cp-comm-type itself
        return STOCK_ATTENTION
    if cp_algo is not None and cp_algo not in CP_ALGOS:
        raise ValueError(f"cp_algo={cp_algo!r} is not a megatron-burst algorithm: choose one of "
                         f"{', '.join(CP_ALGOS)}, or {STOCK_ATTENTION} for Megatron's own (--cp-algo)")
    comm = cp_comm_type
    if isinstance(comm, (list, tuple)):
        distinct = sorted(set(comm))
        if len(distinct) > 1:
            if cp_algo is not None:
                raise ValueError(f"--cp-algo {cp_algo} runs in every layer, but --cp-comm-type {' '.join(comm)} "
                                 "names an algorithm per layer: drop one of them")
            for entry in distinct:
                resolve_cp_algo(None, entry)
            return PER_LAYER
        comm = distinct[0] if distinct else None
    if comm is None:
        return cp_algo or DEFAULT_CP_ALGO
    if comm in CP_ALGOS:
        if cp_algo is not None and cp_algo != comm:
            raise ValueError(f"conflicting algorithms: --cp-algo {cp_algo} but --cp-comm-type {comm}; "
                             "set one of them (or the same value in both)")
        return comm
    if comm == _TE_RING_NAME:
        return cp_algo or "ring"
    if comm in COMM_TYPE_ALGOS:
        ours = COMM_TYPE_ALGOS[comm]
        if cp_algo is not None and cp_algo != ours:
            raise ValueError(f"conflicting algorithms: --cp-algo {cp_algo} but --cp-comm-type {comm} (= {ours}); "
                             "set one of them")
        return ours
    raise ValueError(f"--cp-comm-type {comm} is not a context-parallel communication type: use one of "
                     f"{', '.join([_TE_RING_NAME] + list(COMM_TYPE_ALGOS))} (Megatron's) or {', '.join(CP_ALGOS)}, "
                     "or --cp-algo")


# A Gated DeltaNet layer has one CP exchange, an all-gather of per-segment state maps. It serves the
# --cp-comm-type values naming a ring (p2p, Megatron-LM's default; ring, burst, auto) or an all-gather
# (allgather, all_gather): the result is the same, in one collective. Head all-to-alls (a2a, a2a+p2p)
# it does not implement.
GDN_COMM_REFUSED = ("ulysses", "usp")


def check_gated_delta_net_comm_type(comm: Optional[str], layer: Optional[int] = None) -> str:
    """The exchange a Gated DeltaNet layer runs for Megatron's ``cp_comm_type`` value ``comm``
    (what TransformerLayer passes it under CP): "allgather" (its per-segment maps) for p2p,
    allgather/all_gather and ring/burst/auto; ValueError naming the layer and the value for a2a,
    a2a+p2p and values that are not CP communication types."""
    where = f"layer {layer} (gated_delta_net)" if layer is not None else "gated_delta_net"
    algo = resolve_cp_algo(None, comm)  # validates the value, naming it
    if algo in GDN_COMM_REFUSED:
        raise ValueError(f"{where}: --cp-comm-type {comm} exchanges attention heads all-to-all ({algo}), which "
                         "Gated DeltaNet layers do not implement (they all-gather per-segment state maps): give "
                         "the gated_delta_net layers p2p or allgather (Megatron's per-layer --cp-comm-type list, one "
                         "value per layer), or choose ulysses/usp for the softmax layers with --cp-algo and leave "
                         "--cp-comm-type at p2p")
    return "allgather"


def make_cp_options(cp_algo: Optional[str] = None, cp_layout: Optional[str] = None,
                    cp_stripe: Optional[int] = None,
                    cp_comm_type: Union[str, Sequence[str], None] = None, cp_ring: Optional[str] = None,
                    cp_ranks_per_node: Optional[int] = None,
                    seq_selective_ckpt_ratio: Optional[float] = None,
                    hierarchical_cp_sizes: Optional[Sequence[int]] = None,
                    ulysses_size: Optional[int] = None) -> CPOptions:
    """Validate and resolve CP options; ``None`` means "the default".

    ``hierarchical_cp_sizes`` is Megatron's ``--hierarchical-context-parallel-sizes`` [a2a, p2p]:
    for usp its first entry is the Ulysses group size (``ulysses_size`` gives it directly).
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
    if layout not in LAYOUTS:
        raise ValueError(f"cp_layout={layout!r} is not a layout: choose one of {', '.join(LAYOUTS)} "
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
    return CPOptions(algo=algo, layout=layout, stripe=stripe, ring=cp_ring, ranks_per_node=cp_ranks_per_node,
                     selective_ckpt_ratio=seq_selective_ckpt_ratio, ulysses_size=ulysses_size)


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


def linear_attention_freq_type(value: Union[int, str, None]) -> Union[int, list, None]:
    """``--linear-attention-freq`` as Megatron-LM parses it: an int N, "N", or a list expression of
    0/1 such as "([1]*3+[0])*2" (evaluated safely: list literals, + and * only)."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip()
    if "[" not in text:
        return int(text)
    import ast

    def evaluate(node):
        if isinstance(node, ast.List):
            return [evaluate(item) for item in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"--linear-attention-freq {text!r}: only list literals of 0/1 with + and * are "
                         "accepted, e.g. \"([1]*3+[0])*2\"")

    try:
        pattern = evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, TypeError) as exc:
        raise ValueError(f"--linear-attention-freq {text!r} is not a list expression ({exc})") from None
    if not isinstance(pattern, list):
        raise ValueError(f"--linear-attention-freq {text!r} does not evaluate to a list")
    return pattern


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


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-burst's flags to ``parser`` (one argument group) and return it.

    ``--cp-algo`` (ring/burst/auto), ``--cp-layout`` (contiguous/zigzag/striped), ``--cp-stripe``,
    ``--cp-ring`` (flat/double), ``--cp-ranks-per-node``, ``--seq-selective-ckpt-ratio`` and
    ``--fused-lm-loss``; and, in a second group, ``--linear-attention-type``,
    ``--linear-attention-freq`` (Megatron-LM's own flag: added only when the parser lacks it) and
    ``--linear-cp-algo``; see each flag's help. Usable as Megatron-LM's ``extra_args_provider``
    (which must return the parser).
    """
    group = parser.add_argument_group("megatron-burst", "context-parallel attention")
    group.add_argument("--cp-algo", type=str, default=None, choices=list(CP_ALGOS) + [STOCK_ATTENTION],
                       help="context-parallel attention algorithm: ring, burst (ring forward, "
                            "BurstAttention backward), auto (the cost model's pick, megatron_burst.plan), "
                            "allgather, ulysses (all-to-all of heads), usp (Ulysses groups of "
                            "--hierarchical-context-parallel-sizes' first entry, a ring across). Default: the value of "
                            "--cp-comm-type when it names one of ours, else 'burst'. "
                            "Megatron-LM's default --cp-comm-type p2p counts as 'ring' only when "
                            "--cp-algo is not given. 'none' keeps Megatron's own attention and "
                            "zigzag slicing (megatron-burst changes nothing in the model then, "
                            "except --fused-lm-loss if given)")
    group.add_argument("--cp-layout", type=str, default=DEFAULT_CP_LAYOUT, choices=list(LAYOUTS),
                       help="how the sequence is split over CP ranks; batches and RoPE follow it "
                            f"(default {DEFAULT_CP_LAYOUT}, Megatron's own)")
    group.add_argument("--cp-stripe", type=int, default=1,
                       help="tokens per stripe for --cp-layout striped (default 1)")
    group.add_argument("--cp-ring", type=str, default=None, choices=list(RING_SHAPES),
                       help="ring shape: 'double' runs intra-node rings inside an inter-node ring "
                            "(default when the CP group spans nodes), 'flat' one ring")
    group.add_argument("--cp-ranks-per-node", type=int, default=None,
                       help="CP ranks per node for the double ring (default: the launcher's "
                            "LOCAL_WORLD_SIZE / tensor-parallel size, or Megatron's "
                            "--hierarchical-context-parallel-sizes first entry)")
    group.add_argument("--seq-selective-ckpt-ratio", type=float, default=None,
                       help="with activation recompute (--recompute-granularity), store attention "
                            "(out, lse) for this later fraction of each sequence and recompute only "
                            "the earlier part (0.5: half the stored bytes of storing everything, "
                            "1/4 of the attention recompute FLOPs)")
    group.add_argument("--fused-lm-loss", action="store_true",
                       help="while training, compute the LM head and vocab-parallel cross-entropy in "
                            "one fused op that never builds the [s, b, V/tp] logits "
                            "(megatron_burst.fused_linear_cross_entropy)")
    group.add_argument("--sparse-attention", type=str, default="none", choices=["none", "vertical_slash"],
                       help="vertical_slash: MTraining's dynamic vertical-slash sparse attention in every "
                            "softmax layer (estimated per step from the last --sparse-last-q queries; ring or "
                            "burst; use --cp-layout striped --cp-stripe 64 for its balanced sparse ring)")
    group.add_argument("--sparse-budget", type=float, nargs=2, default=[0.9, 0.9], metavar=("P_V", "P_S"),
                       help="top-p budgets of the vertical and slash attention mass (default 0.9 0.9)")
    group.add_argument("--sparse-last-q", type=int, default=64, metavar="N",
                       help="queries (the last N of the sequence) the dynamic pattern is estimated from (default 64)")
    group = parser.add_argument_group("megatron-burst linear attention",
                                      "LASP-2 linear attention and LASP-2H hybrid models")
    group.add_argument("--linear-attention-type", type=str, default=None, choices=list(LINEAR_ATTENTION_TYPES),
                       help="build linear-attention layers of this variant (basic: elu+1 feature map; "
                            "lightning: Lightning Attention's per-head decay; retention: RetNet; gla: gated "
                            "linear attention; gated_delta_net: Megatron-Core's GatedDeltaNet, Qwen3-Next style, "
                            "sized by --linear-num-key-heads etc. under Megatron-LM, by the attention heads in "
                            "megatron_burst.train); which layers follows --linear-attention-freq (default: all)")
    if "--linear-attention-freq" not in parser._option_string_actions:  # Megatron-LM defines it itself
        group.add_argument("--linear-attention-freq", type=linear_attention_freq_type, default=None,
                           help="Megatron-LM's flag: an integer N makes every N-th layer softmax attention and "
                                "the others linear; a list expression such as \"([1]*3+[0])*2\" gives one "
                                "entry per layer, 1 = linear, 0 = softmax (default: every layer linear)")
    group.add_argument("--linear-cp-algo", type=str, default=DEFAULT_LINEAR_CP_ALGO, choices=list(LINEAR_CP_ALGOS),
                       help="context-parallel algorithm of the linear layers: lasp2 (one all-gather of the "
                            f"per-rank states) or lasp1 (a ring of states) (default {DEFAULT_LINEAR_CP_ALGO})")
    return parser


def sparse_from_args(args: argparse.Namespace) -> Optional[tuple]:
    """(p_v, p_s, last_q) of --sparse-attention vertical_slash, validated; None without it."""
    if getattr(args, "sparse_attention", "none") in (None, "none"):
        return None
    from megatron_burst.dynamic_pattern import Dynamic

    p_v, p_s = getattr(args, "sparse_budget", (0.9, 0.9))
    budgets = Dynamic(float(p_v), float(p_s), int(getattr(args, "sparse_last_q", 64)))
    seq = getattr(args, "seq_length", None)
    try:
        budgets.check(seq if seq is not None else budgets.last_q)
    except ValueError as exc:
        raise ValueError(f"--sparse-budget {p_v} {p_s} --sparse-last-q {budgets.last_q}: {exc}") from None
    return (budgets.p_v, budgets.p_s, budgets.last_q)


def cp_options_from_args(args: argparse.Namespace) -> CPOptions:
    """Resolve parsed flags (ours, plus Megatron's ``cp_comm_type`` when present) and validate
    them against ``--seq-length`` and ``--context-parallel-size`` when those are present."""
    opts = make_cp_options(getattr(args, "cp_algo", None), getattr(args, "cp_layout", None),
                           getattr(args, "cp_stripe", None), getattr(args, "cp_comm_type", None),
                           getattr(args, "cp_ring", None), cp_ranks_per_node_from_args(args),
                           getattr(args, "seq_selective_ckpt_ratio", None),
                           getattr(args, "hierarchical_context_parallel_sizes", None))
    ratio = opts.selective_ckpt_ratio
    granularity = getattr(args, "recompute_granularity", "unset")
    if ratio is not None and granularity is None:
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} needs activation recompute: add "
                         "--recompute-granularity selective (core attention) or full")
    modules = getattr(args, "recompute_modules", None)
    if ratio is not None and granularity == "selective" and modules is not None and "core_attn" not in modules:
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} acts on the recompute of core attention, but "
                         f"--recompute-modules {' '.join(modules)} does not recompute it: add core_attn to "
                         "--recompute-modules (or use --recompute-granularity full)")
    if ratio is not None and opts.algo == STOCK_ATTENTION:
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} needs megatron-burst's attention, but --cp-algo "
                         "none keeps Megatron's: drop one of them")
    check_selective_ckpt_algo(ratio, opts.algo)
    seq_length = getattr(args, "seq_length", None)
    cp = getattr(args, "context_parallel_size", None) or 1
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    if sizes:  # Megatron-LM asserts this too; its first entry also sets our ring's ranks per node
        product = 1
        for size in sizes:
            product *= int(size)
        if product != cp:
            raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(str(x) for x in sizes)} multiply to "
                             f"{product}, but they must multiply to --context-parallel-size {cp} (A2A x P2P = CP): "
                             "give such sizes, or drop the flag")
    _check_sparse_flags(args, opts)
    if opts.algo == STOCK_ATTENTION and opts.layout != "zigzag":
        raise ValueError(f"--cp-algo none keeps Megatron's attention, which slices in zigzag only: drop "
                         f"--cp-layout {opts.layout}")
    check_cp_heads(opts, getattr(args, "cp_comm_type", None), cp, getattr(args, "num_attention_heads", None),
                   getattr(args, "num_query_groups", None), getattr(args, "tensor_model_parallel_size", None) or 1)
    if seq_length is not None and cp > 1:  # one rank holds any sequence length
        try:
            check_seq_len(seq_length, cp, opts.layout, opts.stripe)
        except ValueError as exc:
            raise ValueError(f"--seq-length {seq_length} with --context-parallel-size {cp} and "
                             f"--cp-layout {opts.layout}: {exc}") from None
    return opts


def _check_sparse_flags(args: argparse.Namespace, opts: CPOptions) -> None:
    """--sparse-attention vertical_slash runs on the ring/burst schedules of the softmax layers,
    without windows, sequence-selective checkpointing, attention dropout or documents: refuse the
    others at the flags, each naming what to drop."""
    if getattr(args, "sparse_attention", "none") in (None, "none") or opts.algo == STOCK_ATTENTION:
        return
    clash = []
    if opts.algo not in ("ring", "burst"):
        clash.append(f"--cp-algo {opts.algo} (use ring or burst)" if opts.algo != PER_LAYER
                     else "a per-layer --cp-comm-type list (use --cp-algo ring or burst)")
    window = getattr(args, "window_size", None)
    if window:
        from megatron_burst.megatron.attention import layer_window

        config = argparse.Namespace(window_size=window,
                                    window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None))
        num_layers = getattr(args, "num_layers", None) or 1
        if any(layer_window(config, number) is not None for number in range(1, num_layers + 1)):
            clash.append(f"--window-size {','.join(str(x) for x in window)}")
    if opts.selective_ckpt_ratio is not None:
        clash.append(f"--seq-selective-ckpt-ratio {opts.selective_ckpt_ratio}")
    dropout = getattr(args, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        clash.append(f"--attention-dropout {dropout} (pass 0)")
    if getattr(args, "reset_attention_mask", False):
        clash.append("--reset-attention-mask (documents)")
    if clash:
        raise ValueError(f"--sparse-attention vertical_slash runs on the ring/burst schedules alone, over whole "
                         f"causal sequences: drop {'; '.join(clash)}")


def check_selective_ckpt_algo(ratio: Optional[float], algo: str) -> None:
    """Sequence-level selective checkpointing recomputes a prefix of query rows; Ulysses and USP
    compute every row of the head-sharded sequence, so they cannot (``auto`` falls back to a plain
    recompute when it picks them)."""
    if ratio is not None and algo in ("ulysses", "usp"):
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} recomputes part of each sequence, which {algo} cannot "
                         "(it attends every row after its all-to-all): use ring, burst or allgather, or drop the ratio")


def check_cp_heads(opts: CPOptions, cp_comm_type, cp: int, heads: Optional[int], query_groups: Optional[int],
                   tp: int) -> None:
    """Ulysses/USP (any layer's) need the heads per TP rank to split over the all-to-all group, and
    the hierarchical sizes to multiply to the CP size; raise ValueError naming the flags otherwise."""
    from megatron_burst.algorithms.ulysses import check_heads

    if isinstance(cp_comm_type, (list, tuple)):
        algos = {resolve_cp_algo(None, c) for c in cp_comm_type}
    else:
        algos = {opts.algo}
    if cp <= 1 or not algos & {"ulysses", "usp"}:
        return
    if "usp" in algos and (opts.ulysses_size is None or cp % opts.ulysses_size):
        raise ValueError(f"--hierarchical-context-parallel-sizes must multiply to --context-parallel-size {cp} "
                         f"(first entry {opts.ulysses_size}: the all-to-all group size)")
    if heads is None:
        return
    hq, hkv = heads // tp, max(1, (query_groups or heads) // tp)
    for algo in algos & {"ulysses", "usp"}:
        U = cp if algo == "ulysses" else opts.ulysses_size
        try:
            check_heads(hq, hkv, U, algo)
        except ValueError as exc:
            raise ValueError(f"--num-attention-heads {heads} / --num-query-groups {query_groups or heads} over "
                             f"--tensor-model-parallel-size {tp}: {exc}") from None


@dataclass(frozen=True)
class LinearAttentionOptions:
    """Resolved linear-attention flags (``--linear-attention-type/-freq``, ``--linear-cp-algo``)."""

    type: str  # a variant of megatron_burst.megatron.linear_variants
    pattern: tuple  # one entry per decoder layer: 1 = linear attention, 0 = softmax
    cp_algo: str  # lasp2 | lasp1


def linear_options_from_args(args: argparse.Namespace, cp_opts: CPOptions,
                             num_query_groups: Optional[int]) -> Optional[LinearAttentionOptions]:
    """The linear-attention options these flags ask for (None: no linear layers), refusing what the
    linear layers cannot honour, each error naming its flag. ``num_query_groups`` is the model's
    key/value head count (None: one per attention head)."""
    kind = getattr(args, "linear_attention_type", None)
    freq = getattr(args, "linear_attention_freq", None)
    megatron_variant = getattr(args, "experimental_attention_variant", None)
    cp = getattr(args, "context_parallel_size", None) or 1
    if megatron_variant is not None and kind is None and cp > 1 and cp_opts.algo != STOCK_ATTENTION:
        # Megatron's own variant layers have no context parallelism (its config asserts as much for GDN)
        hint = ("megatron-burst runs Megatron-Core's GatedDeltaNet layers under context parallelism itself: pass "
                "--linear-attention-type gated_delta_net instead (same parameters; --linear-attention-freq places "
                "them)" if megatron_variant == GATED_DELTA_NET else
                "megatron-burst's context-parallel attention does not implement it; train it at "
                "--context-parallel-size 1")
        raise ValueError(f"--experimental-attention-variant {megatron_variant} with --context-parallel-size {cp}: "
                         f"{hint}")
    # --reset-attention-mask: the linear layers take the batch's documents as the softmax layers do
    # (the state restarts at every document start, in every layout and --linear-cp-algo)
    if kind is None:
        if freq is not None and megatron_variant is None:
            raise ValueError(f"--linear-attention-freq {freq} has no linear layers to place: add "
                             f"--linear-attention-type ({', '.join(LINEAR_ATTENTION_TYPES)}), or drop it")
        return None
    if megatron_variant is not None:
        raise ValueError(f"--linear-attention-type {kind} and --experimental-attention-variant {megatron_variant} "
                         "both replace attention layers: pass one of them")
    if cp_opts.algo == STOCK_ATTENTION:
        raise ValueError(f"--linear-attention-type {kind} builds megatron-burst's hybrid model, but --cp-algo none "
                         "keeps Megatron's model untouched: drop one of them")
    pattern = tuple(linear_attention_pattern(args.num_layers, freq))
    if kind == GATED_DELTA_NET:
        return _gated_delta_net_options(args, cp_opts, pattern)
    variant = get_variant(kind)
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    cp = getattr(args, "context_parallel_size", None) or 1
    head_dim = getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
    if variant.shared_kv_heads and num_query_groups is not None and num_query_groups % tp:
        raise ValueError(f"--linear-attention-type {kind} shares key/value heads over --num-query-groups "
                         f"{num_query_groups}, which --tensor-model-parallel-size {tp} does not divide: use a "
                         "multiple of the TP size")
    low_rank = variant.low_rank_dim(head_dim)
    if low_rank is not None and low_rank % tp:
        raise ValueError(f"--linear-attention-type {kind}'s low-rank projection has {low_rank} outputs (the head "
                         f"dim --kv-channels for lightning, 16 for gla), which --tensor-model-parallel-size {tp} "
                         "does not divide")
    if variant.rotary and getattr(args, "position_embedding_type", "rope") != "rope":
        raise ValueError(f"--linear-attention-type {kind} rotates queries and keys (RetNet's Theta), but "
                         f"--position-embedding-type is {args.position_embedding_type}: pass "
                         "--position-embedding-type rope")
    if cp > 1 and 1 in pattern and cp_opts.layout == "striped" and cp_opts.stripe < LINEAR_MIN_STRIPE:
        raise ValueError(f"--cp-layout striped with --cp-stripe {cp_opts.stripe}: linear attention runs in chunks "
                         f"of at least {LINEAR_MIN_STRIPE} tokens per stripe under context parallelism; pass "
                         f"--cp-stripe {LINEAR_MIN_STRIPE} or more, or --cp-layout zigzag/contiguous")
    return LinearAttentionOptions(type=kind, pattern=pattern, cp_algo=getattr(args, "linear_cp_algo", None)
                                  or DEFAULT_LINEAR_CP_ALGO)


def _gated_delta_net_options(args: argparse.Namespace, cp_opts: CPOptions, pattern: tuple) -> LinearAttentionOptions:
    """--linear-attention-type gated_delta_net: its CP is one all-gather of per-segment maps (no
    --linear-cp-algo choice); heads split over TP; stripes of at least a chunk."""
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    cp = getattr(args, "context_parallel_size", None) or 1
    algo = getattr(args, "linear_cp_algo", None)
    if algo not in (None, DEFAULT_LINEAR_CP_ALGO):
        raise ValueError(f"--linear-cp-algo {algo}: gated_delta_net always exchanges its per-segment maps in one "
                         f"all-gather (LASP-2 style); drop --linear-cp-algo or pass {DEFAULT_LINEAR_CP_ALGO}")
    # Megatron-LM sizes the layers by its own --linear-* flags (megatron_burst.train by the attention's)
    sizes = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
             "linear_num_value_heads")
    unset = [f"--{name.replace('_', '-')}" for name in sizes if hasattr(args, name) and getattr(args, name) is None]
    if 1 in pattern and unset:
        raise ValueError(f"--linear-attention-type gated_delta_net sizes its layers by {', '.join(unset)}: set "
                         "them (Qwen3-Next: 4, 128, 128, 16, 32)")
    key_heads = getattr(args, "linear_num_key_heads", None) or getattr(args, "num_query_groups", None) \
        or args.num_attention_heads
    if key_heads % tp:
        raise ValueError(f"--linear-attention-type gated_delta_net: {key_heads} key heads cannot be split over "
                         f"--tensor-model-parallel-size {tp}")
    comm = getattr(args, "cp_comm_type", None)
    if cp > 1 and comm is not None:  # what Megatron's TransformerLayer hands each layer under CP
        per_layer = list(comm) if isinstance(comm, (list, tuple)) else [comm]
        if len(per_layer) == 1:
            per_layer = per_layer * len(pattern)
        for number, (entry, linear) in enumerate(zip(per_layer, pattern), start=1):
            if linear:
                check_gated_delta_net_comm_type(entry, number)
    if cp > 1 and 1 in pattern and cp_opts.layout == "striped" and cp_opts.stripe < LINEAR_MIN_STRIPE:
        raise ValueError(f"--cp-layout striped with --cp-stripe {cp_opts.stripe}: gated_delta_net runs in chunks of "
                         f"at least {LINEAR_MIN_STRIPE} tokens per stripe under context parallelism; pass "
                         f"--cp-stripe {LINEAR_MIN_STRIPE} or more, or --cp-layout zigzag/contiguous")
    return LinearAttentionOptions(type=GATED_DELTA_NET, pattern=pattern, cp_algo=DEFAULT_LINEAR_CP_ALGO)


def cp_ranks_per_node_from_args(args: argparse.Namespace) -> Optional[int]:
    """``--cp-ranks-per-node``, else Megatron's ``--hierarchical-context-parallel-sizes`` (inner size)."""
    explicit = getattr(args, "cp_ranks_per_node", None)
    if explicit is not None:
        return explicit
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    return int(sizes[0]) if sizes else None


def default_cp_ranks_per_node(cp_size: int, tp_size: int) -> int:
    """CP ranks per node from the launcher (torchrun's LOCAL_WORLD_SIZE): Megatron orders ranks
    tensor-parallel fastest, then context-parallel, so a node holds LOCAL_WORLD_SIZE / TP CP ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local <= 0:
        if cp_size > 1:
            warnings.warn(f"megatron-burst: the launcher sets no LOCAL_WORLD_SIZE, so the {cp_size} CP ranks "
                          "are taken to share one node (a flat ring); if they span nodes, pass "
                          "--cp-ranks-per-node (or --hierarchical-context-parallel-sizes) for the double ring")
        return cp_size
    per_node = max(1, local // max(1, tp_size))
    if per_node >= cp_size:
        return cp_size
    if cp_size % per_node:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} with TP={tp_size} gives {per_node} CP ranks per node, "
                         f"which does not divide CP={cp_size}: set --cp-ranks-per-node")
    return per_node


def check_cp_dropout(attention_dropout: float, cp_size: int) -> None:
    """Raise ValueError for attention dropout under CP (the one place this is validated)."""
    if attention_dropout > 0 and cp_size > 1:
        raise ValueError(f"attention dropout {attention_dropout} is not supported with context parallelism "
                         f"(--context-parallel-size {cp_size}): pass --attention-dropout 0.0 "
                         "(TransformerConfig.attention_dropout=0.0)")


def megatron_lm_cp_flags() -> Optional[argparse.Namespace]:
    """Megatron-LM's parsed global args when Megatron-LM is running and our flags were added.

    Lets the module-level ``megatron_burst.specs.gpt_layer_spec`` (imported by Megatron-LM's
    ``--spec``, before any of our code sees the args) pick up ``--cp-algo/--cp-layout``.
    Returns None outside Megatron-LM (megatron-core alone has no global args).
    """
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    if args is None or not hasattr(args, "cp_layout"):
        return None
    return args
