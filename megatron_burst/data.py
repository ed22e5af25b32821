"""Training data: a byte-level corpus every machine has, in Megatron's indexed dataset format.

The default corpus is the Python standard library's own source files (``*.py`` under
``sysconfig``'s stdlib directory, site-packages excluded), sorted by relative path, one document
per file, tokenized as raw bytes (ids 0-255) plus an end-of-document token, and capped at a fixed
number of bytes so it builds in about a second. It is written once with megatron.core's
``IndexedDatasetBuilder`` to ``data_cache/`` (git-ignored) under a name derived from the content
hash, so a different Python version gets its own files instead of a stale cache.

``build_train_dataset`` wraps any indexed dataset (ours or Megatron-LM's preprocess_data output)
in megatron.core's ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sysconfig
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers import MegatronTokenizerBase

BYTE_VOCAB = 256
EOD_ID = 256  # end of document, appended to every file
PAD_ID = 257  # never in the data; GPTDataset masks the loss of pad labels
BYTE_VOCAB_SIZE = 258

DEFAULT_CACHE_DIR = "data_cache"
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
_FORMAT_VERSION = 1  # bump when the corpus recipe changes, so old caches are not reused
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class ByteTokenizer(MegatronTokenizerBase):
    """Byte-level tokenizer: UTF-8 bytes are ids 0-255, EOD is 256, PAD is 257."""

    def __init__(self) -> None:
        super().__init__(path="bytes", config={})
        # GPTDataset hashes its config, tokenizer included, to name its index cache.
        self.unique_identifiers = OrderedDict(class_name=type(self).__name__, vocab_size=BYTE_VOCAB_SIZE)

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < BYTE_VOCAB).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> Dict[str, int]:
        v = {bytes([i]).decode("latin-1"): i for i in range(BYTE_VOCAB)}
        v.update({"<eod>": EOD_ID, "<pad>": PAD_ID})
        return v

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: s for s, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def eod(self) -> int:
        return EOD_ID

    @property
    def pad(self) -> int:
        return PAD_ID

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteTokenizer is for pretraining on raw bytes; it has no chat template")


class NullTokenizer(MegatronTokenizerBase):
    """For data that is already token ids (Megatron-LM's NullTokenizer convention):
    ids are < ``vocab_size`` and EOD is ``vocab_size``, so the model vocabulary is vocab_size + 1."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(path="null", config={})
        if vocab_size < 1:
            raise ValueError(f"--vocab-size {vocab_size} must be positive")
        self._size = vocab_size
        self.unique_identifiers = OrderedDict(class_name=type(self).__name__, vocab_size=vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary: ids are used as they are")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary: ids are used as they are")

    @property
    def vocab_size(self) -> int:
        return self._size + 1

    @property
    def eod(self) -> int:
        return self._size

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("NullTokenizer has no chat template")


def stdlib_source_files(root: Optional[str] = None) -> List[Path]:
    """The standard library's ``*.py`` files, sorted by path relative to ``root``."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Prune here rather than filter afterwards: site-packages can be larger than the stdlib.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def _read_corpus(files: Sequence[Path], max_bytes: int) -> List[bytes]:
    """File contents in order, the last one cut so the total is at most ``max_bytes``."""
    docs, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file in an odd install: skipping it keeps the build going
            continue
        if not data:
            continue
        data = data[: max_bytes - total]
        docs.append(data)
        total += len(data)
    return docs


def build_byte_dataset(docs: Sequence[bytes], prefix: str) -> None:
    """Write ``docs`` (one document each, EOD appended) as ``prefix.bin`` / ``prefix.idx``."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        ids = np.frombuffer(doc, dtype=np.uint8).astype(np.uint16)
        builder.add_item(torch.from_numpy(np.append(ids, np.uint16(EOD_ID))))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def default_corpus(cache_dir: str = DEFAULT_CACHE_DIR, max_bytes: int = DEFAULT_MAX_BYTES,
                   root: Optional[str] = None) -> str:
    """Path prefix of the stdlib byte corpus, building it on first use. Safe to call from many
    processes at once (a file lock serializes the build; later callers reuse the files)."""
    if max_bytes < 1024:
        raise ValueError(f"max_bytes={max_bytes} is too small for a training corpus (>= 1024)")
    files = stdlib_source_files(root)
    if not files:
        raise FileNotFoundError(f"no *.py files under {root or sysconfig.get_paths()['stdlib']}")
    docs = _read_corpus(files, max_bytes)
    digest = hashlib.sha256(f"v{_FORMAT_VERSION}:{max_bytes}".encode())
    for doc in docs:
        digest.update(len(doc).to_bytes(8, "little"))
        digest.update(doc)
    out_dir = Path(cache_dir) / f"stdlib-bytes-{digest.hexdigest()[:16]}"
    prefix = str(out_dir / "text_document")
    if Path(prefix + ".idx").exists() and Path(prefix + ".bin").exists():
        return prefix
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(prefix + ".idx").exists():
            tmp = str(out_dir / f"tmp-{os.getpid()}")
            build_byte_dataset(docs, tmp)
            # .bin first: a reader that sees .idx can rely on .bin being complete.
            os.replace(tmp + ".bin", prefix + ".bin")
            os.replace(tmp + ".idx", prefix + ".idx")
    return prefix


def corpus_stats(prefix: str) -> Dict[str, int]:
    """Documents and tokens of an indexed dataset (for logs)."""
    ds = IndexedDataset(prefix, mmap=True)
    return {"documents": len(ds.document_indices) - 1, "tokens": int(ds.sequence_lengths.sum())}


def build_train_dataset(*, data_path: Optional[Sequence[str]], seq_length: int, num_samples: int,
                        seed: int, tokenizer: MegatronTokenizerBase, mock: bool = False,
                        split: str = "100,0,0", cache_path: Optional[str] = None,
                        reset_position_ids: bool = False):
    """The training split as megatron.core ``GPTDataset`` (or ``MockGPTDataset`` when ``mock``).

    ``data_path`` is Megatron-LM's ``--data-path``: one prefix, or ``weight prefix ...`` pairs
    for a blend. ``reset_position_ids`` restarts position ids after each EOD (documents themselves
    are derived from the EOD tokens at slicing time, so no dense attention mask is built). Every
    rank must call this (megatron.core builds the index on rank 0 first,
    then the others, with a barrier between).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be positive")
    if not mock and not data_path:
        raise ValueError("no --data-path given: pass one (or omit it to use the built-in stdlib "
                         "corpus through megatron_burst.train), or --mock-data")
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length,
        blend=None if mock else get_blend_from_list(list(data_path)),
        split=split, path_to_cache=cache_path, tokenizer=tokenizer,
        reset_position_ids=reset_position_ids, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )  # blend=None is how megatron.core selects mock data
    cls = MockGPTDataset if mock else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, 0, 0], lambda: True, config).build()
    if train is None:
        raise ValueError(f"--split {split} leaves no training documents")
    return train


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack GPTDataset samples into [b, s] tensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
