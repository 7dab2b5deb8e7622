"""apex's FusedLAMB (the MLPerf submissions' kernel: two fused multi-tensor passes where our foreach LAMB runs
~15) behind torch's optimizer interface, when apex is installed and the weights are on a GPU.

The bare class would be wrong here in three ways (apex/optimizers/fused_lamb.py):
- its `zero_grad(self)` takes no `set_to_none`, so the loop's `zero_grad(set_to_none=True)` raised a TypeError
  after the first step; torch's own `zero_grad` is used instead;
- it hands `group["lr"]` to a kernel whose argument is a C++ float, which turns the schedule's device tensor into
  a number with `.item()`: the host would wait for the whole backward every step. `host_lr = True` asks the
  schedule (bert.optim.schedule) for the same lr(k) as a Python float;
- it counts updates in the param group (`group["step"]`), where our LAMB keeps the count in every parameter's
  state. MasterWeights saves its own groups' keys, so a resume restarted apex's bias correction at step 1, and
  our LAMB could not load apex's state (no "step"). Its checkpoints are written and read in our LAMB's layout.

Same update as `bert.optim.lamb.Lamb`; apex's own clipping is off (max_grad_norm=inf) because the `after` clip mode
clips before the step. It cannot skip an overflowed fp16 step on the device (bert.optim.master reads the flag on
the host for it), and it is never the inner optimizer of a compiled or sharded step.
"""

from __future__ import annotations

import functools

import torch


def apex_lamb(groups: list[dict], betas: tuple[float, float], eps: float) -> torch.optim.Optimizer | None:
    """FusedLAMB over `groups` with torch's interface, or None without apex."""
    try:
        from apex.optimizers import FusedLAMB
    except ImportError:
        return None
    return adapted(FusedLAMB)(groups, lr=0.0, betas=betas, eps=eps, bias_correction=True, adam_w_mode=True,
                              max_grad_norm=float("inf"), use_nvlamb=False)


@functools.cache
def adapted(fused_lamb: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A subclass of apex's class that takes a host LR, torch's `zero_grad` and our LAMB's checkpoint layout."""

    class ApexLamb(fused_lamb):
        host_lr = True  # bert.optim.schedule writes lr(k) into the groups as a float

        def zero_grad(self, set_to_none: bool = True) -> None:
            torch.optim.Optimizer.zero_grad(self, set_to_none)

        def state_dict(self) -> dict:
            """The update count moved from each group into its parameters' state (copies: the state is live)."""
            saved = super().state_dict()
            for group in saved["param_groups"]:
                step = group.pop("step", 0)
                for i in group["params"]:
                    if i in saved["state"]:
                        saved["state"][i] = {**saved["state"][i], "step": step}
            return saved

        def load_state_dict(self, state_dict: dict) -> None:
            """The count back into each group, from its parameters' state (ours: an int, or a device tensor read
            once here); the keys apex's step reads that our LAMB's groups lack (bias_correction, grad_averaging)
            from this optimizer's defaults, since torch's load replaces the groups with the saved ones."""
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
                steps = [self.state[p].pop("step") for p in group["params"] if "step" in self.state[p]]
                if steps:
                    group["step"] = int(steps[0])

    return ApexLamb
