"""No run loses or corrupts an existing result log, and a resumed run's log says what it is.

References: the bytes of the existing file; the official compliance checker (mlperf-logging, ruleset 5.0.0)
and logging/verify_result.py on the original and the continuation logs; the training rules ("a run result
[is] a wall-clock timing measurement for a contiguous period"), hence no resumed closed-division run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert.config import ConfigError, from_env_and_args
from bert.train.mlperf_log import RESUMED, ResultLogExists, claim_log_file

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# A finished successful run (abridged): what must survive byte for byte.
SUCCESSFUL = "".join(
    f':::MLLOG {{"namespace": "", "time_ms": {1700000000000 + k}, "event_type": "{kind}", "key": "{key}", '
    f'"value": {value}, "metadata": {meta}}}\n'
    for k, (kind, key, value, meta) in enumerate([
        ("INTERVAL_START", "init_start", "null", "{}"), ("INTERVAL_END", "init_stop", "null", "{}"),
        ("INTERVAL_START", "run_start", "null", "{}"),
        ("POINT_IN_TIME", "eval_accuracy", "0.73", '{"epoch_num": 640}'),
        ("INTERVAL_END", "run_stop", "null", '{"status": "success"}')]))


def driver(data: Path, out: Path, **kw) -> subprocess.CompletedProcess:
    args = dict(input_dir=data / "train_varlength", eval_dir=data / "eval_varlength", bert_config_path="tiny",
                output_dir=out, train_batch_size=16, learning_rate=0.02, max_steps=400, log_freq=5,
                eval_iter_start_samples=320, eval_iter_samples=320, num_eval_examples=256, eval_batch_size=128,
                target_mlm_accuracy=0.72, attention="padded", skip_checkpoint=1, seed=5, division="open")
    args.update(kw)
    cmd = [PY, str(ROOT / "run_pretraining.py"), *[x for k, v in args.items() for x in (f"--{k}", str(v))]]
    env = {k: v for k, v in os.environ.items() if k not in ("MLPERF_LOG", "RESUME", "MLPERF_DIVISION")}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})


def checker(log: Path, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "5.0.0",
                           "--log_output", str(tmp / "cc.log"), str(log)], capture_output=True, text=True, cwd=tmp)


def verifier(log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "logging" / "verify_result.py"), str(log), "--target", "0.72",
                           "--eval-samples", "256", "--eval-start", "320", "--eval-every", "320"],
                          capture_output=True, text=True)


def events(log: Path) -> list[dict]:
    return [json.loads(x.split(":::MLLOG ", 1)[1]) for x in log.read_text().splitlines() if ":::MLLOG" in x]


def test_claim_log_file(tmp_path):
    fresh, empty, full = tmp_path / "fresh.txt", tmp_path / "empty.txt", tmp_path / "full.txt"
    empty.touch()  # run.sub claims result_<i>.txt by creating it empty
    full.write_text(SUCCESSFUL)
    assert claim_log_file("", resume=False) == ""
    assert claim_log_file(str(fresh), resume=False) == str(fresh)
    assert claim_log_file(str(empty), resume=False) == str(empty)
    with pytest.raises(ResultLogExists, match=f"{full} already holds a log"):
        claim_log_file(str(full), resume=False)
    # A resumed run never writes into the log it continues: the next free <log>.resumed-<n>, created empty.
    assert claim_log_file(str(full), resume=True) == f"{full}.resumed-1"
    assert claim_log_file(str(full), resume=True) == f"{full}.resumed-2"
    assert (tmp_path / "full.txt.resumed-2").read_text() == "" and full.read_text() == SUCCESSFUL


def test_existing_log_survives_a_run_that_fails_at_start(synthetic_data, tmp_path):
    log = tmp_path / "result_0.txt"
    log.write_text(SUCCESSFUL)
    out = driver(synthetic_data, tmp_path / "out", eval_dir=tmp_path / "no_such_dir", mlperf_log=log)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: --mlperf_log / $MLPERF_LOG: {log} already holds a log; refusing to overwrite it "
        "(give a new file; RESUME=1 logs a continuation to a file of its own)"]
    assert log.read_text() == SUCCESSFUL


def test_closed_division_cannot_resume():
    env = {"RESUME": "1", "MLPERF_DIVISION": "closed", "DATADIR_PHASE2": "d", "EVALDIR": "e", "BATCHSIZE": "8",
           "LR": "1", "MAX_STEPS": "10", "BERT_CONFIG": "tiny"}
    message = "--resume / $RESUME = True is not allowed in the closed division"
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_env_and_args([], environ=env)
    out = subprocess.run([PY, "-m", "bert.train.config", "--check-env"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **env})  # what run_and_time.sh runs before anything starts
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    from_env_and_args([], environ={**env, "MLPERF_DIVISION": "open"})  # an open-division continuation is fine


def test_verifier_refuses_a_labelled_continuation(tmp_path):
    log = tmp_path / "result_0.txt.resumed-1"
    log.write_text(SUCCESSFUL + ':::MLLOG {"namespace": "", "time_ms": 1700000000009, "event_type": "POINT_IN_TIME", '
                   f'"key": "{RESUMED}", "value": 25, "metadata": {{"samples": 400}}}}\n')
    verified = verifier(log)
    assert verified.returncode == 1 and verified.stdout.strip().splitlines() == [
        f"FAIL {log}: not a result: resumed from a checkpoint at step 25 (400 samples); "
        "a run result is one contiguous timed run"]


@pytest.mark.slow
def test_resumed_run_logs_a_labelled_continuation(synthetic_data, tmp_path):
    log, out = tmp_path / "result_0.txt", tmp_path / "out"
    first = driver(synthetic_data, out, mlperf_log=log, steps_this_job=25)  # pre-empted after the first eval
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    original = log.read_bytes()
    second = driver(synthetic_data, out, mlperf_log=log, resume=1)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    continuation = tmp_path / "result_0.txt.resumed-1"
    assert f"{continuation}" in second.stdout + second.stderr

    # The original log is untouched by the resume, and reads as what it is: no result (no run_stop).
    assert log.read_bytes() == original
    assert "run_stop" not in [e["key"] for e in events(log)]
    assert checker(log, tmp_path).returncode != 0
    verified = verifier(log)
    assert verified.returncode == 1 and "run_stop: expected exactly one, found 0" in verified.stdout

    # The continuation: a complete open-division log that the official checker accepts, labelled as resumed
    # from step 25, which our verifier refuses as a result and says why.
    logged = events(continuation)
    keys = [e["key"] for e in logged]
    assert keys.count("run_start") == keys.count("init_stop") == keys.count("submission_division") == 1
    assert next(e for e in logged if e["key"] == "submission_division")["value"] == "open"
    resumed = next(e for e in logged if e["key"] == RESUMED)
    assert resumed["value"] == 25 and resumed["metadata"]["samples"] == 25 * 16
    assert logged[-1]["key"] == "run_stop" and logged[-1]["metadata"]["status"] == "success"
    assert [e["metadata"]["epoch_num"] for e in logged if e["key"] == "eval_accuracy"][0] == 640  # continues
    cc = checker(continuation, tmp_path)
    assert cc.returncode == 0, cc.stdout[-3000:] + cc.stderr[-3000:]
    verified = verifier(continuation)
    assert verified.returncode == 1
    assert verified.stdout.strip().splitlines() == [
        f"FAIL {continuation}: not a result: resumed from a checkpoint at step 25 (400 samples); "
        "a run result is one contiguous timed run"]
