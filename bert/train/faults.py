"""What ends a run early: a non-finite loss, a pre-emption signal, a step budget.

A stop must be agreed by all ranks at the same step, or the next collective would hang. Each
rank's wish is summed by an allreduce on a CPU (gloo) group, so the GPU stream is never
synchronised for it; the result of one allreduce is read when the next starts, hiding its latency.
gloo sums a one-element tensor around a ring, 2 (W - 1) hops one after another (25-110 µs each
between hosts), so at 1024 ranks one reduction outlasts a step: it is started every
`stop_interval(W)` steps (1 up to 128 ranks), which gives it that many steps to arrive.
"""

from __future__ import annotations

import math
import signal
from datetime import timedelta

import torch
import torch.distributed as dist


class NonFiniteLoss(RuntimeError):
    pass


RANKS_PER_POLL_STEP = 128  # ring hops a reduction may take per step of latency (~10 ms at 40 µs a hop)


def stop_interval(world_size: int) -> int:
    """Steps between two stop reductions: one more per 128 ranks, so the ring's latency stays hidden."""
    return max(1, math.ceil(world_size / RANKS_PER_POLL_STEP))


class StopAgreement:
    """`poll(wish)`, called every step, starts a reduction of the wishes so far every `every` steps and returns
    the verdict of the one before (False in between): every rank stops at the same step."""

    def __init__(self, timeout: timedelta | None = None, every: int = 1):
        """`timeout`: its gloo group's (DIST_TIMEOUT); None leaves torch's 30 minutes."""
        self.signalled = False
        self.every = every
        self._group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self._pending: tuple[torch.Tensor, dist.Work | None] | None = None
        self._polls = 0
        self._wished = False  # a wish between two reductions waits for the next

    def install_signal_handlers(self) -> None:
        """SIGTERM (Slurm pre-emption, scancel) asks for a checkpoint and a clean exit."""
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def poll(self, wish: bool = False) -> bool:
        self._wished |= wish
        self._polls += 1
        if (self._polls - 1) % self.every:
            return False
        verdict = False
        if self._pending is not None:
            flag, work = self._pending
            if work is not None:
                work.wait()
            verdict = bool(flag.numpy()[0])  # host memory (numpy() refuses a device tensor): no device sync
        flag = torch.tensor([int(self._wished or self.signalled)])
        self._wished = False
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
