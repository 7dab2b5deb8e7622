"""Wikipedia `pages-articles` XML dump -> article text, with the `wikiextractor` package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from corpus_sources import CorpusError


def extract_dump(dump: Path, out_dir: Path, processes: int) -> str:
    """Run wikiextractor (--json) on `dump` into `out_dir`, unless a complete `out_dir` exists.

    Returns wikiextractor's summary line. The output goes to a temporary directory that is renamed
    only on success, so an interrupted extraction is redone rather than mistaken for a complete one.
    """
    if out_dir.is_dir():
        return f"{out_dir}: already extracted"
    if not dump.is_file():
        raise CorpusError(f"{dump}: no such Wikipedia dump")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "wikiextractor.WikiExtractor", str(dump), "-o", str(tmp), "--json"]
    result = subprocess.run([*cmd, "--processes", str(processes)], capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = result.stderr.strip().splitlines()[-1:] or ["no message"]
        raise CorpusError(f"{dump}: wikiextractor failed (truncated or not a pages-articles dump?): {tail[0]}")
    tmp.mkdir(parents=True, exist_ok=True)  # a dump without articles writes no directory at all
    tmp.rename(out_dir)
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"{dump}: extracted"
