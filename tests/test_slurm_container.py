"""run.sub's pyxis path, with a recording `srun` on PATH (there is no pyxis/enroot on this machine).

Reference: NVIDIA's run.sub [NVIDIA-BERT]: the container is created once per node
with --container-image, every step runs with --container-name/--container-mounts/--container-workdir, and the
mounts are the training data, the eval set, the phase-1 checkpoint and the results folder.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Records its arguments and the variables the step would see, one JSON line per call, and succeeds.
FAKE_SRUN = """#!/usr/bin/env python3
import json, os, sys
keys = ("DATADIR_PHASE2", "EVALDIR", "INIT_CHECKPOINT", "BERT_CONFIG", "MLPERF_LOG", "OUTPUT_DIR", "SEED")
with open(os.environ["SRUN_RECORD"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
"""


def recording_srun(tmp_path: Path) -> dict[str, str]:
    """The variables that put FAKE_SRUN first on run.sub's PATH and tell it where to record."""
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    return {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SRUN_RECORD": str(tmp_path / "calls.jsonl")}


def recorded_calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_container_flags_and_paths(tmp_path):
    host = {"DATADIR_PHASE2": "/lustre/bert/train", "EVALDIR": "/lustre/bert/eval",
            "CHECKPOINTDIR_PHASE1": "/lustre/bert/phase1"}
    env = {**recording_srun(tmp_path), "CONT": "registry/mlperf-bert:1", "NEXP": "2", "LOGDIR": str(tmp_path / "logs"),
           "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(ROOT), "CLEAR_CACHES": "0",
           "INIT_CHECKPOINT": "/lustre/bert/phase1/model.ckpt-28252.safetensors", **host}
    script = f'source "{ROOT}/config_DGXA100_1x8x56x1.sh" && exec bash "{ROOT}/run.sub"'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    calls = recorded_calls(tmp_path)

    create = calls[0]["argv"]
    assert "--container-image=registry/mlperf-bert:1" in create and "--ntasks=1" in create  # one per node
    mounts = {f"{host['DATADIR_PHASE2']}:/workspace/data_phase2", f"{host['EVALDIR']}:/workspace/evaldata",
              f"{host['CHECKPOINTDIR_PHASE1']}:/workspace/phase1", f"{tmp_path / 'logs'}:/results"}
    for call in calls:  # every step, the container creation included, runs in the same container
        flags = dict(a.split("=", 1) for a in call["argv"] if a.startswith("--container-"))
        assert flags["--container-name"] == "mlperf-bert-77"
        assert flags["--container-workdir"] == "/workspace/bert"
        assert set(flags["--container-mounts"].split(",")) == mounts

    runs = [c for c in calls if c["argv"][-1] == "/workspace/bert/run_and_time.sh"]
    assert [r["argv"][r["argv"].index("--ntasks=8") + 1] for r in runs] == ["--ntasks-per-node=8"] * 2
    assert all("--distribution=block" in r["argv"] for r in runs)  # node-major ranks, whatever SLURM_DISTRIBUTION
    assert [r["env"]["MLPERF_LOG"] for r in runs] == [f"/results/DGXA100_1x8x56x1/bert/result_{i}.txt"
                                                     for i in range(2)]
    assert runs[0]["env"]["DATADIR_PHASE2"] == "/workspace/data_phase2"
    assert runs[0]["env"]["EVALDIR"] == "/workspace/evaldata"
    assert runs[0]["env"]["INIT_CHECKPOINT"] == "/workspace/phase1/model.ckpt-28252.safetensors"
    assert runs[0]["env"]["BERT_CONFIG"] == "/workspace/phase1/bert_config.json"
    assert runs[0]["env"]["SEED"] != runs[1]["env"]["SEED"]
    checks = [c["argv"] for c in calls if "mlperf_logging.compliance_checker" in c["argv"]]
    assert len(checks) == 2 and all(["--ruleset", "5.0.0"] == c[c.index("--ruleset"):][:2] for c in checks)
    # the host folders exist and the result files were claimed on the host side
    assert sorted(p.name for p in (tmp_path / "logs" / "DGXA100_1x8x56x1" / "bert").glob("result_*.txt")) == \
        ["result_0.txt", "result_1.txt"]


def test_a_path_is_seen_through_the_mount_that_holds_it(tmp_path):
    """Whole path components: an eval set in /x/bert_eval is not inside the data mount /x/bert (a prefix match
    sent it to /workspace/data_phase2_eval, and a LOGDIR of /x/bert_results wrote the logs inside the container,
    where the checks in the same container found them while the host's result file stayed empty). A checkpoint
    folder inside the data folder is seen through its own, deeper mount."""
    base = tmp_path / "bert"
    host = {"DATADIR_PHASE2": str(base), "EVALDIR": f"{base}_eval", "CHECKPOINTDIR_PHASE1": f"{base}/phase1/"}
    env = {**recording_srun(tmp_path), "CONT": "registry/mlperf-bert:1", "NEXP": "1", "LOGDIR": f"{base}_results",
           "SLURM_JOB_ID": "78", "SLURM_SUBMIT_DIR": str(ROOT), "CLEAR_CACHES": "0",
           "INIT_CHECKPOINT": f"{base}/phase1/model.ckpt-28252.safetensors",
           "BERT_CONFIG": f"{base}_configs/bert_config.json", **host}  # in no mount: the run sees it as it is
    script = f'source "{ROOT}/config_DGXA100_1x8x56x1.sh" && exec bash "{ROOT}/run.sub"'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    run = next(c for c in recorded_calls(tmp_path) if c["argv"][-1] == "/workspace/bert/run_and_time.sh")
    assert run["env"]["DATADIR_PHASE2"] == "/workspace/data_phase2"
    assert run["env"]["EVALDIR"] == "/workspace/evaldata"
    assert run["env"]["MLPERF_LOG"] == "/results/DGXA100_1x8x56x1/bert/result_0.txt"
    assert run["env"]["INIT_CHECKPOINT"] == "/workspace/phase1/model.ckpt-28252.safetensors"
    assert run["env"]["BERT_CONFIG"] == f"{base}_configs/bert_config.json"


def test_parameter_servers_are_extra_tasks_on_every_node(tmp_path):
    """GRAD_REDUCE=ps: every node runs DGXNGPU + PS_SERVERS tasks (bert/dist/ps.py): 2 nodes x (8 + 2) here, on the
    host's Python (no CONT)."""
    env = {**recording_srun(tmp_path), "NEXP": "1", "LOGDIR": str(tmp_path / "logs"), "SLURM_JOB_ID": "78",
           "SLURM_SUBMIT_DIR": str(ROOT), "CLEAR_CACHES": "0", "GRAD_REDUCE": "ps", "PS_SERVERS": "2"}
    script = f'source "{ROOT}/config_DGXA100_1x8x56x1.sh" && DGXNNODES=2 exec bash "{ROOT}/run.sub"'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [run] = [c["argv"] for c in recorded_calls(tmp_path) if c["argv"][-1] == f"{ROOT}/run_and_time.sh"]
    assert "--ntasks=20" in run and "--ntasks-per-node=10" in run
