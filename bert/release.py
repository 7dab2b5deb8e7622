"""A release's (major, minor) from its version string as pip or torch writes it: "2.11.0+cu130", "2.10.0a0+b4e4ee8".

One parser for the checks that depend on torch's release: the oldest torch (`bert.train.config.MIN_TORCH`), the
torchao release for it (`bert.model.fp8.TORCHAO`) and the cuDNN attention fix (`bert.model.cudnn_varlen.MIN_TORCH`).
Torch-free, as `python -m bert.train.config --check-env` must run before torch is imported.
"""

from __future__ import annotations

import re


def major_minor(version: str) -> tuple[int, int] | None:
    """(major, minor), or None when `version` does not start with two numbers."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return None if found is None else (int(found[1]), int(found[2]))
