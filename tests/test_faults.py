"""Faults end a run the way an operator needs: a dead rank, a non-finite loss, a pre-emption signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from ranks import start_ranks

from bert.config import from_flat
from bert.dist.clip import install_clipping
from bert.dist.ddp import apply_ddp
from bert.dist.env import DistEnv
from bert.optim import build_optimizer, build_schedule
from bert.train.faults import NonFiniteLoss, check_finite, mean_over_ranks
from bert.train.loop import Run, train_step

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 15


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("syn")
    subprocess.run([sys.executable, str(ROOT / "data/make_synthetic_dataset.py"), "--out", str(out),
                    "--train-samples", "512", "--eval-samples", "64"], check=True, capture_output=True)
    return out


def driver(data: Path, out: Path, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    args = dict(input_dir=data / "train_varlength", eval_dir=data / "eval_varlength", bert_config_path="tiny",
                output_dir=out, mlperf_log=out / "result_0.txt", train_batch_size=8, learning_rate=1e-3,
                max_steps=100_000, log_freq=1, eval_iter_start_samples=10**9, num_eval_examples=64,
                attention="padded", dist_timeout_s=TIMEOUT_S)
    args.update(kw)
    cmd = [sys.executable, str(ROOT / "run_pretraining.py"), *[x for k, v in args.items() for x in (f"--{k}", str(v))]]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def wait_for_steps(out: Path, steps: int, proc: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} training steps within {limit_s} s: {proc.communicate()[0][-2000:]}")


def run_stops(out: Path) -> list[str]:
    lines = [json.loads(x.split(":::MLLOG ", 1)[1]) for x in (out / "result_0.txt").read_text().splitlines()]
    return [e["metadata"]["status"] for e in lines if e["key"] == "run_stop"]


@pytest.mark.slow
def test_killed_rank_ends_the_job_nonzero_within_the_timeout(data, tmp_path):
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port())}
    outs = [tmp_path / "rank0", tmp_path / "rank1"]
    procs = [driver(data, outs[r], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        wait_for_steps(outs[0], 3, procs[0])
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = procs[0].communicate(timeout=TIMEOUT_S + 45)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0, output[-2000:]
    assert elapsed < TIMEOUT_S + 45
    assert "success" not in run_stops(outs[0])
    assert "run aborted" in output


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_loss_ends_an_unscaled_run_and_not_a_scaled_one(loss):
    """Without fp16 loss scaling nothing skips the step that made it, so NaN and both infinities end the run;
    with it, GradScaler skips that step and lowers the scale, and training goes on."""
    with pytest.raises(NonFiniteLoss, match=f"non-finite training loss \\({loss}\\) before step 7"):
        check_finite(loss, 7, scaled=False)
    check_finite(loss, 7, scaled=True)
    check_finite(3.5, 7, scaled=False)


def test_stop_agreement_answers_a_step_late_for_a_wish_and_for_sigterm():
    """Each poll starts this step's reduction and answers the previous step's (its latency hidden behind a step): a
    wish, or SIGTERM received at any time, stops the run at the next poll, and stays a stop. No process group here:
    the reduction over one rank is the wish itself."""
    from bert.train.faults import StopAgreement

    stop = StopAgreement()
    assert [stop.poll(), stop.poll(True), stop.poll(), stop.poll()] == [False, False, True, False]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs in the main thread at the next bytecode
        assert stop.signalled and [stop.poll(), stop.poll(), stop.poll()] == [False, True, True]
    finally:
        signal.signal(signal.SIGTERM, previous)
    stop.drain()


def test_stop_reductions_are_spaced_so_a_long_ring_has_steps_to_arrive():
    """At 1024 ranks gloo's ring takes 2046 hops for one flag: a reduction every 8 steps, each read 8 steps on; a
    wish made between two reductions is kept for the next one (not lost)."""
    from bert.train.faults import StopAgreement, stop_interval

    assert [stop_interval(w) for w in (1, 8, 128, 129, 1024, 1368)] == [1, 1, 1, 2, 8, 11]
    stop = StopAgreement(every=3)
    assert [stop.poll(), stop.poll(True)] + [stop.poll() for _ in range(5)] == [False] * 6 + [True]
    assert [stop.poll() for _ in range(3)] == [False] * 3  # the wish was sent once; the next reduction is clear
    stop.drain()


def test_non_finite_loss_aborts_without_loss_scaling(data, tmp_path):
    proc = driver(data, tmp_path, learning_rate=1e6, precision="fp32")  # the largest LR the config accepts
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output[-2000:]
    assert "non-finite training loss" in output
    assert run_stops(tmp_path) == ["aborted"]


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(data, tmp_path):
    proc = driver(data, tmp_path, env={"PEAK_TFLOPS": "0.5"})  # also checks the progress line's tflops and mfu
    wait_for_steps(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-2000:]
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    step = int(latest.removeprefix("step_"))
    assert step >= 2 and (tmp_path / "checkpoints" / latest / "model.safetensors").is_file()
    assert run_stops(tmp_path) == []  # pre-empted: the run is not over, --resume continues it
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "tflops" not in records[0] and len(records) >= 2  # the first interval includes start-up
    for r in records[1:]:
        assert r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / 0.5, rel=1e-3), r
        assert r["tokens_per_s"] > r["samples_per_s"], r  # one process; every sequence has several tokens


class _Scaled(torch.nn.Module):
    """Stand-in model: loss = factor * sum(w * x); factor inf poisons the whole gradient."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, factor: float):
        return SimpleNamespace(loss=factor * self.lin(torch.ones(2, 4)).sum())


def _fp16_worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    results = {}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    for mode in ("after", "bucket"):
        cfg = from_flat(input_dir="x", eval_dir="x", bert_config_path="tiny", train_batch_size=1,
                        learning_rate=0.1, max_steps=10, precision="fp16", grad_clip=mode, optimizer="adam")
        torch.manual_seed(0)
        model = _Scaled()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        ddp = apply_ddp(model, cfg.dist)
        clipper = install_clipping(ddp, mode, cfg.optim.max_grad_norm, scaler)
        optimizer = build_optimizer(model, cfg.optim)
        run = Run(cfg, DistEnv(0, 1, 0, 1, "localhost", 0), ddp, clipper, optimizer,
                  build_schedule(optimizer, cfg.optim), scaler, None, [], nullcontext, None, None, None)
        before = model.lin.weight.detach().clone()
        train_step(run, iter([float("inf")]))
        skipped = torch.equal(model.lin.weight, before) and scaler.get_scale() == 2.0**9
        train_step(run, iter([1.0]))
        results[mode] = [skipped, not torch.equal(model.lin.weight, before), bool(model.lin.weight.isfinite().all())]
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))


def _window_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    means = []
    for losses in ([6.0, 2.0], [6.0, float("nan")]):  # each rank's summed loss over a window of 2 steps
        means.append(mean_over_ranks(torch.tensor(losses[rank]), 2))
    stopped = []
    for mean in means:
        try:
            check_finite(mean, 10, scaled=False)
            stopped.append(False)
        except NonFiniteLoss:
            stopped.append(True)
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps([means[0], stopped]))


def test_a_loss_non_finite_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """The progress line's loss is the mean over the ranks, so a NaN on rank 1 alone (its batch, the window's last
    step, before the all-reduce spreads it into everyone's weights) stops both ranks there, not rank 1 alone while
    rank 0 waits in its next all-reduce for a rank that has left."""
    start_ranks(_window_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"out.{rank}").read_text()) == [2.0, [False, True]]  # (6 + 2) / 2 ranks / 2


def test_fp16_non_finite_step_is_skipped_by_the_loss_scaler(tmp_path):
    out = tmp_path / "results.json"
    start_ranks(_fp16_worker, args=(str(tmp_path / "store"), str(out)), nprocs=1)
    # (inf step skipped and scale halved, next finite step applied, weights finite) per clip mode
    assert json.loads(out.read_text()) == {"after": [True, True, True], "bucket": [True, True, True]}


def test_bad_paths_give_one_line_errors_naming_the_culprit(data, tmp_path):
    missing = tmp_path / "no_such_dir"
    proc = driver(data, tmp_path / "a", input_dir=missing)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and f"error: rank 0: {missing}: no such data directory" in output, output[-2000:]
    proc = driver(data, tmp_path / "b", resume=1)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--resume: no checkpoint under" in output, output[-2000:]
