"""run_and_time.sh when things go wrong: killed ranks, SIGTERM, corrupt data, failing workers.

References: real processes (bash, the launcher, the driver) observed from outside through /proc and their exit
status; the official compliance checker (ruleset 5.0.0) and logging/verify_result.py for the result logs.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# A tiny 2-process run on the synthetic data that would go on for minutes: the tests end it.
RUN = {"BERT_CONFIG": "tiny", "INIT_CHECKPOINT": "", "BATCHSIZE": "16", "LR": "0.001", "WARMUP_STEPS": "0",
       "MAX_STEPS": "100000",
       "EVAL_ITER_START_SAMPLES": "1000000000", "NUM_EVAL_EXAMPLES": "64", "EVAL_BATCHSIZE": "64",
       "ATTENTION": "padded", "LOG_FREQ": "1", "SKIP_CHECKPOINT": "1", "EXTRA_PARAMS": "", "OMP_NUM_THREADS": "1",
       "DIST_TIMEOUT": "20"}
# logs, progress, the resolved configuration (one line)
NOISE = re.compile(r"^(:::MLLOG |STARTING TIMING RUN|ENDING TIMING RUN|RESULT,bert,|PREEMPTED,bert,|step=\d+ "
                   r"|resolved configuration )")


@pytest.fixture
def marker():
    """A unique value put in the run's environment to find its processes; what a failed test leaves is killed."""
    value = uuid.uuid4().hex
    yield value
    for pid in marked(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_env(data: Path, out: Path, marker: str, **overrides: str) -> dict[str, str]:
    """os.environ after `source config_CPU_1x2.sh`, the short run, a unique marker to find its processes by."""
    env = subprocess.run(["bash", "-c", f'source "{ROOT / "config_CPU_1x2.sh"}" && env -0'], capture_output=True,
                         text=True, check=True).stdout
    env = dict(item.split("=", 1) for item in env.split("\0") if "=" in item)
    env.pop("DEBUG", None)
    return {**env, **RUN, "DATADIR_PHASE2": str(data / "train_varlength"), "EVALDIR": str(data / "eval_varlength"),
            "OUTPUT_DIR": str(out), "MLPERF_LOG": str(out / "result_0.txt"), "SEED": "7",
            "PATH": f"{Path(PY).parent}:{os.environ['PATH']}", "FAULTS_TEST_MARKER": marker, **overrides}


def start(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([str(ROOT / "run_and_time.sh")], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def marked(marker: str) -> dict[int, dict[str, str]]:
    """Live processes whose environment holds the marker: pid -> environment."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            raw = environ.read_bytes()
        except OSError:
            continue
        if f"FAULTS_TEST_MARKER={marker}".encode() in raw:
            found[int(environ.parent.name)] = dict(
                x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)
    return found


def worker(marker: str, rank: int) -> int:
    """The pid of the training process of `rank` (torchrun set RANK in its environment)."""
    pids = [pid for pid, env in marked(marker).items() if env.get("RANK") == str(rank)]
    assert len(pids) == 1, pids
    return pids[0]


def wait_until(what, proc: subprocess.Popen, limit_s: float = 150) -> None:
    deadline = time.monotonic() + limit_s
    while not what():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"not reached (exit {proc.poll()}): {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)


def steps_done(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def events(log: Path) -> list[dict]:
    return [json.loads(x.split(":::MLLOG ", 1)[1]) for x in log.read_text().splitlines() if ":::MLLOG " in x]


def user_lines(output: str) -> list[str]:
    """What a user reads on the console besides the result log and the timing lines."""
    return [x for x in output.splitlines() if x.strip() and not NOISE.match(x)]


def finish(proc: subprocess.Popen, limit_s: float = 120) -> str:
    try:
        return proc.communicate(timeout=limit_s)[0]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_killed_rank_leaves_a_log_ending_in_run_stop_aborted(rank, synthetic_data, tmp_path, marker):
    env = run_env(synthetic_data, tmp_path, marker)
    log = tmp_path / "result_0.txt"
    proc = start(env)
    wait_until(lambda: log.is_file() and "block_start" in log.read_text(), proc)
    pid = worker(env["FAULTS_TEST_MARKER"], rank)
    os.kill(pid, signal.SIGKILL)
    output = finish(proc)

    assert proc.returncode != 0, output[-3000:]
    stops = [e for e in events(log) if e["key"] == "run_stop"]
    assert [e["metadata"]["status"] for e in stops] == ["aborted"], output[-3000:]
    assert events(log)[-1]["key"] == "run_stop"
    assert "ENDING TIMING RUN" in output and "Traceback" not in output
    assert f"launch: rank {rank} (pid {pid}) was killed by SIGKILL" in output
    assert not marked(env["FAULTS_TEST_MARKER"])
    cc = subprocess.run([PY, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "5.0.0",
                         "--log_output", str(tmp_path / "cc.log"), str(log)], capture_output=True, text=True,
                        cwd=tmp_path)
    assert cc.returncode != 0
    verify = subprocess.run([PY, str(ROOT / "logging" / "verify_result.py"), str(log), "--eval-samples", "64"],
                            capture_output=True, text=True)
    assert verify.returncode != 0 and "run_stop: expected exactly one" not in verify.stdout, verify.stdout


@pytest.mark.slow
def test_sigterm_to_run_and_time_checkpoints_stops_the_workers_and_exits_3(synthetic_data, tmp_path, marker):
    """Pre-empted: every worker checkpoints and exits 0, and the script says it was a pre-emption, status 3 and no
    RESULT line (run.sub stops its loop on it, where exit 0 made it start the next run)."""
    env = run_env(synthetic_data, tmp_path, marker)
    proc = start(env)
    wait_until(lambda: steps_done(tmp_path) >= 2, proc)
    workers = [pid for pid, e in marked(env["FAULTS_TEST_MARKER"]).items() if "RANK" in e]
    assert len(workers) == 2
    proc.send_signal(signal.SIGTERM)  # the script's own pid, not its process group
    output = finish(proc)

    assert proc.returncode == 3, output[-3000:]  # pre-empted after a checkpoint
    assert not marked(env["FAULTS_TEST_MARKER"])  # no worker outlived the script
    assert "ENDING TIMING RUN" in output and not re.search(r"^RESULT,", output, re.M)
    assert re.search(r"^PREEMPTED,bert,7,\d+: checkpoint saved; not a result \(RESUME=1 SEED=7 continues it\)$",
                     output, re.M), output[-3000:]
    assert "Traceback" not in output and user_lines(output) == [], user_lines(output)
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert int(latest.removeprefix("step_")) >= 2
    assert [e for e in events(tmp_path / "result_0.txt") if e["key"] == "run_stop"] == []  # resumable


def corrupt_copy(src: Path, dst: Path) -> Path:
    """A copy of the synthetic set with 4 KiB of random bytes in the middle of one training shard."""
    shutil.copytree(src, dst)
    shard = dst / "train_varlength" / "part_00001_of_00004.hdf5"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(0).randbytes(4096))
    return shard


@pytest.mark.slow
def test_corrupt_shard_mid_run_is_one_line_naming_the_shard_and_sample(synthetic_data, tmp_path, marker):
    shard = corrupt_copy(synthetic_data, tmp_path / "data")
    proc = start(run_env(tmp_path / "data", tmp_path / "out", marker))
    output = finish(proc)

    assert proc.returncode == 2, output[-3000:]  # bad data
    assert "Traceback" not in output
    lines = user_lines(output)
    assert re.search(rf"^error: rank \d: {re.escape(str(shard))}: sample \d+ unreadable", lines[0]), lines
    assert len(lines) <= 4, lines  # one line per rank, the launcher's line
    assert re.match(r"^launch: rank \d \(pid \d+\) exited with status 2$", lines[-1]), lines
    assert [e["metadata"]["status"] for e in events(tmp_path / "out" / "result_0.txt")
            if e["key"] == "run_stop"] == ["aborted"]


def out_of_vocabulary_copy(src: Path, dst: Path) -> Path:
    """A copy of the synthetic set whose second training shard was tokenized with a larger vocabulary: every
    sample's second token is 30600 (a valid int16, beyond the 30522 words of the MLPerf vocabulary)."""
    shutil.copytree(src, dst)
    shard = dst / "train_varlength" / "part_00001_of_00004.hdf5"
    with h5py.File(shard, "r+") as f:
        ids = f["input_ids"]
        for row in range(len(ids)):
            tokens = ids[row]
            tokens[1] = 30600
            ids[row] = tokens
    return shard


@pytest.mark.slow
def test_token_id_beyond_the_vocabulary_is_one_line_naming_the_shard_and_sample(synthetic_data, tmp_path, marker):
    """Not an embedding's "index out of range" (a device-side assert on a GPU) after run_start, nameless: the loader
    checks every batch against the model's limits (bert.data.limits) and names the sample, status 2 (bad data)."""
    shard = out_of_vocabulary_copy(synthetic_data, tmp_path / "data")
    proc = start(run_env(tmp_path / "data", tmp_path / "out", marker))
    output = finish(proc)

    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    lines = user_lines(output)
    assert re.search(rf"^error: rank \d: {re.escape(str(shard))}: sample \d+: token id 30600 is outside the "
                     r"model's 0\.\.\d+; run aborted$", lines[0]), lines
    assert len(lines) <= 4, lines
    assert [e["metadata"]["status"] for e in events(tmp_path / "out" / "result_0.txt")
            if e["key"] == "run_stop"] == ["aborted"]


WORKER = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
if sys.argv[1] == "exit" and rank == 1:
    print(f"error: rank {rank}: bad input", file=sys.stderr)
    sys.exit(2)
if sys.argv[1] == "kill" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


@pytest.mark.parametrize("mode, status, line", [
    ("exit", 2, "launch: rank 1 (pid {pid}) exited with status 2"),
    ("kill", 128 + 9, "launch: rank 1 (pid {pid}) was killed by SIGKILL"),
])
@pytest.mark.parametrize("debug", ["0", "1"])
def test_launcher_reports_a_failed_worker_in_one_line_with_its_status(mode, status, line, debug, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = subprocess.run([PY, "-m", "bert.dist.launch", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                          str(script), mode], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "DEBUG": debug})
    if debug == "1":  # torchrun as it is: its traceback and report, exit 1
        assert out.returncode == 1 and "ChildFailedError" in out.stderr
        return
    lines = out.stderr.strip().splitlines()
    pid = re.search(r"\(pid (\d+)\)", lines[-1]).group(1)
    assert out.returncode == status and lines[-1] == line.format(pid=pid), out.stderr
    assert len(lines) <= 2 and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("debug", ["0", "1"])
def test_driver_error_is_one_line_and_the_traceback_needs_debug(debug, tmp_path):
    missing = tmp_path / "no_such_dir"
    out = subprocess.run([PY, str(ROOT / "run_pretraining.py"), "--input_dir", str(missing), "--eval_dir",
                          str(missing), "--bert_config_path", "tiny", "--train_batch_size", "8", "--learning_rate",
                          "1e-3", "--max_steps", "10", "--output_dir", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "DEBUG": debug})
    assert out.returncode == 2
    assert f"error: rank 0: {missing}: no such data directory" in out.stderr.splitlines()[-1]
    assert ("Traceback" in out.stderr) == (debug == "1"), out.stderr


@pytest.mark.parametrize("tail, appended", [
    ("block_start", True),  # rank 0 died mid-run
    ("block_start_cut", True),  # ... in the middle of writing a line
    ("run_stop", False),  # the driver closed the log itself
    ("init_start", False),  # no run_start: init failed, the checkers reject the log already
])
def test_abort_log_closes_only_a_log_left_open(tail, appended, tmp_path):
    keys = {"init_start": ["init_start"], "block_start": ["init_start", "run_start", "block_start"],
            "block_start_cut": ["init_start", "run_start", "block_start"],
            "run_stop": ["init_start", "run_start", "block_start", "run_stop"]}[tail]
    lines = [":::MLLOG " + json.dumps({"namespace": "", "time_ms": 1, "event_type": "POINT_IN_TIME", "key": k,
                                       "value": None, "metadata": {"file": "x", "lineno": 1}}) for k in keys]
    text = "\n".join(lines) + ("\n:::MLLOG {\"names" if tail == "block_start_cut" else "\n")
    log = tmp_path / "result_0.txt"
    log.write_text(text)
    out = subprocess.run([PY, "-m", "bert.train.abort_log", str(log)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    after = log.read_text()
    assert after.startswith(text)  # appended, nothing rewritten
    # whole lines after the old ones: a line cut short by the kill stays as it was, and run_stop gets its own
    added = [json.loads(x.removeprefix(":::MLLOG ")) for x in after.splitlines()[len(text.splitlines()):]]
    if appended:
        assert [(e["key"], e["event_type"], e["metadata"]["status"]) for e in added] == \
            [("run_stop", "INTERVAL_END", "aborted")]
    else:
        assert added == []


def test_unreadable_sample_is_named_by_its_row(synthetic_data, tmp_path):
    from bert.data.format import ShardError, VarlenShard

    shard = corrupt_copy(synthetic_data, tmp_path / "data")
    with VarlenShard(shard) as f:
        with pytest.raises(ShardError) as err:
            f.read(np.arange(len(f)))
        row = int(re.search(rf"^{re.escape(str(shard))}: sample (\d+) unreadable \(corrupt shard\?\)", str(err.value))
                  .group(1))
        f.read(np.arange(row))  # every row before it reads
        with pytest.raises(ShardError):
            f.read([row])


def test_resume_without_the_runs_seed_is_refused_before_anything_starts(tmp_path):
    """RESUME=1 with a fresh $RANDOM seed would have the loader refuse the checkpoint after init (another plan)."""
    env = run_env(tmp_path / "data", tmp_path / "out", "none", RESUME="1")
    env.pop("SEED")
    out = subprocess.run([str(ROOT / "run_and_time.sh")], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "RESUME=1 continues a run: set SEED to its seed" in out.stderr, out.stderr
    assert "STARTING TIMING RUN" not in out.stdout


@pytest.mark.slow
def test_a_failed_continuation_leaves_the_original_log_alone(synthetic_data, tmp_path, marker):
    """RESUME=1 logs to result_0.txt.resumed-1. A continuation that fails (here: no checkpoint to continue from)
    used to have run_and_time.sh close $MLPERF_LOG, the pre-empted original, open since its run_start, with a
    run_stop dated at the continuation's failure; the script now closes the file the driver claimed."""
    log = tmp_path / "result_0.txt"
    log.write_text("".join(":::MLLOG " + json.dumps({"namespace": "", "time_ms": t, "event_type": "INTERVAL_START",
                                                     "key": key, "value": None, "metadata": {"file": "x.py"}}) + "\n"
                           for t, key in [(1, "init_start"), (2, "run_start")]))
    original = log.read_bytes()
    proc = start(run_env(synthetic_data, tmp_path, marker, RESUME="1"))
    output = finish(proc)
    assert proc.returncode == 2, output[-3000:]
    assert log.read_bytes() == original, output[-3000:]
    continuation = [e["key"] for e in events(tmp_path / "result_0.txt.resumed-1")]
    assert "init_start" in continuation and "run_start" not in continuation  # failed in init: no checker takes it
