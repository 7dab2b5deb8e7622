"""Wikipedia `pages-articles` XML dump -> article text, with the `wikiextractor` package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus_sources import CorpusError, source_bytes
from tqdm import tqdm


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
    # wikiextractor logs no per-article progress, so the bar follows the text it has written.
    with tempfile.TemporaryFile("w+") as log, tqdm(desc="wikiextractor", unit="B", unit_scale=True) as bar:
        proc = subprocess.Popen([*cmd, "--processes", str(processes)], stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(0.5)
            bar.update((source_bytes([tmp]) if tmp.exists() else 0) - bar.n)
        log.seek(0)
        lines = log.read().strip().splitlines() or ["no message"]
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CorpusError(f"{dump}: wikiextractor failed (truncated or not a pages-articles dump?): {lines[-1]}")
    tmp.mkdir(parents=True, exist_ok=True)  # a dump without articles writes no directory at all
    tmp.rename(out_dir)
    return lines[-1]
