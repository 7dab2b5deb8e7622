"""What run_and_time.sh learns from the driver beyond its exit status: which log it wrote, and how the run ended.

A pre-empted run exits 0 (every rank after the checkpoint: a non-zero exit would have torchrun or srun's
--kill-on-bad-exit stop rank 0 before it points `latest` at the new checkpoint), so the exit status cannot say
it; and a continuation (RESUME=1) logs to `result_<i>.txt.resumed-<n>`, not to $MLPERF_LOG. Rank 0 writes both
here, as `key=value` lines, to the file run_and_time.sh names in $RUN_OUTCOME_FILE (on rank 0's node):

    log=<the result log it claimed>      as soon as it is claimed, so a driver that dies later still names it
    status=success|aborted|preempted     when the run ends

Unset: nothing is written (the driver run by hand, the tests that call it directly).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "RUN_OUTCOME_FILE"


def record(key: str, value: str) -> None:
    """Add `key=value` to the outcome file, if run_and_time.sh asked for one."""
    path = os.environ.get(ENV)
    if path:
        with Path(path).open("a") as f:
            f.write(f"{key}={value}\n")
