"""Write DIR/lengths.npz: the token count of every sample of DIR's shards that store no `lengths` dataset.

    python data/index_lengths.py /data/bert/train_varlength [--workers N]

NVIDIA's varlength shards have no `lengths`, so without this every rank reads every shard's input_ids to
build its length index before run_start (bert.data.index.LengthIndex.scan: ~0.07 s per 36k-sample
shard, ~5 CPU-minutes per rank for 4320 shards). With it, the scan reads one small file. The sidecar
maps each shard's file name to its lengths (int16, int32 if a sequence is longer), its size and its mtime (whole
seconds); the scan checks each listed shard's sample count, size and mtime against them (a shard's own `lengths`
dataset comes first), so copy shards with their times (`rsync -a`, `cp -p`) or run this on the copy. It is not a
shard: shards are *.hdf5 / *.h5 only.
Run it again after replacing shards (written atomically; shards that store `lengths` are left out).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from parallel_map import parallel_imap

from bert.data.format import ShardError, VarlenShard, atomic_output
from bert.data.index import LENGTHS_SIDECAR, STAT_KEY, list_shards, shard_stat


def shard_lengths(path: Path) -> np.ndarray | None:
    """A shard's lengths from its input_ids, in the smallest dtype that holds them; None if it stores them."""
    with VarlenShard(path) as shard:
        if shard.has_length_index:
            return None
        lengths = shard.lengths()
    return lengths.astype(np.int16 if lengths.max(initial=0) <= np.iinfo(np.int16).max else np.int32)


def write_sidecar(directory: Path, workers: int) -> tuple[int, int]:
    """Write directory/lengths.npz unless no shard needs it: (shards listed in it, shards in the directory)."""
    paths = list_shards(directory)
    arrays, listed = {}, 0
    for path, lengths in zip(paths, parallel_imap(shard_lengths, paths, workers, "lengths")):
        if lengths is not None:
            arrays[path.name], arrays[path.name + STAT_KEY] = lengths, np.array(shard_stat(path), dtype=np.int64)
            listed += 1
    if arrays:
        with atomic_output(directory / LENGTHS_SIDECAR) as tmp, tmp.open("wb") as f:
            np.savez(f, **arrays)  # a file object: np.savez would append ".npz" to the temporary's name
    return listed, len(paths)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="a directory of varlength shards (e.g. NVIDIA's train or eval set)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    try:
        listed, total = write_sidecar(args.dir, args.workers)
    except (FileNotFoundError, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if listed:
        print(f"{args.dir / LENGTHS_SIDECAR}: the lengths of {listed} of {total} shards")
    else:
        print(f"{args.dir}: all {total} shards store their lengths; nothing to write")
    return 0


if __name__ == "__main__":
    sys.exit(main())
