"""One line to the console in one write, so that lines from several ranks do not interleave."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """Write `line` and its newline to stderr in one call.

    The ranks run under `python -u` (run_and_time.sh) and share one stderr pipe. Unbuffered, `print` writes the text
    and its newline apart, so two ranks failing together could write "A", "B\\n", "\\n": one console line holding
    both messages. A single write of at most PIPE_BUF bytes to a pipe is atomic (POSIX).
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
