"""Fixtures shared across test modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory) -> Path:
    """data/make_synthetic_dataset.py's default dataset, made once per session; tests only read it."""
    out = tmp_path_factory.mktemp("synthetic")
    subprocess.run([sys.executable, str(ROOT / "data" / "make_synthetic_dataset.py"), "--out", str(out)], check=True,
                   capture_output=True)
    return out
