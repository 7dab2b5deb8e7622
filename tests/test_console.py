"""Console lines from several ranks stay whole (bert/console.py): one write per line, atomic on a pipe."""

import os
import subprocess
import sys
from pathlib import Path

import run_pretraining

ROOT = Path(__file__).resolve().parents[1]


class Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_rank_reports_its_error_in_one_write(monkeypatch):
    """`print` would write the line and its newline apart; under `python -u` another rank's line could fall between
    them (seen as one console line holding two ranks' errors, 2026-11-25)."""
    writes = Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    run_pretraining.report(1, ValueError("shard.hdf5: sample 3: token id 30600 is outside the model's 0..30527"),
                           "; run aborted")
    assert writes.calls == ["error: rank 1: shard.hdf5: sample 3: token id 30600 is outside the model's 0..30527; "
                            "run aborted\n"]


SPEAKER = """
import sys
from bert.console import say
for _ in range(30000):
    say(sys.argv[1] * 60)
"""


def test_unbuffered_processes_sharing_a_pipe_never_split_a_line():
    """The ranks as run_and_time.sh starts them: `python -u`, one stderr pipe. With `print` in `say` this fails (the
    line and its newline go out apart and the two speakers' lines mix)."""
    read_fd, write_fd = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-u", "-c", SPEAKER, f"rank{i}:"], cwd=ROOT, stderr=write_fd)
             for i in range(2)]
    os.close(write_fd)
    with os.fdopen(read_fd) as shared:
        lines = shared.read().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert len(lines) == 2 * 30000
    assert set(lines) == {"rank0:" * 60, "rank1:" * 60}
