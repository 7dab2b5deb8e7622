"""bert.data.manifest: which manifest describes a shard directory, and the closed division's vocab rule."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from bert.data.manifest import ManifestError, check_data_for_division, find_manifest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))

from wordpiece import default_vocab_path  # noqa: E402


def dataset(root: Path, vocab_md5: str | None) -> Path:
    """prepare.py's layout: root/train_varlength, root/eval_varlength, root/manifest.json (None: no manifest)."""
    for split in ("train_varlength", "eval_varlength"):
        (root / split).mkdir(parents=True)
    if vocab_md5 is not None:
        (root / "manifest.json").write_text(json.dumps({"vocab": {"md5": vocab_md5}}))
    return root


def test_the_mlperf_vocab_is_recognised_by_its_own_bytes(tmp_path):
    data = dataset(tmp_path, hashlib.md5(default_vocab_path().read_bytes()).hexdigest())
    check_data_for_division("closed", data / "train_varlength", data / "eval_varlength")


def test_closed_refuses_another_vocab_and_open_does_not(tmp_path):
    train = dataset(tmp_path / "a", "0" * 32) / "train_varlength"
    evals = dataset(tmp_path / "b", None) / "eval_varlength"
    with pytest.raises(ManifestError, match=f"^{tmp_path / 'a' / 'manifest.json'}: .* not the MLPerf vocab"):
        check_data_for_division("closed", train, evals)
    check_data_for_division("open", train, evals)


def test_manifest_in_the_shard_directory_itself_and_unreadable_ones(tmp_path):
    data = dataset(tmp_path, None)
    inner = data / "train_varlength" / "manifest.json"
    inner.write_text("{not json")
    assert find_manifest(data / "train_varlength") == inner and find_manifest(data / "eval_varlength") is None
    with pytest.raises(ManifestError, match=f"^{inner}: unreadable manifest"):
        check_data_for_division("closed", data / "train_varlength")


def test_without_a_manifest_closed_runs_go_ahead(synthetic_data):
    # The synthetic set (and the official MLPerf shards) come without a manifest: nothing to check.
    assert find_manifest(synthetic_data / "train_varlength") is None
    check_data_for_division("closed", synthetic_data / "train_varlength", synthetic_data / "eval_varlength")
