"""Packed-document mixes the document benchmarks share: document boundaries [0, ..., S] for the
issue-L mixes (lognormal, one long document plus short ones, equal lengths, corpus-drawn).

Every generator is seeded and deterministic: every rank and the driver of a measured run build
the same boundaries."""
from __future__ import annotations

import os
import sysconfig
from typing import Optional

import numpy as np

LOGNORMAL = dict(docs=47, sigma=1.0, seed=46)  # close to the zigzag / contiguous numbers


def cu(lengths) -> list:
    return [0] + np.cumsum(np.asarray(lengths, dtype=np.int64)).tolist()


def lognormal_mix(seq: int, docs: int = LOGNORMAL["docs"], sigma: float = LOGNORMAL["sigma"],
                  seed: int = LOGNORMAL["seed"]) -> list:
    """``docs`` lognormal lengths scaled to sum to ``seq`` (the largest absorbs the rounding), in draw order."""
    x = np.random.default_rng(seed).lognormal(0.0, sigma, docs)
    lengths = np.maximum(1, np.floor(x / x.sum() * seq)).astype(np.int64)
    lengths[np.argmax(lengths)] += seq - lengths.sum()
    return cu(lengths)


def _fill(seq: int, first: list, draw) -> list:
    lengths, total = list(first), sum(first)
    while total < seq:
        n = int(min(draw(), seq - total))
        lengths.append(n)
        total += n
    return cu(lengths)


def long_plus_short(seq: int, long: int = 65536, median: int = 1024, sigma: float = 0.8, seed: int = 0) -> list:
    """One ``long`` document first, then lognormal short ones (at least 16 tokens), the last cut to fit."""
    g = np.random.default_rng(seed)
    return _fill(seq, [min(long, seq)], lambda: max(16, round(g.lognormal(np.log(median), sigma))))


def uniform_mix(seq: int, docs: int = 16) -> list:
    return cu([seq // docs] * (docs - 1) + [seq - (seq // docs) * (docs - 1)])


def corpus_lengths(root: Optional[str] = None) -> list:
    """Token counts of the default training corpus's documents (megatron_burst.data: the standard
    library's ``*.py`` files, one byte a token, plus an end-of-document token), from file sizes."""
    base = root or sysconfig.get_paths()["stdlib"]
    sizes = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                try:
                    size = os.path.getsize(os.path.join(dirpath, f))
                except OSError:
                    continue
                if size:
                    sizes.append(size + 1)
    return sizes


def corpus_mix(seq: int, seed: int = 0, lengths: Optional[list] = None) -> list:
    """Documents drawn (seeded, with replacement) from the corpus's lengths until ``seq``; the last is cut."""
    pool = np.asarray(lengths or corpus_lengths(), dtype=np.int64)
    g = np.random.default_rng(seed)
    return _fill(seq, [], lambda: int(pool[g.integers(len(pool))]))


def mixes(seq: int) -> dict:
    out = {"lognormal": lognormal_mix(seq), "64K+short": long_plus_short(seq, long=min(65536, seq // 2)),
           "16x8K": uniform_mix(seq, 16)}
    lengths = corpus_lengths()
    if lengths:
        out["corpus"] = corpus_mix(seq, lengths=lengths)
    return out
