"""`COMPILE_OPTIMIZER=1`: the optimizer step compiled with COMPILE's backend and mode, as torch's
compiled-optimizer recipe does (`torch.compile` of `optimizer.step`, the LR a device tensor so a new LR is
new data, not a recompile). With COMPILE=reduce-overhead the step becomes a CUDA graph, completing issue 9's
"forward, backward and the optimizer step in CUDA graphs where shapes are static": a step's shapes (the
parameters) never change.

The optimizer is built for it (`bert.optim.build_optimizer`, `capturable`): LAMB keeps its update count on
the device (`Lamb(capturable=True)`; never apex's FusedLAMB, which reads the LR on the host); AdamW is
foreach + capturable on CUDA (its fused kernel is opaque to the compiler, which would run it eagerly: no
fusion and no graph) and the single-tensor loop on the CPU (capturable needs an accelerator). Why a setting
of its own and not part of COMPILE: it changes which optimizer kernels run (AdamW leaves the fused kernel),
so each must be measured against the other, and it adds compile time of its own.

Compiled on first call: `warm_up_step` makes two calls before run_start (untimed, `bert.train.warmup`),
one that creates the state and one in steady state, then puts the parameters and the state back, so the
timed run neither compiles nor starts from a different point.
"""

from __future__ import annotations

import time

import torch

from bert.model.compile import COMPILE_MODES


def compile_step(optimizer: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
    """Replace `optimizer.step` with its compiled form under COMPILE mode `name` (checked by `check_compile`
    with the model); returns the same optimizer."""
    if COMPILE_MODES[name] is None:
        raise ValueError(f"COMPILE_OPTIMIZER=1 needs a COMPILE mode to compile the step with, not COMPILE={name}")
    backend, mode = COMPILE_MODES[name]
    optimizer.step = torch.compile(optimizer.step, backend=backend, mode=mode)  # what GradScaler.step calls
    return optimizer


def warm_up_step(optimizer: torch.optim.Optimizer) -> float:
    """Compile now: two steps on zero gradients, then the parameters, their gradients and the optimizer state
    restored (state a step created is zeroed: a fresh state in value). Returns the seconds the steps took."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
             for p in params if optimizer.state.get(p)}
    for p in params:
        p.grad = torch.zeros_like(p)
    start = time.perf_counter()
    optimizer.step()  # creates the state
    optimizer.step()  # the steady-state graph every later step runs
    if params and params[0].is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    with torch.no_grad():  # the steps themselves ran in grad mode, as the loop's do: no recompile for it
        for p, value, grad in zip(params, saved, grads):
            p.copy_(value)
            p.grad = grad
            for k, v in optimizer.state[p].items():
                if p not in state:  # zeros in place: the compiled graph keeps these tensors
                    if torch.is_tensor(v):
                        v.zero_()
                elif torch.is_tensor(v) and torch.is_tensor(state[p][k]):
                    v.copy_(state[p][k])
                else:
                    optimizer.state[p][k] = state[p][k]
    return seconds
