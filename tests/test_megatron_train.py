"""The training entry point: checkpoints move across CP sizes and restore the RNG states, the CLI
runs, logs like Megatron, documents every flag and exits cleanly under torchrun, and the built-in
corpus is real, deterministic Megatron indexed data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

import pytest

from harness import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_BYTES = 64 * 1024  # small corpus: builds in milliseconds, still hundreds of samples


def train_run(argv: List[str]) -> List[dict]:
    """megatron_burst.train.run on this world (the harness initialized torch.distributed)."""
    from megatron_burst import train

    return train.run(argv)


def _argv(tmp, iters, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-iters", "6",
            "--lr-warmup-iters", "1", "--train-iters", str(iters), "--log-interval", "1",
            "--data-cache-path", str(tmp / "data"), "--corpus-max-bytes", str(CORPUS_BYTES),
            *extra]


def test_checkpoint_saved_at_cp2_resumes_at_cp1(tmp_path):
    """Reference: 6 iterations at CP=2. Then 3 iterations at CP=2 saved to disk, resumed at CP=1
    (on a single rank, DP=1) for iterations 4-6: the same losses as the reference."""
    cp2 = ["--context-parallel-size", "2", "--cp-layout", "striped", "--cp-algo", "burst"]
    ref = run_ranks(2, train_run, _argv(tmp_path, 6, *cp2))[0]
    run_ranks(2, train_run, _argv(tmp_path, 3, *cp2, "--save", str(tmp_path / "ckpt")))
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    resumed = run_ranks(1, train_run, _argv(tmp_path, 6, "--load", str(tmp_path / "ckpt"),
                                            "--override-opt-param-scheduler"))[0]
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for got, want in zip(resumed, ref[3:]):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5), (got, want)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
    # The run learns: the trajectory is not flat (so matching it means something).
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"] - 0.05


def train_run_then_draw(argv: List[str]):
    """train_run, then four draws from torch's global CPU generator where the run left it."""
    import torch

    metrics = train_run(argv)
    return [m["lm_loss"] for m in metrics], torch.rand(4).tolist()


def test_resume_restores_rng_states(tmp_path):
    """model_optim_rng.pt holds Megatron-LM's rng_state, and loading it restores the generators:
    with dropout, 4 iterations straight and 2 + 2 resumed draw the same masks (same losses) and
    leave torch's generator in the same place. --no-load-rng resumes from the --seed state
    instead, so both differ (which is what makes the first comparison mean something)."""
    import torch

    drop = ["--hidden-dropout", "0.3"]
    ckpt = str(tmp_path / "ckpt")
    ref_losses, ref_draw = run_ranks(1, train_run_then_draw, _argv(tmp_path, 4, *drop))[0]
    run_ranks(1, train_run, _argv(tmp_path, 2, *drop, "--save", ckpt))
    state = torch.load(tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=False)
    assert isinstance(state["rng_state"], list) and len(state["rng_state"]) == 1
    assert set(state["rng_state"][0]) == {"random_rng_state", "np_rng_state", "torch_rng_state"}

    more = "--override-opt-param-scheduler"  # --train-iters grew: this run's schedule flags win
    losses, draw = run_ranks(1, train_run_then_draw, _argv(tmp_path, 4, *drop, "--load", ckpt, more))[0]
    assert draw == ref_draw
    assert losses == pytest.approx(ref_losses[2:], rel=1e-6, abs=0)

    losses, draw = run_ranks(1, train_run_then_draw,
                             _argv(tmp_path, 4, *drop, "--load", ckpt, more, "--no-load-rng"))[0]
    assert draw != ref_draw
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(losses, ref_losses[2:])), (losses, ref_losses)


def test_checkpoint_without_rng_state_names_the_flag(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(1, train_run, _argv(tmp_path, 1, "--save", ckpt, "--no-save-rng"))
    more = "--override-opt-param-scheduler"
    with pytest.raises(RuntimeError, match="pass --no-load-rng"):
        run_ranks(1, train_run, _argv(tmp_path, 2, "--load", ckpt, more))
    assert [m["iteration"] for m in run_ranks(1, train_run, _argv(tmp_path, 2, "--load", ckpt, more,
                                                                    "--no-load-rng"))[0]] == [2]


def _schedule_argv(tmp, iters, *extra):
    """Like _argv, but the decay length follows --train-iters (Megatron-LM's default)."""
    argv = _argv(tmp, iters, *extra)
    i = argv.index("--lr-decay-iters")
    return argv[:i] + argv[i + 2:]


def test_resume_with_more_iterations_follows_megatron_lm(tmp_path):
    """Saved with --train-iters 3, resumed with --train-iters 5 (the decay now spans 5). It used to
    take the checkpoint's 3-iteration schedule silently and train at the minimum learning rate.
    As in Megatron-LM: without a flag the mismatch is an error naming both flags;
    --override-opt-param-scheduler continues on the 5-iteration schedule (the learning rates of
    an uninterrupted 5-iteration run); --use-checkpoint-opt-param-scheduler keeps the 3."""
    ckpt = str(tmp_path / "ckpt")
    straight = run_ranks(1, train_run, _schedule_argv(tmp_path, 5))[0]
    run_ranks(1, train_run, _schedule_argv(tmp_path, 3, "--save", ckpt))
    with pytest.raises(RuntimeError, match="--override-opt-param-scheduler.*--use-checkpoint-opt-param-scheduler"):
        run_ranks(1, train_run, _schedule_argv(tmp_path, 5, "--load", ckpt))
    resumed = run_ranks(1, train_run, _schedule_argv(tmp_path, 5, "--load", ckpt,
                                                     "--override-opt-param-scheduler"))[0]
    assert [m["iteration"] for m in resumed] == [4, 5]
    assert [m["lr"] for m in resumed] == pytest.approx([m["lr"] for m in straight[3:]], rel=1e-12)
    assert resumed[0]["lr"] > 1e-4  # a learning rate, not the end of the old schedule
    kept = run_ranks(1, train_run, _schedule_argv(tmp_path, 5, "--load", ckpt,
                                                  "--use-checkpoint-opt-param-scheduler"))[0]
    assert [m["lr"] for m in kept] == [0.0, 0.0]  # the checkpoint's schedule had decayed to --min-lr 0


def test_resume_with_another_global_batch_size_continues_the_data(tmp_path):
    """2 iterations of 4 samples saved, resumed with 8 per iteration: the next batch starts at
    sample 8 (consumed_samples is read back), not 16, and the schedule keeps its place in samples."""
    ckpt = str(tmp_path / "ckpt")
    run_ranks(1, train_run, _argv(tmp_path, 2, "--save", ckpt))
    resumed = run_ranks(1, train_run, _argv(tmp_path, 3, "--load", ckpt, "--global-batch-size", "8",
                                            "--override-opt-param-scheduler"))[0]
    assert [(m["iteration"], m["consumed_samples"]) for m in resumed] == [(3, 16)]


def test_checkpoint_from_other_tp_is_rejected(tmp_path):
    run_ranks(2, train_run, _argv(tmp_path, 1, "--tensor-model-parallel-size", "2",
                                  "--save", str(tmp_path / "ckpt")))
    with pytest.raises(RuntimeError, match="different --tensor-model-parallel-size"):
        run_ranks(1, train_run, _argv(tmp_path, 2, "--load", str(tmp_path / "ckpt")))


def test_cli_single_process_logs_like_megatron(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_burst.train", *_argv(tmp_path, 2, "--metrics-file", str(metrics))],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.lstrip().startswith("iteration")]
    assert len(lines) == 2, proc.stdout
    for field in ("iteration        1/       2", "lm loss:", "tokens per second:", "cp comm bytes per rank:"):
        assert field in lines[0], lines[0]
    data = json.loads(metrics.read_text())
    assert (data["cp"], data["algo"], data["layout"]) == (1, "burst", "zigzag")
    assert [m["iteration"] for m in data["metrics"]] == [1, 2]


def _main_in_process(argv, monkeypatch, capsys):
    """megatron_burst.train's main() in this process, for flags that end it before any process group
    exists (--help, a usage error): (exit status, stdout, stderr). The `python -m megatron_burst.train`
    entry point itself runs in the subprocess tests above and below. main() fills in a world of one
    in os.environ; monkeypatch puts the environment back."""
    from megatron_burst.train.__main__ import main

    from megatron_burst.world import LAUNCHER_VARIABLES

    for name in LAUNCHER_VARIABLES:
        # setenv first: delenv alone records nothing for an absent variable, so what main() adds would stay
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_cli_rejects_bad_flags_before_starting(tmp_path, monkeypatch, capsys):
    code, _, err = _main_in_process(_argv(tmp_path, 2, "--cp-comm-type", "a2a+p2p"), monkeypatch, capsys)
    assert code == 2
    assert "--cp-comm-type a2a+p2p" in err and "needs --hierarchical-context-parallel-sizes" in err


def test_cli_error_while_training_exits_1_with_traceback(tmp_path):
    """main() ends through os._exit, but a failure inside training still fails the process."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")  # no iter_0000003/
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_burst.train", *_argv(tmp_path, 2, "--load", str(tmp_path / "ckpt"))],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "ValueError: checkpoint" in proc.stderr, proc.stderr[-3000:]


def test_cli_help_lists_every_flag(monkeypatch, capsys):
    """The README and the package docstring send readers to --help: it lists every flag the
    parser accepts, each with a description."""
    import megatron_burst.train
    from megatron_burst.train import build_parser

    assert "python -m megatron_burst.train --help" in megatron_burst.train.__doc__
    code, out, err = _main_in_process(["--help"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    actions = build_parser()._actions
    assert len(actions) > 60
    for action in actions:
        assert action.help, f"{'/'.join(action.option_strings)} has no help text"
        for flag in action.option_strings:
            assert flag in out, flag
    assert "--no-load-rng" in out and "--fused-lm-loss" in out


# A tiny CP = 2 job: two ranks exchanging KV blocks over gloo point-to-point sends.
_EXIT_FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
               "--context-parallel-size", "2", "--cp-algo", "burst", "--cp-layout", "striped"]
# One job: that main() under torchrun, after gloo P2P traffic, trains and exits 0 with nothing aborting.
# The teardown race itself (about 1 run in 10 without exit_rank) is repeated at the exit_rank level by
# tests/test_world.py::test_p2p_jobs_end_cleanly_every_time (10 jobs); every CP > 1 functional-test
# case (tests/test_functional_tests.py::test_ci_cases_pass_end_to_end) is another torchrun-style job
# that must end 0; and main() ending through exit_rank is checked below without a job.
EXIT_RUNS = 1


def test_torchrun_jobs_exit_cleanly(tmp_path):
    """A rank that used gloo P2P sends can abort in teardown after its work is done ("terminate
    called without an active exception", SIGABRT), failing the torchrun job now and then. main()
    ends through megatron_burst.world.exit_rank instead: the job exits 0 (the race is repeated in
    tests/test_world.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_burst.train", *_EXIT_FLAGS, "--data-cache-path", str(tmp_path / "data"),
           "--corpus-max-bytes", str(CORPUS_BYTES)]
    import inspect

    from megatron_burst.train import __main__ as train_main

    body = inspect.getsource(train_main.main)  # every way out of main() is exit_rank, none a plain return
    assert body.rstrip().endswith("exit_rank(0)") and "exit_rank(1)" in body and "sys.exit" not in body
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for run in range(EXIT_RUNS):
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, (f"job {run + 1} of {EXIT_RUNS}: exit status {proc.returncode}\n"
                                      f"{proc.stderr[-3000:]}")
        assert "iteration        1/       1" in proc.stdout, proc.stdout  # it trained, then ended
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]


def test_stdlib_corpus_is_deterministic_megatron_data(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_burst import data

    a = data.default_corpus(str(tmp_path / "a"), max_bytes=CORPUS_BYTES)
    b = data.default_corpus(str(tmp_path / "b"), max_bytes=CORPUS_BYTES)
    assert os.path.basename(os.path.dirname(a)) == os.path.basename(os.path.dirname(b))
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            assert fa.read() == fb.read()
    assert data.default_corpus(str(tmp_path / "a"), max_bytes=CORPUS_BYTES) == a  # cache hit
    ds = IndexedDataset(a)
    tokens = sum(int(n) for n in ds.sequence_lengths)
    assert tokens == CORPUS_BYTES + len(ds)  # every byte, plus one EOD per document
    first = ds[0]
    assert first[-1] == data.EOD_ID and first[:-1].max() < 256
    files = data.stdlib_source_files()
    assert data.ByteTokenizer().detokenize(first[:-1]) == files[0].read_text(encoding="utf-8")[: len(first) - 1]


def test_gpt_dataset_over_corpus(tmp_path):
    from megatron_burst import data

    prefix = data.default_corpus(str(tmp_path), max_bytes=CORPUS_BYTES)
    ds = data.build_train_dataset(data_path=[prefix], seq_length=64, num_samples=8, seed=1,
                                  tokenizer=data.ByteTokenizer(), cache_path=str(tmp_path / "idx"))
    sample = ds[0]
    assert sample["tokens"].shape == (64,)
    assert (sample["labels"][:-1] == sample["tokens"][1:]).all()  # next-token labels
    # Samples are real text: every piece between EODs is a substring of the corpus (GPTDataset
    # shuffles documents, so a window may join two documents that are not adjacent on disk).
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    as_text = lambda ids: "".join(map(chr, ids))  # noqa: E731  (EOD 256 -> one distinct char)
    corpus = as_text(int(t) for doc in IndexedDataset(prefix) for t in doc)
    for i in range(len(ds)):
        for piece in as_text(ds[i]["tokens"].tolist()).split(chr(data.EOD_ID)):
            assert piece in corpus, f"sample {i}: {piece!r} is not corpus text"
    batch = data.collate([ds[i] for i in range(3)])
    assert batch["tokens"].shape == (3, 64) and batch["loss_mask"].shape == (3, 64)


# ------------------------------------------------------------ issue M2: tried as a Megatron-LM user would

def test_odd_sequence_length_trains_at_cp1(tmp_path):
    """Used to fail at the first step: "sequence length 31 is not divisible by 2, which
    layout='zigzag' needs with world_size=1". One rank holds any length, in every layout."""
    import math

    for layout in (["--cp-layout", "zigzag"], ["--cp-layout", "striped", "--cp-stripe", "4"]):
        metrics = run_ranks(1, train_run, _argv(tmp_path, 1, "--seq-length", "31", *layout))[0]
        assert len(metrics) == 1 and math.isfinite(metrics[0]["lm_loss"]), metrics


@pytest.mark.parametrize("extra,needles", [
    (["--hierarchical-context-parallel-sizes", "2", "2"],
     ["--hierarchical-context-parallel-sizes 2 2 multiply to 4", "must multiply to --context-parallel-size 2"]),
    (["--reset-attention-mask", "--window-size", "8,0", "--sparse-attention", "vertical_slash", "--sparse-last-q",
      "8", "--cp-algo", "burst", "--seq-selective-ckpt-ratio", "0.5", "--recompute-granularity", "full"],
     ["--sparse-attention", "drop --seq-selective-ckpt-ratio 0.5"]),
    (["--linear-attention-type", "gated_delta_net", "--cp-comm-type", "a2a"], ["(gated_delta_net)", "a2a"]),
])
def test_trial_combinations_are_refused_before_training(tmp_path, extra, needles):
    """Combinations the trial found accepted (hierarchical sizes that do not make the CP size) or
    failing only at the first step are refused by validate_args, before any process group."""
    from megatron_burst.train import build_parser, validate_args

    args = build_parser().parse_args(_argv(tmp_path, 1, "--context-parallel-size", "2", *extra))
    with pytest.raises(ValueError) as err:
        validate_args(args, 2)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert "use ring or burst" not in str(err.value)  # burst (or no algorithm) was chosen: nothing to pick


def test_distributed_timeout_minutes_is_megatrons_flag(tmp_path):
    from megatron_burst.train import build_parser, validate_args

    parser = build_parser()
    assert parser.parse_args(_argv(tmp_path, 1)).distributed_timeout_minutes == 10  # Megatron-LM's default
    half = parser.parse_args(_argv(tmp_path, 1, "--distributed-timeout-minutes", "0.5"))
    assert half.distributed_timeout_minutes == 0.5
    with pytest.raises(ValueError, match="--distributed-timeout-minutes 0"):
        validate_args(parser.parse_args(_argv(tmp_path, 1, "--distributed-timeout-minutes", "0")), 1)


STALL_TIMEOUT_MIN = 0.1  # 6 s: the fraction our flag accepts beyond Megatron-LM's int


def test_stalled_peer_ends_the_job_naming_the_timeout(tmp_path):
    """Used to hang: SIGSTOP one rank of a CP = 2 run and the other waited forever. Every process
    group now has --distributed-timeout-minutes' timeout: the waiting rank raises after it, says
    so naming the flag, and exits 1."""
    import signal
    import time

    from megatron_burst.world import free_port

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    flags = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "100000", "--context-parallel-size", "2",
             "--cp-algo", "burst", "--data-cache-path", str(tmp_path / "data"), "--corpus-max-bytes",
             str(CORPUS_BYTES), "--distributed-timeout-minutes", str(STALL_TIMEOUT_MIN)]
    cmd = [sys.executable, "-m", "megatron_burst.train", *flags]
    procs, logs = [], []
    deadline = time.monotonic() + 240  # hard bound on the whole test
    try:
        for rank in (0, 1):
            out, err = tmp_path / f"out{rank}", tmp_path / f"err{rank}"
            logs.append((out, err))
            with open(out, "w") as o, open(err, "w") as e:
                procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=o, stderr=e,
                                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        while "iteration        2/" not in logs[0][0].read_text():  # training, both ranks in step
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0][1].read_text()[-3000:]
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGSTOP)
        stalled = time.monotonic()
        code = procs[0].wait(timeout=max(1.0, deadline - time.monotonic()))
        waited = time.monotonic() - stalled
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=30)
    err = logs[0][1].read_text()
    assert code == 1, err[-3000:]
    assert f"--distributed-timeout-minutes {STALL_TIMEOUT_MIN:g} (6 s)" in err and "stalled or died" in err, err[-3000:]
    assert waited < 6 + 54, f"rank 0 ended {waited:.0f} s after its peer stalled (timeout 6 s)"
