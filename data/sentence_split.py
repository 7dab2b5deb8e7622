"""Cleaning and sentence splitting: raw documents -> MLPerf's text format.

MLPerf's pre-training text has one sentence per line and a blank line between documents.
The splitter is rule based: a sentence ends at . ! or ? (plus closing quotes/brackets)
followed by whitespace and an upper-case letter, digit or opening quote, unless the word
before the full stop is a known abbreviation or a single-letter initial ("Arthur C. Clarke").
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt ft gen col lt sgt capt rev hon pres gov sen rep vs etc cf al approx ca "
    "no nos vol vols fig figs pp ed eds est inc ltd co corp dept univ assn bros e.g i.e a.d b.c u.s u.k "
    "jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
MIN_PARAGRAPH_WORDS = 4  # shorter lines in extracted articles are section headings ("History.")

_BOUNDARY = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_EMPTY_BRACKETS = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")  # left where wikiextractor dropped a template
_SPACES = re.compile(r"\s+")


def clean_paragraph(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    text = _EMPTY_BRACKETS.sub("", text)
    return _SPACES.sub(" ", text).strip()


def _ends_with_abbreviation(text: str) -> bool:
    word = text.rsplit(None, 1)[-1].lstrip("\"'([").rstrip(".").lower()
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(paragraph: str) -> list[str]:
    sentences, start = [], 0
    for match in _BOUNDARY.finditer(paragraph):
        stop = match.start() + 1
        if paragraph[match.start()] == "." and _ends_with_abbreviation(paragraph[start:stop]):
            continue
        end = match.end()
        sentences.append(paragraph[start:end].strip())
        start = end
    tail = paragraph[start:].strip()
    return sentences + [tail] if tail else sentences


def document_sentences(document: str, min_paragraph_words: int = MIN_PARAGRAPH_WORDS) -> list[str]:
    """Sentences of one raw document (paragraphs on separate lines); [] if nothing usable is left."""
    sentences = []
    for line in document.splitlines():
        paragraph = clean_paragraph(line)
        if paragraph and len(paragraph.split()) >= min_paragraph_words:
            sentences.extend(split_sentences(paragraph))
    return sentences


def format_documents(documents: Iterable[list[str]]) -> str:
    """MLPerf text format: one sentence per line, a blank line after each document."""
    return "".join("\n".join(doc) + "\n\n" for doc in documents if doc)


def parse_documents(text: str) -> list[list[str]]:
    """Documents of MLPerf-format text, read as Google's create_pretraining_data reads its input: each line is
    stripped, an empty one ends the document, empty documents are dropped (the inverse of `format_documents`)."""
    documents: list[list[str]] = [[]]
    for line in text.split("\n"):  # "\n" only, as a file's readline(): not str.splitlines' other breaks
        line = line.strip()
        if line:
            documents[-1].append(line)
        elif documents[-1]:
            documents.append([])
    return [doc for doc in documents if doc]
