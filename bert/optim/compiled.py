"""`COMPILE_OPTIMIZER=1`: the optimizer step compiled with COMPILE's backend, as torch's compiled-optimizer
recipe does (`torch.compile` of `optimizer.step`, the LR a device tensor so a new LR is new data, not a
recompile). Under MASTER_WEIGHTS=1 what is compiled is the update over the fp32 masters
(`MasterWeights.update_masters`: cast the gradients up (the flat layout casts them before it, in `step`), fp16
unscale, `after` clip, the inner LAMB/AdamW, copy back), so inductor fuses the casts and the fp16 overflow skip into
the update (bert.optim.master; with AdamW, whose capturable foreach kernels take no overflow flag, the check before it
stays eager and on the host).

No CUDA graphs: COMPILE=reduce-overhead compiles the step with inductor's default mode (max-autotune with
max-autotune-no-cudagraphs). Compiled LAMB replayed as a CUDA graph segfaulted on the H100 under torch 2.11
(inside inductor's cudagraph trees, tests/test_optim_compiled.py's CUDA test), and the fusion is what saves the
time: a step is ~20 foreach launches over ~400 tensors eagerly, a few fused kernels compiled.

The optimizer is built for it (`bert.optim.build_optimizer`, `capturable`): LAMB keeps its update count on
the device (`Lamb(capturable=True)`; never apex's FusedLAMB, which reads the LR on the host); AdamW is
foreach + capturable on CUDA (its fused kernel is opaque to the compiler, which would run it eagerly: no
fusion) and the single-tensor loop on the CPU (capturable needs an accelerator). Why a setting of its own and
not part of COMPILE: it changes which optimizer kernels run (AdamW leaves the fused kernel), so each must be
measured against the other, and it adds compile time of its own.

Compiled on first call: `warm_up_step` makes two calls before run_start (untimed, `bert.train.warmup`),
one that creates the state and one in steady state, then puts the weights (and the masters) and the state
back, so the timed run neither compiles nor starts from a different point.
"""

from __future__ import annotations

import time

import torch

from bert.model.compile import COMPILE_MODES, WITHOUT_CUDA_GRAPHS
from bert.model.compile_keys import configure_caches
from bert.optim.master import MasterWeights


def compile_step(optimizer: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
    """Replace `optimizer.step` (MasterWeights: its `update_masters`) with its compiled form under COMPILE mode
    `name` (checked by `check_compile` with the model), without CUDA graphs; returns the same optimizer."""
    if COMPILE_MODES[name] is None:
        raise ValueError(f"COMPILE_OPTIMIZER=1 needs a COMPILE mode to compile the step with, not COMPILE={name}")
    backend, mode = COMPILE_MODES[name]
    mode = WITHOUT_CUDA_GRAPHS.get(mode, mode)
    configure_caches()  # keyed as the model's graphs are, by whichever compiles first (bert.model.compile_keys)
    if isinstance(optimizer, MasterWeights) and optimizer.layout and backend == "inductor":
        # OPTIMIZER_LAYOUT=flat: torch 2.11's inductor failed on the flat update on CUDA, in the loop reordering
        # it tries when fusing (scheduler.reorder_loops_by_dep_pair: `assert isinstance(snode, SchedulerNode)`, seen
        # on an H100 and an H200; inductor never reorders loops on the CPU). The mode's options without it. That
        # graph cast the gradients into the flat buffer; since `MasterWeights.step` casts them before it, the fake
        # H100 (bench/gpu_compile.py) compiles it with or without this: kept until a GPU has compiled it.
        options = {**torch._inductor.list_mode_options(mode), "loop_ordering_after_fusion": False}
        if hasattr(torch._inductor.config, "loop_reindexing_after_fusion"):  # torch >= 2.12 reorders through it too
            options["loop_reindexing_after_fusion"] = False
        optimizer.update_masters = torch.compile(optimizer.update_masters, backend=backend, options=options)
    elif isinstance(optimizer, MasterWeights):  # GradScaler calls its step, which checks for overflow first
        optimizer.update_masters = torch.compile(optimizer.update_masters, backend=backend, mode=mode)
    else:
        optimizer.step = torch.compile(optimizer.step, backend=backend, mode=mode)  # what GradScaler.step calls
    return optimizer


def warm_up_step(optimizer: torch.optim.Optimizer) -> float:
    """Compile now: two steps on zero gradients, then the weights (MasterWeights: the model's and the masters),
    the gradients and the optimizer state restored (state a step created is zeroed: a fresh state in value).
    Returns the seconds the steps took."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    master = isinstance(optimizer, MasterWeights)
    holder = optimizer.inner if master else optimizer  # whose state the steps create
    weights = params + (optimizer.masters if master else [])
    keys = [p for group in holder.param_groups for p in group["params"]]
    saved = [w.detach().clone() for w in weights]
    grads = [p.grad for p in params]
    state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in holder.state[p].items()}
             for p in keys if holder.state.get(p)}
    for p in params:
        p.grad = torch.zeros_like(p)
    if master and optimizer.compute_dtype == torch.float16:  # the GradScaler hands a scale to every fp16 step:
        optimizer.grad_scale = torch.ones((), device=params[0].device)  # compile that variant (x 1, no overflow)
        optimizer.found_inf = torch.zeros((), device=params[0].device)
    start = time.perf_counter()
    optimizer.step()  # creates the state
    optimizer.step()  # the steady-state graph every later step runs
    if params and params[0].is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if master and optimizer.compute_dtype == torch.float16:
        del optimizer.grad_scale, optimizer.found_inf  # as GradScaler.step leaves it
    with torch.no_grad():  # the steps themselves ran in grad mode, as the loop's do: no recompile for it
        for w, value in zip(weights, saved):
            w.copy_(value)
        for p, grad in zip(params, grads):
            p.grad = grad
        for p in keys:
            for k, v in holder.state[p].items():
                if p not in state:  # zeros in place: the compiled graph keeps these tensors
                    if torch.is_tensor(v):
                        v.zero_()
                elif torch.is_tensor(v) and torch.is_tensor(state[p][k]):
                    v.copy_(state[p][k])
                else:
                    holder.state[p][k] = state[p][k]
    return seconds
