"""Weights in and out: our safetensors files, Hugging Face BERT checkpoints, converted TF checkpoints.

Our parameter names are Hugging Face's `BertForPreTraining` names, so importing is a near-identity
mapping: a bare `BertModel` gets the `bert.` prefix, old `LayerNorm.gamma/beta` become `weight/bias`,
and the decoder (tied to the word embeddings) is dropped. A checkpoint with the unpadded vocabulary
(30522) is zero-padded to the model's (30528), as MLPerf's converter does (the MLM head leaves the
padding rows out of its softmax: `BertConfig.real_vocab_size`). Anything else that does not fit
raises `ValueError` naming the tensor.

Fused QKV: our attention has one `attention.self.qkv` Linear where every other BERT (Google's TF,
Hugging Face, NVIDIA, and our own files before the fusion) has `query`, `key` and `value`. Import
concatenates the three along the output rows, in that order (`layers.QKV_PARTS`), so each source
tensor lands in one known slice; `export_state` cuts them out again. Our files store the model's own
state (fused), so saving and resuming need no mapping; files with the separate tensors still load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from bert.model.config import pad_vocab
from bert.model.layers import QKV_PARTS

VOCAB_ROWS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")  # first dim is the vocabulary
TIED = {"cls.predictions.decoder.weight": VOCAB_ROWS[0], "cls.predictions.decoder.bias": VOCAB_ROWS[1]}
IGNORED = ("bert.embeddings.position_ids",)  # a buffer older HF versions saved
HEADS_PREFIX = "cls."
SEPARATE_QKV = re.compile(r"^(?P<block>.+\.attention\.self)\.(?P<part>query|key|value)\.(?P<leaf>weight|bias)$")


def save_weights(model: nn.Module, path: str | Path) -> None:
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    metadata = {"format": "bert-mlperf"}
    if hasattr(model, "config"):
        metadata["config"] = json.dumps(model.config.to_dict())
    save_file(tensors, str(path), metadata=metadata)


def load_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Our own checkpoint: every tensor present, every shape exact."""
    return load_state(model, load_file(str(path)), pad_vocab_rows=False)


def load_pretrained(model: nn.Module, path: str | Path, strict_heads: bool = True) -> list[str]:
    """Ours, HF `BertForPreTraining`/`BertModel` (.safetensors or .bin, or their directory), or a
    converted TF checkpoint. `strict_heads=False` allows a checkpoint without the MLM/NSP heads
    (they keep their initialisation). Returns the names of the tensors loaded."""
    return load_state(model, read_state_dict(path), strict_heads=strict_heads)


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("model.safetensors", "pytorch_model.bin") if (path / n).is_file()]
        if not found:
            raise ValueError(f"{path}: no model.safetensors or pytorch_model.bin inside")
        path = found[0]
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("model", state)  # NVIDIA's converted checkpoints wrap the state dict as {"model": ...}


def to_our_name(name: str) -> str:
    name = name.removeprefix("module.")
    if name.startswith(("embeddings.", "encoder.", "pooler.")):
        name = "bert." + name
    if name.endswith("LayerNorm.gamma"):
        name = name.removesuffix("gamma") + "weight"
    if name.endswith("LayerNorm.beta"):
        name = name.removesuffix("beta") + "bias"
    return name


def load_state(model: nn.Module, state: Mapping[str, Tensor], strict_heads: bool = True,
               pad_vocab_rows: bool = True) -> list[str]:
    """Check `state` (any of the supported namings) against `model` and copy it in."""
    renamed = {to_our_name(k): v for k, v in state.items()}
    for tied, kept in TIED.items():  # keep one copy of a tied tensor, whichever the file stored
        if tied in renamed:
            renamed.setdefault(kept, renamed[tied])
            del renamed[tied]
    for name in IGNORED:
        renamed.pop(name, None)
    renamed = fuse_qkv(renamed)

    expected = model.state_dict()
    missing = [n for n in expected if n not in renamed and (strict_heads or not n.startswith(HEADS_PREFIX))]
    unexpected = [n for n in renamed if n not in expected]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) the model does not: {', '.join(unexpected[:5])}")
    fitted = {n: _fit(n, t, expected[n], pad_vocab_rows) for n, t in renamed.items()}
    model.load_state_dict(fitted, strict=False)
    return sorted(fitted)


def fuse_qkv(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Separate `...attention.self.{query,key,value}.{weight,bias}` -> one `...attention.self.qkv.*`
    (rows: query, key, value); every other tensor passes through. A partial triple is an error naming
    the missing tensor."""
    fused: dict[str, Tensor] = {}
    triples: dict[str, dict[str, Tensor]] = {}
    for name, tensor in state.items():
        match = SEPARATE_QKV.match(name)
        if match is None:
            fused[name] = tensor
        else:
            triples.setdefault(f"{match['block']}.qkv.{match['leaf']}", {})[match["part"]] = tensor
    for name, parts in triples.items():
        block, leaf = name.rsplit(".qkv.", 1)
        if name in fused:
            raise ValueError(f"checkpoint has both {name} and separate {block}.query/key/value.{leaf}")
        lacking = [f"{block}.{p}.{leaf}" for p in QKV_PARTS if p not in parts]
        if lacking:
            raise ValueError(f"checkpoint lacks {len(lacking)} tensor(s): {', '.join(lacking)}")
        shapes = {p: tuple(parts[p].shape) for p in QKV_PARTS}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"{block}: query/key/value.{leaf} shapes differ: {shapes}")
        fused[name] = torch.cat([parts[p] for p in QKV_PARTS])
    return fused


def export_state(model: nn.Module, real_vocab: bool = True) -> dict[str, Tensor]:
    """The weights under Hugging Face `BertForPreTraining` names (also Google's and NVIDIA's layout):
    `qkv` split back into `query`, `key`, `value`. `real_vocab` cuts the vocabulary rows to the
    tokenizer's (30522), as those checkpoints have them; the padding rows are never used."""
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if name.endswith(("attention.self.qkv.weight", "attention.self.qkv.bias")):
            block, leaf = name.rsplit(".qkv.", 1)
            for part, piece in zip(QKV_PARTS, tensor.chunk(len(QKV_PARTS))):
                state[f"{block}.{part}.{leaf}"] = piece.clone()
            continue
        if real_vocab and name in VOCAB_ROWS:
            tensor = tensor[: model.config.real_vocab_size]
        state[name] = tensor.clone()
    return state


def _fit(name: str, tensor: Tensor, target: Tensor, pad_vocab_rows: bool) -> Tensor:
    if tensor.shape == target.shape:
        return tensor
    if name in VOCAB_ROWS and tensor.shape[1:] == target.shape[1:]:
        rows, want = tensor.shape[0], target.shape[0]
        if pad_vocab_rows and pad_vocab(rows) == want:
            return torch.cat([tensor, tensor.new_zeros(want - rows, *tensor.shape[1:])])
        raise ValueError(f"{name}: checkpoint vocabulary of {rows} tokens does not match the model's {want}")
    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
