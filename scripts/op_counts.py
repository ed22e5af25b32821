"""Tensor ops per forward + backward of the linear family's torch paths, on CPU: a stand-in for GPU
kernel launches (each op that is not a view is at least one launch, ~5 us of host time each).

    python scripts/op_counts.py [--lengths 1024 4096 32768] [--sequences 4 32] [--world-size 4]

Prints, for one rank: LASP-2 (per-token decay) and the gated delta rule over one contiguous
sequence of each length (W = 1), then over a packed THD batch of each number of sequences at
``--world-size`` ranks (gloo on CPU). A count that grows with the length (or with the number of
sequences) is a Python loop per chunk (or per run) that a GPU pays in launches.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "slice", "unsqueeze", "squeeze", "permute", "transpose", "detach", "expand",
         "select", "alias", "t", "unbind", "split", "split_with_sizes", "narrow", "as_strided", "unfold"}


class ComputeOps(TorchDispatchMode):
    """Counts the aten ops that are not views."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in VIEWS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _count(fn) -> int:
    fn().float().sum().backward()  # warm: per-batch plans are cached, as in training
    with ComputeOps() as c:
        fn().float().sum().backward()
    return c.ops


def _ops(s: int, cu_seqlens=None, layout: str = "contiguous") -> dict:
    import megatron_burst as mb
    from megatron_burst.linear.delta import gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    h, d = 2, 16
    q, k, v = (torch.randn(s, 1, h, d, generator=gen).requires_grad_() for _ in range(3))
    g = (-torch.rand(s, 1, h, generator=gen)).requires_grad_()
    beta = torch.rand(s, 1, h, generator=gen).requires_grad_()
    kn = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_()
    kw = dict(layout=layout, cu_seqlens=cu_seqlens, kernel="torch")
    return {"lasp2": _count(lambda: mb.linear_attention(q, k, v, g=g, **kw)),
            "gdn": _count(lambda: gated_delta_rule(q, kn, v, g, beta, **kw))}


def _thd_rank(n_seq: int) -> dict:
    import torch.distributed as dist

    W = dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    lens = [4 * W * (1 + int(x)) for x in torch.randint(1, 40, (n_seq,), generator=gen)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return _ops(sum(lens) // W, cu, "thd")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 32768])
    p.add_argument("--sequences", type=int, nargs="+", default=[4, 32])
    p.add_argument("--world-size", type=int, default=4)
    a = p.parse_args(argv)
    print("| case | LASP-2 ops | GDN ops |\n|---|---|---|")
    for s in a.lengths:
        o = _ops(s)
        print(f"| one sequence of {s} tokens, W = 1 | {o['lasp2']} | {o['gdn']} |", flush=True)
    from megatron_burst.bench.launch import run_local
    for n in a.sequences:
        o = run_local(a.world_size, _thd_rank, n)[0]
        print(f"| THD batch of {n} sequences, rank 0 of W = {a.world_size} | {o['lasp2']} | {o['gdn']} |", flush=True)


if __name__ == "__main__":
    main()
