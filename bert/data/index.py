"""The length index: every sample's token count, and where it lives, without reading tokens.

A sample's global id is its position in the concatenation of the shards in sorted file-name
order: shard `s` holds ids `offsets[s] .. offsets[s+1]-1`, row = id - offsets[s]. All ranks
build the same index from the same directory, which is what lets each of them plan every
rank's draw and the balancing assignment with no collective (design in `bert.data.plan`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.data.format import ShardError, VarlenShard

SHARD_SUFFIXES = (".hdf5", ".h5")


def list_shards(directory: str | os.PathLike) -> list[Path]:
    """The varlength shards in `directory`, sorted by name; an error naming the directory if none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such data directory")
    paths = sorted(p for p in directory.iterdir() if p.suffix in SHARD_SUFFIXES and not p.name.startswith("."))
    if not paths:
        raise FileNotFoundError(f"{directory}: no shards ({' or '.join(SHARD_SUFFIXES)} files) found")
    return paths


@dataclass(frozen=True)
class LengthIndex:
    paths: tuple[Path, ...]
    offsets: np.ndarray  # (num_shards + 1,) int64, prefix sums of the shard sizes
    lengths: np.ndarray  # (num_samples,) int64, tokens per sample

    @classmethod
    def scan(cls, directory: str | os.PathLike) -> LengthIndex:
        """Read the lengths of every shard in `directory` (cheap: the `lengths` key, not the tokens)."""
        paths = list_shards(directory)
        per_shard = []
        for path in paths:
            with VarlenShard(path) as shard:
                lengths = shard.lengths()
            if len(lengths) and lengths.min() < 1:
                raise ShardError(f"{path}: a sample has {lengths.min()} tokens")
            per_shard.append(lengths)
        if not sum(map(len, per_shard)):
            raise ShardError(f"{directory}: all {len(paths)} shards are empty")
        return cls.from_lengths(paths, per_shard)

    @classmethod
    def from_lengths(cls, paths: list[Path], per_shard: list[np.ndarray]) -> LengthIndex:
        sizes = [len(lengths) for lengths in per_shard]
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(sizes)
        return cls(tuple(paths), offsets, np.concatenate(per_shard).astype(np.int64))

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def shard_sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of each global id."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(f"sample ids outside 0..{self.num_samples - 1}")
        shard = np.searchsorted(self.offsets, ids, side="right") - 1
        return shard, ids - self.offsets[shard]
