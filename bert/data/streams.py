"""Per-rank sample streams of one epoch: files dealt to ranks, then a shuffle buffer.

File level (NVIDIA `run_pretraining.py` [NVIDIA-BERT], TPU [004] §3.5 "shuffle before repeat"): every
epoch the shard list is permuted with a seed shared by all ranks, and rank r takes shards
`perm[r], perm[r + world], ...` -- NVIDIA's `files[(f_id*world_size + rank) % num_files]`
without the wrap-around, which would give some shards twice. With fewer shards than ranks,
each shard is first cut into `ceil(world / num_shards)` row ranges so every rank gets data.

Sample level: the ids of a rank's shards, in file order, go through a shuffle buffer seeded
by (seed, epoch, rank). Everything is a pure function of the length index and the seed, so
any rank can compute any rank's stream.
"""

from __future__ import annotations

import numpy as np

from bert.data.index import LengthIndex
from bert.data.shuffle import shuffle_buffer_order

FILES, SAMPLES = 0, 1  # rng stream tags


def epoch_rng(seed: int, epoch: int, *tags: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, *tags])


def id_dtype(num_samples: int) -> type[np.signedinteger]:
    """int32 ids where they fit: phase 2's 156.7 M samples laid out by every rank (1024 of them, 16 to a node) take
    half the memory of int64 (1.25 GB an epoch) and the orders are the same."""
    return np.int32 if num_samples < 2**31 else np.int64


def pieces(offsets: np.ndarray, world: int) -> list[np.ndarray]:
    """Id ranges to deal out: whole shards, or equal row ranges of them when shards < ranks."""
    num_shards = len(offsets) - 1
    cuts = -(-world // num_shards)  # ceil
    dtype = id_dtype(int(offsets[-1]))
    return [
        part
        for start, stop in zip(offsets[:-1], offsets[1:])
        for part in np.array_split(np.arange(start, stop, dtype=dtype), cuts)
    ]


def rank_streams(index: LengthIndex, world: int, seed: int, epoch: int, shuffle_buffer: int) -> list[np.ndarray]:
    """The ids each rank draws in `epoch`, in order (a partition of all ids)."""
    parts = pieces(index.offsets, world)
    order = epoch_rng(seed, epoch, FILES).permutation(len(parts))
    streams = []
    for rank in range(world):
        mine = [parts[p] for p in order[rank::world]]
        ids = np.concatenate(mine) if mine else parts[0][:0]  # no ids, of the ids' dtype
        streams.append(ids[shuffle_buffer_order(len(ids), shuffle_buffer, epoch_rng(seed, epoch, SAMPLES, rank))])
    return streams
