"""Whether the local Slurm (scripts/slurm_local.sh start; .ci/run starts it) has an idle node: the tests that
submit real jobs skip, with this reason, where it has none."""

from __future__ import annotations

import shutil
import subprocess

import pytest

REASON = "no idle local Slurm node (bash scripts/slurm_local.sh install && bash scripts/slurm_local.sh start)"


def slurm_idle() -> bool:
    if not (shutil.which("sinfo") and shutil.which("srun") and shutil.which("sbatch")):
        return False
    return "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout


needs_slurm = pytest.mark.skipif(not slurm_idle(), reason=REASON)
