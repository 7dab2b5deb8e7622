"""The load-balance lab: length distributions, packing and the min/max simulation, against hand-worked cases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bert.balance import get_strategy, stratum_of
from bert.balance.lab.length_pmf import LengthPMF
from bert.balance.lab.packing import pack_histogram
from bert.balance.lab.simulate import draw, pack, simulate, simulate_node_ideal, simulate_packing, stratum_histogram
from bert.lengths import WIKI_PHASE2, LengthMix

# P(100) = P(300) = 1/2: small enough to enumerate every outcome by hand.
COIN = LengthPMF(np.where(np.isin(np.arange(1, 513), [100, 300]), 0.5, 0.0))


def test_pmf_from_mix_matches_the_mix_sampler() -> None:
    pmf = LengthPMF.from_mix(WIKI_PHASE2)
    drawn = WIKI_PHASE2.sample(400_000, np.random.default_rng(0))
    empirical = np.bincount(drawn - 1, minlength=512) / drawn.size
    assert pmf.probs.sum() == pytest.approx(1.0)
    assert pmf.probs[511] == pytest.approx(0.23)
    # Per-stratum shares and the spike agree to sampling error; so does every 32-token window.
    np.testing.assert_allclose(empirical.reshape(16, 32).sum(1), pmf.probs.reshape(16, 32).sum(1), atol=3e-3)
    assert drawn.mean() == pytest.approx(pmf.mean, rel=3e-3)


def test_pmf_from_lengths_and_bad_input() -> None:
    pmf = LengthPMF.from_lengths([3, 3, 1, 4], max_length=8)
    np.testing.assert_allclose(pmf.probs, [0.25, 0, 0.5, 0.25, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="above the maximum 8"):
        LengthPMF.from_lengths([3, 9], max_length=8)
    with pytest.raises(ValueError, match="no lengths"):
        LengthPMF.from_lengths([])


def test_stratified_draw_has_exact_counts_per_rank() -> None:
    pmf = LengthPMF.from_mix(WIKI_PHASE2)
    lengths = draw(pmf, True, (3, 64, 16), np.random.default_rng(1), (128, 256, 384, 512))
    per_rank = np.stack([np.bincount(stratum_of(row), minlength=4) for row in lengths.reshape(-1, 16)])
    assert (per_rank == [6, 3, 2, 5]).all()
    np.testing.assert_allclose(stratum_histogram(pmf), [0.373, 0.197, 0.117, 0.314], atol=1e-3)


def test_simulation_tiny_case_by_hand() -> None:
    # 2 GPUs x 2 sequences from COIN. No balancing: each GPU holds 200/400/600 with p 1/4, 1/2, 1/4,
    # so E[min] = 200 + 200 P(both >= 400) + 200 P(both 600) = 200 + 200 * 9/16 + 200 * 1/16 = 325,
    # E[max] = 800 - 325 = 475. Global presort over k = #300s of 4 (p = 1, 4, 6, 4, 1 / 16):
    # (min, max) = (200, 200), (200, 400), (400, 400), (400, 600), (600, 600) -> 350 and 450.
    rng = np.random.default_rng(2)
    none = simulate(get_strategy("none"), COIN, 2, 2, 2, 40_000, rng)
    glob = simulate(get_strategy("global"), COIN, 2, 2, 2, 40_000, rng)
    for spread, lo, hi in ((none, 325, 475), (glob, 350, 450)):
        assert spread.stderr < 1.0
        assert abs(spread.avg_min - lo) < 4 * spread.stderr and abs(spread.avg_max - hi) < 4 * spread.stderr
        assert spread.mean == pytest.approx(400, abs=3)


def histogram_of(pairs: dict[int, int]) -> np.ndarray:
    counts = np.zeros(512, dtype=np.int64)
    for length, n in pairs.items():
        counts[length - 1] = n
    return counts


@pytest.mark.parametrize(
    "sequences,expected",
    [
        # 300 300 | 200 joins each (room 12 left) | 100 opens a pack
        ({300: 2, 200: 2, 100: 1}, {500: 2, 100: 1}),
        # at most 3 per pack even with room to spare
        ({1: 10}, {3: 3, 1: 1}),
        # 512s stay alone; 100 100 100 fill one pack (3 max), the 4th 100 takes two 50s, one 50 left
        ({512: 3, 100: 4, 50: 3}, {512: 3, 300: 1, 200: 1, 50: 1}),
        # best fit: the 60 goes to the pack with 100 free (412 + 60), not the one with 212
        ({412: 1, 300: 1, 60: 1}, {472: 1, 300: 1}),
    ],
)
def test_packing_by_hand(sequences: dict[int, int], expected: dict[int, int]) -> None:
    packs = pack_histogram(histogram_of(sequences))
    assert {t + 1: int(n) for t, n in enumerate(packs) if n} == expected


def test_packing_keeps_every_token() -> None:
    pmf = LengthPMF.from_mix(WIKI_PHASE2)
    counts = pmf.counts(50_000)
    packs = pack_histogram(counts)
    tokens = np.arange(1, 513)
    assert (packs * tokens).sum() == (counts * tokens).sum()
    assert counts.sum() / packs.sum() <= 3  # at most 3 per pack
    with pytest.raises(ValueError, match="longer than the pack capacity 256"):
        pack_histogram(counts, capacity=256)


def test_packing_simulation_draws_whole_packs() -> None:
    # A mix whose packs are all exactly full (every 256 pairs with another 256): no spread at all.
    halves = LengthPMF.from_mix(LengthMix(edges=(256, 512), probs=(1.0, 0.0), at_max=0.0, min_length=256))
    packed = pack(halves, pool=1000)
    assert packed.ratio == 2.0
    spread = simulate_packing(packed, gpus=16, packs_per_gpu=8, trials=10, rng=np.random.default_rng(3))
    assert spread.avg_min == spread.avg_max == 8 * 512


def test_node_ideal_is_the_floor_of_node_local_balancing() -> None:
    pmf, rng = LengthPMF.from_mix(WIKI_PHASE2), np.random.default_rng(4)
    one_node = simulate_node_ideal(pmf, gpus=8, gpus_per_node=8, local_batch=16, trials=20, rng=rng)
    assert one_node.avg_min == one_node.avg_max == pytest.approx(one_node.mean)
    assert one_node.gpus == 8
    ideal = simulate_node_ideal(pmf, gpus=256, gpus_per_node=8, local_batch=16, trials=50, rng=rng)
    samsung = simulate(get_strategy("samsung"), pmf, 256, 8, 16, 50, rng)
    assert 0.03 < ideal.range_over_mean < samsung.range_over_mean  # nodes' totals differ; snake adds to that


# Every module of the package outside the lab (found on disk: pkgutil.walk_packages would import
# the lab package itself to look inside it), plus the driver.
PRODUCT_IMPORTS = """
import importlib, pathlib, sys
sys.path.insert(0, ".")
import run_pretraining
for path in sorted(pathlib.Path("bert").rglob("*.py")):
    if "lab" not in path.parts:
        importlib.import_module(".".join(path.with_suffix("").parts).removesuffix(".__init__"))
print(" ".join(sorted(n for n in sys.modules if n.startswith("bert."))))
"""


def test_the_product_never_loads_the_lab() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", PRODUCT_IMPORTS], cwd=root, capture_output=True, text=True, check=True)
    loaded = out.stdout.split()
    # The walk reached the product (driver, data pipeline, training loop) and the lab is a package of its own.
    assert {"bert.data.pipeline", "bert.train.loop", "bert.balance.stratify"} <= set(loaded)
    assert (root / "bert" / "balance" / "lab" / "__init__.py").exists()
    assert [n for n in loaded if n == "bert.balance.lab" or n.startswith("bert.balance.lab.")] == []


def test_counts_round_by_largest_remainder() -> None:
    # 10 x (0.17, 0.38, 0.45) = 1.7, 3.8, 4.5: floors 1, 3, 4 leave 2, for the .8 and then the .7
    pmf = LengthPMF(np.array([0.17, 0.38, 0.45]))
    assert pmf.counts(10).tolist() == [2, 4, 4]


def test_spread_statistics_by_hand() -> None:
    from bert.balance.lab.simulate import Spread, _spread

    # 4 trials x 2 GPUs: the least loaded always holds 1 (std 0), the most loaded 5, 9, 7, 3 (std sqrt 5).
    spread = _spread("x", np.array([[1, 5], [9, 1], [1, 7], [3, 1]]))
    assert (spread.gpus, spread.trials, spread.avg_min, spread.avg_max, spread.mean) == (2, 4, 1.0, 6.0, 3.5)
    assert spread.stderr == pytest.approx(np.sqrt(5) / 2)  # the larger of the two, over sqrt(trials)
    # Samsung's Table 5 snake row, 3900 to 4246 around a mean of 16 x 254.6 tokens: 8.5 % of the mean.
    table5 = Spread("samsung", 1024, 1, 3900.0, 4246.0, 4073.6, 0.0)
    assert table5.range_over_mean == pytest.approx(346 / 4073.6)


def test_node_ideal_splits_each_nodes_tokens_over_its_gpus() -> None:
    # Every sequence 100 tokens: 16 per GPU is 1600 tokens on every GPU, however the nodes are cut.
    flat = LengthPMF(np.where(np.arange(1, 513) == 100, 1.0, 0.0))
    ideal = simulate_node_ideal(flat, gpus=16, gpus_per_node=8, local_batch=16, trials=3, rng=np.random.default_rng(5))
    assert (ideal.avg_min, ideal.avg_max, ideal.mean) == (1600, 1600, 1600)
