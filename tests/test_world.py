"""megatron_burst.world: the shared free_port, and exit_rank ending spawned benchmark ranks
(megatron_burst.bench.launch.run_local) with their results delivered and failures reported."""
from __future__ import annotations

import socket

import pytest


def test_free_port_is_bindable():
    from megatron_burst.world import free_port

    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def _ring_sum(scale: float) -> float:
    """A P2P send/recv around the ring (the traffic that can make gloo's teardown abort)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return scale * got.item()


def _fail_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return dist.get_rank()


def test_run_local_gathers_results_and_reports_a_failing_rank():
    from megatron_burst.bench.launch import run_local

    assert run_local(3, _ring_sum, 10.0) == [20.0, 0.0, 10.0]  # rank r received rank r - 1's value
    with pytest.raises(RuntimeError, match="a benchmark rank failed"):
        run_local(2, _fail_on_rank_1)
