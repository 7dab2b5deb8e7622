"""bench/norm_sass.py: with Triton, every variant of the norm's kernels compiles for sm_90, and the forward's mask
costs a thread no more Philox than its eight elements need: two calls, ten rounds, two high products a round (the
(4, W) tile before the forty-third session made 181 where this allows 40). The bounds are as its doc says."""

from __future__ import annotations

import importlib.util

import pytest
from script_modules import run_for_json

from bert.model.philox import ROUNDS  # the norms' Philox


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton (torch's CUDA build) not installed")
def test_the_forward_draws_each_counter_once_and_the_bounds_hold(tmp_path):
    report = run_for_json("bench/norm_sass.py", tmp_path / "norm_sass.json")
    rows = {(r["kernel"], r["dropout"]): r for r in report["rows"]}
    assert len(rows) == 10
    for (kernel, dropout), r in rows.items():
        assert r["loop_instructions"] > 0 and r["memory_clocks"] > 0, r
        assert 0 < r["step_ms"] <= r["step_ms_no_overlap"], r
        if kernel.startswith("forward") and dropout:
            assert 0 < r["high_products"] <= 2 * ROUNDS * 2, r  # two calls a thread
            assert r["loop_instructions"] > rows[(kernel, False)]["loop_instructions"]
        else:
            assert r["high_products"] == 0, r  # no Philox: the backward reads the bits
    estimate = report["step_estimate"]
    assert estimate["float8_forward_ms"] <= estimate["float8_forward_ms_dropout"]
