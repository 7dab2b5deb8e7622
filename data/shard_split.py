"""Fixed-length parts -> N varlength training shards (NVIDIA's chop + convert), and the eval pick.

Shard k takes rows [k*T/N, (k+1)*T/N) of the parts read back to back, as NVIDIA's
`chop_hdf5_files.py` balances shard sizes; each part's samples are already shuffled, and
the online reader shuffles files and samples again. The eval set is picked at random, or, for
MLPerf's own text, with the reference's `pick_eval_samples.py` stride.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.data.format import FixedShard, VarlenShard, fixed_slices_to_varlength, write_varlength_shard
from bert.sample import Sample

MLPERF_NUM_SHARDS = 4320
MIN_SAMPLES_PER_SHARD = 1024  # small corpora get fewer shards rather than tiny ones
REFERENCE_EVAL_SAMPLES = 10_000
EVAL_READ_BLOCK = 4096  # eval-part rows read at a time: only the picked ones are kept


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
    return fixed_slices_to_varlength(job.dst, [(piece.part, piece.start, piece.stop) for piece in job.pieces])


def reference_pick(total: int, wanted: int) -> list[int]:
    """The rows pick_eval_samples.py takes, in its order and float arithmetic: int(i * total / wanted)."""
    ratio = total / wanted
    return [int(i * ratio) for i in range(wanted)]


def eval_file_name(n: int, reference: bool) -> str:
    return "part_eval_10k.hdf5" if reference and n == REFERENCE_EVAL_SAMPLES else f"part_eval_{n}.hdf5"


def _read_rows(part: FixedShard, rows: list[int]) -> list[Sample]:
    """The samples at increasing `rows`, copied out of the blocks read, so no block stays in memory."""
    picked, wanted = [], iter(rows)
    row = next(wanted, None)
    for start in range(0, len(part), EVAL_READ_BLOCK):
        block = part.read(start, min(start + EVAL_READ_BLOCK, len(part)))
        while row is not None and row < start + len(block):
            s = block[row - start]
            picked.append(Sample(*(np.array(x) for x in s[:4]), s.nsp_label))
            row = next(wanted, None)
    return picked


def write_eval_set(fixed_eval: Path, dst_dir: Path, wanted: int, seed: int, reference: bool = False) -> Path:
    """Pick `wanted` samples (all if fewer) from the eval part into one varlength file: at random, or with the
    reference's stride (`reference`)."""
    with FixedShard(fixed_eval) as part:
        n = min(wanted, len(part))
        dst = dst_dir / eval_file_name(n, reference)
        if not dst.exists():
            if reference:
                picked = reference_pick(len(part), n)
            else:
                picked = np.sort(np.random.default_rng(seed).choice(len(part), size=n, replace=False)).tolist()
            write_varlength_shard(dst, _read_rows(part, picked))
    return dst
