"""Close a result log whose driver died mid-run: append `run_stop` with status `aborted`.

    python -m bert.train.abort_log results/.../result_0.txt   # run_and_time.sh, after a failed launch

A rank 0 killed by SIGKILL (or the OOM killer, or a node failure) writes nothing more, so its log
ends at `block_start` and reads as a run still in progress. The launcher calls this when the
driver failed; a log whose last `run_start` is followed by a `run_stop` is left alone, and so is a
log without `run_start` (init failed: the checkers already reject it). Only appends: the lines
already there are never rewritten.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlperf_logging.mllog import constants as C

from bert.train.mlperf_log import MLPerfLog

_PREFIX = ":::MLLOG "


def left_open(path: Path) -> bool:
    """True if the log's last run_start/run_stop event is a run_start."""
    last = None
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith(_PREFIX):
            continue
        try:
            key = json.loads(line[len(_PREFIX):]).get("key")
        except json.JSONDecodeError:  # a line cut short by the kill
            continue
        if key in (C.RUN_START, C.RUN_STOP):
            last = key
    return last == C.RUN_START


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bert.train.abort_log RESULT_LOG", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.is_file() or not left_open(path):
        return 0
    with path.open("rb+") as f:  # a line cut short by the kill must not swallow ours
        end = f.seek(0, 2)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
    MLPerfLog(str(path), enabled=True, append=True).end(C.RUN_STOP, metadata={C.STATUS: C.ABORTED})
    print(f"abort_log: {path}: the driver died without run_stop; appended run_stop (status aborted)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
