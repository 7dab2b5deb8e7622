"""bench/time_to_train.py: the step model against hand arithmetic, the RCPs against mlperf-logging's own file,
and bad settings rejected with one line and exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    return load_script(f"bench/{name}.py")


@pytest.fixture(scope="module")
def ttt():
    return load("time_to_train")


def test_step_model_matches_a_hand_calculation(ttt) -> None:
    """64 A100s, hierarchical all-reduce half overlapped, sharded optimizer; every figure written out."""
    run = ttt.Run("A100", gpus=64, local_batch=48, samples=2_700_000, eval_interval=175_000)
    tech = ttt.Technique("global", "hierarchical", "sharded", overlap=0.5)
    got = ttt.predict(0.003, run, tech, imbalance_factor=1.02)

    compute = 48 * 0.003 * 1.02
    grad = 2 * 335e6  # bf16 BERT-large gradient
    # in-node reduce-scatter and all-gather over 8 GPUs on NVLink (2 us, 240 GB/s): lg(8) a + 7/8 n / B each
    in_node = 3 * 2e-6 + 7 / 8 * grad / 240e9
    # across 8 nodes, each GPU all-reduces its eighth on its own HDR NIC (6 us, 25 GB/s)
    across = 2 * (3 * 6e-6 + 7 / 8 * (grad / 8) / 25e9)
    comm = 2 * in_node + across
    exposed = comm / 2  # half hides: the backward (2/3 of compute) is longer than that
    optimizer = 335e6 * 36 / (0.8 * 2.0e12) / 64
    step = compute + exposed + optimizer
    evals = 2_700_000 / 175_000 * 10_000 / 64 * 0.003 / 3
    minutes = (2_700_000 / 3072 * step + evals) / 60

    assert got.comm_s == pytest.approx(comm, rel=1e-12)
    assert got.exposed_comm_s == pytest.approx(exposed, rel=1e-12)
    assert got.optimizer_s == pytest.approx(optimizer, rel=1e-12)
    assert got.step_s == pytest.approx(step, rel=1e-12)
    assert got.minutes == pytest.approx(minutes, rel=1e-12)


def test_comm_terms_by_hand(ttt) -> None:
    a100 = ttt.SYSTEMS["A100"]
    grad = 670e6
    flat = 2 * (10 * 6e-6 + 1023 / 1024 * grad / 25e9)  # one ring over 1024 GPUs at the NIC share
    assert ttt.allreduce_seconds(grad, 1024, "flat", a100) == pytest.approx(flat, rel=1e-12)
    # in-node reduce-scatter + all-gather on NVLink, then 128 nodes all-reduce an eighth each on their own NIC
    hier = 2 * (3 * 2e-6 + 7 / 8 * grad / 240e9) + 2 * (7 * 6e-6 + 127 / 128 * (grad / 8) / 25e9)
    assert ttt.allreduce_seconds(grad, 1024, "hierarchical", a100) == pytest.approx(hier, rel=1e-12)
    # Inside one node both are the NVLink ring.
    one_node = 2 * (3 * 2e-6 + 7 / 8 * grad / 240e9)
    assert ttt.allreduce_seconds(grad, 8, "flat", a100) == pytest.approx(one_node, rel=1e-12)
    assert ttt.allreduce_seconds(grad, 8, "hierarchical", a100) == pytest.approx(one_node, rel=1e-12)
    # A backward too short to hide behind: only 2/3 of compute hides, whatever the overlap.
    run = ttt.Run("A100", 1024, 1, 1e6, 325_000)
    got = ttt.predict(1e-4, run, ttt.Technique("none", "flat", "replicated", 1.0), imbalance_factor=1.0)
    assert got.exposed_comm_s == pytest.approx(flat - 2 / 3 * 1e-4, rel=1e-12)


def test_rates_and_calibration_invert_the_model(ttt) -> None:
    h100 = ttt.SYSTEMS["H100"]
    c = ttt.c_from_rate(540.0, 96, h100)
    alone = ttt.predict(c, ttt.Run("H100", 1, 96, 1e6, 150_000), ttt.Technique(optimizer="replicated"))
    assert alone.step_s == pytest.approx(96 / 540, rel=1e-12)  # one GPU: the measured step, optimizer included
    run = ttt.Run("A100", 8, 56, 2.46e6, 150_000)
    tech = ttt.Technique("global", "hierarchical", "sharded", 0.0)
    assert ttt.predict(ttt.calibrate(16.88, run, tech), run, tech).minutes == pytest.approx(16.88, rel=1e-9)


def olympic_mean(values: list[float]) -> float:
    values = sorted(values)[1:-1]
    return sum(values) / len(values)


def test_rcps_come_from_mlperf_loggings_file(ttt) -> None:
    import mlperf_logging

    table = ttt.load_rcps()
    path = Path(mlperf_logging.__file__).parent.parent / table.path
    assert path.name == "rcps_bert.json" and "training_5.0.0" in path.parts
    raw = {r["BS"]: olympic_mean(r["Epochs to converge"]) for r in json.loads(path.read_text()).values()}
    assert table.full == pytest.approx(raw)
    # The pruned set the checker uses (reference: mlperf_logging.md section 5).
    assert sorted(table.points) == [448, 4608, 6144, 6912, 12288, 13056, 16384]
    assert table.samples(448) == (pytest.approx(raw[448]), "RCP found")
    # config_DGXA100_8x8x48x1.sh: GBS 3072 has an RCP of its own, but the pruned checker interpolates 448..4608.
    env = ttt.sourced(ROOT / "config_DGXA100_8x8x48x1.sh")
    gbs = int(env["BATCHSIZE"]) * int(env["GRADIENT_STEPS"]) * int(env["DGXNNODES"]) * int(env["DGXNGPU"])
    assert gbs == 3072
    want = raw[448] + (raw[4608] - raw[448]) * (3072 - 448) / (4608 - 448)
    assert table.samples(gbs) == (pytest.approx(want, rel=1e-12), "interpolated 448..4608")
    assert table.samples(256)[0] == pytest.approx(raw[448])  # below the smallest: the checker uses it
    with pytest.raises(ttt.BadInput, match="Missing RCP"):
        table.samples(32768)


def test_rules_eval_interval(ttt) -> None:
    got = {gbs: ttt.rules_eval_interval(gbs) for gbs in (448, 3072, 8192, 16384)}
    assert got == {448: 150_000, 3072: 175_000, 8192: 225_000, 16384: 325_000}


BAD = [
    (["--system", "TPUv4"], "unknown system 'TPUv4'"),
    (["--rate", "0"], "--rate 0.0 samples/s is not positive"),
    (["--rate", "-3"], "--rate -3.0 samples/s is not positive"),
    (["--model-json", "/nonexistent/model.json"], "--model-json /nonexistent/model.json does not exist"),
    (["--balances", "none", "zigzag"], "unknown balance strategy 'zigzag'"),
    (["--overlap", "1.5"], "overlap 1.5 is not in [0, 1]"),
    (["--gpus", "8", "0"], "every count must be positive"),
    (["--rate", "fast"], "argument --rate: invalid float value"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_settings_fail_with_one_line(ttt, capsys, tmp_path: Path, argv: list[str], message: str) -> None:
    out = ["--json", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")]
    try:
        code = ttt.main([*argv, *out])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("subset", (True, False, None), ids=("subset", "full", "before_the_subset"))
def test_a_bert_large_model_json_is_taken_at_its_own_rate(ttt, tmp_path: Path, subset) -> None:
    """A BERT-large bench row is not rescaled, whether it ran the last-layer subset or not (None: a JSON written
    before the key existed, when every row ran the full last layer): the rate is BERT-large's as measured."""
    from bert.model.config import NAMED
    from bert.model.flops import StepShape, train_flops

    lengths, masked = [512, 300, 128, 77], 80
    flops = train_flops(NAMED["large"], StepShape.unpadded(lengths, masked, bool(subset)))
    row = {"variant": "unpadded/varlen", "samples_per_s": 600.0, "flops_per_step": flops}
    row |= {} if subset is None else {"last_layer_subset": subset}
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"results": [row], "batch_lengths": lengths, "masked_tokens": masked,
                                "device": "H100"}))
    rate, batch, note = ttt.rate_from_model_json(path)
    assert (rate, batch) == (600.0, 4) and " x " not in note


def test_a_bad_model_json_exits_2_from_the_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "model.json"
    bad.write_text('{"results": [], "batch_lengths": [512], "masked_tokens": 76}')
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "time_to_train.py"), "--model-json", str(bad),
                          "--json", str(tmp_path / "t.json")], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"time_to_train: error: model JSON {bad} has no unpadded result to take the rate from"
    ]


def test_report_covers_every_config_and_states_its_error(ttt, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    argv = ["--gpus", "8", "1024", "--balances", "none", "--json", str(out), "--png", str(tmp_path / "t.png")]
    assert ttt.main(argv) == 0
    report = json.loads(out.read_text())
    configs = {p.name for p in ROOT.glob("config_DGX*_*x*.sh") if not p.is_symlink()}
    assert {r["config"] for r in report["configs"]} == configs
    rows = report["validation"]["rows"]
    assert sum(not r["calibration"] for r in rows) >= 3
    for r in rows:
        assert r["error_rcp"] == pytest.approx(r["predicted_min_rcp"] / r["minutes"] - 1)
        if r["calibration"]:  # calibrated with its published samples: reproduced exactly
            assert r["error_published_samples"] == pytest.approx(0, abs=1e-9)
    summary = report["validation"]["summary"]
    checked = [abs(r["error_rcp"]) for r in rows if not r["calibration"]]
    assert summary["mean_abs_error_rcp"] == pytest.approx(sum(checked) / len(checked))
    assert {r["gpus"] for r in report["curve"]} == {8, 1024}
    assert len(report["curve"]) == 2 * 2 * 4  # systems x GPU counts x (reduce x optimizer) for one balance
    assert all(math.isfinite(r["minutes"]) and r["minutes"] > 0 for r in report["curve"])


def test_imbalance_is_the_most_loaded_gpu_over_the_mean_as_in_table5(ttt) -> None:
    """Samsung [000] Table 5 (1024 GPUs, 8 per node, 16 per GPU): most loaded 6459 tokens without balancing, 4246
    with stratification + local presort + snake, against a mean of 16 x 254.6 = 4074 tokens on the Wikipedia
    phase-2 mix (37.3 / 19.7 / 11.7 / 31.4 %, 23 % at 512, the rest uniform in each stratum, shares / 1.001)."""
    mean = 16 * (0.373 * 64.5 + 0.197 * 192.5 + 0.117 * 320.5 + 0.084 * 448 + 0.23 * 512) / 1.001
    assert ttt.imbalance("samsung", 1024, 8, 16) == pytest.approx(4246 / mean, abs=0.01)
    assert ttt.imbalance("none", 1024, 8, 16) == pytest.approx(6459 / mean, abs=0.03)


def test_packing_draws_as_many_sequences_per_gpu_as_the_local_batch(ttt, monkeypatch) -> None:
    """NVIDIA's packed data holds 2 sequences per pack ([NVIDIA] --average_packing_rate 2; 1.999 measured): a local
    batch of 48 sequences is 24 packs."""
    import numpy as np

    from bert.balance.lab import simulate as lab
    from bert.balance.lab.length_pmf import LengthPMF

    full = lab.PackedData(LengthPMF(np.eye(512)[511]), ratio=2.0)  # every pack 512 tokens
    seen = []
    real = lab.simulate_packing

    def spy(packed, gpus, packs_per_gpu, trials, rng):
        seen.append(packs_per_gpu)
        return real(packed, gpus, packs_per_gpu, trials, rng)

    monkeypatch.setattr(lab, "pack", lambda pmf: full)
    monkeypatch.setattr(lab, "simulate_packing", spy)
    assert ttt.imbalance.__wrapped__("packing", 16, 8, 48) == 1.0  # full packs: no spread
    assert seen == [24]


def test_a_smaller_models_json_is_scaled_to_bert_large_by_flops(ttt, tmp_path: Path) -> None:
    """The fastest unpadded row (not a padded one, not a slower unpadded one), its rate times its model's FLOPs over
    BERT-large's: a model with a quarter of BERT-large's FLOPs at 2000 samples/s is BERT-large at 500."""
    from bert.model.config import NAMED
    from bert.model.flops import StepShape, train_flops

    lengths, masked = [512, 300, 128, 77], 80
    quarter = train_flops(NAMED["large"], StepShape.unpadded(lengths, masked, False)) / 4
    rows = [{"variant": "padded/sdpa", "samples_per_s": 9000.0, "flops_per_step": quarter},
            {"variant": "unpadded/loop", "samples_per_s": 1000.0, "flops_per_step": quarter},
            {"variant": "unpadded/varlen", "samples_per_s": 2000.0, "flops_per_step": quarter}]
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"results": rows, "batch_lengths": lengths, "masked_tokens": masked, "device": "x"}))
    rate, batch, note = ttt.rate_from_model_json(path)
    assert rate == pytest.approx(500.0) and batch == 4
    assert "unpadded/varlen 2000 samples/s" in note and "x 0.25" in note


def test_a_configs_local_batch_counts_its_gradient_steps(ttt, tmp_path: Path) -> None:
    # 2 DGX A100 x 8 GPUs, 24 sequences per micro-batch, 2 accumulation steps: 48 per GPU per step, GBS 768.
    config = tmp_path / "config_DGXA100_2x8x24x2.sh"
    config.write_text("export DGXSYSTEM=DGXA100_2x8x24x2\nexport DGXNNODES=2\nexport DGXNGPU=8\n"
                      "export BATCHSIZE=24\nexport GRADIENT_STEPS=2\n")
    (row,) = ttt.config_rows([config], {"A100": 0.003}, ttt.load_rcps(), {})
    assert (row["gpus"], row["local_batch"], row["gbs"]) == (16, 48, 768)
    assert row["eval_interval"] == 150_000  # FLOOR(0.05 x (230.23 x 768 + 3e6), 25000)
