"""md5 checksum lists in `md5sum` format ("<md5>  <path relative to the list>"), so `md5sum -c` also works."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from wordpiece import md5_of

from bert.data.format import atomic_output


def write_md5_list(list_path: Path, files: Iterable[Path]) -> None:
    root = list_path.parent
    lines = [f"{md5_of(f)}  {f.relative_to(root).as_posix()}\n" for f in sorted(files)]
    with atomic_output(list_path) as tmp:
        tmp.write_text("".join(lines))


def check_md5_list(list_path: Path) -> tuple[list[Path], list[str]]:
    """The files the list names, and one message per file that is missing or does not match."""
    if not list_path.is_file():
        return [], [f"{list_path}: no checksum list"]
    files, problems = [], []
    for number, line in enumerate(list_path.read_text().splitlines(), 1):
        want, sep, name = line.partition("  ")
        if not sep or len(want) != 32:
            problems.append(f"{list_path}:{number}: not an md5sum line: {line!r}")
            continue
        path = list_path.parent / name
        files.append(path)
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif (got := md5_of(path)) != want:
            problems.append(f"{path}: md5 {got} does not match {want} in {list_path.name} (corrupt or truncated)")
    return files, problems
