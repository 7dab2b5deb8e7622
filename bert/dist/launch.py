"""torchrun, with one line per failure and a pre-emption that ends in exit 0.

    python -m bert.dist.launch --standalone --nproc_per_node 2 run_pretraining.py [args]   # torchrun's flags

Plain torchrun ends a failed run with a `ChildFailedError` traceback and a report box after the
workers' own error lines, exits 1 whatever the workers' status was, and on SIGTERM raises a
`SignalException` (exit 1) even when every worker checkpointed and exited 0. Here:

* a worker failure prints `launch: rank R (pid P) <exited with status N | was killed by SIG>` and
  exits with that status (128 + signal number for a signal), so the driver's 2 for bad input
  survives the launcher;
* SIGTERM or SIGINT is forwarded to the workers as SIGTERM (the driver checkpoints and exits 0
  on it) and the launcher keeps monitoring them, so its status is theirs;
* torchrun's own log lines are silenced.

DEBUG=1 gives torchrun's behaviour back: its logs and the traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

# Signals torchrun's agent turns into SignalException; SIGTERM/SIGINT are ours (see _forward).
_AGENT_SIGNALS = "SIGHUP,SIGQUIT"


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (torchrun's workers), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _forward(signum: int, frame) -> None:
    # Each worker runs in its own session (torchrun's start_new_session), so nothing else reaches it.
    for child in _children(os.getpid()):
        try:
            os.kill(child, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _status(exitcode: int) -> int:
    return 128 - exitcode if exitcode < 0 else exitcode


def _root_cause(failures: dict) -> tuple:
    """The failure to name. torchrun's timestamps have one-second resolution, so order by cause first:
    a worker killed by a signal from outside (its peers then fail on the dead collective), then a worker
    that exited with an error, and last one killed by SIGTERM (what torchrun sends the survivors when it
    stops the group); the earliest within a class."""

    def cause(failure) -> int:
        if failure.exitcode >= 0:
            return 1
        return 2 if failure.exitcode == -signal.SIGTERM else 0

    return min(failures.items(), key=lambda kv: (cause(kv[1]), kv[1].timestamp, kv[0]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from torch.distributed import run as torchrun

    if os.environ.get("DEBUG") == "1":
        torchrun.main(argv)
        return 0
    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        args = torchrun.parse_args(argv)
        args.signals_to_handle = _AGENT_SIGNALS
        torchrun.run(args)  # run(), not main(): main's @record prints the report box
    except ChildFailedError as e:
        rank, failure = _root_cause(e.failures)
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        print(f"launch: rank {rank} (pid {failure.pid}) {how}", file=sys.stderr, flush=True)
        return _status(failure.exitcode) or 1
    except SignalException as e:  # SIGHUP/SIGQUIT: torchrun stopped the workers
        print(f"launch: stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
