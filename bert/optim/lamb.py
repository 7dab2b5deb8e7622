"""LAMB as the MLPerf BERT submissions run it (apex FusedLAMB, adam_w_mode, bias correction).

For every tensor p with gradient g, at update t:

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd p
    p = p - lr r u,   r = ||p|| / ||u||  (1 if either norm is 0)

The trust ratio r applies only to tensors with weight decay, as in apex without `use_nvlamb`:
biases and LayerNorm parameters take a plain Adam step. Gradient clipping is not done here; the
`after` clip mode (bert.dist.clip) clips the averaged gradient by its global norm beforehand,
which is the same as FusedLAMB's `max_grad_norm`. Written with torch's foreach kernels; the
learning rate is a device tensor so the schedule never copies a host value per step.

`tensor_norms` computes (||p||, ||u||) per tensor; the sharded update (bert.optim.sharded) passes
one that completes the norms of tensors split across ranks.

`capturable=True` keeps the update count t on the parameters' device and computes the bias corrections
there, as torch's capturable Adam does: a compiled step (`bert.optim.compiled`, COMPILE_OPTIMIZER=1) then
has no host value that changes every step, so one graph serves
every step. The corrections are then fp32 instead of the host's float64 (a relative difference ~1e-7).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

TensorNorms = Callable[[list[Tensor], list[Tensor]], tuple[Tensor, Tensor]]


def local_tensor_norms(params: list[Tensor], update: list[Tensor]) -> tuple[Tensor, Tensor]:
    return torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(update))


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: Tensor | float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, tensor_norms: TensorNorms = local_tensor_norms, capturable: bool = False):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"LAMB betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.tensor_norms = tensor_norms
        self.capturable = capturable

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("Lamb.step does not take a closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)

    def _update(self, group: dict, params: list[Tensor]) -> None:
        b1, b2 = group["betas"]
        for p in params:
            if not self.state[p]:
                step = torch.zeros((), dtype=torch.float32, device=p.device) if self.capturable else 0
                self.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        grads, m, v = [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        if self.capturable:  # one device counter per group, updated in place (a loaded checkpoint's moved there)
            t = states[0]["step"] = torch.as_tensor(states[0]["step"], dtype=torch.float32, device=params[0].device)
            t.add_(1)
        else:  # one host counter per group: no device sync
            t = states[0]["step"] = states[0]["step"] + 1
        for s in states[1:]:
            s["step"] = t

        torch._foreach_lerp_(m, grads, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, (1.0 - b2**t) ** 0.5)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(m, denom)
        torch._foreach_div_(update, 1.0 - b1**t)

        lr = torch.as_tensor(group["lr"], device=params[0].device)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
            p_norm, u_norm = self.tensor_norms(params, update)
            trust = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
            torch._foreach_mul_(update, list((-lr * trust).unbind()))
        else:
            torch._foreach_mul_(update, -lr)
        torch._foreach_add_(params, update)
