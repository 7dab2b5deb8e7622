"""The lab's command line: real shards in, clear errors and a non-zero exit on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from script_modules import load_script

from bert.data.format import write_varlength_shard
from bert.synthetic import random_sample


def load(name: str):
    return load_script(f"bench/{name}.py")


@pytest.fixture(scope="module")
def lab():
    return load("balance")


def test_lab_reads_the_length_distribution_from_shards(lab, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    # Two lengths only, 100 and 300 in a 3:1 ratio: the shard's own histogram must drive the draw.
    shard = tmp_path / "part_00000.hdf5"
    write_varlength_shard(shard, [random_sample(n, rng) for n in [100, 100, 100, 300] * 10])
    out = tmp_path / "lab.json"
    argv = ["--shards", str(shard), "--gpus", "8", "--trials", "300", "--strategies", "none", "stratified"]
    assert lab.main([*argv, "--json", str(out), "--png", str(tmp_path / "lab.png")]) == 0
    report = json.loads(out.read_text())
    assert report["distribution"]["sequences"] == 40
    assert report["distribution"]["stratum_shares"] == [0.75, 0.0, 0.25, 0.0]
    none, stratified = report["results"]
    assert none["mean"] == pytest.approx(16 * 150, rel=0.02)
    # Stratified draws 12 x 100 + 4 x 300 every time: no spread at all.
    assert stratified["avg_min"] == stratified["avg_max"] == 12 * 100 + 4 * 300
    assert report["table5"] is None  # not the paper's setup
    assert (tmp_path / "lab.png").stat().st_size > 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--probs", "0.5", "0.5"], "one probability per stratum"),
        (["--strategies", "snaek"], "unknown balance strategy 'snaek'"),
        (["--shards", "missing.hdf5"], "missing.hdf5: no such shard"),
    ],
)
def test_lab_bad_input(lab, tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    outputs = ["--json", str(tmp_path / "x.json"), "--png", str(tmp_path / "x.png")]
    assert lab.main([*argv, "--gpus", "8", "--trials", "2", *outputs]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_cost_bench_rejects_unknown_strategy(capsys) -> None:
    assert load("balance_cost").main(["--strategies", "global", "lpd"]) == 2
    assert "unknown balance strategy 'lpd'" in capsys.readouterr().err


def test_lab_on_less_than_a_node_and_packs_of_two(lab, tmp_path: Path) -> None:
    """4 GPUs (half a node of 8) from a shard of 256-token sequences only: every GPU gets 16 x 256 = 4096 tokens
    whatever the strategy, and packing pairs them, so 8 full packs per GPU carry the same 16 sequences."""
    shard = tmp_path / "part_00000.hdf5"
    write_varlength_shard(shard, [random_sample(256, np.random.default_rng(i)) for i in range(8)])
    out = tmp_path / "lab.json"
    argv = ["--shards", str(shard), "--gpus", "4", "--trials", "3", "--strategies", "samsung", "node_ideal", "packing"]
    assert lab.main([*argv, "--json", str(out), "--png", str(tmp_path / "lab.png")]) == 0
    report = json.loads(out.read_text())
    assert (report["packing"]["ratio"], report["packing"]["packs_per_gpu"]) == (2.0, 8)
    for r in report["results"]:
        assert (r["gpus"], r["avg_min"], r["avg_max"]) == (4, 4096, 4096), r["strategy"]


def test_cost_bench_prices_the_exchange_and_the_cpu_time_by_hand(monkeypatch) -> None:
    """16 GPUs in 2 nodes of 8, 16 padded sequences of 4098 bytes each, links given in us and GB/s; the CPU time of
    `assign` stubbed (world 4 ms, a rank's own group 1 ms) against a 100 ms step."""
    cost = load("balance_cost")
    monkeypatch.setattr(cost, "time_assign", lambda names, *a: {(n, part): t for n in names
                                                                for part, t in (("world", 4e-3), ("group", 1e-3))})
    args = cost.parse_args(["--gpus", "16", "--strategies", "global", "samsung", "--step-ms", "100",
                            "--nvlink", "3", "100", "--infiniband", "5", "20"])
    rows = {r["strategy"]: r for r in cost.run(args)["rows"]}
    world, node = 16 * 16 * 4098, 8 * 16 * 4098
    # NVIDIA: the 2 nodes' same-rank peers swap their eighth over InfiniBand, then the node shares all of it.
    nvidia = (5e-6 + world / 8 / 2 / 20e9) + (3 * 3e-6 + world * 7 / 8 / 100e9)
    samsung = 3 * 3e-6 + node * 7 / 8 / 100e9  # inside the node only
    for name, seconds in (("global", nvidia), ("samsung", samsung)):
        assert rows[name]["comm_ms"] == pytest.approx(seconds * 1e3, rel=1e-12)
        assert rows[name]["paper_overhead"] == pytest.approx((seconds + 1e-3) / 0.1, rel=1e-12)
        assert rows[name]["harness_cpu_share"] == pytest.approx(4e-3 / 0.1, rel=1e-12)
