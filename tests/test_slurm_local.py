"""scripts/slurm_local.sh on this host, and the Slurm facts run_and_time.sh relies on.

run_and_time.sh runs the driver directly iff it is inside a job step (SLURM_STEP_ID) whose SLURM_NTASKS equals
DGXNNODES*DGXNGPU; the batch script itself has no SLURM_STEP_ID (local_slurm.md, checked on Slurm 22.05).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(not shutil.which("sinfo"), reason="Slurm is not installed")]


def pids() -> list[str]:
    return [Path(p).read_text().strip() for p in ("/run/slurmctld.pid", "/run/slurmd.pid")]


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
