"""Optimizers (LAMB, Samsung's AdamW) and the learning-rate schedule, built from the config's optim section.

`OPTIMIZERS` is the registry the config validates `OPTIMIZER` against. The update runs plain, sharded
(`OPTIMIZER_SHARDING=1`, bert.optim.sharded) or on fp32 masters of a bf16/fp16 model (`MASTER_WEIGHTS=1`,
bert.optim.master).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from bert.config import OptimConfig
from bert.dist.shard_plan import ShardPlan
from bert.optim.apex_lamb import apex_lamb
from bert.optim.flat import FlatLamb
from bert.optim.lamb import Lamb
from bert.optim.param_groups import decay_groups
from bert.optim.schedule import WarmupPolyDecay

__all__ = ["OPTIMIZERS", "Lamb", "WarmupPolyDecay", "build_optimizer", "build_schedule", "decay_groups",
           "hook_clip_mode"]

Groups = list[dict]
Betas = tuple[float, float]


def _adamw(groups: Groups, lr: torch.Tensor, betas: Betas, eps: float, on_cuda: bool, compiled: bool = False,
           skip_on_device: bool = False) -> torch.optim.Optimizer:
    """Samsung: plain AdamW with decoupled weight decay; fused works on CPU and CUDA, and skips an overflowed
    step inside its kernel (`skip_on_device` asks nothing more). `compiled` (bert.optim.compiled): foreach +
    capturable on CUDA, the single-tensor loop on the CPU (neither skips on the device)."""
    if compiled:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=on_cuda, capturable=on_cuda)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def _lamb(groups: Groups, lr: torch.Tensor, betas: Betas, eps: float, on_cuda: bool, compiled: bool = False,
          skip_on_device: bool = False) -> torch.optim.Optimizer:
    """A compiled step: ours, with the update count on the device. Else apex's FusedLAMB when installed on CUDA
    (two fused kernels where ours runs ~15 foreach passes: worth the host-side overflow check under fp16), else
    ours, with the update count on the device where it should skip an overflowed step there (bert.optim.lamb)."""
    if compiled:
        return Lamb(groups, lr=lr, betas=betas, eps=eps, capturable=True)
    return (on_cuda and apex_lamb(groups, betas, eps)) or Lamb(groups, lr=lr, betas=betas, eps=eps,
                                                                 capturable=skip_on_device)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"lamb": _lamb, "adam": _adamw}


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A load_state_dict pre-hook: the loaded groups keep this optimizer's kernel choice. torch's load takes every
    group key from the checkpoint, so a fused AdamW step would come back foreach + capturable after a checkpoint of a
    compiled step (and lose the fp16 overflow skip on the device: a host sync per step), or fused inside a compiled
    step (an opaque kernel, nothing fused around it)."""
    if len(state_dict["param_groups"]) != len(optimizer.param_groups):
        return state_dict  # torch's own check refuses it, naming the counts
    groups = [{**saved, **{k: live[k] for k in IMPLEMENTATION_KEYS if k in live}}
              for saved, live in zip(state_dict["param_groups"], optimizer.param_groups, strict=True)]
    return {**state_dict, "param_groups": groups}


def build_optimizer(model: nn.Module, cfg: OptimConfig, compute_dtype: torch.dtype = torch.float32,
                    plan: ShardPlan | None = None) -> torch.optim.Optimizer:
    """LAMB or AdamW over the decay/no-decay groups. The LR is set to a device tensor by the schedule.
    With `optimizer_sharding` each rank updates 1/N of the weights (bert.optim.sharded). With `master_weights`
    the model's fp32 weights become the optimizer's masters and the model is cast to `compute_dtype`
    (bert.optim.master; both: each rank holds 1/N of the masters, bert.optim.sharded_master): build it before
    anything that takes the parameters' dtype (DDP's buckets). `plan`: the sharded masters' collectives
    (bert.dist.shard_plan; None: one reduce-scatter over every rank)."""
    optimizer = _build_optimizer(model, cfg, compute_dtype, plan)
    for part in (optimizer, getattr(optimizer, "inner", None)):  # the wrappers load their inner optimizer's state
        if part is not None:
            part.register_load_state_dict_pre_hook(keep_implementation)
    return optimizer


def _build_optimizer(model: nn.Module, cfg: OptimConfig, compute_dtype: torch.dtype, plan: ShardPlan | None
                     ) -> torch.optim.Optimizer:
    groups = decay_groups(model, cfg.weight_decay_rate)
    lr = torch.tensor(cfg.learning_rate)  # replaced by the schedule's device tensor
    if cfg.optimizer_sharding and cfg.master_weights:  # the config allows it with LAMB over the flat layout only
        from bert.optim.sharded_master import ShardedMasters

        return ShardedMasters(groups, compute_dtype, lr, (cfg.opt_lamb_beta_1, cfg.opt_lamb_beta_2), cfg.opt_epsilon,
                              cfg.max_grad_norm if cfg.grad_clip == "after" else None,
                              blocks=cfg.optimizer_shard_blocks, plan=plan, gather=cfg.optimizer_shard_gather)
    if cfg.optimizer_sharding:
        from bert.optim.sharded import build_sharded  # needs torch.distributed initialised

        return build_sharded(groups, cfg, lr)
    on_cuda = next(model.parameters()).is_cuda
    # fp16 master weights skip an overflowed step on the device (bert.optim.master), where the optimizer can
    skip_on_device = cfg.master_weights and compute_dtype == torch.float16
    build = functools.partial(OPTIMIZERS[cfg.optimizer], lr=lr, betas=(cfg.opt_lamb_beta_1, cfg.opt_lamb_beta_2),
                              eps=cfg.opt_epsilon, on_cuda=on_cuda, compiled=cfg.compile_optimizer,
                              skip_on_device=skip_on_device)
    if cfg.optimizer_layout == "flat":  # LAMB over flat buffers of the masters (the config allows no other)
        build = functools.partial(FlatLamb, lr=lr, betas=(cfg.opt_lamb_beta_1, cfg.opt_lamb_beta_2),
                                  eps=cfg.opt_epsilon)
    if cfg.master_weights:
        from bert.optim.master import MasterWeights

        return MasterWeights(groups, build, compute_dtype, cfg.max_grad_norm if cfg.grad_clip == "after" else None)
    return build(groups)


def hook_clip_mode(cfg: OptimConfig) -> str:
    """The clip mode DDP's hook runs. `after` moves into the optimizer's step where the optimizer is the first
    to see the averaged gradient whole: sharded (as shards) and master weights (as fp32, unscaled)."""
    return "none" if (cfg.optimizer_sharding or cfg.master_weights) and cfg.grad_clip == "after" else cfg.grad_clip


def build_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> WarmupPolyDecay:
    return WarmupPolyDecay(optimizer, cfg.learning_rate, cfg.warmup_steps, cfg.start_warmup_step,
                           cfg.lr_max_steps or cfg.max_steps, cfg.end_learning_rate, cfg.lr_poly_power)
