"""bert.data.manifest: which manifest describes a shard directory, and the closed division's rules: the MLPerf vocab
and data made by the reference pipeline."""

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


def dataset(root: Path, vocab_md5: str | None, pipeline: str | None = "reference") -> Path:
    """prepare.py's layout: root/train_varlength, root/eval_varlength, root/manifest.json (None: no manifest;
    pipeline None: a manifest from before prepare.py recorded one)."""
    for split in ("train_varlength", "eval_varlength"):
        (root / split).mkdir(parents=True)
    if vocab_md5 is not None:
        manifest = {"vocab": {"md5": vocab_md5}} | ({"pipeline": pipeline} if pipeline is not None else {})
        (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def mlperf_md5() -> str:
    return hashlib.md5(default_vocab_path().read_bytes()).hexdigest()


def test_the_mlperf_vocab_is_recognised_by_its_own_bytes(tmp_path):
    data = dataset(tmp_path, mlperf_md5())
    check_data_for_division("closed", data / "train_varlength", data / "eval_varlength")


@pytest.mark.parametrize("pipeline", ["custom", None, 1])
def test_closed_refuses_data_the_reference_pipeline_did_not_make(tmp_path, pipeline):
    data = dataset(tmp_path, mlperf_md5(), pipeline)
    with pytest.raises(ManifestError) as refused:
        check_data_for_division("closed", data / "train_varlength", data / "eval_varlength")
    assert str(refused.value) == (
        f"{data / 'manifest.json'}: the data set was not made by the reference pipeline (pipeline {pipeline!r}); a "
        "closed-division run needs MLPerf's data: data/prepare.py --mlperf-text results4/, or NVIDIA's prepared "
        "shards (they come without a manifest), or MLPERF_DIVISION=open to use this data")
    check_data_for_division("open", data / "train_varlength", data / "eval_varlength")


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
