"""NVIDIA's content checksums of hdf5 shards (their hdf5_md5.py), to compare data with the lists they publish
(`4320_shards_varlength.chk`, `eval_varlength.chk`): one "name<TAB>md5" line per file.

    python data/hdf5_content_md5.py DIR [--out FILE] [--workers N]   # every *.hdf5 / *.h5 in DIR, by name
    python data/verify.py OUT --chk FILE                              # check a list (data/verify.py)

A file's checksum covers its input_ids only: the md5 of str() of the list of every row's md5 of
str(row.tolist()). tolist() gives Python ints, so the storage dtype (int16 vlen, int32 fixed) does not
matter; rows are hashed as stored, so a fixed-length file's padding is part of its rows.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import h5py
from parallel_map import parallel_imap

from bert.data.format import ShardError, atomic_output
from bert.data.index import list_shards

ROWS_PER_READ = 4096  # input_ids rows read at a time: memory does not grow with the file


def content_md5(path: Path) -> str:
    """hdf5_md5.py's checksum of one file; ShardError naming the file if it has no readable input_ids."""
    row_md5s = []
    try:
        with h5py.File(path, "r") as f:
            rows = f["input_ids"]
            for start in range(0, rows.shape[0], ROWS_PER_READ):
                for row in rows[start : start + ROWS_PER_READ]:
                    row_md5s.append(hashlib.md5(str(row.tolist()).encode("utf-8")).hexdigest())
    except (OSError, KeyError, TypeError) as e:  # not hdf5, truncated, no input_ids, input_ids not a dataset
        raise ShardError(f"{path}: no readable input_ids to checksum ({type(e).__name__}: {e})") from e
    return hashlib.md5(str(row_md5s).encode("utf-8")).hexdigest()


def _md5_or_problem(path: Path) -> tuple[str | None, str | None]:
    try:
        return content_md5(path), None
    except ShardError as e:
        return None, str(e)


def read_chk(list_path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """The (file name, md5) pairs of a list, and one message per line that is not "name<TAB>md5"."""
    entries, problems = [], []
    for number, line in enumerate(list_path.read_text().splitlines(), 1):
        fields = line.rsplit(None, 1)
        if len(fields) != 2 or len(fields[1]) != 32:
            if line.strip():
                problems.append(f"{list_path}:{number}: not a 'name<TAB>md5' line: {line!r}")
            continue
        entries.append((fields[0].strip(), fields[1]))
    return entries, problems


def _by_name(root: Path) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            found.setdefault(path.name, []).append(path)
    return found


def check_chk(list_path: Path, root: Path, workers: int) -> tuple[int, list[str]]:
    """Check every file a list names, found by name under `root` (recursively): (files listed, problems)."""
    if not list_path.is_file():
        return 0, [f"{list_path}: no such checksum list"]
    entries, problems = read_chk(list_path)
    found, todo = _by_name(root), []
    for name, want in entries:
        paths = found.get(name, [])
        if not paths:
            problems.append(f"{root}: {name} (listed in {list_path}) is missing")
        elif len(paths) > 1:
            problems.append(f"{root}: {name} (listed in {list_path}) is there {len(paths)} times "
                            f"({', '.join(map(str, paths))}); give a directory that holds one")
        else:
            todo.append((paths[0], want))
    results = parallel_imap(_md5_or_problem, [path for path, _ in todo], workers, f"content md5 ({list_path.name})")
    for (path, want), (got, problem) in zip(todo, results):
        if problem:
            problems.append(problem)
        elif got != want:
            problems.append(f"{path}: content md5 {got} does not match {want} in {list_path.name}")
    return len(entries), problems


def chk_lines(files: list[Path], workers: int) -> Iterator[str]:
    """hdf5_md5.py's line for each of `files`, sorted by name, as each is computed."""
    files = sorted(files, key=lambda p: p.name)
    for path, md5 in zip(files, parallel_imap(content_md5, files, workers, "content md5")):
        yield f"{path.name}\t{md5}\n"


def write_chk(list_path: Path, files: list[Path], workers: int) -> None:
    """Write the list of `files` (sorted by name), in hdf5_md5.py's line format."""
    lines = "".join(chk_lines(files, workers))
    with atomic_output(list_path) as tmp:
        tmp.write_text(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="directory of hdf5 shards")
    p.add_argument("--out", type=Path, help="the list to write (default: print it)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    try:
        files = list_shards(args.dir)
        if args.out:
            write_chk(args.out, files, args.workers)
            print(f"{len(files)} files in {args.out}")
        else:
            for line in chk_lines(files, args.workers):
                print(line, end="", flush=True)
    except (FileNotFoundError, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
