"""bench/sass_count.py: its counts read cuobjdump's listing as written (a hand-made one here), and, with Triton,
the per-element bias correction compiles for sm_90 into a pow subroutine called once per element while the loaded
one has no float64 instruction at all."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from script_modules import ROOT, load_script

bench = load_script("bench/sass_count.py")

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA 0x40 ;
        /*0020*/                   CALL.REL.NOINC 0x0050 ;
        /*0030*/                   CALL.REL.NOINC 0x0050 ;
        /*0040*/                   EXIT ;
        /*0050*/                   DFMA R2, R4, R6, R8 ;
        /*0060*/              @!P1 DADD R2, R2, R4 ;
        /*0070*/                   FADD R2, R2, R4 ;
        /*0080*/                   RET.REL.NODEC R20 0x0 ;
        /*0090*/                   BRA 0x90;
"""


def test_the_counts_follow_the_listing():
    assert bench.count(LISTING) == {"instructions": 10, "float64": 2, "calls": 2, "subroutine_instructions": 4,
                                    "subroutine_float64": 2}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton (torch's CUDA build) not installed")
def test_the_inlined_correction_calls_a_float64_pow_per_element(tmp_path):
    out = tmp_path / "sass.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/sass_count.py"), "--json", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["inlined"]["calls"] == 8 and rows["inlined"]["subroutine_float64"] > 50  # 1,024 elements, 128 threads
    assert rows["loaded"]["float64"] == rows["loaded"]["calls"] == 0
    assert rows["inlined"]["per_element"] > 10 * rows["loaded"]["per_element"]
    assert rows["dropout4x"]["per_element"] < rows["dropout"]["per_element"]  # a Philox call for 4 elements, not 1
