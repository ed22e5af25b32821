"""megatron_burst.bench.launch.in_step: the multi-rank benches' variants (bench gpu / bench linear --gpu on
ranks sharing one GPU) run in step. A variant that fails on every rank before any collective lets the
next one run; one that fails on some ranks only -- its peers left waiting in a collective -- gives up
the remaining variants within the agreement timeout, instead of a 120 s collective timeout for every
variant still to come (device minutes a GPU session cannot spare)."""
from __future__ import annotations

import time

AGREE_S = 3.0


def _body(plan: dict) -> dict:
    """Variants by name: 'ok' (an all-reduce), 'refused' (raises everywhere before any collective,
    after a timing barrier), 'rank1_fails' (rank 1 raises while rank 0 waits in an all-reduce),
    'stale_send' (every rank sends to its ring neighbour, which never receives, and raises: the sends
    would meet the next variant's receives)."""
    import torch
    import torch.distributed as dist

    from megatron_burst.bench.launch import in_step

    ran = []

    def run(variant: str, sync) -> None:
        name = variant.split("#")[0]
        sync()  # the bodies' timing barriers: not the default group's traffic
        if name == "refused":
            raise ValueError("refused on every rank")
        if name == "stale_send":
            rank, world = dist.get_rank(), dist.get_world_size()
            dist.isend(torch.full((1,), float(rank)), (rank + 1) % world)
            raise RuntimeError("failed after posting a send")
        if name == "ring":  # a ring exchange: would receive a stale send
            rank, world = dist.get_rank(), dist.get_world_size()
            got = torch.zeros(1)
            ops = [dist.P2POp(dist.isend, torch.full((1,), 100.0 + rank), (rank + 1) % world),
                   dist.P2POp(dist.irecv, got, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            assert got.item() == 100.0 + (rank - 1) % world, got
        if name == "rank1_fails" and dist.get_rank() == 1:
            raise RuntimeError("rank 1 out of memory")
        t = torch.ones(1)
        dist.all_reduce(t)
        ran.append(variant)

    errors = in_step(plan["variants"], run, agree_timeout_s=AGREE_S)
    again = None
    if plan.get("again"):
        try:
            in_step(["ok"], run, agree_timeout_s=AGREE_S)
        except RuntimeError as e:
            again = str(e)
    return {"ran": ran, "errors": {k: v.splitlines()[0] for k, v in errors.items()}, "again": again}


def test_a_failure_everywhere_lets_the_next_variant_run():
    from megatron_burst.bench.launch import run_local

    results = run_local(3, _body, {"variants": ["ok#1", "refused", "ok#2"]})
    for res in results:
        assert res["ran"] == ["ok#1", "ok#2"], res
        assert list(res["errors"]) == ["refused"] and "refused on every rank" in res["errors"]["refused"]


def test_a_failure_on_one_rank_gives_up_the_rest_within_the_agreement_timeout():
    from megatron_burst.bench.launch import COLLECTIVE_TIMEOUT_S, run_local

    start = time.perf_counter()
    results = run_local(2, _body, {"variants": ["ok#1", "rank1_fails", "ok#2", "ok#3"]})
    took = time.perf_counter() - start
    assert took < AGREE_S + 20 < COLLECTIVE_TIMEOUT_S, took  # not one collective timeout per variant left
    for rank, res in enumerate(results):
        assert res["ran"] == ["ok#1"], res
        assert set(res["errors"]) == {"rank1_fails", "ok#2", "ok#3"}, res
        for later in ("ok#2", "ok#3"):
            assert res["errors"][later].startswith("not run: gave up the remaining variants"), res
    assert "rank 1 out of memory" in results[1]["errors"]["rank1_fails"]
    # rank 0 was inside the all-reduce: the peer's exit ended its wait with an error (not a timeout)
    assert "out of memory" not in results[0]["errors"]["rank1_fails"]


def test_a_failure_everywhere_after_communicating_gives_up_the_rest():
    """Every rank failed, but after posting sends nobody received: running on would hand them to the
    next variant's receives (a 120 s timeout there, the gloo pair closed after), so the rest is given
    up, quickly, and a second in_step in the process refuses to start."""
    from megatron_burst.bench.launch import run_local

    start = time.perf_counter()
    results = run_local(2, _body, {"variants": ["ok#1", "stale_send", "ring"], "again": True})
    assert time.perf_counter() - start < AGREE_S + 20
    for res in results:
        assert res["ran"] == ["ok#1"], res
        assert "failed after posting a send" in res["errors"]["stale_send"]
        assert res["errors"]["ring"].startswith("not run: gave up the remaining variants"), res
        assert "gave up its variants earlier in this process" in res["again"], res


def test_run_local_starts_again_when_its_port_was_taken(monkeypatch):
    """free_port() hands out a port that another process may bind before the ranks' rendezvous does
    (seen once in make test: EADDRINUSE failed a bench smoke test). The first port here is held by
    a listening socket: rank 0 cannot bind it, exits PORT_TAKEN_EXIT, and run_local starts the ranks
    again on a fresh port instead of failing."""
    import socket

    import torch.distributed as dist

    from megatron_burst.bench import launch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = [taken]
        real = launch.free_port
        handed = []

        def free_port():
            handed.append(ports.pop() if ports else real())
            return handed[-1]

        monkeypatch.setattr(launch, "free_port", free_port)
        assert launch.run_local(2, dist.get_world_size) == [2, 2]
    assert handed[0] == taken and len(handed) == 2  # one restart, on a port of its own
