"""The training loop and the run it is built with, in one process: the real `build_run` on the synthetic data set
(tiny BERT, a world of one). Where `train` stops, when it checkpoints, what a resumed job counts, that every step
clips what the optimizer is handed, and what `build_run` decides from the precision. The driver-level tests
(tests/test_train.py, test_resume.py) run the same code at tens of seconds a run; these pin the edges by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bert.config import from_flat
from bert.data.format import ShardError
from bert.dist.env import DistEnv
from bert.synthetic import random_batch
from bert.train.build import build_run
from bert.train.loop import ABORTED, PREEMPTED, Run, train, train_step
from bert.train.mlperf_log import MLPerfLog

BATCH = 4  # sequences per step: the global batch in a world of one


def make_run(data: Path, out: Path, env: DistEnv | None = None, **fields) -> Run:
    cfg = from_flat(**{
        "input_dir": str(data / "train_varlength"), "eval_dir": str(data / "eval_varlength"),
        "bert_config_path": "tiny", "output_dir": str(out), "train_batch_size": BATCH, "learning_rate": 1e-3,
        "max_steps": 100, "eval_iter_start_samples": 10**9, "num_eval_examples": 16, "attention": "padded",
        "log_freq": 1, "seed": 3, **fields})
    return build_run(cfg, env or DistEnv(0, 1, 0, 1, "localhost", 0), torch.device("cpu"),
                     MLPerfLog(str(out / "result_0.txt"), True))


def finish(run: Run) -> str:
    try:
        return train(run)
    finally:
        run.loader.close()


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def test_stops_aborted_at_exactly_max_samples(world_of_one, synthetic_data, tmp_path):
    run = make_run(synthetic_data, tmp_path, max_samples_termination=3 * BATCH)
    assert finish(run) == ABORTED
    assert (run.state.step, run.state.samples) == (3, 3 * BATCH)  # not one step past the limit


def test_checkpoints_every_k_steps_from_step_k(world_of_one, synthetic_data, tmp_path):
    run = make_run(synthetic_data, tmp_path, max_steps=5, checkpoint_every=2)
    assert finish(run) == ABORTED and run.state.step == 5
    assert checkpoints(tmp_path) == ["step_00000002", "step_00000004"]  # the final one is the caller's


def test_a_resumed_job_takes_its_own_steps_this_job(world_of_one, synthetic_data, tmp_path):
    run = make_run(synthetic_data, tmp_path, steps_this_job=2)
    run.state.step, run.state.samples = 5, 5 * BATCH  # as a checkpoint at step 5 leaves it
    assert finish(run) == PREEMPTED
    assert (run.state.step, run.state.samples) == (7, 7 * BATCH)


@pytest.mark.parametrize("clip", ["after", "bucket"])
def test_the_optimizer_is_handed_the_clipped_accumulated_gradient(world_of_one, synthetic_data, tmp_path, clip):
    """Two micro-batches: the gradients are reduced (and, for `bucket`, clipped in the hook) once, on the last one,
    so what the optimizer sees has norm <= c, although one micro-batch's gradient alone is 100s of times larger."""
    c = 1e-3
    run = make_run(synthetic_data, tmp_path, grad_clip=clip, max_grad_norm=c, gradient_accumulation_steps=2,
                   grad_buckets="balanced" if clip == "bucket" else "ddp")
    seen = []
    run.optimizer.register_step_pre_hook(lambda opt, *_: seen.append(
        torch.nn.utils.get_total_norm([p.grad for group in opt.param_groups for p in group["params"]]).item()))
    batches = iter(run.loader)
    try:
        train_step(run, batches)
        run.ddp.module(next(batches)).loss.backward()  # outside DDP: one micro-batch's plain gradient
        alone = torch.nn.utils.get_total_norm([p.grad for p in run.ddp.module.parameters() if p.grad is not None])
    finally:
        run.loader.close()
    assert seen[0] <= c * (1 + 1e-4)  # bucket: C/sqrt(B) per bucket, each factor and norm rounded in fp32
    assert alone > 100 * c


@pytest.mark.parametrize("fields, scaled, autocast, weights", [
    ({"precision": "fp32"}, False, False, torch.float32),
    ({"precision": "bf16"}, False, True, torch.float32),  # autocast over fp32 weights
    ({"precision": "bf16", "master_weights": True}, False, False, torch.bfloat16),  # no casts: bf16 weights
    ({"precision": "fp16", "master_weights": True}, True, False, torch.float16),
], ids=["fp32", "bf16", "bf16-master", "fp16-master"])
def test_the_precision_decides_the_loss_scaler_and_autocast(world_of_one, synthetic_data, tmp_path, fields, scaled,
                                                            autocast, weights):
    run = make_run(synthetic_data, tmp_path, **fields)
    run.loader.close()
    with run.autocast():
        assert torch.is_autocast_enabled("cpu") == autocast
    assert run.scaler.is_enabled() == scaled and next(run.ddp.module.parameters()).dtype == weights


def test_ranks_start_from_the_same_weights_and_draw_their_own_dropout(world_of_one, synthetic_data, tmp_path):
    """The same seed on every rank gives the same initial weights; the dropout masks are drawn per rank, as they
    are per sequence across the global batch (a world of one stands in: the two runs differ only in their rank)."""
    batch = random_batch((30, 17, 9), seed=1)  # the same batch on both
    outputs, weights = [], []
    for rank in (0, 1):
        run = make_run(synthetic_data, tmp_path / f"rank{rank}", env=DistEnv(rank, 2, rank, 2, "localhost", 0))
        run.loader.close()
        model = run.ddp.module.train()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        outputs.append(model(batch).loss.item())
    assert torch.equal(weights[0], weights[1])
    assert outputs[0] != outputs[1]


def test_sequences_longer_than_max_seq_length_are_refused_before_training(world_of_one, synthetic_data, tmp_path):
    """The synthetic set holds sequences of up to 32 tokens; tiny BERT's positions reach 512, MAX_SEQ_LENGTH=16
    is the tighter limit (bert.data.limits)."""
    with pytest.raises(ShardError, match="16"):
        make_run(synthetic_data, tmp_path, max_seq_length=16)
