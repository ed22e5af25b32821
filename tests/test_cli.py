"""Command-line front doors answer --help with exit status 0 and refuse bad input with a message."""
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
