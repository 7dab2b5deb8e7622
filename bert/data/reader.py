"""Read samples by global id, keeping a bounded set of shards open.

Balancing makes a rank read sequences drawn from other ranks' shards (its node's or the
world's), so over a run it touches many shards; an LRU of open files keeps the descriptor
count bounded (thousands of shards vs. a typical limit of 1024 open files).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from bert.batch import Sample
from bert.data.format import ShardError, VarlenShard
from bert.data.index import LengthIndex


class SampleReader:
    def __init__(self, index: LengthIndex, max_open: int = 64):
        self.index = index
        self.max_open = max_open
        self._open: OrderedDict[int, VarlenShard] = OrderedDict()

    def _shard(self, s: int) -> VarlenShard:
        if s in self._open:
            self._open.move_to_end(s)
        else:
            self._open[s] = VarlenShard(self.index.paths[s])
            if len(self._open) > self.max_open:
                self._open.popitem(last=False)[1].close()
        return self._open[s]

    def read(self, ids: np.ndarray) -> list[Sample]:
        """The samples with global `ids`, in that order (one read per shard touched)."""
        shards, rows = self.index.locate(ids)
        out: list[Sample | None] = [None] * len(shards)
        for s in np.unique(shards):
            where = np.flatnonzero(shards == s)
            for i, sample in zip(where, self._shard(int(s)).read(rows[where])):
                # The plan balanced on the length index; a row that disagrees would unbalance silently.
                if len(sample.input_ids) != self.index.lengths[ids[i]]:
                    raise ShardError(
                        f"{self.index.paths[s]}: row {rows[i]} has {len(sample.input_ids)} tokens, "
                        f"the length index says {self.index.lengths[ids[i]]}"
                    )
                out[i] = sample
        return out

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()
