"""Command-line front doors answer --help with exit status 0 and refuse bad input with a message."""
import os
import subprocess
import sys

import pytest


def _run(*argv):
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)


def _bench_in_process(monkeypatch, capsys, *argv):
    """``python -m megatron_burst.bench ARGV`` as its main() in this process (the `python -m` entry point
    itself runs as a subprocess in test_bench_help_exits_zero_and_lists_the_benchmarks)."""
    import types

    from megatron_burst.bench.__main__ import main

    monkeypatch.setattr(sys, "argv", ["python -m megatron_burst.bench", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main()
    out, err = capsys.readouterr()
    return types.SimpleNamespace(returncode=exc.value.code, stdout=out, stderr=err)


def test_bench_help_exits_zero_and_lists_the_benchmarks():
    res = _run("megatron_burst.bench", "--help")
    assert res.returncode == 0, res.stderr
    for name in ("attention", "kernels", "multinode", "loss", "ckpt", "linear", "sparse"):
        assert name in res.stdout


def test_bench_linear_help_names_the_core_cap(monkeypatch, capsys):
    res = _bench_in_process(monkeypatch, capsys, "linear", "--help")
    assert res.returncode == 0, res.stderr
    assert "--cpu-per-rank" in res.stdout and "--seqs" in res.stdout


def test_bench_unknown_name_is_an_error(monkeypatch, capsys):
    res = _bench_in_process(monkeypatch, capsys, "nonsense")
    assert res.returncode == 2 and "unknown benchmark 'nonsense'" in res.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--world-size", "3", "--seq", "512"], "--seq 512 at --world-size 3, layout contiguous"),
    (["--world-size", "3", "--seq", "513", "--layouts", "zigzag"], "layout zigzag"),
    (["--heads", "8", "--kv-heads", "3"], "--heads 8 is not divisible by --kv-heads 3"),
])
def test_bench_attention_runs_the_sequence_asked_for_or_refuses(argv, needle, capsys):
    """It used to cut 512 tokens to 510 at W = 3 without saying so."""
    from megatron_burst.bench import attention

    with pytest.raises(SystemExit) as exc:
        attention.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_train_alone_needs_no_port(monkeypatch):
    """``python -m megatron_burst.train`` without a launcher makes a world of one whose store lives in
    the process (a HashStore): no rendezvous port, so none another process can take between picking
    and binding it (the old start picked one with world.free_port()). main() runs here up to the
    process group (recorded, not made) and the training call (skipped); tests/test_e2e_smoke.py and
    ``make demo`` train such worlds for real."""
    import torch.distributed as dist

    import megatron_burst.train.__main__ as entry

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores them, absent ones included
        monkeypatch.delenv(name)
    made = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: made.append((a, k)))
    monkeypatch.setattr(entry, "run", lambda argv: None)
    monkeypatch.setattr(entry, "exit_rank", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as exc:
        entry.main(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
                    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"])
    assert exc.value.code == 0
    (args, kwargs), = made
    assert isinstance(kwargs.get("store"), dist.HashStore) and kwargs["rank"] == 0 and kwargs["world_size"] == 1
    assert "MASTER_PORT" not in os.environ
