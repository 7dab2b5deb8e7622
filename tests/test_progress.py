"""The progress line's throughput: FLOPs counted from batch shapes, tflops and mfu, the peak FLOP/s table."""

from __future__ import annotations

import json

import pytest
import torch

from bert.model import BertConfig
from bert.model.flops import StepShape, train_flops
from bert.static_shapes import MASKED_BUCKET, masked_rows_bound, pad_to_buckets, padding_sequences
from bert.synthetic import random_batch
from bert.train import progress as progress_module
from bert.train.peak_flops import device_peak_flops, peak_flops
from bert.train.progress import FlopMeter, Progress


def test_flop_meter_counts_each_drawn_batch_once_and_resets():
    cfg = BertConfig.load("tiny")
    batches = [random_batch(lengths, seed=i) for i, lengths in enumerate([(3, 512), (1,), (77, 260, 130)])]
    meter = FlopMeter(cfg)
    drawn = meter.counting(iter(batches))
    assert next(drawn) is batches[0] and next(drawn) is batches[1]
    want = sum(train_flops(cfg, StepShape.unpadded(b.seq.lengths, len(b.masked_labels))) for b in batches[:2])
    assert meter.take() == {"train_flops": want, "train_tokens": 3 + 512 + 1}
    assert meter.take() == {"train_flops": 0, "train_tokens": 0}
    next(drawn)
    want = train_flops(cfg, StepShape.unpadded((77, 260, 130), len(batches[2].masked_labels)))
    assert meter.take() == {"train_flops": want, "train_tokens": 77 + 260 + 130}


@pytest.mark.parametrize("bucket, sequences", [(512, 1), (1024, 3)])
def test_flop_meter_leaves_out_the_static_padding_sequences(bucket, sequences):
    cfg = BertConfig.load("tiny")
    batch = random_batch((77, 260, 130), seed=3)
    padded = pad_to_buckets(batch, bucket, MASKED_BUCKET)  # 467 tokens + padding sequences up to the bucket
    assert padded.num_sequences == 3 + sequences == 3 + padding_sequences(bucket)
    meter = FlopMeter(cfg, static_tokens=bucket)
    next(meter.counting(iter([padded])))
    # the real sequences, and the masked rows as the head runs them (padded to the bucket)
    want = train_flops(cfg, StepShape.unpadded((77, 260, 130), padded.masked_labels.numel()))
    assert meter.take() == {"train_flops": want, "train_tokens": 77 + 260 + 130}
    rows = max(batch.masked_labels.numel(), masked_rows_bound(bucket, 3))  # the rows a bucket of that size carries
    assert padded.masked_labels.numel() == MASKED_BUCKET * -(-rows // MASKED_BUCKET)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("peak", (None, 400e12), ids=("unknown_peak", "known_peak"))
def test_training_records_get_tflops_and_mfu_from_the_interval(tmp_path, monkeypatch, capsys, peak):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    progress = Progress(tmp_path, enabled=True, peak_flops=peak)
    clock.now += 7.0  # start-up: the first interval gets no rates
    progress.log(step=10, samples=80, loss=5.0, train_flops=123)
    clock.now += 2.0
    progress.log(step=20, samples=160, loss=4.0, train_flops=3 * 10**14, train_tokens=5000)  # 1.5e14 FLOP/s over 2 s
    progress.log(step=20, samples=160, eval_accuracy=0.5)  # an eval record: no rates
    progress.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"step": 10, "samples": 80, "loss": 5.0}
    want = {"step": 20, "samples": 160, "loss": 4.0, "samples_per_s": 40.0, "tokens_per_s": 2500.0, "tflops": 150.0}
    if peak:
        want["mfu"] = 0.375  # 150 / 400
    assert records[1] == want and records[2] == {"step": 20, "samples": 160, "eval_accuracy": 0.5}
    line = capsys.readouterr().out.splitlines()[1]
    assert "samples_per_s=40 tokens_per_s=2500 tflops=150" in line and ("mfu=0.375" in line) == bool(peak)


def test_peak_table_by_device_name_and_precision():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == peak_flops("NVIDIA H100 80GB HBM3", "fp16") == 989.4e12
    assert peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    # fp8: half the datasheets' sparse FP8 figures (H100 SXM / H200 3,958, PCIe 3,026); no FP8 on an A100
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == peak_flops("NVIDIA H200", "fp8") == 3958e12 / 2
    assert peak_flops("NVIDIA H100 PCIe", "fp8") == 3026e12 / 2
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp16") == peak_flops("NVIDIA A100 80GB PCIe", "bf16") == 312e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12  # torch's default: no TF32 matmuls
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # fp32 matmuls as TF32 on tensor cores
        assert peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 156e12
    finally:
        torch.set_float32_matmul_precision(previous)
    assert peak_flops("Tesla T4", "fp16") is None
    assert device_peak_flops(torch.device("cpu"), "fp32") is None
    assert device_peak_flops(torch.device("cpu"), "bf16", override_tflops=100) == 100e12


def test_a_resumed_run_appends_to_the_metrics_and_a_fresh_one_starts_them(tmp_path):
    """RESUME=1 continues metrics.jsonl (the first job's intervals stay); a fresh run in the same folder replaces it."""
    def run(resume: bool, step: int) -> None:
        progress = Progress(tmp_path, enabled=True, resume=resume)
        progress.log(step=step, samples=8 * step, loss=1.0)
        progress.close()

    def steps() -> list[int]:
        return [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    run(False, 1)
    run(True, 2)
    assert steps() == [1, 2]
    run(False, 3)
    assert steps() == [3]


def test_a_resume_forgets_the_records_past_its_checkpoint(tmp_path, capsys):
    """Killed at step 9 with its last checkpoint at 6: steps 7-9 are trained and logged again by the continuation,
    so metrics.jsonl would hold them twice and a plot of it would double back."""
    first = progress_module.Progress(tmp_path, enabled=True)
    for step in range(1, 10):
        first.log(step=step, samples=8 * step, loss=1.0 / step)
    first.log(compiled_after_run_start={})  # a record without a step stays
    first._file.write('{"step": 10, "samp')  # cut short by the kill
    first._file.close()
    again = progress_module.Progress(tmp_path, enabled=True, resume=True)
    again.drop_after(6)
    for step in range(7, 9):
        again.log(step=step, samples=8 * step, loss=0.5)
    again._file.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in records] == [1, 2, 3, 4, 5, 6, None, 7, 8]
    assert [r["loss"] for r in records if r.get("step", 0) > 6] == [0.5, 0.5]
