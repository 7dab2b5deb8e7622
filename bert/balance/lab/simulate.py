"""The load-balance lab's simulation (Samsung [000] §5.2, Figure 6, Table 5).

Draw a local batch per GPU (stratified if the strategy says so), run the strategy's own
`assign` (the code the input pipeline runs), and record the fewest and the most tokens any
GPU gets; average both over many trials. Packing is simulated the paper's way: every GPU
draws whole packs from a pre-packed data set and nothing is reassigned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bert.balance.lab.length_pmf import LengthPMF
from bert.balance.lab.packing import pack_histogram
from bert.balance.strategies import Strategy
from bert.balance.stratify import EDGES, strata_counts, stratum_of


@dataclass(frozen=True)
class Spread:
    """Per-GPU token counts of one strategy at one GPU count, averaged over trials."""

    strategy: str
    gpus: int
    trials: int
    avg_min: float  # mean over trials of the least-loaded GPU's tokens
    avg_max: float  # mean over trials of the most-loaded GPU's tokens
    mean: float  # mean tokens per GPU
    stderr: float  # standard error of avg_min and avg_max (the larger)

    @property
    def range_over_mean(self) -> float:
        return (self.avg_max - self.avg_min) / self.mean


def _spread(name: str, tokens: np.ndarray) -> Spread:
    """`tokens`: (trials, gpus) per-GPU token counts."""
    lo, hi = tokens.min(axis=1), tokens.max(axis=1)
    stderr = float(max(lo.std(), hi.std()) / np.sqrt(len(tokens)))
    return Spread(name, tokens.shape[1], len(tokens), float(lo.mean()), float(hi.mean()), float(tokens.mean()), stderr)


def stratum_histogram(pmf: LengthPMF, edges: Sequence[int] = EDGES) -> np.ndarray:
    """Share of the distribution in each stratum."""
    return np.bincount(stratum_of(np.arange(1, pmf.max_length + 1), edges), weights=pmf.probs, minlength=len(edges))


def draw(
    pmf: LengthPMF, stratified: bool, shape: tuple[int, int, int], rng: np.random.Generator, edges: Sequence[int]
) -> np.ndarray:
    """Lengths (trials, gpus, local_batch) as the sampler draws them."""
    trials, gpus, local_batch = shape
    if not stratified:
        return pmf.sample(shape, rng)
    counts = strata_counts(stratum_histogram(pmf, edges), edges, local_batch)
    return pmf.sample_stratified(counts, edges, trials * gpus, rng).reshape(shape)


def simulate(
    strategy: Strategy,
    pmf: LengthPMF,
    gpus: int,
    gpus_per_node: int,
    local_batch: int,
    trials: int,
    rng: np.random.Generator,
    edges: Sequence[int] = EDGES,
) -> Spread:
    lengths = draw(pmf, strategy.stratified, (trials, gpus, local_batch), rng, edges)
    tokens = np.stack([trial.ravel()[strategy.assign(trial, gpus_per_node)].sum(axis=1) for trial in lengths])
    return _spread(strategy.name, tokens)


def simulate_node_ideal(
    pmf: LengthPMF,
    gpus: int,
    gpus_per_node: int,
    local_batch: int,
    trials: int,
    rng: np.random.Generator,
    edges: Sequence[int] = EDGES,
) -> Spread:
    """The floor of any node-local balancer: stratified draw, then each node's tokens split evenly."""
    lengths = draw(pmf, True, (trials, gpus, local_batch), rng, edges)
    per_node = lengths.reshape(trials, gpus // gpus_per_node, -1).sum(axis=2) / gpus_per_node
    return _spread("node_ideal", np.repeat(per_node, gpus_per_node, axis=1))


@dataclass(frozen=True)
class PackedData:
    packs: LengthPMF  # distribution of tokens per pack
    ratio: float  # sequences per pack


def pack(pmf: LengthPMF, max_per_pack: int = 3, pool: int = 1_000_000) -> PackedData:
    """Pack a pool of `pool` sequences in the distribution's proportions into rows of max_length tokens."""
    counts = pmf.counts(pool)
    per_tokens = pack_histogram(counts, capacity=pmf.max_length, max_per_pack=max_per_pack)
    return PackedData(LengthPMF(per_tokens / per_tokens.sum()), pool / per_tokens.sum())


def simulate_packing(
    packed: PackedData, gpus: int, packs_per_gpu: int, trials: int, rng: np.random.Generator
) -> Spread:
    tokens = packed.packs.sample((trials, gpus, packs_per_gpu), rng).sum(axis=2)
    return _spread("packing", tokens)
