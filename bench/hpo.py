"""Hyperparameter search for samples to target: Optuna TPE over Samsung [000]'s search space (App. A, Table 4).

[000] compares ADAM and LAMB, and the clipping modes, each with its own hyperparameters found by NNI + SMAC.
Here Optuna's TPE sampler [Akiba-Optuna] searches the same dimensions: peak LR, β1, β2, warmup steps, the step
where the polynomial decay ends (LR_MAX_STEPS; END_LR is LR x 5e-4, [000]'s fine-stage end-LR ratio) and
weight decay. A trial is one real `./run_and_time.sh` run through `bench/trial.py`; the objective is the
samples it took to reach the target, a run that missed it counting at the sample limit (censored).

Trials run one after another as local processes by default. With `--slurm` the study is created in the
storage and `sbatch --wait` runs a job array whose tasks each run trials against that same storage until
`--trials` exist. Storage: SQLite through SQLAlchemy by default, with a 60 s busy timeout so that array tasks
that write at once wait for the file lock instead of failing with "database is locked" (writes are a few per
trial of minutes, so the wait is short); `journal:PATH` selects Optuna's append-only journal file instead,
for workers on several hosts over NFS, where SQLite's file locking cannot be trusted.

    .venv/bin/python bench/hpo.py --trials 10                    # ADAM, bucket-wise clipping, local
    .venv/bin/python bench/hpo.py --trials 12 --slurm --tasks 2  # the same as a 2-task Slurm job array
    .venv/bin/python bench/hpo.py --optimizer lamb --study lamb --trials 10

Writes results/bench/hpo.json (every trial), hpo.png (objective vs trial) and hpo_best.sh (the best trial's
settings as a config fragment to source after a config_*.sh).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trial import BASE, TrialError, run_trial  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results/bench"
END_LR_RATIO = 5e-4  # [000] Table 4: fixed in the fine stage (fANOVA importance 0.01)
# Peak LR ranges per optimizer: LAMB's trust ratio scales its step, ADAM's is the LR itself.
LR_RANGE = {"adam": (2e-4, 1e-2), "lamb": (2e-3, 5e-2)}


def suggest(trial: optuna.Trial, optimizer: str) -> dict[str, str]:
    """The searched settings as environment overrides ([000] Table 4's coarse ranges, scaled to our ~200 steps)."""
    lr = trial.suggest_float("LR", *LR_RANGE[optimizer], log=True)
    return {
        "LR": f"{lr:.6g}",
        "OPT_LAMB_BETA_1": f"{trial.suggest_float('OPT_LAMB_BETA_1', 0.7, 0.99):.4f}",
        "OPT_LAMB_BETA_2": f"{trial.suggest_float('OPT_LAMB_BETA_2', 0.85, 0.999):.4f}",
        "WARMUP_STEPS": str(trial.suggest_int("WARMUP_STEPS", 0, 50)),
        "LR_MAX_STEPS": str(trial.suggest_int("LR_MAX_STEPS", 150, 1000)),
        "END_LR": f"{lr * END_LR_RATIO:.6g}",
        "WEIGHT_DECAY_RATE": f"{trial.suggest_float('WEIGHT_DECAY_RATE', 1e-3, 1e-1, log=True):.5f}",
    }


def fake_samples(overrides: dict[str, str], limit: int) -> tuple[int, bool]:
    """A stand-in objective for tests: a bowl in log LR and β1 with its floor at 800 samples, censored at `limit`."""
    distance = (math.log10(float(overrides["LR"])) + 2.7) ** 2 + (float(overrides["OPT_LAMB_BETA_1"]) - 0.8) ** 2
    samples = 160 * round(5 + 60 * distance)
    return min(samples, limit), samples >= limit


def make_objective(args: argparse.Namespace, work: Path):
    def objective(trial: optuna.Trial) -> float:
        overrides = {"OPTIMIZER": args.optimizer, "GRAD_CLIP": args.clip, "SEED": str(args.seed), **suggest(
            trial, args.optimizer)}
        trial.set_user_attr("overrides", overrides)
        trial.set_user_attr("worker", os.environ.get("SLURM_ARRAY_TASK_ID", "local"))
        limit = int(BASE["MAX_SAMPLES_TERMINATION"])
        if args.objective == "fake":
            samples, censored = fake_samples(overrides, limit)
        else:
            result = run_trial(overrides, work / f"{args.study}-trial{trial.number}")
            samples, censored = result["samples"], result["censored"]
            trial.set_user_attr("evals", result["evals"])
            trial.set_user_attr("wall_s", result["wall_s"])
            trial.set_user_attr("status", result["status"])
        trial.set_user_attr("censored", censored)
        return float(samples)

    return objective


def open_storage(url: str) -> optuna.storages.BaseStorage:
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    if url.startswith("sqlite:"):
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    return optuna.storages.RDBStorage(url)


def open_study(args: argparse.Namespace) -> optuna.Study:
    # Few trials: TPE models the space after 4 random ones instead of its default 10. Each array task draws
    # from its own seed: with one seed the tasks would propose the same point at the same time.
    task = int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
    sampler = optuna.samplers.TPESampler(n_startup_trials=4, seed=args.sampler_seed + 1000 * task)
    return optuna.create_study(study_name=args.study, storage=open_storage(args.storage), sampler=sampler,
                               direction="minimize", load_if_exists=True)


def counted(study: optuna.Study) -> int:
    """Trials that count toward --trials: finished ones and those running now."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
    return len(study.get_trials(deepcopy=False, states=states))


def run_worker(args: argparse.Namespace, work: Path) -> None:
    """Run trials in this process until the study holds --trials (a local run, or one array task).

    An array task runs at most its share, ceil(trials / tasks), so that every task gets work; the count is
    checked after each trial, so tasks that finish together may add up to tasks-1 more."""
    study = open_study(args)
    cap = optuna.study.MaxTrialsCallback(args.trials, states=(optuna.trial.TrialState.COMPLETE,
                                                              optuna.trial.TrialState.RUNNING))
    if counted(study) < args.trials:
        share = math.ceil(args.trials / args.tasks) if args.worker else args.trials
        study.optimize(make_objective(args, work), n_trials=share, callbacks=[cap], catch=(TrialError,))


def worker_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--study", args.study, "--storage",
            args.storage, "--trials", str(args.trials), "--tasks", str(args.tasks), "--optimizer", args.optimizer,
            "--clip", args.clip, "--seed", str(args.seed), "--sampler-seed", str(args.sampler_seed), "--objective",
            args.objective, "--work", str(args.work)]


def run_slurm(args: argparse.Namespace) -> None:
    """The study's trials as a job array over the shared storage; returns when every task has ended."""
    open_study(args)  # created once here, so that the tasks do not race to create it
    script = args.work / f"{args.study}.sbatch"
    script.write_text("#!/bin/bash\n"
                      f"#SBATCH --array=0-{args.tasks - 1}\n"
                      f"#SBATCH --job-name=hpo-{args.study}\n"
                      f"#SBATCH --output={args.work}/{args.study}-%A_%a.out\n"
                      f"cd {shlex.quote(str(ROOT))}\n"
                      f"export PYTHONPATH={shlex.quote(str(ROOT))}\n"
                      f"exec {shlex.join(worker_command(args))}\n")
    done = subprocess.run(["sbatch", "--wait", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: job array {done.stdout.strip()} failed (exit {done.returncode}): "
                 f"{done.stderr.strip()[-300:]}; task logs in {args.work}")


def table(study: optuna.Study) -> list[dict]:
    return [{"number": t.number, "state": t.state.name, "samples": t.value, "censored": t.user_attrs.get("censored"),
             "params": t.params, "overrides": t.user_attrs.get("overrides"), "worker": t.user_attrs.get("worker"),
             "wall_s": t.user_attrs.get("wall_s"), "evals": t.user_attrs.get("evals")}
            for t in study.get_trials(deepcopy=False)]


def best_fragment(study: optuna.Study, args: argparse.Namespace) -> str:
    best = study.best_trial
    lines = [f"# bench/hpo.py study {args.study!r}: best of {len(study.trials)} trials (trial {best.number}, "
             f"{best.value:.0f} samples to MLM accuracy {BASE['TARGET_MLM_ACCURACY']}, tiny BERT, "
             f"{BASE['DGXNGPU']} ranks x {BASE['BATCHSIZE']}).",
             "# Source after a config_*.sh and bench/trial.py's BASE settings; found on the lab's setting, it is",
             "# not a recipe for another model or batch."]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in best.user_attrs["overrides"].items() if k != "SEED"]
    return "# shellcheck shell=bash\n" + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["state"] == "COMPLETE"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in done:
        ax.scatter(r["number"], r["samples"], marker="^" if r["censored"] else "o",
                   color="C3" if r["censored"] else "C0")
    best, running = [], math.inf
    for r in done:
        running = min(running, r["samples"])
        best.append(running)
    ax.step([r["number"] for r in done], best, where="post", color="k", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("samples to target (triangle: censored at the limit)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(args: argparse.Namespace) -> None:
    study = open_study(args)
    rows = table(study)
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    if not complete:
        sys.exit("error: no trial completed")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.prefix}.json").write_text(json.dumps({
        "what": "Optuna TPE search for samples to target (Samsung [000] App. A search space)",
        "study": args.study, "optimizer": args.optimizer, "clip": args.clip, "seed": args.seed,
        "objective": args.objective, "settings": BASE, "end_lr_ratio": END_LR_RATIO,
        "machine": "2-core shared CPU VM, gloo", "loadavg_at_write": [round(x, 2) for x in os.getloadavg()],
        "best": {"number": study.best_trial.number, "samples": study.best_value, "params": study.best_params},
        "trials": rows}, indent=1) + "\n")
    (out / f"{args.prefix}_best.sh").write_text(best_fragment(study, args))
    plot(rows, out / f"{args.prefix}.png", f"{args.optimizer.upper()} + {args.clip} clipping: TPE, "
         f"{len(complete)} trials")
    print(f"{'trial':>5s} {'samples':>7s} censored  params")
    for r in complete:
        params = " ".join(f"{k}={v:.4g}" for k, v in r["params"].items())
        print(f"{r['number']:5d} {r['samples']:7.0f} {str(r['censored']):8s}  {params}")
    print(f"best: trial {study.best_trial.number}, {study.best_value:.0f} samples; wrote {out}/{args.prefix}"
          ".json, .png, _best.sh")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="trials the study should hold in all")
    parser.add_argument("--optimizer", default="adam", choices=sorted(LR_RANGE))
    parser.add_argument("--clip", default="bucket", choices=("after", "before", "bucket"))
    parser.add_argument("--seed", type=int, default=1, help="training seed, the same for every trial")
    parser.add_argument("--sampler-seed", type=int, default=0)
    parser.add_argument("--study", default="adam-bucket")
    parser.add_argument("--work", type=Path, default=ROOT / "work/hpo", help="trial directories, storage, logs")
    parser.add_argument("--storage", help="sqlite:///PATH (default: WORK/hpo.db), another SQLAlchemy URL, "
                        "or journal:PATH")
    parser.add_argument("--slurm", action="store_true", help="run the trials as a Slurm job array")
    parser.add_argument("--tasks", type=int, default=2, help="array tasks with --slurm")
    parser.add_argument("--objective", default="train", choices=("train", "fake"),
                        help="fake: an analytic stand-in, for testing the search machinery")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--prefix", default="hpo", help="output file names: PREFIX.json, .png, _best.sh")
    parser.add_argument("--report-only", action="store_true", help="write the outputs from the storage, run nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trials < 1 or args.tasks < 1:
        sys.exit("error: --trials and --tasks must be at least 1")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.storage = args.storage or f"sqlite:///{args.work / 'hpo.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.worker:
        run_worker(args, args.work)
        return
    if args.report_only:
        pass
    elif args.slurm:
        if not shutil.which("sbatch"):
            sys.exit("error: --slurm: sbatch is not on PATH (run without --slurm for local trials)")
        run_slurm(args)
    else:
        run_worker(args, args.work)
    report(args)


if __name__ == "__main__":
    main()
