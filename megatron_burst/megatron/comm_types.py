"""Megatron's ``--cp-comm-type`` values and the megatron-burst algorithm each one selects.

Megatron-LM hands ``--cp-comm-type`` to every core attention unvalidated (Transformer Engine's CP
implementations); megatron-burst reads it as a choice of algorithm, next to its own ``--cp-algo``:

* our algorithm names (``ring``, ``burst``, ``auto``, ``allgather``, ``ulysses``, ``usp``) select
  themselves;
* ``p2p`` (Megatron-LM's default, also what you get when you never typed the flag) is TE's ring
  exchange of KV blocks: ``ring``, unless ``--cp-algo`` says otherwise;
* ``a2a`` is Ulysses, ``allgather``/``all_gather`` (Megatron's / TE's spelling) the all-gather CP,
  ``a2a+p2p`` USP with Megatron's ``--hierarchical-context-parallel-sizes [a2a size, p2p size]``;
* a per-layer list (Megatron's form) naming several values: every layer resolves its own entry.

Gated DeltaNet layers take the same value (:func:`check_gated_delta_net_comm_type`).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from megatron_burst.algorithms import CP_ALGOS

DEFAULT_CP_ALGO = "burst"
# --cp-algo none: keep Megatron's own core attention (and its zigzag slicing); the opt-out
STOCK_ATTENTION = "none"
# a --cp-comm-type list naming different algorithms per layer: each layer resolves its own
PER_LAYER = "per-layer"

TE_RING_NAME = "p2p"
_TE_RING_NAME = TE_RING_NAME  # the name megatron_burst.megatron.args used
COMM_TYPE_ALGOS = {"a2a": "ulysses", "allgather": "allgather", "all_gather": "allgather", "a2a+p2p": "usp"}

__all__ = ["DEFAULT_CP_ALGO", "STOCK_ATTENTION", "PER_LAYER", "TE_RING_NAME", "COMM_TYPE_ALGOS", "resolve_cp_algo",
           "GDN_COMM_REFUSED", "check_gated_delta_net_comm_type"]


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
    if comm == TE_RING_NAME:
        return cp_algo or "ring"
    if comm in COMM_TYPE_ALGOS:
        ours = COMM_TYPE_ALGOS[comm]
        if cp_algo is not None and cp_algo != ours:
            raise ValueError(f"conflicting algorithms: --cp-algo {cp_algo} but --cp-comm-type {comm} (= {ours}); "
                             "set one of them")
        return ours
    raise ValueError(f"--cp-comm-type {comm} is not a context-parallel communication type: use one of "
                     f"{', '.join([TE_RING_NAME] + list(COMM_TYPE_ALGOS))} (Megatron's) or {', '.join(CP_ALGOS)}, "
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
