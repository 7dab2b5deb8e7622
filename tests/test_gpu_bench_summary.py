"""bench/train_gpu.py's window statistics: the median interval rate, by hand (tests/test_train_gpu_bench.py has the
rest of the script)."""

from __future__ import annotations

import sys

import pytest
from script_modules import ROOT, load_script

sys.path.insert(0, str(ROOT / "bench"))  # the script imports bench/model.py
bench = load_script("bench/train_gpu.py")


def test_the_median_interval_rate_is_the_middle_one_per_gpu():
    # Three intervals at 2 GPUs: 8, 4 and 5 samples/s in all, i.e. 4, 2 and 2.5 per GPU; the middle one is 2.5
    # (their mean, 2.83, would be pulled up by the fast interval).
    intervals = [{"samples_per_s": rate, "seconds": 80 / rate, "new_samples": 80, "new_steps": 5}
                 for rate in (8.0, 4.0, 5.0)]
    stats = bench.summarise(intervals, world=2, matmul_flops=1e11)
    assert stats["samples_per_s_per_gpu_median"] == 2.5
    assert (stats["samples_per_s_per_gpu_min"], stats["samples_per_s_per_gpu_max"]) == (2.0, 4.0)
    assert stats["samples_per_s_per_gpu"] == pytest.approx(240 / (10 + 20 + 16) / 2)
