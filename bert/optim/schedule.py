"""Learning rate: linear warmup, then polynomial decay, computed on the device.

With k the number of updates already taken (the k-th update uses lr(k), as torch's schedulers do):

    w = k - start_warmup_step                        # start_warmup_step may be negative
    lr(k) = base * w / warmup_steps                  if w < warmup_steps
          = (base - end) * (1 - min(k / decay_steps, 1))^power + end   otherwise

This is NVIDIA's LinearWarmupPolyDecayScheduler; with decay_steps = lr_max_steps < max_steps and
end > 0 it is Samsung's variant (decay to `end` at lr_max_steps, then held).
"""

from __future__ import annotations

import torch
from torch import Tensor


class WarmupPolyDecay:
    """Owns the optimizer's learning rate: one 0-d device tensor shared by every param group."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int, start_warmup_step: int,
                 decay_steps: int, end_lr: float = 0.0, power: float = 1.0):
        if decay_steps <= 0:
            raise ValueError(f"decay_steps must be positive, got {decay_steps}")
        self.optimizer, self.base_lr, self.end_lr, self.power = optimizer, base_lr, end_lr, power
        self.warmup_steps, self.start_warmup_step, self.decay_steps = warmup_steps, start_warmup_step, decay_steps
        device = optimizer.param_groups[0]["params"][0].device
        self.updates = torch.zeros((), dtype=torch.float64, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self._attach()
        self._write()

    def _attach(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def _write(self) -> None:
        k = self.updates
        decay = (self.base_lr - self.end_lr) * (1.0 - (k / self.decay_steps).clamp(max=1.0)) ** self.power + self.end_lr
        if self.warmup_steps > 0:
            w = k - self.start_warmup_step
            decay = torch.where(w < self.warmup_steps, self.base_lr * w / self.warmup_steps, decay)
        self.lr.copy_(decay)

    def step(self) -> None:
        self.updates.add_(1)
        self._write()

    def state_dict(self) -> dict[str, Tensor]:
        return {"updates": self.updates.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load after the optimizer: its load_state_dict replaces the groups' LR with a saved copy."""
        self.updates.copy_(state["updates"])
        self._attach()
        self._write()
