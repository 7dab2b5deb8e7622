"""bench/train_gpu.py without a driver run: the steady-state window and its statistics from a metrics.jsonl
written here with known interval times, the driver environment built from a config, the run_stop status, and
the table and JSON.

Reference: totals worked out by hand from the synthetic intervals (samples and seconds chosen, rates derived).
"""

from __future__ import annotations

import json
import sys

import pytest
from script_modules import ROOT, load_script

from bert.config import from_env_and_args
from bert.train.profile import Timed, summarize

sys.path.insert(0, str(ROOT / "bench"))  # the script imports bench/model.py
bench = load_script("bench/train_gpu.py")

# (step, new samples, seconds, tokens, TFLOP) per interval of 5 steps at 2 GPUs; the first is start-up.
INTERVALS = [(5, 80, 30.0, 9000, 0.3), (10, 80, 10.0, 22000, 0.5), (15, 80, 20.0, 21000, 0.4),
             (20, 80, 16.0, 23000, 0.48)]


def metrics_lines() -> list[dict]:
    """Records as bert.train.progress writes them (the first interval has no rates), plus an eval record."""
    records, samples = [], 0
    for i, (step, new, seconds, tokens, tflop) in enumerate(INTERVALS):
        samples += new
        r = {"step": step, "samples": samples, "loss": 10.0, "lr": 1e-3}
        if i:
            r |= {"samples_per_s": round(new / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                  "tflops": float(f"{tflop / seconds:.4g}")}
        records.append(r)
    records.insert(3, {"step": 15, "samples": 240, "eval_accuracy": 0.1})
    return records


def test_window_skips_warmup_intervals_and_weights_by_time():
    picked = bench.window(metrics_lines(), warmup_steps=5, log_freq=5)
    assert [r["step"] for r in picked] == [10, 15, 20]  # step 5's interval (1-5) is warm-up, and has no rates
    stats = bench.summarise(picked, world=2, matmul_flops=1e11)
    seconds = 10 + 20 + 16
    assert stats["steps"] == 15 and stats["intervals"] == 3
    assert stats["seconds"] == pytest.approx(seconds, rel=1e-3)
    assert stats["samples_per_s_per_gpu"] == pytest.approx(240 / seconds / 2, rel=1e-3)
    assert stats["tokens_per_s_per_gpu"] == pytest.approx((22000 + 21000 + 23000) / seconds, rel=1e-3)
    assert stats["tflops_per_gpu"] == pytest.approx((0.5 + 0.4 + 0.48) / seconds, rel=1e-3)
    assert stats["mfu_vs_matmul"] == pytest.approx(stats["tflops_per_gpu"] * 1e12 / 1e11)
    assert stats["samples_per_s_per_gpu_min"] == pytest.approx(80 / 20 / 2, rel=1e-3)
    assert stats["samples_per_s_per_gpu_max"] == pytest.approx(80 / 10 / 2, rel=1e-3)
    assert "mfu_vs_datasheet" not in stats  # the records carry no mfu (a CPU)
    # A later warm-up leaves fewer intervals; one past the run leaves none, which is an error.
    assert [r["step"] for r in bench.window(metrics_lines(), 10, 5)] == [15, 20]
    assert [r["step"] for r in bench.window(metrics_lines(), 5, 5, last_step=15)] == [10, 15]  # profiled steps after
    with pytest.raises(ValueError, match="no progress interval"):
        bench.summarise(bench.window(metrics_lines(), 20, 5), 2, 1e11)


def test_driver_vs_bench_ratios():
    driver = {"samples_per_s_per_gpu": 9.5, "tokens_per_s_per_gpu": 2600.0, "tflops_per_gpu": 0.19}
    ratios = bench.driver_vs_bench(driver, {"samples_per_s": 10.0, "tokens_per_s": 2500.0, "tflops": 0.2})
    assert ratios == pytest.approx({"samples_per_s": 0.95, "tokens_per_s": 1.04, "tflops": 0.95})


def test_run_stop_status_reads_the_result_log(tmp_path):
    log = tmp_path / "result.txt"
    assert bench.run_stop_status(log) is None
    log.write_text(':::MLLOG {"key": "run_start", "metadata": {}}\n'
                   ':::MLLOG {"key": "run_stop", "value": null, "metadata": {"status": "aborted"}}\n')
    assert bench.run_stop_status(log) == "aborted"


def test_driver_env_bounds_the_run_and_applies_flags_last(random_shards, tmp_path):
    args = bench.parse_args(["--config", str(ROOT / "config_CPU_1x2.sh"), "--gpus", "2", "--data", str(random_shards),
                             "--batchsize", "4", "--balance", "lpt", "--env", "LR=0.5", "--env", "BALANCE=none"])
    env = bench.driver_env(args, tmp_path / "run")
    # 10 warm-up + 30 window steps, then 5 under the driver's profiler
    assert env["MAX_STEPS"] == "45" and env["LOG_FREQ"] == "5" and env["TARGET_MLM_ACCURACY"] == "0.999"
    assert (env["PROFILE_FROM"], env["PROFILE_STEPS"]) == ("41", "5")
    assert int(env["EVAL_ITER_START_SAMPLES"]) > 40 * 4 * 2 and int(env["MAX_SAMPLES_TERMINATION"]) > 40 * 4 * 2
    assert env["NUM_EVAL_EXAMPLES"] == "30"  # the config's 200, cut to the eval set
    assert env["BATCHSIZE"] == "4" and env["LR"] == "0.5" and env["BALANCE"] == "none"  # --env comes last
    assert env["BERT_CONFIG"] == "minilm" and env["DGXNGPU"] == "2" and env["OPTIMIZER"] == "adam"  # the config's
    cfg = from_env_and_args([], environ=env)  # what the driver will parse
    assert cfg.optim.max_steps == 45 and cfg.data.train_batch_size == 4 and cfg.run.profile_from == 41
    assert "MAX_STEPS=45" in bench.driver_settings(env)
    args.profile_steps = 0
    env = bench.driver_env(args, tmp_path / "run")
    assert env["MAX_STEPS"] == "40" and "PROFILE_FROM" not in env


def small_vocabulary_tiny(folder) -> str:
    """BERT tiny with 2048 words, as a config file: the MLM decoder's GEMMs over MLPerf's 30528 were nearly all of a
    bench step's time on the CPU (three quarters of a minute in bf16, which it has no fast GEMM for). Neither the
    optimizer the step builds nor the FLOPs it counts depend on the vocabulary's size."""
    from bert.model.config import NAMED

    path = folder / "tiny_2048_words.json"
    path.write_text(json.dumps({**NAMED["tiny"].to_dict(), "vocab_size": 2048, "real_vocab_size": 2048}))
    return str(path)


@pytest.mark.parametrize("master", ("0", "1"))
def test_bench_step_builds_the_drivers_optimizer(random_shards, tmp_path, master):
    """The bench step takes the driver's optimizer, master weights included (the model cast to bf16 inside
    build_optimizer: a bench that did not pass the compute dtype failed here on the GPU). COMPILE_OPTIMIZER=1
    (compiled there as the driver compiles it) is left to the GPU: it compiles the model too, ~50 s here."""
    args = bench.parse_args(["--config", str(ROOT / "config_CPU_1x2.sh"), "--data", str(random_shards), "--bert-config",
                             small_vocabulary_tiny(tmp_path), "--precision", "bf16", "--env",
                             f"MASTER_WEIGHTS={master}"])
    step = bench.bench_step(bench.driver_env(args, tmp_path / "run"), "cpu", repeats=1, seed=0)
    assert step["master_weights"] is (master == "1") and step["precision"] == "bf16"
    assert step["compile_optimizer"] is False
    assert step["optimizer"] == ("MasterWeights" if master == "1" else "AdamW") and step["samples_per_s"] > 0


@pytest.mark.parametrize("subset", ("0", "1"))
def test_bench_step_runs_the_drivers_last_layer(random_shards, tmp_path, subset):
    """LAST_LAYER_SUBSET reaches the bench step's model, and its FLOPs are counted as that model runs them."""
    from bert.model import BertConfig
    from bert.model.flops import StepShape, train_flops
    from bert.synthetic import random_batch

    config = small_vocabulary_tiny(tmp_path)
    args = bench.parse_args(["--config", str(ROOT / "config_CPU_1x2.sh"), "--data", str(random_shards), "--bert-config",
                             config, "--env", f"LAST_LAYER_SUBSET={subset}"])
    step = bench.bench_step(bench.driver_env(args, tmp_path / "run"), "cpu", repeats=1, seed=0)
    assert step["last_layer_subset"] is (subset == "1")
    batch = random_batch(step["batch_lengths"], seed=0, vocab_size=2048)
    want = train_flops(BertConfig.load(config), StepShape.of_batch(batch, subset == "1"))
    assert step["tflops"] * step["median_s"] * 1e12 == pytest.approx(want, rel=1e-9)


def test_bad_windows_and_missing_data_are_named(tmp_path, capsys):
    base = ["--config", str(ROOT / "config_CPU_1x2.sh"), "--data", str(tmp_path)]
    for extra, words in ((["--window-steps", "12"], "multiples of --log-freq"), ([], "no train_varlength")):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(base + extra)
        assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_bench_variant_names_match_bench_model():
    assert bench.bench_variant("loop", "cpu", "off", 0, "fp32") == "unpadded/loop"
    assert bench.bench_variant("varlen", "cuda", "default", 512, "bf16") == "compiled-static512/varlen"
    assert bench.bench_variant("varlen", "cuda", "off", 512, "bf16") == "static512/varlen"
    assert bench.bench_variant("varlen", "cuda", "off", 512, "fp8") == "fp8/varlen"  # padded to STATIC_TOKENS
    assert bench.bench_variant("varlen", "cuda", "default", 512, "fp8") == "compiled-fp8/varlen"
    with pytest.raises(ValueError, match="ATTENTION=varlen only"):
        bench.bench_variant("grouped", "cuda", "default", 0, "bf16")


def test_table_and_json(tmp_path, capsys):
    stats = bench.summarise(bench.window(metrics_lines(), 5, 5), 2, 1e11)
    step = {"variant": "unpadded/loop", "optimizer": "Lamb", "precision": "fp32", "repeats": 3, "samples_per_s": 3.0,
            "tokens_per_s": 800.0, "tflops": 0.03}
    report = {"device": "cpu", "torch": "x", "config": "config_CPU_1x2.sh", "gpus": 2, "driver_status": "aborted",
              "warmup_steps": 5, "window_steps": 15, "matmul_flops_per_s": {"before": 1e11, "after": 1.2e11},
              "load_average_1min": {"before": 1.0, "after": 2.0}, "driver": stats, "bench": step,
              "driver_vs_bench": bench.driver_vs_bench(stats, step),
              "profile": {**summarize([Timed("nvjet_tst_x", 2000.0)], steps=2, wall_s=0.004), "first": 21, "last": 22,
                          "device": "cpu"},
              "compiled_after_run_start": {"stats": {"unique_graphs": 1}}}
    bench.write_report(report, tmp_path / "out" / "train_gpu_cpu.json")
    assert json.loads((tmp_path / "out" / "train_gpu_cpu.json").read_text()) == report
    table = capsys.readouterr().out
    assert "window: steps 6-20 (3 records" in table
    assert "profile: steps 21-22 on cpu: 2.0 ms per step, device busy 1.0 ms (50%)" in table
    assert "compile after run_start: stats unique_graphs +1\n" in table
    row = next(line for line in table.splitlines() if line.startswith("samples/s per GPU"))
    assert row.split()[-3:] == [f"{stats['samples_per_s_per_gpu']:.2f}", "3.00",
                                f"{stats['samples_per_s_per_gpu'] / 3.0:.3f}"]


def test_the_median_interval_rate_is_the_middle_one_per_gpu():
    # Three intervals at 2 GPUs: 8, 4 and 5 samples/s in all, i.e. 4, 2 and 2.5 per GPU; the middle one is 2.5
    # (their mean, 2.83, would be pulled up by the fast interval).
    intervals = [{"samples_per_s": rate, "seconds": 80 / rate, "new_samples": 80, "new_steps": 5}
                 for rate in (8.0, 4.0, 5.0)]
    stats = bench.summarise(intervals, world=2, matmul_flops=1e11)
    assert stats["samples_per_s_per_gpu_median"] == 2.5
    assert (stats["samples_per_s_per_gpu_min"], stats["samples_per_s_per_gpu_max"]) == (2.0, 4.0)
    assert stats["samples_per_s_per_gpu"] == pytest.approx(240 / (10 + 20 + 16) / 2)


@pytest.mark.parametrize("ending", ["crash", "limit", "early"])
def test_a_driver_that_fails_after_its_window_still_reports_it(random_shards, tmp_path, monkeypatch, ending):
    """The profiled steps come after the window: a crash there (exit 139 inside CUPTI or a graph replay) or the device
    call's step limit (SIGTERM to the benchmark) used to lose the whole measurement. Now the JSON is written from the
    window, with how the driver ended, and the benchmark still exits 1; a window the driver did not finish is not
    reported."""
    out, report = tmp_path / "run", tmp_path / "report.json"
    args = ["--config", str(ROOT / "config_CPU_1x2.sh"), "--gpus", "2", "--data", str(random_shards), "--warmup-steps",
            "5", "--window-steps", "15", "--log-freq", "5", "--keep", str(out), "--json", str(report)]

    real_run = bench.subprocess.run

    def driver(command, *rest, **kw):
        if not str(command[-1]).endswith("run_and_time.sh"):  # sourcing the config
            return real_run(command, *rest, **kw)
        lines = metrics_lines() if ending != "early" else metrics_lines()[:2]
        (out / "output").mkdir(parents=True, exist_ok=True)
        (out / "output" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (out / "driver.log").write_text("step 20\nerror: rank 0: CUDA error: an illegal memory access\n")
        if ending == "limit":
            raise bench.Stopped
        return bench.subprocess.CompletedProcess([], 139)

    monkeypatch.setattr(bench.subprocess, "run", driver)
    monkeypatch.setattr(bench, "matmul_rate", lambda device: 1e11)
    assert bench.main(args) == 1
    if ending == "early":
        assert not report.exists()
        return
    written = json.loads(report.read_text())
    assert written["driver"]["samples_per_s_per_gpu"] == pytest.approx(240 / 46 / 2, rel=1e-3)
    assert written["bench"] is None
    assert written["driver_status"] == ("failed after its window: stopped by the step's time limit (SIGTERM)"
                                        if ending == "limit" else "failed after its window: exit status 139, run_stop "
                                        "None: error: rank 0: CUDA error: an illegal memory access")
