"""The Dockerfile's own commands run on any base image that has Python 3.

Reference: `scripts/docker_cpu.sh`, whose Debian stand-in base has `python3` and no `python`; the first build there
stopped with exit 127 at the Dockerfile's `python -c` check (results/docker_cpu/, docs/journal.md).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_commands(text: str) -> list[str]:
    """Each RUN instruction's shell command, its continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith("RUN ")]


def test_run_commands_call_python3_not_a_bare_python():
    commands = run_commands((ROOT / "Dockerfile").read_text())
    assert any("check_torch" in c for c in commands)  # the torch check is still a RUN command
    for command in commands:
        assert not re.search(r"(?<![\w/.-])python(?![\w.-])", command), command
    # the pattern itself: a bare interpreter is found, python3 and paths are not
    assert re.search(r"(?<![\w/.-])python(?![\w.-])", '&& python -c "x"')
    assert not re.search(r"(?<![\w/.-])python(?![\w.-])", "python3 -c x; /usr/lib/python3.11/x; python-is-python3")
