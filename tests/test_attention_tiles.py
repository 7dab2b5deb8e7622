"""bench/attention_tiles.py: its candidate tiles are ones the kernels take, and, in Triton's interpreter, every
candidate's results are checked against the default tiles' and a wrong one is flagged (the GPU timings themselves come
from a device session)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from script_modules import ROOT, load_script
from triton_checks import LOOP_BOUND_PATCH, needs_triton, run_check

from bert.model import triton_attention as ta

sys.path.insert(0, str(ROOT / "bench"))
tiles = load_script("bench/attention_tiles.py")


def test_the_candidates_are_tiles_the_kernels_take_defaults_first():
    for candidates, default in ((tiles.FORWARD, ta.FORWARD_TILE), (tiles.DQ, ta.BACKWARD_TILE),
                                (tiles.DKDV, ta.BACKWARD_TILE)):
        assert candidates[0] == default and len(set(candidates)) == len(candidates)
        for tile in candidates:
            assert ta.check_tile(tile) == tile


@pytest.mark.parametrize("tile", [(128, 8, 4), (96, 64, 4), (512, 64, 8), (64, 64, 3), (64, 64, 16)])
def test_a_tile_the_kernels_cannot_take_is_refused(tile):
    with pytest.raises(ValueError, match="a tile is"):
        ta.check_tile(tile)


@pytest.mark.skipif(ta.triton is not None, reason="Triton installed")
def test_without_triton_it_says_so_in_one_line():
    done = subprocess.run([sys.executable, "bench/attention_tiles.py", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "attention_tiles: needs Triton (torch's CUDA build)\n"


SWEEP = LOOP_BOUND_PATCH + """
import json, sys, tempfile
import torch
sys.path.insert(0, "bench")
import attention_tiles as at
from bert.model import triton_attention as ta

ARGS = ["--device", "cpu", "--sequences", "3", "--heads", "1", "--dim", "16", "--max-length", "80", "--dtype",
        "float16", "--repeats", "1", "--calls", "1"]
bad = []
with tempfile.TemporaryDirectory() as tmp:
    rc = at.main(ARGS + ["--json", f"{tmp}/a.json"])
    result = json.load(open(f"{tmp}/a.json"))
    rows = result["rows"]
    ran = {(r["kernel"], tuple(r["tile"])) for r in rows if r["tile"] and r.get("ok") and "layer_ms" in r}
    want = {("forward", t) for t in at.FORWARD} | {("dq", t) for t in at.DQ} | {("dkdv", t) for t in at.DKDV}
    if rc != 0 or ran != want or not all(r["same_mask"] for r in rows if r["kernel"] == "forward"):
        bad.append(("sweep", rc, want - ran, rows))
    if [r["kernel"] for r in rows][-1] != "dq+dkdv" or not rows[-1].get("ok"):  # the pair: best() has its own test
        bad.append(("best pair", rows[-1]))

    # one forward candidate's output off by half, another's mask with a bit flipped; one dK/dV candidate's dK off by
    # half, another's NaN: each flagged (a NaN is an infinite gap), nothing else, and neither dK/dV in the best pair
    real_forward, real_backward = ta.launch_forward, ta.launch_backward
    def wrong_forward(q, k, v, cu, longest, p, seed, tile=ta.FORWARD_TILE):
        out, lse, bits = real_forward(q, k, v, cu, longest, p, seed, tile)
        if tile == at.FORWARD[1]:
            out = out * 1.5
        if tile == at.FORWARD[2]:
            bits = bits ^ 1
        return out, lse, bits
    def wrong_backward(*args):
        dq, dk, dv = real_backward(*args).unbind(1)
        if args[-1] == at.DKDV[1]:
            dk = dk * 1.5
        if args[-1] == at.DKDV[2]:
            dk = dk.clone()
            dk[0, 0, 0] = float("nan")
        return torch.stack((dq, dk, dv), 1)
    ta.launch_forward, ta.launch_backward = wrong_forward, wrong_backward
    at.DQ, at.DKDV = at.DQ[:1], at.DKDV[:3]
    rc = at.main(ARGS + ["--json", f"{tmp}/b.json"])
    result = json.load(open(f"{tmp}/b.json"))
    flagged = [(r["kernel"], tuple(r["tile"]), r.get("same_mask")) for r in result["rows"] if r.get("ok") is False]
    want = [("forward", at.FORWARD[1], True), ("forward", at.FORWARD[2], False), ("dkdv", at.DKDV[1], None),
            ("dkdv", at.DKDV[2], None)]
    if rc != 1 or flagged != want or tuple(result["best_dkdv"]) in at.DKDV[1:3]:
        bad.append(("wrong", rc, flagged, result["best_dkdv"]))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_in_the_interpreter_every_candidate_matches_the_default_and_a_wrong_one_is_flagged():
    """Three short sequences of the mix, fp16 (the interpreter's bf16 products are wrong): every candidate of each
    kernel runs and matches the default tiles (the forward's mask bit for bit), the best pair is timed last; a
    candidate whose output is off, or whose mask differs, is flagged and the bench exits 1."""
    run_check(SWEEP, timeout=900, interpret=True)


def test_the_best_tile_is_the_fastest_that_ran_right():
    rows = [{"kernel": "dq", "tile": [64, 64, 4], "layer_ms": 0.30, "ok": True},
            {"kernel": "dq", "tile": [128, 64, 8], "layer_ms": 0.20, "ok": True},
            {"kernel": "dq", "tile": [64, 32, 4], "layer_ms": 0.10, "ok": False},  # fastest, wrong
            {"kernel": "dq", "tile": [32, 64, 4], "error": "OutOfResources: x"},
            {"kernel": "dkdv", "tile": [32, 64, 4], "layer_ms": 0.05, "ok": True}]
    assert tiles.best(rows, "dq", (64, 64, 4)) == (128, 64, 8)
    assert tiles.best(rows[2:4], "dq", (64, 64, 4)) == (64, 64, 4)  # none ran right: the default


def test_a_nan_is_an_infinite_gap_wherever_it_is():
    import torch

    want = [torch.ones(3), torch.ones(2)]
    assert tiles.largest_gap([torch.ones(3), torch.tensor([1.0, 1.5])], want) == pytest.approx(0.5)
    for at in (0, 1):
        got = [w.clone() for w in want]
        got[at][0] = float("nan")
        assert tiles.largest_gap(got, want) == float("inf")


def test_the_table_lists_every_row():
    result = {"rows": [{"phase": "forward", "kernel": "forward", "tile": [128, 64, 8], "layer_ms": 0.25,
                        "step_ms": 6.0, "tflops": 300.0, "same_mask": True, "largest_gap": 1e-3, "ok": True},
                       {"phase": "forward", "kernel": "forward", "tile": [64, 128, 4], "error": "OutOfResources: x"},
                       {"phase": "backward", "kernel": "dq+dkdv", "tile": None, "tiles": [[64, 64, 4], [32, 64, 4]],
                        "layer_ms": 0.5, "step_ms": 12.0, "tflops": 250.0, "largest_gap": 0.1, "ok": False},
                       {"phase": "backward", "kernel": "flash2", "tile": None, "layer_ms": 0.7, "step_ms": 16.8,
                        "tflops": 200.0}]}
    lines = tiles.table(result).splitlines()
    assert len(lines) == 5
    assert "128x64,8" in lines[1] and "ok 1.0e-03" in lines[1]
    assert "64x128,4" in lines[2] and "OutOfResources" in lines[2]
    assert "64x64,4 + 32x64,4" in lines[3] and "WRONG" in lines[3]
    assert "flash2" in lines[4] and "16.80" in lines[4]
    json.dumps(result)
