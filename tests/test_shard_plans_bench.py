"""bench/shard_plans.py: its measured bytes are the ring formulas' on the gradient buffer the optimizer really holds
(4 gloo ranks as 2 nodes of 2), and its computed table is consistent at one node, where every plan is flat."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from script_modules import ROOT, load_script

bench = load_script("bench/shard_plans.py")


def test_computed_plans_agree_at_one_node_and_cut_the_rings_steps_across_nodes():
    at_one = [bench.computed(10**6, 1, 8, plan) for plan in ("flat", "2d", "node")]
    assert len({(r["sent_MiB_per_rank"], r["ring_steps"], r["fp32_kept_MiB_per_rank"]) for r in at_one}) == 1
    flat, two_d, node = (bench.computed(10**6, 128, 8, plan) for plan in ("flat", "2d", "node"))
    assert (flat["ring_steps"], two_d["ring_steps"], node["ring_steps"]) == (2046, 268, 268)
    assert two_d["fp32_kept_MiB_per_rank"] == flat["fp32_kept_MiB_per_rank"] == node["fp32_kept_MiB_per_rank"] / 128
    assert two_d["network_MiB_per_node"] < flat["network_MiB_per_node"]


@pytest.mark.slow
def test_measured_bytes_follow_the_plans(tmp_path):
    out = tmp_path / "plans.json"  # a process of its own: the ranks it spawns import the script by its path
    run = subprocess.run([sys.executable, str(ROOT / "bench/shard_plans.py"), "--nodes", "1", "8", "--steps", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "measured: BERT tiny" in run.stdout
    ranks = json.loads(out.read_text())["measured_tiny"]["by_rank"]
    for rank, rows in enumerate(ranks):
        flat, two_d, node, unsharded = rows
        s = flat["gradient_bytes"]  # the bf16 gradient buffer, padded to whole blocks
        assert flat["sent_bytes_per_step"] == {"world": round(2 * 3 / 4 * s)}  # RS + AG over 4 ranks
        for plan in (two_d, node):  # inside the node RS + AG of s over 2; across 2 nodes RS + AG (or AR) of s / 2
            assert plan["gradient_bytes"] == s
            assert plan["sent_bytes_per_step"] == {"net": round(2 * 1 / 2 * s / 2), "node": round(2 * 1 / 2 * s)}
        assert node["fp32_kept_bytes"] == 2 * two_d["fp32_kept_bytes"] == 2 * flat["fp32_kept_bytes"]
        assert (flat["owner"], two_d["owner"], node["owner"]) == (rank, [0, 2, 1, 3][rank], rank % 2)
        # another summation order of the bf16 gradients: no further from flat than an unsharded allreduce is
        assert 0 < max(two_d["max_master_diff_vs_flat"], node["max_master_diff_vs_flat"]) \
            <= unsharded["max_master_diff_vs_flat"]
