"""The training loop: `train()` runs steps until the target, a limit, or a stop; `train_step` is one update.

Host-device synchronisation happens only every `log_freq` steps (loss, finiteness) and at
evaluations (the accuracy decides whether to stop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.batch import Batch
from bert.config import TrainConfig
from bert.data.eval_set import EvalSet
from bert.dist.clip import Clipper
from bert.dist.env import DistEnv
from bert.model.fp8_delayed import AmaxState
from bert.optim import WarmupPolyDecay
from bert.optim.gather_ahead import settle
from bert.train.checkpoint import save_checkpoint
from bert.train.evaluate import EvalSchedule, evaluate
from bert.train.faults import StopAgreement, check_finite, mean_over_ranks
from bert.train.mlperf_log import MLPerfLog
from bert.train.profile import StepProfiler
from bert.train.progress import FlopMeter, Progress

SUCCESS, ABORTED, PREEMPTED = "success", "aborted", "preempted"


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    last_accuracy: float | None = None
    evals: EvalSchedule | None = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(**{**state, "evals": EvalSchedule(**state["evals"])})


@dataclass
class Run:
    """Everything one training run touches, built by `bert.train.build`."""

    cfg: TrainConfig
    env: DistEnv
    ddp: DDP
    clipper: Clipper  # installed on ddp once; called before every optimizer step
    optimizer: torch.optim.Optimizer
    schedule: WarmupPolyDecay
    scaler: torch.amp.GradScaler
    loader: Any  # an endless iterator of Batch with state_dict/load_state_dict (bert.data.pipeline.TrainLoader)
    eval_set: EvalSet  # read at the first evaluation (the rules' clock starts before the dataset is touched)
    autocast: Callable[[], AbstractContextManager]
    log: MLPerfLog
    progress: Progress
    stop: StopAgreement
    state: TrainState = field(default_factory=TrainState)
    profiler: StepProfiler = field(default_factory=StepProfiler)  # PROFILE_FROM=0: profiles nothing
    eval_samples: int = 0  # sequences in the eval set over all ranks, as logged

    @property
    def global_batch_size(self) -> int:
        return self.cfg.global_batch_size_per_rank * self.env.world_size

    def checkpoint(self) -> None:
        save_checkpoint(self.cfg.run.output_dir, self.state.step, self.ddp.module, self.shared_parts(), self.env.rank,
                        self.rank_parts())

    def shared_parts(self) -> dict[str, Any]:
        """What rank 0 checkpoints for every rank (besides the weights)."""
        return {"optimizer": self.optimizer, "schedule": self.schedule, "scaler": self.scaler, "state": self.state}

    def rank_parts(self) -> dict[str, Any]:
        """What each rank checkpoints of its own: the loader's position and the float8 amaxes it recorded."""
        return {"loader": self.loader, "fp8_amaxes": AmaxState(self.ddp.module)}


def eval_schedule(run: Run) -> EvalSchedule:
    """The run's evaluation schedule: a resumed run's, else the config's (EVAL_ITER_START_SAMPLES, EVAL_ITER_SAMPLES,
    or the rules' formula)."""
    cfg = run.cfg.run
    return run.state.evals or EvalSchedule.from_config(run.global_batch_size, cfg.eval_iter_start_samples,
                                                       cfg.eval_iter_samples)


def train_step(run: Run, batches: Iterator[Batch]) -> Tensor:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; returns the loss (device tensor)."""
    ddp = run.ddp
    micro_steps = run.cfg.optim.gradient_accumulation_steps
    loss_sum = torch.zeros((), device=run.schedule.lr.device)
    for micro in range(micro_steps):
        batch = next(batches)
        # Gradients are averaged only on the last micro-step; before that they accumulate locally, so
        # the clipping hooks see (and clip) the accumulated gradient.
        with nullcontext() if micro == micro_steps - 1 else ddp.no_sync():
            with run.autocast():
                loss = ddp(batch).loss / micro_steps
            # loss_factor: 1/W when the comm hook only sums (bert.dist.reduce: where the mean's 1/W goes)
            run.scaler.scale(loss * run.clipper.loss_factor).backward()
        loss_sum += loss.detach()

    run.clipper.before_step(run.optimizer, run.scaler)
    run.scaler.step(run.optimizer)  # under fp16, skipped when the gradient is not finite
    run.scaler.update()
    run.schedule.step()
    # Dropped, not zeroed: the next backward's gradients are then fresh tensors that autograd hands over
    # as they are, and DDP copies each into its bucket once (dividing by the world in the same pass when
    # no hook is registered). Zeroed bucket views would cost a zero, an accumulating add and DDP's
    # separate division: three passes over the gradients instead of one.
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum


def train(run: Run) -> str:
    """Train until the eval accuracy reaches the target (success), a limit is hit (aborted), or the
    job must end (pre-empted). The caller writes the final checkpoint, after run_stop is logged."""
    cfg, state = run.cfg.run, run.state
    state.evals = eval_schedule(run)
    # for the progress line's tokens_per_s, tflops and mfu; the loader's padding sequences (STATIC_TOKENS) are not
    # useful work
    model = run.ddp.module  # the FLOPs of the model as built: its config and whether its last layer keeps a subset
    meter = FlopMeter(model.config, run.cfg.model.static_tokens, last_layer_subset=model.last_layer_subset)
    batches = meter.counting(iter(run.loader))
    window_loss, window_steps, job_steps = torch.zeros((), device=run.schedule.lr.device), 0, 0
    while True:
        # --- one optimizer step (inside the profiled window, PROFILE_FROM, it is recorded)
        with run.profiler.step(state.step + 1):
            window_loss += train_step(run, batches)
        state.step += 1
        state.samples += run.global_batch_size
        window_steps += 1
        job_steps += 1
        # --- progress: the only per-interval host sync
        if state.step % cfg.log_freq == 0:
            mean_loss = mean_over_ranks(window_loss, window_steps)
            check_finite(mean_loss, state.step, run.scaler.is_enabled())
            run.progress.log(step=state.step, samples=state.samples, loss=mean_loss, lr=run.schedule.value(),
                             loss_scale=run.scaler.get_scale() if run.scaler.is_enabled() else 1.0,
                             last_eval=state.last_accuracy, **meter.take())
            window_loss.zero_()
            window_steps = 0
        # --- evaluation on the rules' schedule; stop at the target
        if state.evals.due(state.samples):
            # OPTIMIZER_SHARD_GATHER=forward: a rank without eval batches (fewer sequences than ranks) runs no
            # forward to wait in, so every rank finishes the step's all-gathers here, in one order
            settle(run.optimizer)
            run.log.start("eval_start", state.samples, {"epoch_num": state.samples})
            state.last_accuracy = evaluate(run.ddp.module, run.eval_set, run.autocast())
            run.log.end("eval_stop", state.samples, {"epoch_num": state.samples})
            run.log.eval_result(state.samples, state.last_accuracy)
            run.progress.log(step=state.step, samples=state.samples, eval_accuracy=state.last_accuracy)
            if state.last_accuracy >= cfg.target_mlm_accuracy:
                status = SUCCESS
                break
        # --- limits, pre-emption, periodic checkpoints
        if state.samples >= cfg.max_samples_termination or state.step >= run.cfg.optim.max_steps:
            status = ABORTED
            break
        if run.stop.poll() or (cfg.steps_this_job and job_steps >= cfg.steps_this_job):
            status = PREEMPTED
            break
        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
            run.checkpoint()
    run.stop.drain()
    settle(run.optimizer)  # OPTIMIZER_SHARD_GATHER=forward: the last step's all-gathers, which no forward waited for
    run.profiler.close()  # a window the run ended inside
    return status
