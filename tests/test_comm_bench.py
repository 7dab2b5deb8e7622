"""bench/comm.py: the BERT-large bucket report (Herring [003] §III-1) and one tiny end-to-end run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from script_modules import load_script

from bert.dist.reduce import REDUCTIONS

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    return load_script(f"bench/{name}.py")


def test_bert_large_ddp_buckets_against_balanced_ones():
    report = load("comm").bucket_report(25.0)
    # "BERT-large contains 398 trainable variables" (Herring §III-1), with separate query, key and value; our fused
    # QKV holds each layer's three weights and three biases in one weight and one bias: 4 fewer per layer.
    assert report["tensors"] == 398 - 4 * 24
    ddp, balanced = report["ddp"], report["balanced"]
    # The word embedding's gradient, ready last, makes the last bucket five caps big (Herring §III-1, Table II).
    assert ddp["bytes"][-1] == ddp["max_bytes"] >= 30528 * 1024 * 4
    assert ddp["spread"] > 3 and sum(ddp["bytes"]) == report["params"] * 4  # 125 MB vs the smallest of ~25-33 MB
    assert balanced["max_bytes"] - balanced["min_bytes"] <= 4 and balanced["max_bytes"] <= 25 * 2**20
    assert balanced["buckets"] == -(-report["params"] * 4 // (25 * 2**20))
    # The balanced buffers hold every gradient byte (4 per fp32 parameter), in near-equal parts.
    count = balanced["buckets"]
    assert balanced["min_bytes"] * count <= report["params"] * 4 <= balanced["max_bytes"] * count


@pytest.mark.slow
def test_bench_runs_every_registered_reduction_and_bucketing(tmp_path):
    out, png = tmp_path / "comm.json", tmp_path / "comm.png"
    cmd = [sys.executable, str(ROOT / "bench" / "comm.py"), "--scale", "32", "--world", "2", "--local-world", "1",
           "--bucket-cap-mb", "200", "--steps", "1", "--rounds", "1", "--out", str(out),
           "--plot", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    timed = {f"{r}/{b}" if d == "fp32" else f"{r}+{d}/{b}" for r, b, d in load("comm").timed_variants()}
    assert set(result["runs"]) == timed and {r for r in REDUCTIONS if r != "ps"} <= {k.split("/")[0] for k in timed}
    params = result["setup"]["params"]
    flat = result["runs"]["flat/ddp"]
    assert flat["median_step_ms"] > 0 and flat["bytes_sent_per_rank"] == pytest.approx(2 * 1 / 2 * params * 4)
    assert result["runs"]["flat/balanced"]["buckets_count"] == result["bert_large_buckets"]["balanced"]["buckets"]
    at_1024 = {name: rows[-1] for name, rows in result["model"]["predictions"]["H100"].items()}
    assert at_1024["flat"]["inter_bytes_per_gpu"] > 8 * at_1024["hierarchical"]["inter_bytes_per_gpu"]
    assert png.stat().st_size > 10_000


def test_only_rejects_an_unknown_variant_before_running():
    with pytest.raises(SystemExit, match="unknown variant.*hierarchical/dpp.*choose from flat/ddp"):
        load("comm").main(["--only", "flat/ddp,hierarchical/dpp"])


def test_profile_reads_the_cpu_time_of_every_live_thread():
    load("comm")  # bench/comm_profile.py imports it by name, as it does when run from bench/
    prof = load("comm_profile")
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:  # 0.3 s of this thread's CPU, then stay alive until read
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        spun.set()
        release.wait()

    thread = threading.Thread(target=spin)
    thread.start()
    spun.wait()
    seconds = prof.thread_cpu_s()
    release.set()
    thread.join()
    # /proc counts in clock ticks (10 ms): the spinner's 0.3 s shows as at least 0.25 s, under its own id
    assert seconds[thread.native_id][1] >= 0.25
    assert threading.get_native_id() in seconds and thread.native_id != threading.get_native_id()


def test_pooled_ratios_are_the_median_of_every_round_of_every_run():
    """bench/comm_pool.py against statistics.median by hand, and its interval around it."""
    def run(wall: list[float], cpu: list[float]) -> dict:
        return {"ratio_to_flat": {"hierarchical/ddp": {"vs": "flat/ddp", "median": sorted(wall)[len(wall) // 2],
                                                       "per_round": wall, "cpu_median": sorted(cpu)[len(cpu) // 2],
                                                       "cpu_per_round": cpu},
                                  "only/here": {"vs": "flat/ddp", "median": 9.0, "per_round": [9.0],
                                                "cpu_median": 9.0, "cpu_per_round": [9.0]}}}

    runs = [run([1.0, 1.2, 0.9], [1.1, 1.1, 1.0]), run([1.5, 1.05], [1.2, 1.3])]
    del runs[1]["ratio_to_flat"]["only/here"]  # a variant missing from one run is left out
    pooled = load("comm_pool").pool(runs)
    assert list(pooled) == ["hierarchical/ddp"]
    wall, cpu = pooled["hierarchical/ddp"]["wall"], pooled["hierarchical/ddp"]["cpu"]
    assert wall["rounds"] == 5 and wall["pooled_median"] == 1.05  # of 0.9, 1.0, 1.05, 1.2, 1.5
    assert cpu["pooled_median"] == 1.1 and wall["run_medians"] == [1.0, 1.5]
    assert wall["median_of_runs"] == 1.25
    low, high = wall["pooled_median_95"]
    assert 0.9 <= low <= 1.05 <= high <= 1.5


def test_ratios_to_flat_pair_each_run_with_flat_on_the_same_buckets_and_dtype():
    """Per round: the mean of the round's `steps` steps over flat's; overall: median over median (by hand)."""
    def run(reduce: str, wall: list[float]) -> dict:
        return {"reduce": reduce, "step_s": wall, "step_cpu_s": [2 * w for w in wall]}

    runs = {"flat/ddp": run("flat", [1.0, 1.0, 2.0, 2.0]),
            "hierarchical/ddp": run("hierarchical", [2.0, 2.0, 3.0, 3.0]),
            "flat+bf16/ddp": run("flat+bf16", [1.0, 3.0]),
            "hierarchical+bf16/ddp": run("hierarchical+bf16", [1.0, 1.0]),
            "ps/balanced": run("ps", [5.0, 5.0])}  # no flat run on balanced buckets: left out
    ratios = load("comm").ratios_to_flat(runs, steps=2)
    assert set(ratios) == {"hierarchical/ddp", "hierarchical+bf16/ddp"}
    hier = ratios["hierarchical/ddp"]
    assert hier["vs"] == "flat/ddp" and ratios["hierarchical+bf16/ddp"]["vs"] == "flat+bf16/ddp"
    assert hier["per_round"] == [2.0, 1.5] and hier["cpu_per_round"] == [2.0, 1.5]  # 2/1, 3/2
    assert hier["median"] == pytest.approx(2.5 / 1.5) and ratios["hierarchical+bf16/ddp"]["per_round"] == [0.5]
