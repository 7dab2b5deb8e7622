"""Convert MLPerf fixed-length hdf5 shards (e.g. NVIDIA's chopped 4320 shards) to varlength shards.

    python data/convert_fixed2varlength.py IN_DIR OUT_DIR [--workers N]

Each IN_DIR/*.hdf5 becomes OUT_DIR/<same name>; existing outputs are kept (writes are atomic),
and OUT_DIR/checksums.md5 lists them. A bad input shard is named and the exit status is 2.
Each shard is converted a block of rows at a time (bert.data.format.VARLEN_BLOCK), so a worker's
memory does not grow with the shard.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from md5_list import write_md5_list
from parallel_map import parallel_imap

from bert.data.format import ShardError, fixed_to_varlength


def _convert(pair: tuple[Path, Path]) -> None:
    src, dst = pair
    if not dst.exists():
        fixed_to_varlength(src, dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    sources = sorted(args.src.glob("*.hdf5"))
    if not sources:
        print(f"error: {args.src}: no *.hdf5 shards", file=sys.stderr)
        return 2
    args.dst.mkdir(parents=True, exist_ok=True)
    pairs = [(src, args.dst / src.name) for src in sources]
    try:
        for _ in parallel_imap(_convert, pairs, args.workers, "fixed -> varlength"):
            pass
    except ShardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_md5_list(args.dst / "checksums.md5", [dst for _, dst in pairs])
    print(f"{len(pairs)} varlength shards in {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
