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


def test_train_alone_needs_no_port(tmp_path):
    """``python -m megatron_burst.train`` without a launcher makes a world of one whose store lives in
    the process: it binds no rendezvous port, so another process taking a port it picked cannot fail
    it (the old start picked one with world.free_port(); here every port it could pick is taken)."""
    code = (
        "import socket, sys\n"
        "import megatron_burst.world as world\n"
        "taken = socket.socket(); taken.bind(('127.0.0.1', 0)); taken.listen()\n"
        "world.free_port = lambda host='127.0.0.1': taken.getsockname()[1]\n"
        "import megatron_burst.train.__main__ as m\n"
        "m.free_port = world.free_port\n"
        "m.main(sys.argv[1:])\n")
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--data-cache-path", str(tmp_path / "data"), "--corpus-max-bytes", "65536"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration        1/       1" in proc.stdout
