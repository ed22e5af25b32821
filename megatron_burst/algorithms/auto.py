"""``algo="auto"``: the CP algorithm and ring backward the cost model (megatron_burst.cost_model)
predicts fastest for a call's shape and topology, and the bytes each backward sends.

The cost model is imported inside the functions, so that ``python -m megatron_burst.cost_model``
does not find itself pre-imported. Pure functions of the shape: the same on every rank.
"""
from __future__ import annotations

from typing import Optional

from megatron_burst.algorithms import allgather, burst, ring

__all__ = ["resolve_algo", "choose_algo", "backward_bytes"]

_BACKWARD_BYTES = {"ring": ring.backward_bytes, "burst": burst.backward_bytes,
                   "allgather": allgather.backward_bytes}


def resolve_algo(algo: str, b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int,
                 nodes: int = 1, ring: str = "flat", causal: bool = True) -> str:
    """``auto`` -> the backward scheme the cost model (megatron_burst.cost_model) predicts faster on this
    topology and ring; with equal hop counts for both schemes that is the one sending fewer bytes."""
    if algo != "auto":
        return algo
    if world_size == 1:
        return "burst"
    # imported here so that `python -m megatron_burst.cost_model` does not find itself pre-imported
    from megatron_burst.cost_model import AttnShape, Cluster, choose_backward

    cluster = Cluster(nodes=nodes, gpus_per_node=world_size // nodes)
    shape = AttnShape(seq=n * world_size, heads=hq, kv_heads=hkv, head_dim=d, batch=b, elem=elem, causal=causal)
    return choose_backward(cluster, shape, ring if nodes > 1 else "flat")


def choose_algo(b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int, nodes: int = 1,
                ring: str = "flat", causal: bool = True, usp_sizes: tuple[int, ...] = (),
                algos: tuple[str, ...] = ("ring", "burst", "allgather", "ulysses", "usp")) -> tuple[str, Optional[int]]:
    """``algo="auto"`` -> (algorithm, Ulysses size or None) the cost model predicts fastest for this
    shape and topology (megatron_burst.cost_model.choose_algorithm). usp is considered only for the sizes
    in ``usp_sizes`` (those whose 2-D process groups were built); ties go to the ring family."""
    if world_size == 1:
        return "burst", None
    from megatron_burst.cost_model import AttnShape, Cluster, choose_algorithm

    cluster = Cluster(nodes=nodes, gpus_per_node=world_size // nodes)
    shape = AttnShape(seq=n * world_size, heads=hq, kv_heads=hkv, head_dim=d, batch=b, elem=elem, causal=causal)
    algo, U = choose_algorithm(cluster, shape, ring, usp_sizes=usp_sizes, algos=algos)
    return algo, (U if algo in ("ulysses", "usp") else None)


def backward_bytes(algo: str, b: int, hq: int, hkv: int, n: int, d: int, elem: int, world_size: int) -> int:
    """Bytes one rank sends in ``algo``'s backward for n local tokens (see each algorithm's docstring)."""
    scheme = resolve_algo(algo, b, hq, hkv, n, d, elem, world_size)
    return _BACKWARD_BYTES[scheme](b, hq, hkv, n, d, elem, world_size)
