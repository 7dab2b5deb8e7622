"""One text part -> one fixed-length hdf5 part: WordPiece tokenization, then create_pretraining_data.

A part made from our own text gets a seed derived from `--seed` and its name; a part of MLPerf's text
(`reference`) gets `--seed` itself, as the reference runs create_pretraining_data on each of its 500 parts
with the same --random_seed.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from corpus_sources import CorpusError
from pretraining_instances import PretrainingConfig, SpecialIds, create_instances
from sentence_split import parse_documents
from wordpiece import VocabError, encode_sentences, load_vocab, make_tokenizer

from bert.data.format import FixedShard, write_fixed_shard

MAX_UNK_RATE = 0.05  # English Wikipedia with the MLPerf vocab has ~0.01 % [UNK]


@dataclass(frozen=True)
class PartJob:
    text: Path
    fixed: Path
    vocab: Path
    cfg: PretrainingConfig
    reference: bool = False  # MLPerf's text, through the reference's steps


@dataclass(frozen=True)
class PartStats:
    samples: int
    tokens: int  # WordPiece tokens of the text (0 when skipped)
    seconds: float
    skipped: bool


def make_fixed_part(job: PartJob) -> PartStats:
    """Write job.fixed unless a complete one exists (writes are atomic, so an existing file is complete)."""
    if job.fixed.exists():
        with FixedShard(job.fixed) as shard:  # still validated: a damaged file is reported, not trained on
            return PartStats(len(shard), 0, 0.0, skipped=True)
    start = time.perf_counter()
    vocab = load_vocab(job.vocab)
    documents = parse_documents(_read_text(job.text))
    sentences = [s for doc in documents for s in doc]
    encoded = iter(encode_sentences(make_tokenizer(vocab), sentences))
    tokenized = [[next(encoded) for _ in doc] for doc in documents]
    tokens = sum(len(s) for doc in tokenized for s in doc)
    unk = sum(s.count(vocab.unk_id) for doc in tokenized for s in doc)
    if tokens and unk / tokens > MAX_UNK_RATE:
        raise VocabError(f"{vocab.path}: {unk / tokens:.1%} of the tokens of {job.text} are [UNK]; wrong vocab?")
    ids = SpecialIds(vocab.cls_id, vocab.sep_id, vocab.mask_id, vocab.size)
    samples = create_instances(tokenized, job.cfg, ids, part_rng(job))
    if not samples:  # an empty or blank file: a broken download or copy, not a part of no samples
        raise CorpusError(f"{job.text}: no text to make samples of (empty or blank)")
    write_fixed_shard(job.fixed, samples, job.cfg.max_seq_length, job.cfg.max_predictions_per_seq)
    return PartStats(len(samples), tokens, time.perf_counter() - start, skipped=False)


def part_rng(job: PartJob) -> random.Random:
    """The part's generator: the seed itself for MLPerf's text (the reference's --random_seed=12345 for every part);
    otherwise one seed per part derived from it (string seeds hash the same way on every run)."""
    return random.Random(job.cfg.seed if job.reference else f"{job.cfg.seed}:{job.text.name}")


def _read_text(path: Path) -> str:
    """The text as Google's reader sees it: lines end at a newline only and every carriage return is dropped (TF's
    GFile.readline); universal newlines would make a lone carriage return a line break."""
    try:
        with path.open(encoding="utf-8", newline="") as f:
            return f.read().replace("\r", "")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text: {e}") from e
