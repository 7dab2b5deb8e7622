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
