"""Sequence-length distributions: the Wikipedia phase-2 mix and draws from it.

The benchmarks and the load-balance lab use the same mix the Samsung paper measured on
the MLPerf phase-2 data ([000] appendix C): 37.3 / 19.7 / 11.7 / 31.4 % of the
samples in (0,128] / (128,256] / (256,384] / (384,512], with about 23 % of all samples at
exactly 512 tokens and the rest uniform inside each stratum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthMix:
    edges: tuple[int, ...]  # upper edges of the strata, e.g. (128, 256, 384, 512)
    probs: tuple[float, ...]  # share of samples in each stratum
    at_max: float  # share of *all* samples at exactly edges[-1]
    min_length: int = 1

    def __post_init__(self) -> None:
        if len(self.edges) != len(self.probs):
            raise ValueError("one probability per stratum")
        # The paper's shares are rounded (they sum to 100.1 %); normalise, but catch typos.
        if abs(sum(self.probs) - 1.0) > 0.01:
            raise ValueError(f"stratum probabilities sum to {sum(self.probs)}, not 1")
        if not 0.0 <= self.at_max <= self.probs[-1]:
            raise ValueError("the share at the maximum length must fit in the last stratum")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Draw `n` lengths (int64)."""
        lows = (self.min_length - 1,) + self.edges[:-1]
        p = np.asarray(self.probs) / sum(self.probs)
        stratum = rng.choice(len(self.edges), size=n, p=p)
        lo = np.asarray(lows)[stratum] + 1
        hi = np.asarray(self.edges)[stratum]
        # Inside the last stratum, a fixed share sits exactly at the maximum (truncated documents).
        full = (stratum == len(self.edges) - 1) & (rng.random(n) < self.at_max / p[-1])
        hi_uniform = np.where(stratum == len(self.edges) - 1, hi - 1, hi)  # 512 itself only via `full`
        lengths = rng.integers(lo, hi_uniform + 1)
        return np.where(full, hi, lengths).astype(np.int64)


WIKI_PHASE2 = LengthMix(edges=(128, 256, 384, 512), probs=(0.373, 0.197, 0.117, 0.314), at_max=0.23)


def histogram(lengths: Sequence[int] | np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """Counts of `lengths` per stratum (0, e0], (e0, e1], ..."""
    lengths = np.asarray(lengths)
    idx = np.searchsorted(np.asarray(edges), lengths, side="left")
    if len(lengths) and idx.max() >= len(edges):
        raise ValueError(f"length {lengths.max()} is above the last stratum edge {edges[-1]}")
    return np.bincount(idx, minlength=len(edges))
