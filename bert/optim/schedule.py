"""Learning rate: linear warmup, then polynomial decay, held in a device tensor.

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
    """Owns the optimizer's learning rate: one 0-d device tensor shared by every param group.

    The update count lives on the host and lr(k) is computed there, then written into the tensor with `fill_`
    (a kernel launch with the value as its argument: no host sync), so a compiled or captured update reads it as
    an input. An optimizer with `host_lr = True` (apex's FusedLAMB, bert.optim.apex_lamb, whose kernel takes
    the LR as a C++ float and would read a tensor with `.item()`, a sync per step) gets the float instead."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int, start_warmup_step: int,
                 decay_steps: int, end_lr: float = 0.0, power: float = 1.0):
        if decay_steps <= 0:
            raise ValueError(f"decay_steps must be positive, got {decay_steps}")
        self.optimizer, self.base_lr, self.end_lr, self.power = optimizer, base_lr, end_lr, power
        self.warmup_steps, self.start_warmup_step, self.decay_steps = warmup_steps, start_warmup_step, decay_steps
        self.updates = 0
        self.lr = torch.zeros((), dtype=torch.float32, device=optimizer.param_groups[0]["params"][0].device)
        self._write()

    def value(self) -> float:
        """lr(k) for the k updates taken so far, in float64 as Python computes it."""
        k = self.updates
        w = k - self.start_warmup_step
        if self.warmup_steps > 0 and w < self.warmup_steps:
            return self.base_lr * w / self.warmup_steps
        return (self.base_lr - self.end_lr) * (1.0 - min(k / self.decay_steps, 1.0)) ** self.power + self.end_lr

    def _write(self) -> None:
        value = self.value()
        self.lr.fill_(value)
        on_host = getattr(self.optimizer, "host_lr", False)
        for group in self.optimizer.param_groups:
            group["lr"] = value if on_host else self.lr

    def step(self) -> None:
        self.updates += 1
        self._write()

    def state_dict(self) -> dict[str, Tensor]:
        return {"updates": torch.tensor(float(self.updates), dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load after the optimizer: its load_state_dict replaces the groups' LR with a saved copy."""
        self.updates = round(float(state["updates"]))
        self._write()
