"""A sequence-length distribution as a probability per length, for the load-balance lab.

One representation for both sources the lab takes: the parametric mix of `bert.lengths`
(strata shares, uniform inside a stratum, a spike at the maximum) and the lengths read from
real shards. Drawing per stratum (stratified sampling) is drawing from the pmf restricted
to the stratum's lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bert.lengths import LengthMix


@dataclass(frozen=True)
class LengthPMF:
    probs: np.ndarray  # probs[i] = P(length == i + 1), sums to 1

    @classmethod
    def from_mix(cls, mix: LengthMix) -> LengthPMF:
        """The exact distribution `LengthMix.sample` draws from."""
        shares = np.asarray(mix.probs, dtype=np.float64) / sum(mix.probs)
        probs = np.zeros(mix.edges[-1])
        low = mix.min_length
        for i, (edge, share) in enumerate(zip(mix.edges, shares)):
            last = i == len(mix.edges) - 1
            top = edge - 1 if last else edge  # the maximum itself is only the spike
            probs[low - 1 : top] = (share - (mix.at_max if last else 0.0)) / (top - low + 1)
            low = edge + 1
        probs[-1] += mix.at_max
        return cls(probs)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int] | np.ndarray, max_length: int | None = None) -> LengthPMF:
        """The empirical distribution of observed lengths (e.g. a shard's length index)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            raise ValueError("no lengths to build a distribution from")
        if lengths.min() < 1:
            raise ValueError(f"sequence length {lengths.min()} is below 1")
        counts = np.bincount(lengths - 1, minlength=max_length or 0).astype(np.float64)
        if max_length is not None and counts.size > max_length:
            raise ValueError(f"sequence length {lengths.max()} is above the maximum {max_length}")
        return cls(counts / counts.sum())

    @property
    def max_length(self) -> int:
        return len(self.probs)

    @property
    def mean(self) -> float:
        return float(np.dot(np.arange(1, self.max_length + 1), self.probs))

    def counts(self, n: int) -> np.ndarray:
        """`n` sequences in these proportions: counts[i] of length i + 1 (largest remainder, sums to n)."""
        quota = n * self.probs
        whole = np.floor(quota).astype(np.int64)
        whole[np.argsort(-(quota - whole), kind="stable")[: n - whole.sum()]] += 1
        return whole

    def sample(
        self, shape: int | tuple[int, ...], rng: np.random.Generator, low: int = 1, high: int | None = None
    ) -> np.ndarray:
        """Lengths (int64) of the given shape, drawn from the pmf restricted to [low, high]."""
        high = self.max_length if high is None else high
        window = self.probs[low - 1 : high]
        if window.sum() <= 0:
            raise ValueError(f"the length distribution has no mass in [{low}, {high}]")
        cdf = np.cumsum(window / window.sum())
        u = rng.random(shape)
        return low + np.minimum(np.searchsorted(cdf, u, side="right"), len(window) - 1).astype(np.int64)

    def sample_stratified(
        self, counts: Sequence[int], edges: Sequence[int], ranks: int, rng: np.random.Generator
    ) -> np.ndarray:
        """(ranks, sum(counts)) lengths: every rank draws counts[s] from stratum s, stratum by stratum."""
        lows = (1, *(e + 1 for e in edges[:-1]))
        parts = [self.sample((ranks, c), rng, lo, hi) for c, lo, hi in zip(counts, lows, edges) if c]
        return np.concatenate(parts, axis=1)
