"""Import a repository script (bench/*.py, data/*.py) as a module, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str) -> ModuleType:
    """`path` relative to the repository root, e.g. "bench/comm.py"."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_for_json(path: str, out: Path, timeout: int = 600) -> dict:
    """Run the script `path` (as `load_script`'s) with `--json out` in this interpreter; its report, after asserting
    that it exited 0 (else its output's end)."""
    done = subprocess.run([sys.executable, str(ROOT / path), "--json", str(out)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return json.loads(out.read_text())
