"""What ends a run early: a non-finite loss, a pre-emption signal, a step budget.

A stop must be agreed by all ranks at the same step, or the next collective would hang. Each
rank's wish is summed by an allreduce on a CPU (gloo) group, so the GPU stream is never
synchronised for it; the result of step t's allreduce is read at step t+1, hiding its latency.
"""

from __future__ import annotations

import math
import signal
from datetime import timedelta

import torch
import torch.distributed as dist


class NonFiniteLoss(RuntimeError):
    pass


class StopAgreement:
    """`poll(wish)` starts the reduction of this step's wish and returns the previous step's verdict."""

    def __init__(self, timeout: timedelta | None = None):
        """`timeout`: its gloo group's (DIST_TIMEOUT); None leaves torch's 30 minutes."""
        self.signalled = False
        self._group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self._pending: tuple[torch.Tensor, dist.Work | None] | None = None

    def install_signal_handlers(self) -> None:
        """SIGTERM (Slurm pre-emption, scancel) asks for a checkpoint and a clean exit."""
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def poll(self, wish: bool = False) -> bool:
        verdict = False
        if self._pending is not None:
            flag, work = self._pending
            if work is not None:
                work.wait()
            verdict = bool(flag.numpy()[0])  # host memory (numpy() refuses a device tensor): no device sync
        flag = torch.tensor([int(wish or self.signalled)])
        work = dist.all_reduce(flag, group=self._group, async_op=True) if self._group is not None else None
        self._pending = (flag, work)
        return verdict

    def drain(self) -> None:
        """Wait for the outstanding reduction, so that every rank leaves with the same collectives done."""
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].wait()
        self._pending = None


def mean_over_ranks(window_loss: torch.Tensor, steps: int) -> float:
    """The window's mean loss over every rank (the progress line's loss, and the one sync of the interval): with
    each rank's own, a loss that turned non-finite on one rank in the window's last step would stop that rank
    alone, and the others would wait in their next all-reduce for a rank that had left."""
    if dist.is_initialized():
        dist.all_reduce(window_loss)
        window_loss /= dist.get_world_size()
    return window_loss.item() / steps


def check_finite(loss_sum: float, step: int, scaled: bool) -> None:
    """Without fp16 loss scaling nothing skips a bad step, so a non-finite loss ends the run."""
    if not scaled and not math.isfinite(loss_sum):
        raise NonFiniteLoss(f"non-finite training loss ({loss_sum}) before step {step}")
