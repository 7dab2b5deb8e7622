"""create_pretraining_data: documents of tokenized sentences -> masked LM + next-sentence samples.

The algorithm of Google's `create_pretraining_data.py` [Google-BERT], which MLPerf runs with the defaults of
`PretrainingConfig`: documents are shuffled; each is walked `dupe_factor` times, packing whole
sentences into a chunk up to a target length (shorter with probability `short_seq_prob`); the
chunk is cut at a random sentence boundary into A and B, and B is replaced by text from a random
other document with probability 1/2 (always when the chunk has one sentence); the pair is trimmed
from a random end of the longer side; then round(15 %) of the tokens (at most 76, never [CLS]/[SEP])
are picked, and each is replaced by [MASK] (80 %), kept (10 %) or a random vocab entry (10 %).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from bert.sample import Sample

Document = list[list[int]]  # sentences of token ids


@dataclass(frozen=True)
class PretrainingConfig:
    max_seq_length: int = 512
    max_predictions_per_seq: int = 76
    masked_lm_prob: float = 0.15
    dupe_factor: int = 10
    short_seq_prob: float = 0.1
    seed: int = 12345


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    mask: int
    vocab_size: int


def create_instances(
    documents: list[Document], cfg: PretrainingConfig, ids: SpecialIds, rng: random.Random
) -> list[Sample]:
    """All samples of `documents`, shuffled. Empty sentences and documents are dropped first, so
    that both sides of every pair hold at least one token."""
    documents = [doc for doc in ([s for s in doc if s] for doc in documents) if doc]
    rng.shuffle(documents)
    samples = []
    for _ in range(cfg.dupe_factor):
        for index in range(len(documents)):
            samples.extend(_document_instances(documents, index, cfg, ids, rng))
    rng.shuffle(samples)
    return samples


def _document_instances(
    documents: list[Document], index: int, cfg: PretrainingConfig, ids: SpecialIds, rng: random.Random
) -> list[Sample]:
    document = documents[index]
    max_num_tokens = cfg.max_seq_length - 3  # [CLS] A [SEP] B [SEP]
    # Mostly fill the sequence; sometimes target a short one so that short inputs are seen in training.
    target = rng.randint(2, max_num_tokens) if rng.random() < cfg.short_seq_prob else max_num_tokens
    samples, chunk, chunk_length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
            is_random_next = len(chunk) == 1 or rng.random() < 0.5
            if is_random_next:
                tokens_b = _random_continuation(documents, index, target - len(tokens_a), rng)
                i -= len(chunk) - a_end  # the unused sentences start the next chunk
            else:
                tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
            _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng)
            samples.append(_masked_sample(tokens_a, tokens_b, is_random_next, cfg, ids, rng))
            chunk, chunk_length = [], 0
        i += 1
    return samples


def _random_continuation(documents: list[Document], index: int, target: int, rng: random.Random) -> list[int]:
    other = index
    for _ in range(10):  # with a single document, fall back to itself after 10 tries, as Google's script
        other = rng.randint(0, len(documents) - 1)
        if other != index:
            break
    document = documents[other]
    tokens: list[int] = []
    for sentence in document[rng.randint(0, len(document) - 1) :]:
        tokens.extend(sentence)
        if len(tokens) >= target:
            break
    return tokens


def _truncate_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: random.Random) -> None:
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        # Trim from either end, so the model does not learn that sequences always end at a sentence break.
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def masked_count(num_tokens: int, cfg: PretrainingConfig) -> int:
    """How many of a sequence's `num_tokens` tokens (framing included) are masked: round(15 %), at least one,
    at most `max_predictions_per_seq`, and never [CLS] or a [SEP] (Google's create_pretraining_data)."""
    return min(cfg.max_predictions_per_seq, max(1, round(num_tokens * cfg.masked_lm_prob)), max(num_tokens - 3, 0))


def _masked_sample(
    tokens_a: list[int],
    tokens_b: list[int],
    is_random_next: bool,
    cfg: PretrainingConfig,
    ids: SpecialIds,
    rng: random.Random,
) -> Sample:
    tokens = [ids.cls, *tokens_a, ids.sep, *tokens_b, ids.sep]
    segments = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
    special = {0, len(tokens_a) + 1, len(tokens) - 1}
    candidates = [i for i in range(len(tokens)) if i not in special]
    rng.shuffle(candidates)
    n_pred = masked_count(len(tokens), cfg)
    positions = sorted(candidates[:n_pred])
    output = list(tokens)
    for position in candidates[:n_pred]:
        if rng.random() < 0.8:
            output[position] = ids.mask
        elif rng.random() >= 0.5:  # else: keep the original token
            output[position] = rng.randint(0, ids.vocab_size - 1)
    return Sample(  # int32: a corpus' worth of samples is held in memory until written
        input_ids=np.array(output, dtype=np.int32),
        segment_ids=np.array(segments, dtype=np.int32),
        masked_positions=np.array(positions, dtype=np.int32),
        masked_labels=np.array([tokens[p] for p in positions], dtype=np.int32),
        nsp_label=int(is_random_next),
    )
