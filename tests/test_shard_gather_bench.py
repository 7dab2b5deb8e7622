"""bench/shard_gather.py: a row per gather and block count, from both ranks, the same bytes gathered in each (but
for the blocks' padding), and the `step` rows' waits the whole all-gathers (each `step` row is the yardstick of its
block count's `forward` row)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from script_modules import ROOT


@pytest.mark.slow
def test_the_bench_times_both_gathers_for_each_block_count(tmp_path):
    out = tmp_path / "gather.json"  # a process of its own: the ranks it spawns import the script by its path
    run = subprocess.run([sys.executable, str(ROOT / "bench/shard_gather.py"), "--config", "tiny", "--blocks", "2",
                          "3", "--steps", "1", "--sequences", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["gather"], r["blocks"]) for r in rows] == [("step", 2), ("forward", 2), ("step", 3), ("forward", 3)]
    sizes = [r["gathered_MiB"] for r in rows]  # the weights, padded to whole blocks of whole rows
    assert max(sizes) / min(sizes) < 1.01
    assert all(r["waited_ms"] > 0 and r["hidden_share"] == 0 for r in rows if r["gather"] == "step")
    for rank in result["by_rank"]:
        assert [len(r["steps"]) for r in rank] == [1] * 4
    for r in rows:  # the printed table is the JSON's
        assert f"{r['gather']:>8} {r['blocks']:>6}" in run.stdout
