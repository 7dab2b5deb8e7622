"""The resolved run, recorded: rank 0 writes <output_dir>/config.json and prints it once at start.

Besides every configured value it records what the config leaves to the machine: the concrete
attention backend (`auto` -> loop on CPU, varlen on CUDA), the optimizer class actually built and the
one that runs the update (apex FusedLAMB or our foreach LAMB, inside a sharded or master-weight optimizer),
the precision, the dtype of the model's weights and whether autocast runs, the world and node layout,
and the torch, CUDA and NCCL versions, so that a result can be matched with what ran.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bert.model.attention import resolve_backend
from bert.model.precision import autocast_dtype
from bert.train.loop import Run


def _nccl_version() -> str | None:
    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError, TypeError):  # a CPU build of torch has no NCCL
        return None


def shard_plan(optimizer: torch.optim.Optimizer) -> str | None:
    """The sharded masters' collectives and how many slices a block is cut into (OPTIMIZER_SHARD_PLAN)."""
    plan = getattr(optimizer, "plan", None)
    return f"{type(plan).__qualname__}, {plan.owners} owners" if plan is not None else None


def resolved_record(run: Run, device: torch.device) -> dict[str, Any]:
    cfg, env = run.cfg, run.env
    optimizer, update = type(run.optimizer), type(getattr(run.optimizer, "inner", run.optimizer))
    weights = run.optimizer.param_groups[0]["params"][0]
    return {
        "config": cfg.to_dict(),
        "resolved": {
            "attention_backend": resolve_backend(cfg.model.attention, device),
            "optimizer_class": f"{optimizer.__module__}.{optimizer.__qualname__}",
            "update_class": f"{update.__module__}.{update.__qualname__}",  # inside a sharded/master-weight optimizer
            "shard_plan": shard_plan(run.optimizer),
            "weight_dtype": str(weights.dtype).removeprefix("torch."),  # the model's (bf16/fp16 with master weights)
            "master_weights": cfg.optim.master_weights,
            "autocast": autocast_dtype(cfg.model.precision, cfg.optim.master_weights) is not None,
            "clipper_class": type(run.clipper).__qualname__,
            "precision": cfg.model.precision,
            "fp16_loss_scaling": run.scaler.is_enabled(),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "world_size": env.world_size,
            "nodes": env.world_size // env.local_world_size,
            "ranks_per_node": env.local_world_size,
            "process_group_backend": dist.get_backend() if dist.is_initialized() else None,
            "global_batch_size": run.global_batch_size,
            "eval_samples": run.eval_samples,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": _nccl_version(),
        },
    }


def record_run(run: Run, device: torch.device) -> dict[str, Any] | None:
    """On rank 0: write config.json into the output folder and print it; other ranks do nothing."""
    if not run.env.is_main:
        return None
    record = resolved_record(run, device)
    out = Path(run.cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(record, indent=1) + "\n")
    # one line on the console: greppable, and it does not bury the lines around it
    print(f"resolved configuration ({out / 'config.json'}): {json.dumps(record)}", file=sys.stdout, flush=True)
    return record
