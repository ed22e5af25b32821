"""megatron-burst's command-line flags: one argparse group (and a second for linear attention).

:func:`add_args` works as Megatron-LM's ``extra_args_provider`` (the patched ``pretrain_gpt.py``)
and in :mod:`megatron_burst.train`'s parser. This module only defines the flags; turning parsed
args into options is :mod:`megatron_burst.megatron.from_args`, the options themselves are
:mod:`megatron_burst.megatron.options`.
"""
from __future__ import annotations

import argparse
from typing import Union

from megatron_burst.algorithms import CP_ALGOS
from megatron_burst.megatron.comm_types import STOCK_ATTENTION
from megatron_burst.megatron.linear_variants import LINEAR_ATTENTION_TYPES
from megatron_burst.megatron.options import CP_LAYOUTS, DEFAULT_CP_LAYOUT, DEFAULT_LINEAR_CP_ALGO, LINEAR_CP_ALGOS
from megatron_burst.topology import RING_SHAPES

__all__ = ["add_args", "linear_attention_freq_type"]


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


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-burst's flags to ``parser`` (one argument group) and return it.

    ``--cp-algo`` (ring/burst/auto), ``--cp-layout`` (contiguous/zigzag/striped/balanced), ``--cp-stripe``,
    ``--cp-ring`` (flat/double), ``--cp-ranks-per-node``, ``--seq-selective-ckpt-ratio`` and
    ``--fused-lm-loss``, ``--te-free-fusions``, the ``--sparse-*`` flags; and, in a second group, ``--linear-attention-type``,
    ``--linear-attention-freq`` (Megatron-LM's own flag: added only when the parser lacks it) and
    ``--linear-cp-algo``; see each flag's help. Usable as Megatron-LM's ``extra_args_provider``
    (which must return the parser).
    """
    group = parser.add_argument_group("megatron-burst", "context-parallel attention")
    group.add_argument("--cp-algo", type=str, default=None, choices=list(CP_ALGOS) + [STOCK_ATTENTION],
                       help="context-parallel attention algorithm: ring, burst (ring forward, "
                            "BurstAttention backward), auto (the cost model's pick, megatron_burst.cost_model), "
                            "allgather, ulysses (all-to-all of heads), usp (Ulysses groups of "
                            "--hierarchical-context-parallel-sizes' first entry, a ring across). Default: the value of "
                            "--cp-comm-type when it names one of ours, else 'burst'. "
                            "Megatron-LM's default --cp-comm-type p2p counts as 'ring' only when "
                            "--cp-algo is not given. 'none' keeps Megatron's own attention and "
                            "zigzag slicing (megatron-burst changes nothing in the model then, "
                            "except --fused-lm-loss if given)")
    group.add_argument("--cp-layout", type=str, default=DEFAULT_CP_LAYOUT, choices=list(CP_LAYOUTS),
                       help="how the sequence is split over CP ranks; batches and RoPE follow it "
                            f"(default {DEFAULT_CP_LAYOUT}, Megatron's own). 'balanced' places each batch's "
                            "packed documents (--reset-attention-mask EOD documents, or packed THD sequences): "
                            "short documents whole on one rank, long ones split over several, every rank "
                            "S / CP tokens of equal attention work, and K,V sent only to the ranks whose "
                            "documents need them; planned once per batch (megatron_burst.plan_dispatch). "
                            "It needs documents to matter: without them a batch is one document [0, S], "
                            "which the planner splits zigzag-style over all ranks. Not with linear-attention "
                            "or Gated DeltaNet layers")
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
    group.add_argument("--te-free-fusions", action="store_true",
                       help="where neither TransformerEngine nor apex is installed, give megatron.core fused "
                            "kernels for what it otherwise runs unfused: RoPE (a Triton kernel; Megatron-LM's "
                            "default --rope-fusion then works without TE), Adam (torch's fused Adam instead of "
                            "the foreach AdamW) and the gradient norm / clipping / parameter copy (torch _foreach "
                            "ops instead of per-tensor loops). Same math; what TE or apex provide is kept "
                            "(megatron_burst.megatron.te_free)")
    group.add_argument("--sparse-attention", type=str, default="none", choices=["none", "vertical_slash"],
                       help="vertical_slash: MTraining's dynamic vertical-slash sparse attention in every "
                            "softmax layer (estimated per step from the last --sparse-last-q queries; ring or "
                            "burst; use --cp-layout striped --cp-stripe 64 for its balanced sparse ring)")
    group.add_argument("--sparse-budget", type=float, nargs=2, default=[0.9, 0.9], metavar=("P_V", "P_S"),
                       help="top-p budgets of the vertical and slash attention mass (default 0.9 0.9)")
    group.add_argument("--sparse-last-q", type=int, default=64, metavar="N",
                       help="queries (the last N of the sequence) the dynamic pattern is estimated from (default 64)")
    group.add_argument("--sparse-slash-lines", type=str, default="offsets", choices=["offsets", "pools"],
                       help="slash lines of the dynamic pattern: the top offsets (MTraining's Algorithm 1) or every "
                            "offset of the top 64-offset pools (runs that CUDA computes as dense blocks)")
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
                            f"per-rank states) or lasp1 (a ring of states; the fixed layouts only, not "
                            f"packed THD batches or --cp-layout balanced) (default {DEFAULT_LINEAR_CP_ALGO})")
    return parser

