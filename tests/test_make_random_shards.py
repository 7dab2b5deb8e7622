"""data/make_random_shards.py: lengths follow the Wikipedia phase-2 mix, masking follows create_pretraining_data,
and the shards pass the reader and data/verify.py.

References: the mix's exact probability mass function (`LengthPMF.from_mix`, independent of the sampler) for a
chi-square test of the length histogram; create_pretraining_data's rules ([Google-BERT]) restated per sequence.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from script_modules import ROOT, load_script

from bert.balance.lab.length_pmf import LengthPMF
from bert.data.eval_set import eval_batches
from bert.data.format import VarlenShard
from bert.data.index import LengthIndex
from bert.synthetic import CLS, FIRST_WORD_ID, MASK, SEP

sys.path.insert(0, str(ROOT / "data"))  # the script's sibling modules (md5_list)
shards = load_script("data/make_random_shards.py")

# 99.99th percentile of chi-square with 16 degrees of freedom: a correct sampler fails 1 seed in 10,000.
CHI2_16_9999 = 45.92
EDGES = [*range(32, 512, 32), 511, 512]  # 32-token bins up to 480, 481-511, and the spike at 512: 17 bins


def chi_square(lengths: np.ndarray, pmf: np.ndarray) -> float:
    """Pearson's statistic of the binned lengths against `pmf` (P(length = i + 1)), 16 degrees of freedom."""
    bins = lambda x, w=None: np.bincount(np.searchsorted(EDGES, x), weights=w, minlength=len(EDGES))
    expected = len(lengths) * bins(np.arange(1, 513), pmf)
    return float(((bins(lengths) - expected) ** 2 / expected).sum())


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("random_shards")
    assert shards.main(["--out", str(out), "--samples", "6000", "--shards", "3", "--eval-samples", "300",
                        "--seed", "1"]) == 0
    return out


def test_length_histogram_matches_the_phase2_mix(made):
    lengths = LengthIndex.scan(made / "train_varlength").lengths
    assert len(lengths) == 6000 and lengths.min() >= 5 and lengths.max() == 512
    pmf = LengthPMF.from_mix(shards.length_mix(5)).probs
    assert chi_square(lengths, pmf) < CHI2_16_9999
    # The test can fail: the same lengths against the mix with lengths uniform over 5..512 are rejected.
    uniform = np.r_[np.zeros(4), np.full(508, 1 / 508)]
    assert chi_square(lengths, uniform) > 10 * CHI2_16_9999
    # Total variation between the empirical and exact pmf per length is sampling noise only (~0.1 at n=6000).
    empirical = LengthPMF.from_lengths(lengths, 512).probs
    assert 0.5 * np.abs(empirical - pmf).sum() < 0.15


def test_masking_and_framing_follow_create_pretraining_data(made):
    with VarlenShard(made / "train_varlength/part_00000_of_00003.hdf5") as shard:
        samples = list(shard)
    masked = replaced = 0
    for s in samples:
        ids, n = s.input_ids, len(s.input_ids)
        seps = np.flatnonzero(ids == SEP)
        assert ids[0] == CLS and ids[-1] == SEP and len(seps) == 2 and 2 <= seps[0] <= n - 3
        assert np.array_equal(s.segment_ids, (np.arange(n) > seps[0]).astype(np.int64))
        assert len(s.masked_positions) == min(76, max(1, round(0.15 * n)))
        pos = s.masked_positions
        assert np.all(np.diff(pos) > 0) and not np.isin(pos, [0, seps[0], n - 1]).any()
        assert s.masked_labels.min() >= FIRST_WORD_ID and s.masked_labels.max() < 30522
        masked += len(pos)
        replaced += int((ids[pos] == MASK).sum())
    # 80 % [MASK]: binomial standard deviation at ~60,000 masked positions is 0.16 %.
    assert abs(replaced / masked - 0.8) < 0.01


def test_the_loader_and_verify_accept_the_shards(made):
    batches = eval_batches(made / "eval_varlength", 100, world_size=1, rank=0, num_examples=300)
    assert sum(b.num_sequences for b in batches) == 300
    assert load_script("data/verify.py").main([str(made), "--workers", "1"]) == 0


def test_short_sequences_are_refused(capsys):
    with pytest.raises(ValueError, match="at least 5 tokens"):
        shards.random_samples(np.array([4, 100]), np.random.default_rng(0))
    with pytest.raises(SystemExit) as exit_:
        shards.main(["--out", "x", "--min-length", "3"])
    assert exit_.value.code == 2 and "--min-length" in capsys.readouterr().err
