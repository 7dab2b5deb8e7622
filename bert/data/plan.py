"""The global training plan: which sample ids every rank trains on at every step.

Every rank builds the same plan from the same length index and seed, so the global batch
of a step, and its balancing assignment, are known everywhere without a collective and
without moving sample data between ranks (each rank then reads its own sequences):

1. draw (`bert.data.streams`, `bert.data.epoch`): per epoch, shards dealt to ranks, a
   shuffle buffer per rank, optional stratified local batches; step t's draw is a
   (world, local_batch) array of ids, row r = rank r's draw;
2. assign (`bert.balance`): `strategy.assign(lengths of the draw, ranks_per_node)` says
   which of the drawn sequences each rank trains on.

Steps are numbered from 0 across epochs; `draw(t)` jumps straight to any step (the epoch of
a step and its offset are arithmetic), which is what makes resuming exact and cheap.
"""

from __future__ import annotations

import numpy as np

from bert.balance import Strategy, get_strategy, strata_counts, stratum_of
from bert.balance.stratify import EDGES
from bert.data.epoch import lay_out_epoch
from bert.data.index import LengthIndex
from bert.data.streams import epoch_rng, rank_streams

TAIL = 2  # rng stream tag (streams.py uses 0 and 1)


class TrainPlan:
    def __init__(
        self,
        index: LengthIndex,
        world_size: int,
        local_batch_size: int,
        ranks_per_node: int,
        strategy: str | Strategy = "none",
        seed: int = 0,
        shuffle_buffer: int = 10000,
    ):
        if world_size < 1 or local_batch_size < 1 or shuffle_buffer < 1:
            raise ValueError("world size, local batch size and shuffle buffer must be >= 1")
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"world size {world_size} is not a multiple of ranks per node {ranks_per_node}")
        self.index = index
        self.world_size, self.local_batch_size, self.ranks_per_node = world_size, local_batch_size, ranks_per_node
        self.strategy = get_strategy(strategy) if isinstance(strategy, str) else strategy
        self.seed, self.shuffle_buffer = seed, shuffle_buffer
        self.strata = self.counts = None
        if self.strategy.stratified:
            self.strata = self._strata(index)
            # The counts follow the data's own histogram (Samsung [000] §4.1): 6/3/2/5 of 16 on our phase-2 mix.
            present = np.bincount(self.strata, minlength=len(EDGES))
            self.counts = strata_counts(present, EDGES, local_batch_size)
            check_every_stratum_drawn(present, self.counts, self.strategy.name, local_batch_size)
        self._epochs: dict[int, np.ndarray] = {}

    @staticmethod
    def _strata(index: LengthIndex) -> np.ndarray:
        too_long = np.flatnonzero(index.lengths > EDGES[-1])
        if too_long.size:
            shard, row = index.locate(too_long[:1])
            raise ValueError(
                f"{index.paths[shard[0]]}: sample {row[0]} has {index.lengths[too_long[0]]} tokens, "
                f"above the last stratum edge {EDGES[-1]}"
            )
        return stratum_of(index.lengths).astype(np.int8)  # one byte per sample: the index can be 10^8 long

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.local_batch_size

    def epoch(self, e: int) -> np.ndarray:
        """All sample ids in the order epoch `e` draws them (computed once, the last two kept)."""
        order = self._epochs.get(e)
        if order is None:
            streams = rank_streams(self.index, self.world_size, self.seed, e, self.shuffle_buffer)
            offset = e * self.index.num_samples % self.global_batch_size
            rng = epoch_rng(self.seed, e, TAIL)
            order = lay_out_epoch(streams, self.local_batch_size, offset, rng, self.strata, self.counts)
            # Swapped in whole, so a caller on another thread never sees a half-updated cache.
            self._epochs = {k: v for k, v in self._epochs.items() if k >= e - 1} | {e: order}
        return order

    def draw(self, step: int) -> np.ndarray:
        """(world, local_batch) ids drawn at `step`; row r is rank r's draw."""
        n = self.index.num_samples
        start, need, parts = step * self.global_batch_size, self.global_batch_size, []
        while need:
            e, pos = divmod(start, n)
            part = self.epoch(e)[pos : pos + need]
            parts.append(part)
            start, need = start + len(part), need - len(part)
        return np.concatenate(parts).reshape(self.world_size, self.local_batch_size)

    def assignment(self, step: int) -> np.ndarray:
        """(world, local_batch) ids each rank trains on at `step`, after balancing."""
        ids = self.draw(step)
        order = self.strategy.assign(self.index.lengths[ids], self.ranks_per_node)
        return ids.ravel()[order]

    def rank_ids(self, step: int, rank: int) -> np.ndarray:
        return self.assignment(step)[rank]


def check_every_stratum_drawn(present: np.ndarray, counts: tuple[int, ...], strategy: str, local_batch: int) -> None:
    """Refuse counts that draw nothing from a stratum the data holds: rounded to 0 of a small local batch, its
    sequences would wait for the epoch's tail, which a run (a few percent of an epoch) never reaches, so it would
    never train on them. Samsung warns of small batches ([000] §6)."""
    missing = [k for k, (n, c) in enumerate(zip(present, counts)) if n and not c]
    if not missing:
        return
    bounds, total = (0, *EDGES), int(present.sum())
    share = ", ".join(f"({bounds[k]},{bounds[k + 1]}] ({100 * present[k] / total:.3g} % of the samples)"
                      for k in missing)
    # A batch of ceil(total / n) gives a stratum of n samples a quota of at least 1: it is enough; a smaller one may
    # be, by the rounding of the others' remainders (a thousand tries at most: a rare stratum would take 10^8).
    bound = max(-(-total // int(n)) for n in present if n)
    enough = next((b for b in range(local_batch + 1, min(bound, local_batch + 1000))
                   if all(c or not n for n, c in zip(present, strata_counts(present, EDGES, b)))), bound)
    raise ValueError(f"BALANCE={strategy} with a local batch of {local_batch} draws no sequence of length {share}: "
                     f"it would never train on them; use a local batch of at least {enough} or another BALANCE")

