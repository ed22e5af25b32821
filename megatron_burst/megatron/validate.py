"""Refusals: combinations megatron-burst cannot honour, each raising ValueError that names the flag
to change. They take explicit values (no parsed args), so the flag boundary
(:mod:`megatron_burst.megatron.from_args`) and the layers (at construction) share them.
"""
from __future__ import annotations

from typing import Optional, Sequence

from megatron_burst.megatron.comm_types import STOCK_ATTENTION, resolve_cp_algo
from megatron_burst.megatron.options import CPOptions

__all__ = ["check_cp_dropout", "check_selective_ckpt_algo", "check_selective_recompute", "check_cp_heads",
           "check_hierarchical_cp_sizes"]


def check_cp_dropout(attention_dropout: float, cp_size: int) -> None:
    """Raise ValueError for attention dropout under CP (the one place this is validated)."""
    if attention_dropout > 0 and cp_size > 1:
        raise ValueError(f"attention dropout {attention_dropout} is not supported with context parallelism "
                         f"(--context-parallel-size {cp_size}): pass --attention-dropout 0.0 "
                         "(TransformerConfig.attention_dropout=0.0)")


def check_selective_ckpt_algo(ratio: Optional[float], algo: str) -> None:
    """Sequence-level selective checkpointing recomputes a prefix of query rows; Ulysses and USP
    compute every row of the head-sharded sequence, so they cannot (``auto`` falls back to a plain
    recompute when it picks them)."""
    if ratio is not None and algo in ("ulysses", "usp"):
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} recomputes part of each sequence, which {algo} cannot "
                         "(it attends every row after its all-to-all): use ring, burst or allgather, or drop the ratio")


def check_selective_recompute(ratio: Optional[float], algo: str, granularity: Optional[str] = "unset",
                              modules: Optional[Sequence[str]] = None) -> None:
    """--seq-selective-ckpt-ratio acts on the recompute of core attention: it needs
    ``--recompute-granularity full``, or ``selective`` with ``core_attn`` among ``--recompute-modules``
    (``granularity="unset"``: not known here), and megatron-burst's attention."""
    if ratio is None:
        return
    if granularity is None:
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} needs activation recompute: add "
                         "--recompute-granularity selective (core attention) or full")
    if granularity == "selective" and modules is not None and "core_attn" not in modules:
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} acts on the recompute of core attention, but "
                         f"--recompute-modules {' '.join(modules)} does not recompute it: add core_attn to "
                         "--recompute-modules (or use --recompute-granularity full)")
    if algo == STOCK_ATTENTION:
        raise ValueError(f"--seq-selective-ckpt-ratio {ratio} needs megatron-burst's attention, but --cp-algo "
                         "none keeps Megatron's: drop one of them")
    check_selective_ckpt_algo(ratio, algo)


def check_hierarchical_cp_sizes(sizes: Optional[Sequence[int]], cp: int) -> None:
    """Megatron's --hierarchical-context-parallel-sizes must multiply to the CP size (Megatron-LM
    asserts this too; its first entry also sets our ring's ranks per node)."""
    if not sizes:
        return
    product = 1
    for size in sizes:
        product *= int(size)
    if product != cp:
        raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(str(x) for x in sizes)} multiply to "
                         f"{product}, but they must multiply to --context-parallel-size {cp} (A2A x P2P = CP): "
                         "give such sizes, or drop the flag")


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
