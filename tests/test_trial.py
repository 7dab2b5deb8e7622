"""bench/trial.py: samples to target from a result log, censoring, and the trial's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_modules import load_script

from bert.config import from_env_and_args

trial = load_script("bench/trial.py")


def mllog(key: str, value, **metadata) -> str:
    return ":::MLLOG " + json.dumps({"namespace": "", "time_ms": 1.0, "event_type": "POINT_IN_TIME", "key": key,
                                     "value": value, "metadata": metadata})


def log_text(evals: list[tuple[int, float]], status: str | None) -> str:
    lines = [mllog("run_start", None), "some driver output"]
    lines += [f"0: {mllog('eval_accuracy', acc, epoch_num=samples)}" for samples, acc in evals]  # srun -l prefix
    if status:
        lines.append(mllog("run_stop", None, status=status))
    return "\n".join(lines) + "\n"


def test_first_eval_at_or_above_target_is_the_score():
    evals = [(160, 0.05), (320, 0.072), (480, 0.069), (640, 0.071)]
    score = trial.score_log(log_text(evals, "success"), target=0.07, limit=3200)
    assert (score.samples, score.censored, score.status) == (320, False, "success")
    assert score.evals == evals
    # Exactly at the target counts (the driver stops at accuracy >= target).
    assert trial.score_log(log_text([(160, 0.07)], "success"), 0.07, 3200).samples == 160


@pytest.mark.parametrize("status", ["aborted", None])
def test_a_run_that_did_not_succeed_is_censored_at_the_limit(status):
    # Even with an eval above the target in the log: only run_stop success says the run converged.
    score = trial.score_log(log_text([(160, 0.05), (320, 0.08)], status), target=0.07, limit=3200)
    assert (score.samples, score.censored) == (3200, True)
    assert score.status == (status or "missing")


def test_success_without_an_eval_at_target_is_not_a_result():
    score = trial.score_log(log_text([(160, 0.05)], "success"), target=0.07, limit=3200)
    assert score.censored and score.samples == 3200


def test_overrides_win_over_base_and_every_setting_is_a_valid_config(tmp_path):
    env = trial.trial_env({"GRAD_CLIP": "bucket", "SEED": 3, "OPTIMIZER": "adam"})
    assert env["GRAD_CLIP"] == "bucket" and env["SEED"] == "3" and env["BERT_CONFIG"] == "tiny"
    assert env["INIT_CHECKPOINT"] == ""  # from scratch, whatever the CPU config's default model is
    # Every name is one the driver reads (a typo would be ignored silently), and the values pass its checks.
    shell_only = {"BERT_DATA", "DGXNGPU", "EXTRA_PARAMS"}
    cfg = from_env_and_args([], {**{k: v for k, v in env.items() if k not in shell_only},
                                 "DATADIR_PHASE2": str(tmp_path), "EVALDIR": str(tmp_path)})
    assert cfg.optim.grad_clip == "bucket" and cfg.run.target_mlm_accuracy == float(env["TARGET_MLM_ACCURACY"])
    assert cfg.run.eval_iter_samples < int(env["MAX_SAMPLES_TERMINATION"]) // 10  # resolution for the score


def test_a_run_that_cannot_start_is_an_error_not_a_score(tmp_path: Path):
    with pytest.raises(trial.TrialError, match="exit 2"):
        trial.run_trial({"BERT_DATA": str(tmp_path / "missing"), "GRAD_CLIP": "sideways"}, tmp_path / "t")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "result.txt").write_text(log_text([(160, 0.08)], "success"))
    with pytest.raises(trial.TrialError, match="fresh directory"):  # never scores an earlier run's log
        trial.run_trial({}, tmp_path / "old")


def test_clip_convergence_summary_counts_censored_runs_at_the_limit():
    clip = load_script("bench/clip_convergence.py")
    runs = [{"arm": "lamb-after", "samples": 1600, "censored": False},
            {"arm": "lamb-after", "samples": 3200, "censored": True},
            {"arm": "lamb-bucket", "samples": 960, "censored": False}]
    summary = clip.summarize(runs)
    assert summary["lamb-after"] == {"n": 2, "mean": 2400.0, "std": pytest.approx(1131.37, abs=0.01), "min": 1600,
                                     "max": 3200, "censored": 1}
    assert summary["lamb-bucket"]["std"] == 0.0 and summary["lamb-bucket"]["censored"] == 0
