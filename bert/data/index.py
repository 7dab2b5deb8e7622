"""The length index: every sample's token count, and where it lives, without reading tokens.

A sample's global id is its position in the concatenation of the shards in sorted file-name
order: shard `s` holds ids `offsets[s] .. offsets[s+1]-1`, row = id - offsets[s]. All ranks
build the same index from the same directory, which is what lets each of them plan every
rank's draw and the balancing assignment with no collective (design in `bert.data.plan`).

A shard's lengths come from its `lengths` dataset (ours), else from the directory's `lengths.npz`
(data/index_lengths.py writes it for NVIDIA's shards, which store none; it records each shard's size in bytes and
its modification time (to the second) and its sample count, and a shard that no longer matches them is an error,
not a stale index: copy shards with their times, `cp -p` or `rsync -a`, or rerun it), else from its input_ids:
all of them read on every rank before run_start (~5 CPU-minutes for NVIDIA's 4320 shards).
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.console import say
from bert.data.format import ShardError, VarlenShard

SHARD_SUFFIXES = (".hdf5", ".h5")
LENGTHS_SIDECAR = "lengths.npz"  # shard file name -> its lengths, for shards without a `lengths` dataset
STAT_KEY = ":stat"  # "<file name>:stat" -> (size in bytes, whole seconds of mtime) when the sidecar was written


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
    lengths: np.ndarray  # (num_samples,) int32, tokens per sample (0.63 GB for phase 2's 156.7 M, on every rank)

    @classmethod
    def scan(cls, directory: str | os.PathLike) -> LengthIndex:
        """Read the lengths of every shard in `directory` (cheap: the `lengths` key or the sidecar, not the tokens;
        if some shard has neither, its input_ids are read and one line on stderr says how to avoid that)."""
        paths = list_shards(directory)
        sidecar = load_sidecar(directory)
        per_shard, tokens_read = [], 0
        for path in paths:
            lengths, from_tokens = _shard_lengths(path, sidecar)
            tokens_read += from_tokens
            if len(lengths) and lengths.min() < 1:
                raise ShardError(f"{path}: a sample has {lengths.min()} tokens")
            per_shard.append(lengths)
        if tokens_read:
            say(f"{directory}: {tokens_read} of {len(paths)} shards store no lengths, so their input_ids were read "
                f"to find them (on every rank); python data/index_lengths.py {directory} writes them once")
        if not sum(map(len, per_shard)):
            raise ShardError(f"{directory}: all {len(paths)} shards are empty")
        return cls.from_lengths(paths, per_shard)

    @classmethod
    def from_lengths(cls, paths: list[Path], per_shard: list[np.ndarray]) -> LengthIndex:
        sizes = [len(lengths) for lengths in per_shard]
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(sizes)
        return cls(tuple(paths), offsets, np.concatenate(per_shard).astype(np.int32))

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


def shard_stat(path: Path) -> tuple[int, int]:
    """(size in bytes, mtime in whole seconds): what the sidecar remembers of a shard. Whole seconds, as copies
    that keep times (rsync -a, cp -p) may keep no more; the size alone hardly moves (HDF5's heaps are padded)."""
    st = path.stat()
    return st.st_size, int(st.st_mtime)


def load_sidecar(directory: str | os.PathLike) -> dict[str, tuple[np.ndarray, tuple[int, int] | None]]:
    """The lengths data/index_lengths.py wrote for `directory`'s shards, with each shard's `shard_stat` then, by file
    name ({} without a sidecar)."""
    path = Path(directory) / LENGTHS_SIDECAR
    if not path.is_file():
        return {}
    try:
        with np.load(path) as arrays:
            return {name: (arrays[name], tuple(map(int, arrays[name + STAT_KEY])) if name + STAT_KEY in arrays.files
                           else None)
                    for name in arrays.files if not name.endswith(STAT_KEY)}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ShardError(f"{path}: unreadable length sidecar ({e}); rerun python data/index_lengths.py") from e


def _shard_lengths(path: Path, sidecar: dict[str, tuple[np.ndarray, tuple[int, int] | None]]
                   ) -> tuple[np.ndarray, bool]:
    """A shard's lengths (as stored: `from_lengths` makes them int32), and whether they had to be computed from its
    input_ids."""
    with VarlenShard(path) as shard:
        if shard.has_length_index or path.name not in sidecar:
            return shard.lengths(), not shard.has_length_index
        lengths, then = sidecar[path.name]
        now = shard_stat(path)
        if len(lengths) != len(shard) or then not in (None, now):
            raise ShardError(f"{path}: {len(shard)} samples (bytes, mtime {now}), but {path.parent / LENGTHS_SIDECAR} "
                             f"lists {len(lengths)} lengths for it (bytes, mtime {then}): replaced or copied without "
                             f"its times since? rerun python data/index_lengths.py {path.parent}")
        return lengths, False
