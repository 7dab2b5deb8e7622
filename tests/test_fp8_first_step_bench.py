"""bench/fp8_first_step.py: at the amaxes' start (scale 1) e5m2 flushes the small gradients of delayed float8's
first step to zero; one calibration pass on another batch brings them back, nearer float64's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fp8_first_step  # noqa: E402


def test_a_calibrated_first_step_flushes_no_gradient_and_is_nearer_float64():
    start, calibrated = fp8_first_step.measure("tiny", seed=0)
    assert (start["amaxes"], calibrated["amaxes"]) == ("at their start", "calibrated")
    assert start["zero_share"] > 0.1 and calibrated["zero_share"] < 0.01
    assert calibrated["relative_error_vs_float64"] < 0.5 * start["relative_error_vs_float64"]
