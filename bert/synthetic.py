"""Random pre-training samples with the MLPerf masking rules, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from bert.sample import Sample

if TYPE_CHECKING:
    from bert.batch import Batch

CLS, SEP, MASK = 101, 102, 103  # ids in the MLPerf (bert-base-uncased) vocab
FIRST_WORD_ID = 999  # ids below are [PAD], [unusedN], [UNK], [CLS], [SEP], [MASK]


def random_sample(
    length: int,
    rng: np.random.Generator,
    vocab_size: int = 30522,
    max_predictions: int = 76,
    mask_prob: float = 0.15,
) -> Sample:
    """A sample of `length` tokens: [CLS] A [SEP] B [SEP], about 15 % of the words masked."""
    if length < 1:
        raise ValueError("length must be >= 1")
    words = rng.integers(FIRST_WORD_ID, vocab_size, size=length)
    ids = words.copy()
    ids[0] = CLS
    if length >= 2:
        ids[-1] = SEP
    # A's last token is the first [SEP]: at least one position after [CLS], so [CLS] is never overwritten
    split = max(2, int(rng.integers(1, length))) if length >= 3 else length
    segments = np.zeros(length, dtype=np.int64)
    if length >= 3:
        ids[split - 1] = SEP
        segments[split:] = 1
    candidates = np.flatnonzero((ids != CLS) & (ids != SEP))
    n_pred = min(max_predictions, max(1, round(length * mask_prob)), len(candidates))
    positions = np.sort(rng.choice(candidates, size=n_pred, replace=False)) if n_pred else candidates[:0]
    labels = ids[positions].copy()
    ids[positions] = MASK
    return Sample(ids, segments, positions, labels, int(rng.integers(0, 2)))


def random_batch(lengths: Sequence[int], seed: int = 0, vocab_size: int = 30522) -> Batch:
    from bert.batch import collate  # here: torch, which the data tools that draw samples do without

    rng = np.random.default_rng(seed)
    return collate([random_sample(int(n), rng, vocab_size=vocab_size) for n in lengths])
