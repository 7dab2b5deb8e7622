"""Raw documents -> MLPerf text parts: cleaned, one sentence per line, plus a held-out eval text.

Documents are dealt round-robin into `num_parts` train parts (the unit of parallel work later,
like MLPerf's 500 `part-00xxx-of-00500` files). An evenly spaced `eval_fraction` of them goes to
`eval.txt` instead, so eval samples never share a document with training samples. The whole
directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

from corpus_sources import CorpusError
from parallel_map import parallel_imap
from sentence_split import document_sentences, format_documents

EVAL_TEXT = "eval.txt"


def _sentences(item: tuple[str, int]) -> list[str]:
    document, min_paragraph_words = item
    return document_sentences(document, min_paragraph_words)


def _is_eval(index: int, fraction: float) -> bool:
    # Evenly spaced, and document 0 is always held out, so even a tiny corpus has an eval set.
    return math.ceil((index + 1) * fraction) > math.ceil(index * fraction)


def write_text_parts(
    documents: Iterable[tuple[str, int]], out_dir: Path, num_parts: int, eval_fraction: float, workers: int
) -> dict[str, int]:
    """Write `out_dir`/part-NNNNN.txt and eval.txt from (document, min words per paragraph) pairs."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a partial earlier attempt is redone
    tmp.mkdir(parents=True)
    counts = {"documents": 0, "eval_documents": 0, "sentences": 0}
    try:
        with ExitStack() as stack:
            parts = [stack.enter_context((tmp / f"part-{i:05d}.txt").open("w")) for i in range(num_parts)]
            eval_text = stack.enter_context((tmp / EVAL_TEXT).open("w"))
            docs = parallel_imap(_sentences, documents, workers, "clean+split", unit="doc", chunksize=64)
            for sentences in filter(None, docs):
                index = counts["documents"]
                if _is_eval(index, eval_fraction):
                    eval_text.write(format_documents([sentences]))
                    counts["eval_documents"] += 1
                else:
                    parts[(index - counts["eval_documents"]) % num_parts].write(format_documents([sentences]))
                counts["documents"] += 1
                counts["sentences"] += len(sentences)
        if counts["documents"] - counts["eval_documents"] < 1:
            raise CorpusError(f"empty corpus: {counts['documents']} usable documents, none left for training")
        for part in tmp.glob("part-*.txt"):
            if part.stat().st_size == 0:  # fewer documents than parts
                part.unlink()
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return counts
