"""logging/verify_result.py against crafted result logs, with the official compliance checker as the referee.

`write_log` is our own generator of BERT result logs laid out like NVIDIA's result logs
([MLPerf-results]), with evals on the rules' cadence. The clean log must
pass the official checker (so the fixture is realistic) and our verifier; each violation must fail our
verifier with a message naming the rule, most of them while the official checker still passes.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
T0 = 1_700_000_000_000

HYPERPARAMETERS = {
    "opt_base_learning_rate": 0.000425, "opt_lamb_epsilon": 1e-6, "opt_learning_rate_training_steps": 6700,
    "opt_learning_rate_warmup_steps": 0, "num_warmup_steps": 0, "start_warmup_step": 0, "opt_lamb_beta_1": 0.9,
    "opt_lamb_beta_2": 0.999, "opt_lamb_weight_decay_rate": 0.01,
}


def rules_interval(gbs: int) -> int:
    return math.floor(0.05 * (230.23 * gbs + 3_000_000) / 25_000) * 25_000


def write_log(path: Path, accuracies=(0.45, 0.62, 0.705, 0.7205), *, gbs: int = 448, status: str | None = "success",
              division: str = "closed", init_minutes: float = 1.0, epoch_nums: list | None = None,
              train_samples: int | None = None, eval_samples: int = 10000, run_starts: int = 1,
              seed: int = 1234, step_s: float = 60.0) -> Path:
    interval = rules_interval(gbs)
    epoch_nums = epoch_nums or [math.ceil(interval * (k + 1) / gbs) * gbs for k in range(len(accuracies))]
    clock = [T0]
    lines: list[str] = []

    def log(key, value=None, after_s: float = 0.001, **metadata):
        clock[0] += int(after_s * 1000)
        record = {"namespace": "", "time_ms": clock[0], "event_type": "POINT_IN_TIME", "key": key, "value": value,
                  "metadata": {"file": "gen.py", "lineno": len(lines) + 1, **metadata}}
        lines.append(f":::MLLOG {json.dumps(record)}")

    log("cache_clear", True)
    log("init_start")
    for key, value in [("submission_benchmark", "bert"), ("submission_org", "TestOrg"),
                       ("submission_division", division), ("submission_status", "onprem"),
                       ("submission_platform", "1xTest"), ("seed", seed), ("global_batch_size", gbs),
                       ("gradient_accumulation_steps", 1), *HYPERPARAMETERS.items()]:
        log(key, value)
    log("init_stop", after_s=init_minutes * 60)
    for _ in range(run_starts):
        log("run_start")
    log("block_start", first_epoch_num=1, epoch_count=1)
    for n, acc in zip(epoch_nums, accuracies):
        log("eval_accuracy", acc, after_s=step_s, epoch_num=n)
    log("block_stop", first_epoch_num=1)
    log("train_samples", epoch_nums[len(accuracies) - 1] if train_samples is None else train_samples)
    log("eval_samples", eval_samples)
    log("run_stop", **({} if status is None else {"status": status}))
    path.write_text("\n".join(lines) + "\n")
    return path


def official_check(log: Path, tmp: Path) -> bool:
    out = subprocess.run([PY, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "5.0.0",
                          "--log_output", str(tmp / "cc.log"), str(log)], capture_output=True, text=True, cwd=tmp)
    return out.returncode == 0


def verify(*args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "logging" / "verify_result.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_clean_log_passes_official_checker_and_verifier(tmp_path):
    log = write_log(tmp_path / "result_0.txt")
    assert official_check(log, tmp_path)
    out = verify(log)
    assert out.returncode == 0, out.stdout
    assert out.stdout.startswith("PASS")


def test_rank_prefixes_and_other_lines_are_read_past(tmp_path):
    """`srun -l` puts "0: " before every line of a tee'd log, and a job log holds lines that are not MLLOG records;
    as the official parser does, the verifier reads the records after the token."""
    log = write_log(tmp_path / "result_0.txt")
    prefixed = tmp_path / "srun.log"
    prefixed.write_text("run.sub: page cache not dropped\n" + "".join(f"0: {line}" for line in
                                                                        log.read_text().splitlines(keepends=True)))
    out = verify(prefixed)
    assert out.returncode == 0 and out.stdout.startswith("PASS"), out.stdout


def test_open_division_allows_a_long_init(tmp_path):
    assert verify(write_log(tmp_path / "r.txt", division="open", init_minutes=100)).returncode == 0


# (variant kwargs, words the verifier must print, does the official 5.0.0 checker catch it too?)
VIOLATIONS = {
    "last_eval_below_target_but_success": (dict(accuracies=(0.5, 0.73, 0.71)), "convergence", False),
    "target_reached_but_aborted": (dict(status="aborted"), "convergence", False),
    "epoch_index_not_samples": (dict(accuracies=(0.6, 0.73), epoch_nums=[1, 2]), "not a whole number", False),
    "float_epoch_num": (dict(accuracies=(0.73,), epoch_nums=[150080.0]), "integer sample count", False),
    "train_samples_mismatch": (dict(train_samples=999_936), "train_samples", False),
    "wrong_eval_set_size": (dict(eval_samples=5000), "eval_samples", False),
    "skipped_eval": (dict(accuracies=(0.6, 0.73), epoch_nums=[150080, 450240]), "eval cadence", False),
    "two_run_starts": (dict(run_starts=2), "run_start: expected exactly one", False),  # a same-value repeat: WARNING
    "no_run_stop_status": (dict(status=None), "status", True),
    "init_over_30_min": (dict(init_minutes=35), "init: took 35.0 min", True),
}


@pytest.mark.parametrize("name", VIOLATIONS)
def test_verifier_catches(name, tmp_path):
    kwargs, message, official_catches = VIOLATIONS[name]
    log = write_log(tmp_path / "result_0.txt", **kwargs)
    assert official_check(log, tmp_path) is not official_catches
    out = verify(log)
    assert out.returncode == 1
    assert message in out.stdout, out.stdout


def test_cadence_from_the_command_line(tmp_path):
    gbs, every = 32, 1000
    nums = [math.ceil((500 + k * every) / gbs) * gbs for k in range(3)]
    log = write_log(tmp_path / "r.txt", accuracies=(0.3, 0.5, 0.73), gbs=gbs, epoch_nums=nums)
    assert verify(log, "--eval-start", 500, "--eval-every", every).returncode == 0
    assert "eval cadence" in verify(log, "--eval-start", 500, "--eval-every", 2 * every).stdout


def test_unreadable_line_names_file_and_line(tmp_path):
    log = write_log(tmp_path / "r.txt")
    log.write_text(log.read_text() + ':::MLLOG {"key": "broken"\n')
    out = verify(log)
    assert out.returncode == 1 and f"{log}:" in out.stdout


def olympic_mean_minutes(logs: list[Path]) -> float:
    """Time to train by the rules: (run_stop - run_start) per run, drop the fastest and slowest, average."""
    minutes = []
    for log in logs:
        times = {r["key"]: r["time_ms"] for r in (json.loads(line.split(":::MLLOG ", 1)[1])
                                                  for line in log.read_text().splitlines())}
        minutes.append((times["run_stop"] - times["run_start"]) / 60_000)
    return sum(sorted(minutes)[1:-1]) / (len(minutes) - 2)


def ten_logs(tmp: Path, evals: int) -> list[Path]:
    """Ten closed runs at GBS 448 converging at the evals-th eval, with different seeds and speeds."""
    accuracies = [0.4 + 0.3 * k / (evals - 1) for k in range(evals - 1)] + [0.7207]
    return [write_log(tmp / f"run{k}.txt", accuracies, seed=7 + k, step_s=30 + 3 * k) for k in range(10)]


def make_submission(logs: list[Path], out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "logging" / "make_submission.py"), *map(str, logs), "--org", "TestOrg",
                           "--system", "test_box", "--out", str(out), *flags], capture_output=True, text=True)


def score(stdout: str) -> float:
    return float(re.search(r"score \(result_summarizer 5\.0\.0\): bert ([\d.]+) minutes", stdout).group(1))


def test_submission_at_the_reference_convergence_point(tmp_path):
    logs = ten_logs(tmp_path, evals=17)  # 17 evals of 150080 samples: 2.55M, above the GBS-448 RCP mean 2.41M
    out = make_submission(logs, tmp_path / "sub")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "package_checker 5.0.0: PASS\n" in out.stdout and "rcp_checker 5.0.0: PASS" in out.stdout
    assert score(out.stdout) == pytest.approx(olympic_mean_minutes(logs), rel=1e-9)
    org = tmp_path / "sub" / "TestOrg"
    system = json.loads((org / "systems" / "test_box.json").read_text())
    assert system["division"] == "closed" and system["submitter"] == "TestOrg"
    import torch

    assert system["framework"] == f"PyTorch {torch.__version__}"  # the driver's torch, which the script does not import
    results = org / "results" / "test_box" / "bert"  # the rules' names, result_0 .. result_9, in the order given
    assert sorted(p.name for p in results.iterdir()) == sorted(f"result_{k}.txt" for k in range(10))
    assert all((results / f"result_{k}.txt").read_text() == log.read_text() for k, log in enumerate(logs))
    assert not list(org.rglob("scaling.json"))  # the checkers ran on a copy
    assert "host_processor_model_name" in out.stderr and "describe this machine" in out.stderr


def test_host_fields_given_in_the_system_json_replace_this_machines(tmp_path):
    """The processor, memory and software fields are this machine's unless --system-json gives them (the script
    may run on a login node, not the system that ran the logs); the note names the ones still taken from here."""
    logs = ten_logs(tmp_path, evals=17)
    given = {"host_processor_model_name": "AMD EPYC 7742", "host_processor_core_count": "64",
             "host_processors_per_node": "2", "framework": "PyTorch NGC 25.12"}
    (tmp_path / "system.json").write_text(json.dumps(given))
    out = make_submission(logs, tmp_path / "sub", "--system-json", tmp_path / "system.json")
    assert out.returncode == 0, out.stdout + out.stderr
    system = json.loads((tmp_path / "sub" / "TestOrg" / "systems" / "test_box.json").read_text())
    assert {k: system[k] for k in given} == given
    note = next(line for line in out.stderr.splitlines() if "describe this machine" in line)
    assert "host_memory_capacity" in note and not any(k in note for k in given)


def test_submission_converging_too_fast_needs_the_labelled_bypass(tmp_path):
    logs = ten_logs(tmp_path, evals=3)  # 450k samples: far below any reference convergence point
    strict = make_submission(logs, tmp_path / "strict")
    assert strict.returncode == 1
    assert "package_checker 5.0.0: FAIL: RCP Test Failed: RCP found" in strict.stdout
    assert "rcp_checker 5.0.0: FAIL: RCP found, RCP test FAILED" in strict.stdout
    assert "INFO -" not in strict.stdout  # the reasons, not the checkers' whole logs
    bypassed = make_submission(logs, tmp_path / "bypassed", "--rcp-bypass")
    assert bypassed.returncode == 0, bypassed.stdout
    assert "package_checker 5.0.0: PASS (RCP check bypassed: --rcp-bypass)" in bypassed.stdout
    assert "rcp_checker 5.0.0: FAIL -- BYPASSED with --rcp-bypass" in bypassed.stdout
    assert score(bypassed.stdout) == pytest.approx(olympic_mean_minutes(logs), rel=1e-9)


def test_submission_fails_on_a_failed_rcp_check_unless_bypassed(tmp_path):
    # Open division: the package checker skips the RCP check, so only rcp_checker's own verdict catches it.
    logs = [write_log(tmp_path / f"run{k}.txt", (0.4, 0.55, 0.7207), division="open", seed=7 + k, step_s=30 + k)
            for k in range(10)]
    strict = make_submission(logs, tmp_path / "strict")
    assert "package_checker 5.0.0: PASS\n" in strict.stdout
    assert strict.returncode == 1, strict.stdout
    assert "rcp_checker 5.0.0: FAIL: RCP found, RCP test FAILED" in strict.stdout  # the checker's reason
    assert "make_submission: rcp_checker failed" in strict.stderr
    bypassed = make_submission(logs, tmp_path / "bypassed", "--rcp-bypass")
    assert bypassed.returncode == 0, bypassed.stdout + bypassed.stderr
    assert "rcp_checker 5.0.0: FAIL -- BYPASSED with --rcp-bypass" in bypassed.stdout
    assert "RCP test FAILED" in bypassed.stdout


def test_submission_refuses_an_existing_folder(tmp_path):
    logs = ten_logs(tmp_path, evals=3)
    (tmp_path / "sub" / "TestOrg").mkdir(parents=True)
    out = make_submission(logs, tmp_path / "sub")
    assert out.returncode != 0 and "exists" in out.stderr


@pytest.mark.parametrize("division", ["mixed", "missing"])
def test_submission_refuses_logs_without_one_division(division, tmp_path):
    """The system description takes its division from the logs: they must all name the same one."""
    logs = ten_logs(tmp_path, evals=3)
    if division == "mixed":
        logs[3].write_text(logs[3].read_text().replace('"value": "closed"', '"value": "open"'))
    else:
        for log in logs:
            log.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                                   if '"submission_division"' not in line))
    out = make_submission(logs, tmp_path / "sub")
    assert out.returncode != 0 and "the logs disagree on or lack submission_division" in out.stderr, out.stderr
    assert not (tmp_path / "sub").exists()


def test_plot_shows_the_logged_evals_and_the_metrics(tmp_path):
    sys.path.insert(0, str(ROOT / "logging"))
    import plot_run

    log = write_log(tmp_path / "r.txt", accuracies=(0.3, 0.6, 0.73))
    metrics = tmp_path / "metrics.jsonl"
    steps = range(0, 1006, 4)
    metrics.write_text("".join(json.dumps({"samples": 448 * s, "loss": 9.0 - s / 100}) + "\n" for s in steps))
    fig = plot_run.plot(log, metrics, "samples", "loss", 0.72)
    evals, target = fig.axes[0].lines
    assert list(evals.get_xdata()) == [150080, 300160, 450240] and list(evals.get_ydata()) == [0.3, 0.6, 0.73]
    assert list(target.get_ydata()) == [0.72, 0.72] and "success" in fig.axes[0].get_title()
    assert fig.axes[1].lines[0].get_xdata()[-1] == 448 * 1004
    out = subprocess.run([PY, str(ROOT / "logging" / "plot_run.py"), str(log), "--metrics", str(metrics),
                          "--out", str(tmp_path / "run.png")], capture_output=True, text=True)
    assert out.returncode == 0 and (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wrong_key = subprocess.run([PY, str(ROOT / "logging" / "plot_run.py"), str(log), "--metrics", str(metrics),
                                "--x-key", "step", "--out", str(tmp_path / "x.png")], capture_output=True, text=True)
    assert wrong_key.returncode != 0 and "'step'" in wrong_key.stderr


@pytest.mark.parametrize("fault", ["resumed", "status"])
def test_submission_refuses_a_log_that_is_not_a_result(fault, tmp_path):
    """The official checkers pass a continuation of a pre-empted run (its log times only the continuation) and a
    run whose status disagrees with its accuracy; verify_result.py does not, and make_submission asks it first."""
    logs = ten_logs(tmp_path, evals=17)
    if fault == "resumed":  # as bert.train.mlperf_log writes it, after init_start
        lines = logs[3].read_text().splitlines(keepends=True)
        record = {"namespace": "", "time_ms": T0 + 5, "event_type": "POINT_IN_TIME", "key": "resumed_from_checkpoint",
                  "value": 120, "metadata": {"file": "gen.py", "lineno": 3, "samples": 53760}}
        lines.insert(2, f":::MLLOG {json.dumps(record)}\n")
        logs[3].write_text("".join(lines))
        why = "not a result: resumed from a checkpoint at step 120"
    else:
        logs[3] = write_log(logs[3], [0.4 + 0.3 * k / 15 for k in range(16)] + [0.7207], status="aborted")
        why = "status is 'aborted'"
    out = make_submission(logs, tmp_path / "sub")
    assert out.returncode != 0, out.stdout + out.stderr
    assert f"make_submission: {logs[3]}: " in out.stderr and why in out.stderr, out.stderr
    assert "no submission folder made" in out.stderr and not (tmp_path / "sub").exists()
