"""LAMB as the MLPerf BERT submissions run it (apex FusedLAMB, adam_w_mode, bias correction).

For every tensor p with gradient g, at update t:

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd p
    p = p - lr r u,   r = ||p|| / ||u||  (1 if either norm is 0)

The trust ratio r applies only to tensors with weight decay, as in apex without `use_nvlamb`:
biases and LayerNorm parameters take a plain Adam step. Gradient clipping is not done here; the
`after` clip mode (bert.dist.clip) clips the averaged gradient by its global norm beforehand,
which is the same as FusedLAMB's `max_grad_norm`. Written with torch's foreach kernels; the
learning rate is the schedule's device tensor, an input rather than a host value that changes every step.

`tensor_norms` computes (||p||, ||u||) per tensor; the sharded update (bert.optim.sharded) passes
one that completes the norms of tensors split across ranks.

`capturable=True` keeps the update count t on the parameters' device (fp32, as torch's) and computes the bias
corrections there, as torch's capturable Adam does: a compiled step (`bert.optim.compiled`, COMPILE_OPTIMIZER=1)
then has no host value that changes every step, so one graph serves every step. The corrections are the
host's float64 ones (the same pow and the correctly rounded sqrt), so the two counters give the same bits on
the CPU.

A skipped step without a host sync (fp16, bert.optim.master): with the count on the device, `found_inf` set on
the optimizer (torch's convention for fused optimizers: a 0-dim float tensor, 1 where the gradients
overflowed) makes the step a no-op on the device instead of a branch on the host: t advances by 1 - found_inf,
the moments' weights (1 - b1 for m, b2 for v) become 0 and 1, and the LR 0, so the weights, m, v and t keep
their bits; with found_inf 0 the same arithmetic as the plain step, bit for bit. The gradients must be finite
there (inf x 0 is NaN): the caller zeroes an overflowed step's (MasterWeights does, in one pass over its flat
fp32 gradient).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from bert.optim.bias_correction import lamb_bias_corrections

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
        found_inf = getattr(self, "found_inf", None)  # set under fp16 by bert.optim.master (see the module doc)
        if found_inf is not None and not self.capturable:
            raise ValueError("Lamb skips an overflowed step on the device only with its update count there "
                             "(capturable=True)")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params, found_inf)

    def _update(self, group: dict, params: list[Tensor], found_inf: Tensor | None = None) -> None:
        b1, b2 = group["betas"]
        for p in params:
            if not self.state[p]:
                step = torch.zeros((), dtype=torch.float32, device=p.device) if self.capturable else 0
                self.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        grads, m, v = [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        lr = torch.as_tensor(group["lr"], device=params[0].device)
        if self.capturable:  # one device counter per group, updated in place (a loaded checkpoint's moved there)
            t = states[0]["step"] = torch.as_tensor(states[0]["step"], dtype=torch.float32, device=params[0].device)
        else:  # one host counter per group: no device sync
            t = states[0]["step"] = states[0]["step"] + 1
        for s in states[1:]:
            s["step"] = t

        if found_inf is None:
            if self.capturable:
                t.add_(1)
            corrected = t
            torch._foreach_lerp_(m, grads, 1.0 - b1)
            torch._foreach_mul_(v, b2)
        else:  # the same step, or none: every factor that moves a value is 0 where found_inf is 1
            take = found_inf == 0
            t.add_(take.float())
            corrected = t.clamp(min=1)  # a first step skipped leaves t = 0; m = v = 0 then, and the update is 0
            torch._foreach_lerp_(m, grads, [torch.where(take, 1.0 - b1, 0.0)] * len(m))
            torch._foreach_mul_(v, torch.where(take, b2, 1.0))
            lr = lr * take
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - b2)
        c1, sqrt_c2 = _bias_corrections(b1, b2, corrected)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, sqrt_c2)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(m, denom)
        torch._foreach_div_(update, c1)

        if group["weight_decay"] != 0.0:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
            p_norm, u_norm = self.tensor_norms(params, update)
            trust = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
            torch._foreach_mul_(update, list((-lr * trust).unbind()))
        else:
            torch._foreach_mul_(update, -lr)
        torch._foreach_add_(params, update)


def _bias_corrections(b1: float, b2: float, t: Tensor | int) -> tuple[Tensor | float, Tensor | float]:
    """(1 - b1^t, sqrt(1 - b2^t)) in float64, on the host (int t) or the device (an fp32 count, exact to 2^24),
    the same bits both: the same pow and a correctly rounded sqrt (Python's `x ** 0.5` is pow, torch's is sqrt).
    The foreach ops take them in fp32: a host float is rounded there, a device one here (their kernels want the
    list's dtype)."""
    if torch.is_tensor(t):
        # a float64 copy, not a float64 count: stored as a 0-dim float64 CPU state, the count lost its in-place
        # updates when the step was compiled (COMPILE=debug, torch 2.13); computed by an op of its own, which
        # inductor cannot inline into the update's kernels (bert.optim.bias_correction)
        pair = lamb_bias_corrections(t, b1, b2)
        return pair[..., 0], pair[..., 1]
    return 1.0 - b1**t, math.sqrt(1.0 - b2**t)
