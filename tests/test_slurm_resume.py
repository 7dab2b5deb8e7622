"""`scancel` then `RESUME_FROM=<i> sbatch run.sub` on the real local Slurm: the experiment finishes from its checkpoint.

config_CPU_1x2.sh (open division), a checkpoint every 5 steps so that one exists before the cancel. The
continuation is logged to result_0.txt.resumed-1 (the official checker accepts it as an open-division log; it
is labelled as resumed); result_0.txt and every other earlier file are left byte for byte as they were.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_idle import needs_slurm
from test_harness import NEEDS_DRIVER, ROOT, SHORT_RUN, config_env, data_env

PY = sys.executable


def sbatch(env: dict[str, str], out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", *flags, "-o", str(out), "-N1", f"--ntasks-per-node={env['DGXNGPU']}",
                           "--time=15", "run.sub"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


def wait_for(condition, what: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.5)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file()}


def events(log: Path) -> list[dict]:
    return [json.loads(x.split(":::MLLOG ", 1)[1]) for x in log.read_text().splitlines() if ":::MLLOG" in x]


@pytest.mark.slurm
@pytest.mark.slow
@needs_slurm
@NEEDS_DRIVER
def test_cancel_then_resume_from_finishes_the_experiment(tmp_path, synthetic_data):
    # The first eval at 1280 samples (40 steps of 2 x 16): the cancel comes well before it, the target (0.25)
    # is then reached there by the continuation.
    env = config_env("config_CPU_1x2.sh", **{**SHORT_RUN, "TARGET_MLM_ACCURACY": "0.25",
                                             "EVAL_ITER_START_SAMPLES": "1280", "CHECKPOINT_EVERY": "5"},
                     **data_env(synthetic_data), NEXP="1", LOGDIR=str(tmp_path / "results"))
    results, output = tmp_path / "results" / "CPU_1x2" / "bert", tmp_path / "results" / "CPU_1x2" / "output" / "0"
    first = sbatch(env, tmp_path / "job1.out", "--parsable")
    assert first.returncode == 0, first.stderr
    job = first.stdout.strip().split(";")[0]
    latest = output / "checkpoints" / "latest"
    wait_for(latest.is_file, "checkpoint")
    subprocess.run(["scancel", job], check=True)
    wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
             "end of the cancelled job", 120)
    step = int(latest.read_text().strip().removeprefix("step_"))
    assert 5 <= step < 40  # cancelled before the first eval: the run is not over
    before = digests(results)
    original = events(results / "result_0.txt")
    assert "run_stop" not in [e["key"] for e in original]

    second = sbatch({**env, "RESUME_FROM": "0"}, tmp_path / "job2.out", "--wait")
    job_output = (tmp_path / "job2.out").read_text()
    assert second.returncode == 0, second.stderr + job_output[-4000:]
    assert "result_0.txt.resumed-1 continues result_0.txt from a checkpoint: not a result" in job_output

    after = digests(results)
    assert {k: after[k] for k in before} == before  # nothing earlier changed, result_0.txt included
    new = sorted(set(after) - set(before))
    job2 = second.stdout.split()[-1]  # "Submitted batch job <id>"
    assert new == sorted([f"{job2}_0.resumed-1.log", "compliance_0.resumed-1.log", "result_0.txt.resumed-1"]), new
    continuation = results / "result_0.txt.resumed-1"
    logged = events(continuation)
    seed = next(e["value"] for e in logged if e["key"] == "seed")
    assert seed == next(e["value"] for e in original if e["key"] == "seed")  # the same experiment
    resumed = next(e for e in logged if e["key"] == "resumed_from_checkpoint")
    assert resumed["value"] == step and resumed["metadata"]["samples"] == step * 32  # from the checkpoint
    assert [e["metadata"]["epoch_num"] for e in logged if e["key"] == "eval_accuracy"] == [1280]
    assert logged[-1]["key"] == "run_stop" and logged[-1]["metadata"]["status"] == "success"
    cc = subprocess.run([PY, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "5.0.0",
                         "--log_output", str(tmp_path / "cc.log"), str(continuation)], capture_output=True, text=True,
                        cwd=tmp_path)
    assert cc.returncode == 0, cc.stdout[-3000:] + cc.stderr[-3000:]


@pytest.mark.slurm
@pytest.mark.slow
@needs_slurm
@NEEDS_DRIVER
def test_a_preempted_run_ends_the_job_instead_of_starting_the_next(tmp_path, synthetic_data):
    """SIGTERM to the job's steps (Slurm's --signal, a pre-emption): the run checkpoints, run_and_time.sh exits 3,
    and run.sub starts none of the remaining NEXP - 1 runs (they would only be cut by the time limit) and names
    the RESUME_FROM that continues it. Its log stays open for that."""
    env = config_env("config_CPU_1x2.sh", **{**SHORT_RUN, "CHECKPOINT_EVERY": "5"}, **data_env(synthetic_data),
                     NEXP="2", LOGDIR=str(tmp_path / "results"))
    results, output = tmp_path / "results" / "CPU_1x2" / "bert", tmp_path / "results" / "CPU_1x2" / "output" / "0"
    submitted = sbatch(env, tmp_path / "job.out", "--parsable")
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    wait_for((output / "checkpoints" / "latest").is_file, "checkpoint")
    subprocess.run(["scancel", "--signal=TERM", job], check=True)  # the steps, not the batch script
    wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
             "end of the job", 180)
    job_output = (tmp_path / "job.out").read_text()
    assert "run.sub: run 0 pre-empted after a checkpoint: result_0.txt is not a result; continue it with " \
           "RESUME_FROM=0" in job_output, job_output[-4000:]
    assert "result_1" not in job_output and not (results / "result_1.txt").exists()
    assert "PREEMPTED,bert," in job_output and "RESULT,bert," not in job_output
    assert "run_stop" not in [e["key"] for e in events(results / "result_0.txt")]  # open, to be continued


@pytest.mark.parametrize("overrides, message", [
    ({"RESUME_FROM": "x"}, "$RESUME_FROM='x' must be an experiment index"),
    ({"RESUME_FROM": "0", "NEXP": "2"}, "RESUME_FROM continues one experiment: NEXP must be 1"),
    ({"RESUME_FROM": "0", "MLPERF_DIVISION": "closed"}, "RESUME_FROM: a closed-division run cannot be resumed"),
    ({"RESUME_FROM": "7"}, "RESUME_FROM=7: no "),
], ids=["not-an-index", "nexp", "closed", "no-checkpoint"])
def test_resume_from_preconditions(overrides, message, tmp_path):
    # run.sub checks these before any step starts: no Slurm needed, so it runs as a plain script.
    env = config_env("config_CPU_1x2.sh", **{"NEXP": "1", "LOGDIR": str(tmp_path / "results"), **overrides})
    out = subprocess.run(["bash", str(ROOT / "run.sub")], env=env, cwd=ROOT, capture_output=True, text=True)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"run.sub: {message}"), out.stderr
    assert not list((tmp_path / "results").rglob("result_*"))
