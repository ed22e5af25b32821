"""The training entry point: checkpoints move across CP sizes, the CLI runs and logs like
Megatron, and the built-in corpus is real, deterministic Megatron indexed data."""
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
    resumed = run_ranks(1, train_run, _argv(tmp_path, 6, "--load", str(tmp_path / "ckpt")))[0]
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for got, want in zip(resumed, ref[3:]):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5), (got, want)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
    # The run learns: the trajectory is not flat (so matching it means something).
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"] - 0.05


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


def test_cli_rejects_bad_flags_before_starting(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_burst.train", *_argv(tmp_path, 2, "--cp-comm-type", "a2a")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2
    assert "--cp-comm-type a2a" in proc.stderr and "not supported" in proc.stderr


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
