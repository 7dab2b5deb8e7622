"""bench/attention_sass.py: the inner loop is found as the listing's longest backward branch (a hand-made listing
here), and, with Triton, every kernel compiles for sm_90 with no spill in its loop, Hopper's MMA there, and dropout
costing instructions an element beside the same kernel without it; the step estimate is bounded as its doc says."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from script_modules import ROOT, load_script, run_for_json

bench = load_script("bench/attention_sass.py")

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   MOV R2, RZ ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0030*/                   FFMA R3, R2, R4, R5 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   FADD R2, R2, R4 ;
        /*0060*/               @P1 BRA 0x50 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x80;
"""


def test_the_loop_is_the_longest_backward_branch():
    assert bench.inner_loop(LISTING) == ["HGMMA.64", "FFMA", "BRA"]  # opcodes (as the regex reads them)
    assert bench.inner_loop("        /*0000*/                   EXIT ;\n") == []


def test_the_step_counts_whole_tiles():
    computed, useful = bench.elements((128, 64))
    assert computed >= useful > 0
    assert bench.elements((16, 16))[0] < computed  # smaller tiles waste less of a cut one


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton (torch's CUDA build) not installed")
def test_every_kernel_compiles_without_spills_and_the_estimate_is_bounded(tmp_path):
    report = run_for_json("bench/attention_sass.py", tmp_path / "attention_sass.json")
    rows = {(r["kernel"], r["dropout"]): r for r in report["rows"]}
    assert len(rows) == 6
    for (kernel, dropout), r in rows.items():
        # no spill inside the loop; dK dV with dropout keeps one value for after it on the stack (a store and a load
        # a program)
        assert r["loop_local"] == 0 and r["stack_bytes"] <= 8 and r["hgmma"] > 0 and r["mufu"] > 0, r
        if dropout:
            assert r["per_element"] > rows[(kernel, False)]["per_element"]
    for phase in ("forward", "backward"):
        e = report["step_estimate"][phase]
        assert 0 < e["issue_bound_ms"] <= e["no_overlap_ms"]


def test_the_candidates_are_every_tile_the_gpu_bench_times(monkeypatch):
    """--candidates counts each kernel at each of bench/attention_tiles.py's tiles, with dropout (the count itself,
    which needs Triton, is replaced by its arguments)."""
    import types

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    tiles = load_script("bench/attention_tiles.py")
    kernel = {name: types.SimpleNamespace(fn=types.SimpleNamespace(__name__=name))
              for name in ("_forward", "_backward_kv", "_backward_q")}
    ta = types.SimpleNamespace(FORWARD_TILE=tiles.FORWARD[0], BACKWARD_TILE=tiles.DQ[0], **kernel)
    monkeypatch.setattr(bench, "count", lambda k, tile, signature, dropout: (k.fn.__name__, tile, dropout))
    monkeypatch.setitem(sys.modules, "attention_tiles", tiles)
    want = [("_forward", t, True) for t in tiles.FORWARD] + [("_backward_kv", t, True) for t in tiles.DKDV] \
        + [("_backward_q", t, True) for t in tiles.DQ]
    assert bench.candidates(ta) == want
