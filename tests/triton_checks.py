"""What the tests of our Triton kernels share: running a check script on Triton's own tools (the interpreter, or its
sm_90 compiler) in a process of its own, and refusing a module's torch path on CUDA so a CUDA test that passes ran
the kernels."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
from script_modules import ROOT

# The head of a script for Triton's interpreter: Triton 3.6's interpreter reads a loop bound with int() of a
# one-element array, which numpy 2.5 refuses
LOOP_BOUND_PATCH = """
import triton.runtime.interpreter as interpreter
patch = interpreter._patch_lang_tensor
def patched(tensor, scope):
    patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = patched
"""

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton (torch's CUDA build) not installed")


def run_check(script: str, timeout: int, interpret: bool = False) -> None:
    """Run `script` (which prints "bad [...]" and exits non-zero on a finding) with the checkout on the path, in
    Triton's interpreter if `interpret`; fail with its output unless it found nothing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **({"TRITON_INTERPRET": "1"} if interpret else {}))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "bad []" in done.stdout


def refuse_torch_path_on_cuda(monkeypatch: pytest.MonkeyPatch, module: ModuleType, *names: str) -> None:
    """Replace each `module.<name>` (a torch path taking a tensor first) by one that fails on a CUDA tensor."""
    def only_off_cuda(path: Callable) -> Callable:
        def run(first, *rest):
            assert not first.is_cuda, "the torch path ran on CUDA"
            return path(first, *rest)
        return run

    for name in names:
        monkeypatch.setattr(module, name, only_off_cuda(getattr(module, name)))
