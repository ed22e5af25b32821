"""The host-staged transport (several ranks on one GPU) on CPU: staging CPU tensors through host
buffers (stage_cpu) changes nothing the callers or the tools see -- outputs and gradients are
bit-identical, comm_counter counts the same bytes, record_schedule records the same trace and the
NCCL replay checker passes on it -- and CUDA tensors on a gloo group without it fail loudly.
The real single-GPU run (W processes on cuda:0) is harness.run_ranks_on_one_gpu's job on a GPU."""
import pytest
import torch

import megatron_burst.comm as comm
import megatron_burst.launch as launch
from harness import run_ranks, run_ranks_on_one_gpu
import host_staged_cases
from test_nccl_schedule import _assert_replays

ATTENTION = [(algo, W) for W in (2, 3) for algo in ("ring", "burst", "allgather", "ulysses")]


def _assert_staged_like_direct(res, what):
    assert res["unequal_tensors"] == [], f"{what}: staged run differs in {res['unequal_tensors']}"
    direct_bytes, staged_bytes = res["bytes"]
    assert sum(direct_bytes.values()) > 0, f"{what}: nothing was counted"
    assert staged_bytes == direct_bytes, f"{what}: comm_counter differs"
    assert res["trace_equal"], f"{what}: the staged schedule trace differs from the direct one"
    _assert_replays(res["replays"], what)
    stats = res["stats"]
    assert stats["staged_ops"] == res["posted"], f"{what}: not every posted operation was staged ({stats})"
    assert stats["copies_in"] > 0 and stats["copies_out"] > 0 and stats["buffers_reused"] > 0, stats


@pytest.mark.parametrize("algo,world_size", ATTENTION)
def test_attention_staged_equals_direct(algo, world_size):
    for rank, res in enumerate(run_ranks(world_size, host_staged_cases.staged_matches_direct, algo)):
        _assert_staged_like_direct(res, f"{algo} W={world_size} rank {rank}")


def test_usp_staged_equals_direct():
    """U = 2 Ulysses groups and a ring of 2 across them: three communicators per rank."""
    for rank, res in enumerate(run_ranks(4, host_staged_cases.staged_matches_direct, "usp", 2)):
        _assert_staged_like_direct(res, f"usp 2x2 rank {rank}")


@pytest.mark.parametrize("mode", ["stage_cpu", "env", "pretend_cuda"])
def test_every_operation_staged(mode):
    """Ring exchange and all four collectives: same values, bytes and trace; receive tensors are
    written by wait(), not before; the second round reuses the first round's buffers."""
    for rank, res in enumerate(run_ranks(3, host_staged_cases.comm_ops_staged, mode)):
        for run in ("run0", "run1"):
            got = res[run]
            assert got["unequal"] == [], f"rank {rank} {run}: {got['unequal']} differ from the direct transport"
            assert got["bytes_equal"] and got["trace_equal"], (rank, run, got)
            assert got["recv_before_wait_untouched"], f"rank {rank} {run}: receive written before wait()"
        stats = res["stats"]
        # per round: 1 exchange + 5 collectives, each one copy in (send, input, all_reduce in place), one out
        assert stats["staged_ops"] == 12 and stats["copies_in"] == 2 * 6 and stats["copies_out"] == 2 * 6, stats
        assert stats["buffers_reused"] >= 2 * 6, stats


def test_device_tensors_on_gloo_without_staging_fail_loudly():
    for rank, res in enumerate(run_ranks(2, host_staged_cases.refusals)):
        for op, (kind, message, counted, traced) in res.items():
            assert kind == "TransportError", f"rank {rank} {op}: {kind} {message}"
            assert "set_transport('host_staged')" in message and "MEGATRON_BURST_TRANSPORT=host_staged" in message
            assert "gloo" in message
            assert counted == 0 and traced == 0, f"rank {rank} {op}: counted or traced before refusing"


# ------------------------------------------------------------------ choosing the transport (no ranks)


def test_transport_choice(monkeypatch):
    monkeypatch.setattr(comm, "_transport_override", None)
    monkeypatch.delenv(comm.TRANSPORT_ENV, raising=False)
    assert comm.active_transport() == comm.Transport("direct", False)
    monkeypatch.setenv(comm.TRANSPORT_ENV, "host_staged")
    assert comm.active_transport() == comm.Transport("host_staged", False)
    monkeypatch.setenv(comm.TRANSPORT_ENV, "host_staged_cpu")
    assert comm.active_transport() == comm.Transport("host_staged", True)
    with comm.transport("direct") as chosen:  # code wins over the environment
        assert chosen == comm.active_transport() == comm.Transport("direct", False)
        with comm.transport("host_staged", stage_cpu=True):
            assert comm.active_transport() == comm.Transport("host_staged", True)
        assert comm.active_transport().name == "direct"
    assert comm.active_transport() == comm.Transport("host_staged", True)  # back to the environment
    comm.set_transport("direct")
    assert comm.active_transport().name == "direct"
    comm.set_transport(None)
    assert comm.active_transport().stage_cpu
    monkeypatch.setenv(comm.TRANSPORT_ENV, "nccl_on_host")
    with pytest.raises(ValueError, match="MEGATRON_BURST_TRANSPORT='nccl_on_host'"):
        comm.active_transport()
    with pytest.raises(ValueError, match="choose one of"):
        comm.set_transport("hostStaged")
    with pytest.raises(ValueError, match="stage_cpu"):
        comm.set_transport("direct", stage_cpu=True)


def test_cpu_tensors_need_no_staging():
    assert not comm.needs_staging(torch.ones(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_one_gpu_launchers_refuse_without_cuda():
    with pytest.raises(RuntimeError, match="need CUDA"):
        launch.run_on_one_gpu(host_staged_cases.refusals, 2)
    with pytest.raises(RuntimeError, match="need CUDA"):
        run_ranks_on_one_gpu(2, host_staged_cases.refusals)


def test_call_on_one_gpu_selects_and_restores_the_transport():
    for res in run_ranks(2, host_staged_cases.one_gpu_call_pretending_cuda):
        assert res["inside"] == (comm.Transport("host_staged", False), 2)
        assert res["after"] == comm.Transport("direct", False)
        assert res["chosen"] == [0, 0] and res["device"] == "cuda:0"
        assert res["kept"] == comm.Transport("host_staged", False)  # setup_one_gpu_rank: for the whole run
