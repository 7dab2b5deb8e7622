"""Stratified sampling: how many sequences of each length stratum go into every local batch.

Samsung (paper 000 §4.1, Figure 3; `SplitRandomSampler(batch_ratio=[6,3,2,5])`) fills each
local batch of 16 with 6/3/2/5 sequences from the (0,128] / (128,256] / (256,384] /
(384,512] strata. The counts follow the data's own histogram: largest-remainder rounding of
`local_batch * share`, so they always sum to `local_batch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bert.lengths import LengthMix, histogram

EDGES = (128, 256, 384, 512)


def stratum_of(lengths: Sequence[int] | np.ndarray, edges: Sequence[int] = EDGES) -> np.ndarray:
    """Index of the stratum (0, e0], (e0, e1], ... of every length (int64)."""
    lengths = np.asarray(lengths)
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"sequence length {lengths.min()} is below 1")
    idx = np.searchsorted(np.asarray(edges), lengths, side="left").astype(np.int64)
    if lengths.size and idx.max() >= len(edges):
        raise ValueError(f"sequence length {lengths.max()} is above the last stratum edge {edges[-1]}")
    return idx


def strata_counts(
    lengths_or_histogram: Sequence[int] | np.ndarray | LengthMix,
    edges: Sequence[int] = EDGES,
    local_batch: int = 16,
) -> tuple[int, ...]:
    """Per-stratum counts of a local batch, proportional to the data's histogram.

    Takes a `LengthMix`, a histogram (a 1-D array with exactly one entry per stratum) or
    the lengths themselves (anything else).
    """
    if local_batch < 1:
        raise ValueError(f"local batch size must be positive, got {local_batch}")
    if isinstance(lengths_or_histogram, LengthMix):
        if tuple(lengths_or_histogram.edges) != tuple(edges):
            raise ValueError(f"length mix edges {lengths_or_histogram.edges} differ from the strata edges {edges}")
        counts = np.asarray(lengths_or_histogram.probs, dtype=np.float64)
    else:
        data = np.asarray(lengths_or_histogram)
        counts = data.astype(np.float64) if data.shape == (len(edges),) else histogram(data.ravel(), edges)
    if counts.min() < 0 or counts.sum() <= 0:
        raise ValueError(f"the length histogram {counts.tolist()} is empty or negative")
    quota = local_batch * counts / counts.sum()
    whole = np.floor(quota).astype(np.int64)
    # Largest remainder; ties go to the lower stratum (stable sort) so the result is deterministic.
    order = np.argsort(-(quota - whole), kind="stable")
    whole[order[: local_batch - whole.sum()]] += 1
    return tuple(int(c) for c in whole)
