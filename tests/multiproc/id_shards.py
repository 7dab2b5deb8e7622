"""Shards whose samples carry their own global id, so a batch says which samples it holds.

Sample g (numbered across shards in file order) is [CLS] w w ... w [SEP] with w = 1000 + g,
sentence B from the middle on, position 1 masked with label g, NSP label g % 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bert.batch import Batch, Sample
from bert.data.format import write_varlength_shard

ID_BASE = 1000


def id_sample(g: int, length: int) -> Sample:
    if length < 3 or ID_BASE + g > np.iinfo(np.int16).max:
        raise ValueError("id samples need >= 3 tokens and an id that fits int16")
    ids = np.full(length, ID_BASE + g, dtype=np.int64)
    ids[0], ids[-1] = 101, 102
    segments = (np.arange(length) >= length // 2).astype(np.int64)
    return Sample(ids, segments, np.array([1]), np.array([g]), g % 2)


def write_id_shards(directory: Path, lengths_per_shard: list[list[int]]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths, g = [], 0
    for s, lengths in enumerate(lengths_per_shard):
        path = directory / f"part_{s:05d}_of_{len(lengths_per_shard):05d}.hdf5"
        write_varlength_shard(path, [id_sample(g + i, int(n)) for i, n in enumerate(lengths)])
        g += len(lengths)
        paths.append(path)
    return paths


def batch_ids(batch: Batch) -> list[int]:
    """The global ids of a batch's sequences, in batch order."""
    starts = batch.seq.cu_seqlens[:-1].long().cpu()
    return (batch.input_ids.cpu()[starts + 1] - ID_BASE).tolist()
