"""comm_counter sees work on any thread; GPU waits are timed with CUDA events, not host time."""
import time

import pytest
import torch

import megatron_burst.comm as comm
from harness import run_ranks
import comm_cases


@pytest.mark.parametrize("algo", ["ring", "burst"])
def test_backward_on_another_thread_counts_the_same_bytes(algo):
    """Autograd runs a GPU backward on its device thread: a counter opened around backward() in
    the caller's thread must still see every byte (it was thread-local and saw none)."""
    for counts in run_ranks(2, comm_cases.bytes_by_thread, algo):
        fwd, bwd = counts["caller"]
        assert fwd > 0 and bwd > 0
        assert counts["backward_in_thread"] == (fwd, bwd)
        assert counts["all_in_thread"] == (fwd, bwd)


class _FakeEvent:
    """Stands in for torch.cuda.Event: record() stamps a scripted device time."""

    device_clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None
        self.synced = False

    def record(self):
        self.t = self.device_clock[0]

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert end.synced, "elapsed_time read before the end event completed"
        return (end.t - self.t) * 1e3  # ms, like CUDA


class _FakeNcclWork:
    """An NCCL request: wait() returns at once on the host; the stream stalls 0.25 s on the device."""

    def wait(self):
        _FakeEvent.device_clock[0] += 0.25


def test_gpu_waits_are_timed_with_cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("host time used for a GPU wait"))
    with comm.comm_counter() as counter:
        comm.PendingExchange([_FakeNcclWork(), _FakeNcclWork()], [], "backward", "inter",
                             torch.device("cuda", 0)).wait()
        assert counter.wait_seconds(link="intra") == 0.0
        assert counter.wait_seconds(phase="backward", link="inter") == pytest.approx(0.5)
        assert counter.wait_seconds() == pytest.approx(0.5)  # resolved once, not double-counted


def test_cpu_waits_are_timed_on_the_host():
    class SlowWork:
        def wait(self):
            time.sleep(0.05)

    with comm.comm_counter() as counter:
        comm.PendingExchange([SlowWork()], [], "forward", "intra", torch.device("cpu")).wait()
    assert 0.05 <= counter.wait_seconds(phase="forward") < 1.0


def test_counters_nest_and_stop_counting_when_closed():
    with comm.comm_counter() as outer:
        comm.record("sent", "forward", "intra", 10)
        with comm.comm_counter() as inner:
            comm.record("sent", "backward", "inter", 5)
        comm.record("sent", "forward", "intra", 1)
    comm.record("sent", "forward", "intra", 100)
    assert inner.bytes("sent") == 5
    assert outer.bytes("sent") == 16 and outer.bytes("sent", phase="backward", link="inter") == 5
