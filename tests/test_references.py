"""Every source the repository cites by key resolves to a full entry in REFERENCES.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A key is a three-digit paper number ([000]) or capitalised words joined by hyphens ([NVIDIA-BERT]).
# Not after a name or a closing bracket (indexing: x[000]) and not a markdown link text ([Key](url)).
KEY = re.compile(r"(?<![\w\])])\[(0\d\d|[A-Z][A-Za-z0-9]+(?:-[A-Za-z0-9.]+)+)\](?!\()")
ENTRY = re.compile(r"^### \[([^\]]+)\] (.+)$", re.M)
# Citation styles this file replaces: bare paper numbers and private notes a reader cannot open.
OLD_STYLES = re.compile(r"paper 00\d|\b(?:Samsung|Baidu|TPU|Herring) 00\d|reference doc|/work/shared", re.I)


def tracked_sources() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", "*.sub", "Dockerfile"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [ROOT / line for line in out.split() if line != "REFERENCES.md" and (ROOT / line).exists()]


def entries() -> dict[str, str]:
    text = (ROOT / "REFERENCES.md").read_text()
    heads = list(ENTRY.finditer(text))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return {h.group(1): text[h.start() : end] for h, end in zip(heads, ends)}


def test_key_pattern_finds_citations_and_skips_code() -> None:
    found = KEY.findall("Samsung [000] §4.1, [NVIDIA-BERT]; x[001], [CLS], [A-Z0-9], [Key](http://a), `[MLPerf-rules]`")
    assert found == ["000", "NVIDIA-BERT", "MLPerf-rules"]


def test_every_cited_key_has_an_entry() -> None:
    known = entries()
    used: dict[str, list[str]] = {}
    for path in tracked_sources():
        for key in KEY.findall(path.read_text(errors="replace")):
            used.setdefault(key, []).append(str(path.relative_to(ROOT)))
    missing = {key: files for key, files in used.items() if key not in known}
    assert not missing, f"cited but not in REFERENCES.md: {missing}"
    # The four papers are cited, and so is every entry (no dead entries).
    assert {"000", "001", "003", "004"} <= set(used)
    assert set(known) - set(used) == set(), "entries nothing cites"


@pytest.mark.parametrize("key", sorted(entries()))
def test_entry_has_title_authors_venue(key: str) -> None:
    body = entries()[key]
    title = ENTRY.match(body).group(2).strip()
    assert len(title) > 10, key
    for field in ("Authors", "Venue", "Used for"):
        line = re.search(rf"^- {field}: (.+)$", body, re.M)
        assert line and len(line.group(1).strip()) > 5, f"[{key}] has no {field}"
    if re.fullmatch(r"0\d\d", key):  # a paper: a year and where to find it
        assert re.search(r"\b20[12]\d\b", body) and "https://" in body, key


def test_no_citation_in_the_old_unresolvable_styles() -> None:
    stale = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in tracked_sources()
        if path.name != "test_references.py"  # its own pattern names the old styles
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OLD_STYLES.search(line)
    ]
    assert not stale, "\n".join(stale)
