"""megatron_burst.bench.launch.in_step: the multi-rank benches' variants (bench gpu / bench linear --gpu on
ranks sharing one GPU) run in step. A variant that fails on every rank before any collective lets the
next one run; one that fails on some ranks only -- its peers left waiting in a collective -- gives up
the remaining variants within the agreement timeout, instead of a 120 s collective timeout for every
variant still to come (device minutes a GPU session cannot spare)."""
from __future__ import annotations

import time

AGREE_S = 3.0


def _body(plan: dict) -> dict:
    """Variants by name: 'ok' (an all-reduce), 'refused' (raises everywhere before any collective),
    'rank1_fails' (rank 1 raises while rank 0 waits in an all-reduce)."""
    import torch
    import torch.distributed as dist

    from megatron_burst.bench.launch import in_step

    ran = []

    def run(variant: str) -> None:
        name = variant.split("#")[0]
        if name == "refused":
            raise ValueError("refused on every rank")
        if name == "rank1_fails" and dist.get_rank() == 1:
            raise RuntimeError("rank 1 out of memory")
        t = torch.ones(1)
        dist.all_reduce(t)
        ran.append(variant)

    errors = in_step(plan["variants"], run, agree_timeout_s=AGREE_S)
    return {"ran": ran, "errors": {k: v.splitlines()[0] for k, v in errors.items()}}


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
