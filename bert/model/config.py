"""BERT hyperparameters: Google's `bert_config.json` (also HF's `config.json`) or a named size."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

VOCAB_MULTIPLE = 8  # tensor-core friendly; MLPerf pads 30522 -> 30528 the same way
MLPERF_VOCAB = 30522  # bert-base-uncased WordPiece vocabulary, the one MLPerf's data is tokenised with


def pad_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30528
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    # Classes the MLM head predicts: the tokenizer's vocabulary. The rest of vocab_size is padding that
    # never enters the softmax nor the accuracy's argmax (None: no padding, all of vocab_size).
    real_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.real_vocab_size is None:
            object.__setattr__(self, "real_vocab_size", self.vocab_size)
        if not 0 < self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"real_vocab_size {self.real_vocab_size} is not in 1..vocab_size ({self.vocab_size})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.vocab_size % VOCAB_MULTIPLE:
            raise ValueError(f"vocab_size {self.vocab_size} is not padded to a multiple of {VOCAB_MULTIPLE}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def load(cls, name_or_path: str | Path) -> BertConfig:
        """A named config (see `NAMED`) or a JSON file; the vocabulary is padded to a multiple of 8 and its
        unpadded size kept as `real_vocab_size` (unless the file gives it: our own `to_dict` output)."""
        if str(name_or_path) in NAMED:
            return NAMED[str(name_or_path)]
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"{name_or_path!r} is neither a named config ({', '.join(NAMED)}) nor a file")
        raw = json.loads(path.read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only exact 'gelu')")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        missing = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"} - values.keys()
        if missing:
            raise ValueError(f"{path}: missing {sorted(missing)}")
        values.setdefault("real_vocab_size", int(values["vocab_size"]))
        values["vocab_size"] = pad_vocab(int(values["vocab_size"]))
        return cls(**values)

    def with_dropout(self, p: float) -> BertConfig:
        return replace(self, hidden_dropout_prob=p, attention_probs_dropout_prob=p)

    def to_dict(self) -> dict:
        return asdict(self)


_MLPERF = BertConfig(real_vocab_size=MLPERF_VOCAB)  # vocab_size 30528: MLPERF_VOCAB padded
NAMED: dict[str, BertConfig] = {
    "tiny": replace(_MLPERF, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "base": _MLPERF,
    "large": replace(_MLPERF, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    # MiniLM-L6-H384, the encoder of the named checkpoint `minilm` (bert.model.init_checkpoint)
    "minilm": replace(_MLPERF, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
}
