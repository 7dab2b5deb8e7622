"""bert.dist.launch's own logic, without starting torchrun (tests/test_run_faults.py runs the launcher for real):
the exit status of a failed worker, which failure is named, and which processes a forwarded signal reaches.

References: POSIX shell convention (128 + signal number), the root-cause order the launcher documents, written
out here as cases, and a real child process found through /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import SimpleNamespace

from bert.dist.launch import _children, _root_cause, _status


def failure(exitcode: int, timestamp: int) -> SimpleNamespace:
    """What torchrun's ProcessFailure holds that the launcher reads (a negative exitcode: killed by that signal)."""
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


def test_status_is_the_workers_or_128_plus_the_signal():
    assert _status(2) == 2 and _status(1) == 1 and _status(0) == 0
    assert _status(-signal.SIGKILL) == 137 and _status(-signal.SIGTERM) == 143 and _status(-signal.SIGSEGV) == 139


def test_root_cause_is_an_outside_signal_then_an_error_then_sigterm_earliest_first():
    term, kill, error = -signal.SIGTERM, -signal.SIGKILL, 2
    # the survivors torchrun stopped with SIGTERM come first in time; the worker killed from outside is the cause
    assert _root_cause({0: failure(term, 100), 1: failure(error, 101), 2: failure(kill, 102)})[0] == 2
    # no outside signal: the worker that exited with an error, not the SIGTERMed one before it
    assert _root_cause({0: failure(term, 100), 1: failure(error, 105)})[0] == 1
    # within a class the earliest, then the lowest rank
    assert _root_cause({0: failure(error, 7), 1: failure(1, 3), 3: failure(error, 9)})[0] == 1
    assert _root_cause({4: failure(error, 3), 2: failure(error, 3)})[0] == 2
    assert _root_cause({0: failure(term, 1), 1: failure(term, 2)})[0] == 0


def test_children_are_the_direct_children_in_their_own_session():
    """torchrun starts each worker in a new session (start_new_session): a signal to the launcher's process group
    would not reach it, so _forward finds the workers by their parent pid."""
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert child.pid in _children(os.getpid())
        assert os.getpid() not in _children(os.getpid())
        assert _children(child.pid) == []
    finally:
        child.kill()
        child.wait()
