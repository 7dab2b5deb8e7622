"""bench/fp8_convergence.py's yardstick: each precision's largest eval gap to fp32's, seed by seed and eval by eval."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fp8_convergence  # noqa: E402


def row(precision: str, seed: int, evals: list[float]) -> dict:
    return {"precision": precision, "seed": seed, "evals": [(160 * (i + 1), a) for i, a in enumerate(evals)]}


def test_the_gap_pairs_each_eval_with_fp32s_of_the_same_seed_and_samples():
    rows = [row("fp32", 7, [0.10, 0.20]), row("fp32", 8, [0.30, 0.40]),
            row("fp8-delayed", 7, [0.11, 0.20]), row("fp8-delayed", 8, [0.30, 0.37]),
            row("bf16-masters", 7, [0.10, 0.21]), row("bf16-masters", 8, [0.30, 0.40])]
    gaps = fp8_convergence.gaps(rows)
    # seed 8's second eval against seed 8's (0.40), not seed 7's (0.20) or the first eval's
    assert abs(gaps["fp8-delayed"] - 0.03) < 1e-12 and abs(gaps["bf16-masters"] - 0.01) < 1e-12
    assert gaps["fp32"] == 0.0


def test_every_run_takes_the_candidates_settings_and_only_the_precision_differs():
    keys = {frozenset(settings) - {"FP8_RECIPE", "MASTER_WEIGHTS"} for settings in fp8_convergence.PRECISIONS.values()}
    assert keys == {frozenset({"PRECISION"})}
    assert {"ATTENTION": "triton", "RESIDUAL_NORM": "fused-lean", "BIAS_GELU": "fused"}.items() <= \
        fp8_convergence.CANDIDATE.items()


def test_the_loss_gap_pairs_each_logged_step_the_same_way():
    rows = [{"precision": "fp32", "seed": 7, "losses": [(10, 7.0), (20, 6.5)]},
            {"precision": "fp8-delayed", "seed": 7, "losses": [(10, 7.1), (20, 6.45)]}]
    assert abs(fp8_convergence.gaps(rows, "losses")["fp8-delayed"] - 0.1) < 1e-12
