"""scripts/slurm_local.sh on this host, and the Slurm facts run_and_time.sh relies on.

run_and_time.sh runs the driver directly iff it is inside a job step (SLURM_STEP_ID) whose SLURM_NTASKS equals
DGXNNODES*DGXNGPU; the batch script itself has no SLURM_STEP_ID (local_slurm.md, checked on Slurm 22.05).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(not shutil.which("sinfo"), reason="Slurm is not installed")]


def pids() -> list[str]:
    return [Path(p).read_text().strip() for p in ("/run/slurmctld.pid", "/run/slurmd.pid")]


def slurm_local(command: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/slurm_local.sh", command], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def daemons() -> dict[str, int]:
    """PID of each munged/slurmctld/slurmd process alive on this host, from /proc (not from any pid file)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            name = (proc / "comm").read_text().strip()
        except OSError:
            continue
        if name in ("munged", "slurmctld", "slurmd"):
            found[name] = int(proc.name)
    return found


def munge_works() -> bool:
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


def test_start_is_idempotent():
    first = subprocess.run(["bash", "scripts/slurm_local.sh", "start"], cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    before = pids()
    again = subprocess.run(["bash", "scripts/slurm_local.sh", "start"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "idle" in again.stdout
    assert pids() == before  # no second daemon


def test_step_environment_seen_by_run_and_time(tmp_path):
    show = 'echo "$SLURM_PROCID ${SLURM_STEP_ID:-none} $SLURM_NTASKS"'
    step = subprocess.run(["srun", "-N1", "-n2", "bash", "-c", show], capture_output=True, text=True, timeout=120)
    ranks = sorted(line.split() for line in step.stdout.splitlines())
    assert [r[0] for r in ranks] == ["0", "1"]
    assert all(r[1] != "none" and r[2] == "2" for r in ranks)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{show}\n")
    batch = subprocess.run(["sbatch", "--wait", "-o", str(tmp_path / "out"), "-N1", "--ntasks-per-node=2",
                            str(script)], capture_output=True, text=True, timeout=120)
    assert batch.returncode == 0, batch.stderr
    assert (tmp_path / "out").read_text().split() == ["0", "none", "2"]  # the batch script is not a step


@pytest.mark.skipif(os.geteuid() != 0, reason="starts and stops daemons (root)")
def test_stop_ends_exactly_the_daemons_start_started():
    try:
        assert slurm_local("stop").returncode == 0
        assert not {"slurmctld", "slurmd"} & set(daemons())
        if "munged" in daemons():
            pytest.skip("a munged that slurm_local.sh did not start is running; stop leaves it alone")
        started = slurm_local("start")
        assert started.returncode == 0, started.stderr
        before = daemons()
        assert set(before) == {"munged", "slurmctld", "slurmd"}
        assert slurm_local("stop").returncode == 0
        assert not daemons()  # stop waited for all three to exit
        # A munged running before `start` (not ours) survives `stop`.
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        foreign = daemons()["munged"]
        assert slurm_local("start").returncode == 0
        assert slurm_local("stop").returncode == 0
        assert daemons() == {"munged": foreign} and munge_works()
        os.kill(foreign, 15)  # the test started it
        for _ in range(50):
            if "munged" not in daemons():
                break
            time.sleep(0.1)
    finally:
        # other tests in the session need the cluster. With OMP_NUM_THREADS=1 (a shell set for one-thread CPU
        # runs), which coreutils' nproc obeys: the node must still offer every core, or a job of two tasks per node
        # pends for ever ("PartitionConfig": the suite hung so, a worker having set it for its subprocesses)
        restored = slurm_local("start", OMP_NUM_THREADS="1")
    assert restored.returncode == 0 and "idle" in restored.stdout, restored.stderr
    assert set(daemons()) == {"munged", "slurmctld", "slurmd"}
    node = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True, check=True).stdout
    assert f"CPUTot={len(os.sched_getaffinity(0))} " in node, node
