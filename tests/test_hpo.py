"""bench/hpo.py: the search space, the outputs, and the Slurm job array over one shared storage.

The objective here is `--objective fake` (an analytic bowl, no training): what is tested is the machinery
around the real runs, which bench/trial.py's tests cover.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optuna
import pytest
from script_modules import ROOT, load_script
from slurm_idle import needs_slurm

from bert.config import from_env_and_args

hpo = load_script("bench/hpo.py")
trial = sys.modules["trial"]  # loaded by hpo.py from bench/


def run_hpo(tmp_path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "bench/hpo.py"), "--objective", "fake", "--work", str(tmp_path / "work"),
           "--out", str(tmp_path / "out"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env or {**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_suggested_settings_are_valid_config_values(tmp_path, optimizer):
    low, high = hpo.LR_RANGE[optimizer]
    params = {"LR": high, "OPT_LAMB_BETA_1": 0.7, "OPT_LAMB_BETA_2": 0.999, "WARMUP_STEPS": 50,
              "LR_MAX_STEPS": 150, "WEIGHT_DECAY_RATE": 0.1}
    overrides = hpo.suggest(optuna.trial.FixedTrial(params), optimizer)
    env = {**trial.trial_env({"OPTIMIZER": optimizer, **overrides}), "DATADIR_PHASE2": str(tmp_path),
           "EVALDIR": str(tmp_path)}
    cfg = from_env_and_args([], {k: v for k, v in env.items() if k not in ("BERT_DATA", "DGXNGPU", "EXTRA_PARAMS")})
    o = cfg.optim
    assert (o.learning_rate, o.opt_lamb_beta_1, o.opt_lamb_beta_2) == (high, 0.7, 0.999)
    assert (o.warmup_steps, o.lr_max_steps, o.weight_decay_rate) == (50, 150, 0.1)
    assert o.end_learning_rate == pytest.approx(high * hpo.END_LR_RATIO, rel=1e-5)
    assert o.lr_max_steps <= o.max_steps  # the decay ends inside the schedule


def search_here(tmp_path, monkeypatch, *extra: str) -> None:
    """hpo.py's main in this process (no interpreter start, optuna already imported)."""
    monkeypatch.setattr(sys, "argv", ["hpo.py", "--objective", "fake", "--work", str(tmp_path / "work"), "--out",
                                      str(tmp_path / "out"), *extra])
    hpo.main()


def test_local_search_writes_the_best_trial_as_a_config_fragment(tmp_path, monkeypatch):
    search_here(tmp_path, monkeypatch, "--trials", "5", "--study", "t")
    table = json.loads((tmp_path / "out/hpo.json").read_text())
    complete = [t for t in table["trials"] if t["state"] == "COMPLETE"]
    assert len(complete) == 5 and all(t["worker"] == "local" for t in complete)
    best = min(complete, key=lambda t: t["samples"])
    assert table["best"]["samples"] == best["samples"]
    limit = int(trial.BASE["MAX_SAMPLES_TERMINATION"])
    for t in complete:  # the recorded score is the fake objective of the recorded settings
        assert (t["samples"], t["censored"]) == hpo.fake_samples(t["overrides"], limit)
    # Sourced, the fragment sets exactly the best trial's settings.
    shown = subprocess.run(["bash", "-c", f'source {tmp_path}/out/hpo_best.sh && echo "$LR $WARMUP_STEPS $OPTIMIZER"'],
                           capture_output=True, text=True, check=True).stdout.split()
    o = best["overrides"]
    assert shown == [o["LR"], o["WARMUP_STEPS"], o["OPTIMIZER"]]
    assert (tmp_path / "out/hpo.png").stat().st_size > 0
    search_here(tmp_path, monkeypatch, "--trials", "5", "--study", "t")  # the storage holds 5: nothing more runs
    assert len(json.loads((tmp_path / "out/hpo.json").read_text())["trials"]) == 5


def test_slurm_without_sbatch_is_a_one_line_error(tmp_path):
    bare = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": "/nonexistent"}
    done = run_hpo(tmp_path, "--slurm", env=bare)
    assert done.returncode != 0 and done.stderr.strip() == \
        "error: --slurm: sbatch is not on PATH (run without --slurm for local trials)"


@pytest.mark.slurm
@needs_slurm
def test_job_array_tasks_share_one_storage(tmp_path):
    done = run_hpo(tmp_path, "--slurm", "--tasks", "2", "--trials", "2", "--study", "array")
    assert done.returncode == 0, done.stdout + done.stderr
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/work/hpo.db")
    trials = optuna.load_study(study_name="array", storage=storage).get_trials()
    assert len(trials) >= 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    # Both array tasks ran trials into the one study, and drew different points (a seed of their own).
    assert {t.user_attrs["worker"] for t in trials} == {"0", "1"}
    assert len({t.params["LR"] for t in trials}) == len(trials)


def test_an_array_task_runs_its_share_of_the_trials(tmp_path, monkeypatch):
    """5 trials over 2 array tasks: the first task to start runs ceil(5 / 2) = 3, so that the two cover all 5."""
    import argparse

    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    storage = f"sqlite:///{tmp_path}/hpo.db"
    args = argparse.Namespace(worker=True, trials=5, tasks=2, study="share", storage=storage, optimizer="adam",
                              clip="bucket", seed=1, sampler_seed=0, objective="fake")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    hpo.run_worker(args, tmp_path)
    assert len(optuna.load_study(study_name="share", storage=storage).trials) == 3
