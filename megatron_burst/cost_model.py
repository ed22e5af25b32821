"""Communication/compute cost model for CP attention, and the planner CLI.

    python -m megatron_burst.cost_model --nodes 4 --gpus-per-node 8 --intra-gbps 3200 --inter-gbps 200 \
        --seq 1M --heads 40 --kv-heads 40 --head-dim 128 --layers 40

Two levels:

* :func:`table1` is BurstEngine's Table 1 as printed (communication time of one layer's forward +
  backward for RingAttention, DoubleRing and BurstAttention), with T = latency + P / bandwidth.
* :func:`predict` is our per-layer model of what this package runs, per rank: exact hop counts of
  the flat and double rings (W-1 hops; on a double ring N_nodes*(R-1) intra and N_nodes-1 inter),
  the bytes of each backward scheme with GQA (ring's K,V,dK,dV carry hkv heads, burst's Q,dO,dQ,
  D,lse carry hq heads; gradients travel in fp32), inter-node transfers hidden behind the inner ring,
  and compute from FLOPs at a given throughput, overlapped with communication.

* :func:`predict_family` adds the other CP algorithms to those: ``allgather`` (K,V gathered over
  the flat ring, overlapped with compute; dK,dV reduce-scattered, the last piece's exposed),
  ``ulysses`` and ``usp<U>/<backward>/<ring>`` (two all-to-alls per direction on the critical path,
  which compute cannot hide, around the ring schedule over the W/U Ulysses groups). An all-to-all
  over U ranks costs U-1 latencies plus (U-1)/U of the buffer at the slowest link it crosses.

``algo="auto"`` in cp_attention uses :func:`choose_algorithm` (which algorithm) and
:func:`choose_backward` (which ring backward) with the run's shape and topology.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Cluster", "AttnShape", "table1", "hop_bytes", "pass_time", "attention_flops", "predict", "choose_backward",
           "a2a_time", "ulysses_sizes", "predict_family", "family_key", "choose_algorithm", "rank_key", "recommend",
           "main", "ALGO_VARIANTS", "FAMILY", "DEFAULT_INTRA_GBPS", "DEFAULT_INTER_GBPS", "DEFAULT_INTRA_LAT_US",
           "DEFAULT_INTER_LAT_US"]

ALGO_VARIANTS = {
    # name: (backward scheme, ring shape)
    "ring/flat": ("ring", "flat"),
    "burst/flat": ("burst", "flat"),
    "ring/double": ("ring", "double"),
    "burst/double": ("burst", "double"),
}

# Defaults: the paper's A800 cluster (400 GB/s NVLink per GPU, one 200 Gb/s HDR NIC per GPU).
DEFAULT_INTRA_GBPS = 3200.0
DEFAULT_INTER_GBPS = 200.0
DEFAULT_INTRA_LAT_US = 5.0
DEFAULT_INTER_LAT_US = 10.0


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    intra_gbps: float = DEFAULT_INTRA_GBPS
    inter_gbps: float = DEFAULT_INTER_GBPS
    intra_lat_us: float = DEFAULT_INTRA_LAT_US
    inter_lat_us: float = DEFAULT_INTER_LAT_US
    tflops: float = 200.0  # sustained attention throughput per GPU

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def hop(self, nbytes: float, link: str) -> float:
        """Seconds for one point-to-point transfer of ``nbytes`` over an intra/inter link."""
        if link == "intra":
            return self.intra_lat_us * 1e-6 + nbytes * 8 / (self.intra_gbps * 1e9)
        return self.inter_lat_us * 1e-6 + nbytes * 8 / (self.inter_gbps * 1e9)


@dataclass(frozen=True)
class AttnShape:
    seq: int  # global tokens
    heads: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    elem: int = 2  # bytes per activation element (bf16)
    causal: bool = True


def table1(world: int, nodes: int, t_intra: float, t_inter: float) -> dict[str, float]:
    """BurstEngine Table 1, literally: N = total GPUs, T = one transfer of a tensor slice."""
    n, ni = world, nodes
    return {
        "RingAttention": 6 * max(n * t_intra, n * t_inter),
        "DoubleRing": 4 * max((n - ni) * t_intra, ni * t_inter) + 2 * ((n - ni) * t_intra + ni * t_inter),
        "BurstAttention": 5 * max((n - ni) * t_intra, ni * t_inter),
    }


def hop_bytes(shape: AttnShape, world: int) -> dict[str, int]:
    """Bytes of one ring hop per tensor group, for n = seq / world local tokens."""
    n = shape.seq // world
    b, hq, hkv, d, e = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.elem
    return {
        "forward": 2 * b * n * hkv * d * e,  # K, V
        "ring_act": 2 * b * n * hkv * d * e,  # K, V again in the backward
        "ring_grad": 2 * b * n * hkv * d * 4,  # dK, dV in fp32
        "burst_act": 2 * b * n * hq * d * e + 2 * b * n * hq * 4,  # Q, dO + D, lse
        "burst_grad": b * n * hq * d * 4,  # dQ in fp32
    }


def pass_time(cluster: Cluster, nbytes: float, ring: str) -> float:
    """Seconds for one block to visit every rank (the communication of one ring pass)."""
    W, N, R = cluster.world, cluster.nodes, cluster.gpus_per_node
    if W == 1:
        return 0.0
    intra = cluster.hop(nbytes, "intra")
    if N == 1:
        return (W - 1) * intra
    inter = cluster.hop(nbytes, "inter")
    if ring == "flat":  # every step waits for the slowest hop of the ring
        return (W - 1) * max(intra, inter)
    # double: each inter-node transfer hides behind one whole inner ring; the last inner ring has none
    return (N - 1) * max((R - 1) * intra, inter) + (R - 1) * intra


def attention_flops(shape: AttnShape) -> tuple[float, float]:
    """Global (forward, backward) attention FLOPs of one layer (backward = 2.5 x forward: 5 vs 2 matmuls)."""
    fwd = 4.0 * shape.batch * shape.seq ** 2 * shape.heads * shape.head_dim * (0.5 if shape.causal else 1.0)
    return fwd, 2.5 * fwd


def predict(cluster: Cluster, shape: AttnShape) -> dict[str, dict[str, float]]:
    """Per-layer, per-rank predicted seconds for every variant: comm and compute, forward/backward."""
    hb = hop_bytes(shape, cluster.world)
    fwd_flops, bwd_flops = attention_flops(shape)
    comp_f = fwd_flops / cluster.world / (cluster.tflops * 1e12)
    comp_b = bwd_flops / cluster.world / (cluster.tflops * 1e12)
    out = {}
    for name, (scheme, ring) in ALGO_VARIANTS.items():
        comm_f = pass_time(cluster, hb["forward"], ring)
        act = pass_time(cluster, hb[f"{scheme}_act"], ring)
        grad = pass_time(cluster, hb[f"{scheme}_grad"], ring)
        # activations and gradients go to the same neighbour over the same link: their times add
        # (separate communicators let both overlap compute, not share one link's bandwidth twice)
        comm_b = act + grad
        out[name] = {
            "fwd_comm": comm_f, "bwd_comm": comm_b, "fwd_compute": comp_f, "bwd_compute": comp_b,
            "fwd_comm_bytes": hb["forward"] * (cluster.world - 1),
            "bwd_comm_bytes": (hb[f"{scheme}_act"] + hb[f"{scheme}_grad"]) * (cluster.world - 1),
            "total": max(comm_f, comp_f) + max(comm_b, comp_b),
        }
    return out


def choose_backward(cluster: Cluster, shape: AttnShape, ring: str) -> str:
    """The backward scheme ("ring" or "burst") with the lower predicted backward time on ``ring``.

    Ties (e.g. compute-bound) go to the scheme that sends fewer bytes; then to burst.
    """
    pred = predict(cluster, shape)
    r, b = pred[f"ring/{ring}"], pred[f"burst/{ring}"]
    key = lambda p: (round(p["bwd_comm"], 12), p["bwd_comm_bytes"])  # noqa: E731
    return "ring" if key(r) < key(b) else "burst"


FAMILY = ("ring", "burst", "allgather", "ulysses", "usp")
# ties (equal predicted time and communication) go to the algorithm holding less memory: the ring
# family keeps n tokens of K,V; all-gather holds a gathered piece of W x that; Ulysses and USP
# reshuffle q, k, v and the output through extra buffers
_PREFERENCE = {"ring": 0, "burst": 0, "allgather": 1, "usp": 2, "ulysses": 3}


def a2a_time(cluster: Cluster, nbytes: float, U: int) -> float:
    """Seconds of an all-to-all over U consecutive ranks, each holding ``nbytes`` (U equal parts)."""
    if U == 1:
        return 0.0
    R = cluster.gpus_per_node
    if U <= R:
        return (U - 1) * cluster.intra_lat_us * 1e-6 + nbytes * (U - 1) / U * 8 / (cluster.intra_gbps * 1e9)
    # the parts for ranks on other nodes (U - R of U) leave through this rank's NIC
    return (U - 1) * cluster.inter_lat_us * 1e-6 + nbytes * (U - R) / U * 8 / (cluster.inter_gbps * 1e9)


def ulysses_sizes(cluster: Cluster, shape: AttnShape) -> list[int]:
    """Ulysses group sizes U > 1 the heads allow (hq % U == 0; hkv splits or repeats evenly), that
    divide W and nest with the node (U divides or is a multiple of the GPUs per node)."""
    W, R = cluster.world, cluster.gpus_per_node
    return [U for U in range(2, W + 1)
            if W % U == 0 and shape.heads % U == 0 and (shape.kv_heads % U == 0 or U % shape.kv_heads == 0)
            and (R % U == 0 or U % R == 0)]


def _entry(fwd_comm, bwd_comm, comp_f, comp_b, fwd_bytes, bwd_bytes, total, algo, ulysses_size=1):
    return {"fwd_comm": fwd_comm, "bwd_comm": bwd_comm, "fwd_compute": comp_f, "bwd_compute": comp_b,
            "fwd_comm_bytes": fwd_bytes, "bwd_comm_bytes": bwd_bytes, "total": total, "algo": algo,
            "ulysses_size": ulysses_size}


def predict_family(cluster: Cluster, shape: AttnShape) -> dict[str, dict]:
    """:func:`predict` plus allgather, ulysses and every usp<U>/<backward>/<ring> the heads allow.

    Each entry also names its ``algo`` (cp_attention's) and ``ulysses_size``.
    """
    W = cluster.world
    out = {}
    for name, p in predict(cluster, shape).items():
        out[name] = dict(p, algo=ALGO_VARIANTS[name][0], ulysses_size=1)
    if W == 1:
        return out
    hb = hop_bytes(shape, W)
    ring_fam = predict(cluster, shape)["ring/flat"]
    comp_f, comp_b = ring_fam["fwd_compute"], ring_fam["bwd_compute"]
    gather = pass_time(cluster, hb["forward"], "flat")
    scatter = pass_time(cluster, hb["ring_grad"], "flat")
    # the last piece's reduce-scatter (of two) starts after the compute: exposed
    out["allgather"] = _entry(gather, gather + scatter, comp_f, comp_b, hb["forward"] * (W - 1),
                              (hb["ring_act"] + hb["ring_grad"]) * (W - 1),
                              max(gather, comp_f) + max(gather + scatter, comp_b) + scatter / 2, "allgather")
    n, b, d, e = shape.seq // W, shape.batch, shape.head_dim, shape.elem
    for U in ulysses_sizes(cluster, shape):
        kv = shape.kv_heads if shape.kv_heads % U == 0 else U
        qkv, o = b * n * (shape.heads + 2 * kv) * d, b * n * shape.heads * d
        a2a_f = a2a_time(cluster, qkv * e, U) + a2a_time(cluster, o * e, U)
        a2a_b = a2a_time(cluster, o * e, U) + a2a_time(cluster, qkv * 4, U)
        a2a_bytes_f = (U - 1) * (qkv + o) * e // U
        a2a_bytes_b = (U - 1) * (o * e + qkv * 4) // U
        members = W // U
        R = cluster.gpus_per_node
        sub_cluster = Cluster(cluster.nodes if U <= R else members, max(1, R // U) if U <= R else 1,
                              cluster.intra_gbps, cluster.inter_gbps, cluster.intra_lat_us, cluster.inter_lat_us,
                              cluster.tflops)
        sub_shape = AttnShape(shape.seq, shape.heads // U, kv // U, d, b, e, shape.causal)
        rings = {"ring/flat": predict(sub_cluster, sub_shape)["ring/flat"]} if members == 1 else \
            predict(sub_cluster, sub_shape)
        for sub, p in rings.items():
            if members > 1 and sub_cluster.nodes == 1 and sub.endswith("/double"):
                continue
            name = "ulysses" if members == 1 else f"usp{U}/{sub}"
            out[name] = _entry(a2a_f + p["fwd_comm"], a2a_b + p["bwd_comm"], comp_f, comp_b,
                               a2a_bytes_f + p["fwd_comm_bytes"], a2a_bytes_b + p["bwd_comm_bytes"],
                               a2a_f + a2a_b + p["total"], "ulysses" if members == 1 else "usp", U)
    return out


def family_key(name: str, p: dict) -> tuple:
    """Order for the whole family: predicted time, then communication time, then memory (_PREFERENCE)."""
    return rank_key(p) + (_PREFERENCE[p["algo"]], name)


def choose_algorithm(cluster: Cluster, shape: AttnShape, ring: str = "flat",
                     usp_sizes: Optional[Sequence[int]] = None,
                     algos: Sequence[str] = FAMILY) -> tuple[str, int]:
    """(cp_attention algo, Ulysses size) predicted fastest among ``algos``. The ring family runs on
    ``ring``; ``usp_sizes`` limits usp to the sizes whose process groups exist (None: any)."""
    pred = predict_family(cluster, shape)
    ring = ring if cluster.nodes > 1 else "flat"
    allowed = {}
    for name, p in pred.items():
        if p["algo"] not in algos:
            continue
        if p["algo"] in ("ring", "burst") and not name.endswith("/" + ring):
            continue
        if p["algo"] == "usp" and usp_sizes is not None and p["ulysses_size"] not in usp_sizes:
            continue
        allowed[name] = p
    if not allowed:
        raise ValueError(f"no CP algorithm among {', '.join(algos)} fits {shape.heads} query / {shape.kv_heads} "
                         f"key-value heads on {cluster.world} ranks (usp sizes {usp_sizes})")
    best = min(allowed, key=lambda k: family_key(k, allowed[k]))
    return allowed[best]["algo"], allowed[best]["ulysses_size"]


def rank_key(p: dict[str, float]) -> tuple[float, float]:
    """Order variants by predicted time, then (when compute hides all of it) by communication time:
    the variant with less communication keeps more slack for the rest of the step."""
    return (round(p["total"], 9), p["fwd_comm"] + p["bwd_comm"])


def recommend(cluster: Cluster, shape: AttnShape) -> str:
    """The best variant name in ALGO_VARIANTS, e.g. "burst/double"."""
    pred = predict(cluster, shape)
    return min(pred, key=lambda k: rank_key(pred[k]))


def _parse_count(text: str) -> int:
    """'1M' -> 1048576, '128K' -> 131072, '4096' -> 4096."""
    mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    t = text.strip().upper()
    return int(float(t[:-1]) * mult[t[-1]]) if t[-1] in mult else int(t)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.cost_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--intra-gbps", type=float, default=DEFAULT_INTRA_GBPS, help="per-GPU intra-node Gbit/s")
    p.add_argument("--inter-gbps", type=float, default=DEFAULT_INTER_GBPS, help="per-GPU inter-node Gbit/s")
    p.add_argument("--intra-lat-us", type=float, default=DEFAULT_INTRA_LAT_US)
    p.add_argument("--inter-lat-us", type=float, default=DEFAULT_INTER_LAT_US)
    p.add_argument("--tflops", type=float, default=200.0, help="sustained attention TFLOP/s per GPU")
    p.add_argument("--seq", type=_parse_count, required=True, help="global sequence length, e.g. 1M")
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--full", action="store_true", help="no causal mask")
    a = p.parse_args(argv)
    for flag in ("nodes", "gpus_per_node", "seq", "heads", "head_dim", "layers", "batch", "dtype_bytes"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)} must be >= 1")
    for flag in ("intra_gbps", "inter_gbps", "tflops"):
        if getattr(a, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)} must be > 0")
    kv_heads = a.kv_heads or a.heads
    if kv_heads < 1 or a.heads % kv_heads:
        p.error(f"--heads {a.heads} is not divisible by --kv-heads {kv_heads} (grouped-query attention needs "
                "query heads = a multiple of KV heads)")
    cluster = Cluster(a.nodes, a.gpus_per_node, a.intra_gbps, a.inter_gbps, a.intra_lat_us, a.inter_lat_us, a.tflops)
    shape = AttnShape(a.seq, a.heads, kv_heads, a.head_dim, a.batch, a.dtype_bytes, not a.full)
    if shape.seq % cluster.world:
        p.error(f"--seq {shape.seq} is not divisible by {cluster.world} GPUs")
    if cluster.world == 1:
        print(f"# 1 GPU: no context parallelism, so nothing to plan. Train with --context-parallel-size 1; "
              "megatron-burst's attention then runs the whole sequence locally (no ring, no traffic), and "
              "the memory features (--fused-lm-loss, --seq-selective-ckpt-ratio) still apply.")
        print("\nrecommendation: --context-parallel-size 1 (any --cp-algo behaves the same on one GPU)")
        return
    pred = predict_family(cluster, shape)
    print(f"# {a.nodes} nodes x {a.gpus_per_node} GPUs, intra {a.intra_gbps:g} Gb/s, inter {a.inter_gbps:g} Gb/s; "
          f"seq {shape.seq}, heads {shape.heads}/{shape.kv_heads} kv, head dim {shape.head_dim}, "
          f"{a.layers} layers; times per layer in ms (x{a.layers} for the model)")
    print("| variant | fwd comm | fwd compute | bwd comm | bwd compute | fwd+bwd (overlapped) | model s |")
    print("|---|---|---|---|---|---|---|")
    for name, v in sorted(pred.items(), key=lambda kv: family_key(*kv)):
        print(f"| {name} | {v['fwd_comm'] * 1e3:.1f} | {v['fwd_compute'] * 1e3:.1f} | {v['bwd_comm'] * 1e3:.1f} | "
              f"{v['bwd_compute'] * 1e3:.1f} | {v['total'] * 1e3:.1f} | {v['total'] * a.layers:.2f} |")
    hb = hop_bytes(shape, cluster.world)
    t1 = table1(cluster.world, cluster.nodes, cluster.hop(hb["forward"] / 2, "intra"), cluster.hop(hb["forward"] / 2, "inter"))
    print("\nBurstEngine Table 1 (P = one K slice):", ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t1.items()))
    best = min(pred, key=lambda k: family_key(k, pred[k]))
    v = pred[best]
    if v["algo"] not in ("ring", "burst"):  # all-gather, Ulysses or USP beat every ring variant
        U = v["ulysses_size"]
        ring_part = best.split("/", 1)[1] if "/" in best else ""
        flags = {"allgather": "--cp-algo allgather (Megatron: --cp-comm-type allgather)",
                 "ulysses": "--cp-algo ulysses (Megatron: --cp-comm-type a2a)",
                 "usp": f"--cp-algo usp --hierarchical-context-parallel-sizes {U} {cluster.world // U} "
                        f"(Megatron: --cp-comm-type a2a+p2p; ring part {ring_part})"}[v["algo"]]
        best_ring = min((k for k, p in pred.items() if p["algo"] in ("ring", "burst")),
                        key=lambda k: family_key(k, pred[k]))
        print(f"\nrecommendation: {flags}: the lowest predicted fwd+bwd time per layer ({v['total'] * 1e3:.1f} ms "
              f"vs {pred[best_ring]['total'] * 1e3:.1f} ms for {best_ring}); its all-to-alls / reduce-scatter "
              "are on the critical path, the rings' transfers overlap compute")
        return
    scheme, ring = ALGO_VARIANTS[best]
    bound = "compute-bound: attention compute hides its communication" if v["bwd_comm"] <= v["bwd_compute"] \
        else "communication-bound: the backward's transfers outlast its compute"
    why = (f"the lowest predicted fwd+bwd time per layer ({v['total'] * 1e3:.1f} ms, {bound}); ties go to less "
           "communication")
    if ring == "double":
        why += (f"; per pass the double ring takes {cluster.nodes - 1} inter-node hops, where the flat ring's "
                f"node-boundary ranks take {cluster.world - 1}")
    print(f"\nrecommendation: --cp-algo {scheme} --cp-ring {ring}: {why}"
          f" (backward scheme by bytes/time on that ring: {choose_backward(cluster, shape, ring)})")


if __name__ == "__main__":
    main()
