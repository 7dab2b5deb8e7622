"""Fixed-length parts -> N varlength training shards (NVIDIA's chop + convert), and the eval pick.

Shard k takes rows [k*T/N, (k+1)*T/N) of the parts read back to back, as NVIDIA's
`chop_hdf5_files.py` balances shard sizes; each part's samples are already shuffled, and
the online reader shuffles files and samples again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.data.format import FixedShard, VarlenShard, write_varlength_shard

MLPERF_NUM_SHARDS = 4320
MIN_SAMPLES_PER_SHARD = 1024  # small corpora get fewer shards rather than tiny ones


@dataclass(frozen=True)
class Piece:
    part: Path
    start: int
    stop: int


@dataclass(frozen=True)
class ShardJob:
    dst: Path
    pieces: tuple[Piece, ...]


def default_num_shards(total: int) -> int:
    return max(1, min(MLPERF_NUM_SHARDS, total // MIN_SAMPLES_PER_SHARD))


def shard_name(k: int, num_shards: int) -> str:
    return f"part_{k:05d}_of_{num_shards:05d}.hdf5"


def plan_shards(parts: list[Path], counts: list[int], num_shards: int, out_dir: Path) -> list[ShardJob]:
    """Which rows of which parts go into each of `num_shards` shards of (almost) equal size."""
    total = sum(counts)
    if num_shards > total:
        raise ValueError(f"cannot cut {total} samples into {num_shards} shards")
    part_starts = np.concatenate([[0], np.cumsum(counts)])
    bounds = [k * total // num_shards for k in range(num_shards + 1)]
    jobs = []
    for k in range(num_shards):
        pieces = []
        for p, part in enumerate(parts):
            lo, hi = max(bounds[k], part_starts[p]), min(bounds[k + 1], part_starts[p + 1])
            if lo < hi:
                pieces.append(Piece(part, int(lo - part_starts[p]), int(hi - part_starts[p])))
        jobs.append(ShardJob(out_dir / shard_name(k, num_shards), tuple(pieces)))
    return jobs


def write_shard(job: ShardJob) -> int:
    """Write one varlength shard unless a complete one exists; return its sample count."""
    if job.dst.exists():
        with VarlenShard(job.dst) as shard:
            return len(shard)
    samples = []
    for piece in job.pieces:
        with FixedShard(piece.part) as part:
            samples.extend(part.read(piece.start, piece.stop))
    return write_varlength_shard(job.dst, samples)


def write_eval_set(fixed_eval: Path, dst_dir: Path, wanted: int, seed: int) -> Path:
    """Pick `wanted` samples (all if fewer) at random from the eval part into one varlength file."""
    with FixedShard(fixed_eval) as part:
        n = min(wanted, len(part))
        dst = dst_dir / f"part_eval_{n}.hdf5"
        if not dst.exists():
            picked = np.sort(np.random.default_rng(seed).choice(len(part), size=n, replace=False))
            samples = part.read(0, len(part))
            write_varlength_shard(dst, [samples[i] for i in picked])
    return dst
