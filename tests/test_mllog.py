"""The MLPerf result log: truncated per run, caller's file:lineno, JSON values, rank 0 only."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from ranks import start_ranks

from bert.config import TrainConfig, from_env_and_args, from_flat
from bert.train.mlperf_log import MLPerfLog


def lines(path: Path) -> list[dict]:
    return [json.loads(x.split(":::MLLOG ", 1)[1]) for x in path.read_text().splitlines() if ":::MLLOG" in x]


def cfg() -> TrainConfig:
    return from_flat(input_dir="x", eval_dir="x", bert_config_path="tiny", train_batch_size=56,
                     gradient_accumulation_steps=2, learning_rate=4.25e-4, max_steps=6700, division="closed")


def test_a_second_logger_replaces_the_file(tmp_path):
    path = tmp_path / "result_0.txt"
    MLPerfLog(str(path), enabled=True).init_start(cache_cleared=False)
    MLPerfLog(str(path), enabled=True).init_start(cache_cleared=False)  # mllog.config(filename=...) would append here
    assert [e["key"] for e in lines(path)] == ["cache_clear", "init_start"]


@pytest.mark.parametrize("cleared", [True, False])
def test_cache_clear_tells_what_the_launcher_did(cleared, tmp_path):
    path = tmp_path / "result_0.txt"
    MLPerfLog(str(path), enabled=True).init_start(cache_cleared=cleared)
    assert lines(path)[0]["key"] == "cache_clear" and lines(path)[0]["value"] is cleared


def test_cache_cleared_comes_from_the_environment():
    base = {"DATADIR_PHASE2": "x", "EVALDIR": "x", "BERT_CONFIG": "tiny", "BATCHSIZE": "1", "LR": "1", "MAX_STEPS": "1"}
    assert from_env_and_args([], base).log.cache_cleared is False  # not dropped unless the launcher says so
    assert from_env_and_args([], {**base, "CACHE_CLEARED": "1"}).log.cache_cleared is True


def test_metadata_names_the_calling_line(tmp_path):
    path = tmp_path / "result_0.txt"
    log = MLPerfLog(str(path), enabled=True)
    line = inspect.currentframe().f_lineno + 1
    log.eval_result(150_000, 0.5)
    log.start("eval_start", 150_000, {"epoch_num": 150_000})
    first, second = lines(path)
    assert (Path(first["metadata"]["file"]).name, first["metadata"]["lineno"]) == ("test_mllog.py", line)
    assert second["metadata"]["lineno"] == line + 1


def test_hyperparameters_once_each_with_plain_values(tmp_path):
    path = tmp_path / "result_0.txt"
    MLPerfLog(str(path), enabled=True).submission(cfg(), world_size=4)
    events = {e["key"]: e["value"] for e in lines(path)}
    assert len(events) == len(lines(path))  # every key exactly once
    assert events["global_batch_size"] == 56 * 2 * 4
    assert events["gradient_accumulation_steps"] == 2
    assert events["opt_lamb_epsilon"] == events["opt_epsilon"] == 1e-6
    assert events["submission_division"] == "closed" and events["submission_benchmark"] == "bert"
    required = {"opt_base_learning_rate", "opt_learning_rate_training_steps", "opt_learning_rate_warmup_steps",
                "num_warmup_steps", "start_warmup_step", "opt_lamb_beta_1", "opt_lamb_beta_2",
                "opt_lamb_weight_decay_rate", "seed", "submission_org", "submission_platform", "submission_status"}
    assert required <= events.keys()


def test_each_hyperparameter_logs_its_own_value(tmp_path):
    """Every logged hyperparameter against the setting it names, each setting a value no other has (NVIDIA's v2.0
    code logged opt_lamb_weight_decay_rate as 0.0 whatever it was); the RCP checker reads these values."""
    settings = dict(learning_rate=4.25e-4, opt_epsilon=1.5e-6, max_steps=6700, warmup_steps=17, start_warmup_step=-3,
                    opt_lamb_beta_1=0.61, opt_lamb_beta_2=0.853, weight_decay_rate=0.0123, lr_poly_power=0.9,
                    end_learning_rate=2e-7, max_seq_length=500, max_predictions_per_seq=75, optimizer="adam",
                    seed=4321, org="ours", platform="8xH100", status="onprem")
    config = from_flat(input_dir="x", eval_dir="x", bert_config_path="tiny", train_batch_size=48,
                       gradient_accumulation_steps=3, division="open", **settings)
    path = tmp_path / "result_0.txt"
    MLPerfLog(str(path), enabled=True).submission(config, world_size=16)
    events = {e["key"]: e["value"] for e in lines(path)}
    expected = {
        "submission_benchmark": "bert", "submission_org": "ours", "submission_division": "open",
        "submission_status": "onprem", "submission_platform": "8xH100", "seed": 4321,
        "global_batch_size": 48 * 3 * 16, "gradient_accumulation_steps": 3, "max_sequence_length": 500,
        "max_predictions_per_seq": 75, "opt_name": "adam", "opt_base_learning_rate": 4.25e-4,
        "opt_lamb_epsilon": 1.5e-6, "opt_epsilon": 1.5e-6, "opt_learning_rate_training_steps": 6700,
        "opt_learning_rate_warmup_steps": 17, "num_warmup_steps": 17, "start_warmup_step": -3,
        "opt_lamb_beta_1": 0.61, "opt_lamb_beta_2": 0.853, "opt_lamb_weight_decay_rate": 0.0123,
        "opt_lamb_learning_rate_decay_poly_power": 0.9, "opt_learning_rate_end": 2e-7,
    }
    assert events == expected


def test_eval_accuracy_epoch_num_is_an_int_sample_count_and_other_ranks_write_nothing(tmp_path):
    path = tmp_path / "result_0.txt"
    log = MLPerfLog(str(path), enabled=True)
    log.eval_result(samples=np.int64(2_450_000), accuracy=0.7205)
    log.run_stop(samples=2_450_000, eval_samples=10_000, success=True)
    acc = lines(path)[0]
    assert acc["value"] == 0.7205 and acc["metadata"]["epoch_num"] == 2_450_000
    assert type(acc["metadata"]["epoch_num"]) is int
    assert lines(path)[-1]["metadata"]["status"] == "success"
    other = tmp_path / "rank1.txt"
    MLPerfLog(str(other), enabled=False).run_stop(1, 1, success=True)
    assert not other.exists()


def test_run_stop_logs_both_sample_counts_and_an_aborted_status(tmp_path):
    """The closing events as the rules' checker reads them: block_stop, train_samples (samples trained), eval_samples
    (the eval set's size), run_stop with success or aborted."""
    path = tmp_path / "result_0.txt"
    MLPerfLog(str(path), enabled=True).run_stop(samples=1_536_000, eval_samples=10_000, success=False)
    events = [(e["key"], e["value"], e["metadata"].get("status")) for e in lines(path)]
    assert events == [("block_stop", None, None), ("train_samples", 1_536_000, None), ("eval_samples", 10_000, None),
                      ("run_stop", None, "aborted")]


def _start_run_worker(rank: int, store: str, log_path: str, times: str) -> None:
    """Rank 1 ends its initialisation late; rank 0 is slow to write run_start. Each records when it entered and left
    `start_run`."""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    log = MLPerfLog(log_path, enabled=rank == 0)
    if rank == 0:
        write = log._log

        def slow(kind, key, value, metadata):
            if key == "run_start":
                time.sleep(0.6)
            write(kind, key, value, metadata)

        log._log = slow
    else:
        time.sleep(0.6)
    entered = time.time()
    log.start_run()
    Path(times).with_suffix(f".{rank}").write_text(json.dumps([entered, time.time()]))
    dist.destroy_process_group()


def test_the_clock_starts_after_every_ranks_init_and_no_rank_trains_before_run_start(tmp_path):
    """Without the barrier before, init_stop would be stamped while rank 1 still initialised (its compile time then
    counted in the timed run); without the one after, rank 1 could start (and fail) before run_start is written."""
    log_path = tmp_path / "result_0.txt"
    start_ranks(_start_run_worker, args=(str(tmp_path / "store"), str(log_path), str(tmp_path / "times")), nprocs=2)
    events = {e["key"]: e["time_ms"] / 1000 for e in lines(log_path)}
    assert list(events) == ["init_stop", "run_start", "block_start"]
    rank1_entered, rank1_left = json.loads((tmp_path / "times.1").read_text())
    assert events["init_stop"] >= rank1_entered
    assert rank1_left >= events["run_start"]
