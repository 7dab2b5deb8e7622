"""Read samples by global id, keeping a bounded set of shards open.

Balancing makes a rank read sequences drawn from other ranks' shards (its node's or the
world's), so over a run it touches many shards. Reopening a shard costs far more than reading its
rows (768 sequences drawn at random from 400 shards: 1.8 s of CPU with 64 files open, 0.38 s with all
of them open), so the LRU of open files is as large as the open-file limit allows: a quarter of the soft
limit (the rest is for sockets, libraries and the other readers), so all 4,320 shards of the full dataset
under a container's usual limit of 2^20. Opening a shard costs about 0.6 MiB (400 shards: 254 MiB), and reading
from it no more than its fixed 64 KiB metadata cache (bert.data.format.METADATA_CACHE_BYTES; HDF5's own grew by
1.2 GB over 6,144 random reads from those 400, bench/reader_memory.py).
"""

from __future__ import annotations

import resource
from collections import OrderedDict

import numpy as np

from bert.data.format import ShardError, VarlenShard
from bert.data.index import LengthIndex
from bert.sample import Sample


def open_file_budget(num_shards: int, soft_limit: int | None = None) -> int:
    """How many shards one reader keeps open: all of them, or a quarter of the open-file soft limit."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY:
        return max(num_shards, 1)
    return max(1, min(num_shards, soft_limit // 4))


class SampleReader:
    def __init__(self, index: LengthIndex, max_open: int | None = None):
        self.index = index
        self.max_open = open_file_budget(len(index.paths)) if max_open is None else max_open
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
