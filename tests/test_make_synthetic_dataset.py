"""data/make_synthetic_dataset.py: every sequence repeats one word, and about --label-noise of the masked labels
are another word, so the best achievable MLM accuracy (predict the repeated word) is below 1.0.

Reference: the repeated word read back from each stored sequence's unmasked tokens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bert.data.format import VarlenShard
from bert.synthetic import CLS, MASK, SEP

ROOT = Path(__file__).resolve().parents[1]


def copy_accuracy(out: Path) -> float:
    """MLM accuracy of the ideal copier on the eval shard: the share of masked labels equal to the repeated word."""
    hits = total = 0
    with VarlenShard(next((out / "eval_varlength").glob("*.hdf5"))) as shard:
        for s in shard:
            word, = set(s.input_ids.tolist()) - {CLS, SEP, MASK}
            hits += int(np.sum(s.masked_labels == word))
            total += len(s.masked_labels)
    return hits / total


@pytest.mark.parametrize("noise, low, high", [("0.1", 0.85, 0.95), ("0", 1.0, 1.0)])
def test_label_noise_sets_the_accuracy_ceiling(noise, low, high, tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data" / "make_synthetic_dataset.py"), "--out", str(tmp_path),
                    "--train-samples", "8", "--shards", "1", "--eval-samples", "512", "--label-noise", noise],
                   check=True, capture_output=True)
    assert low <= copy_accuracy(tmp_path) <= high


def test_bad_noise_is_named(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "data" / "make_synthetic_dataset.py"), "--out", str(tmp_path),
                          "--label-noise", "1.5"], capture_output=True, text=True)
    assert out.returncode == 2 and "--label-noise" in out.stderr
