"""Data parallelism: wrap the model in DDP and install the clipping hook the config asks for."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.dist.clip import LossScale, register_clip_hook
from bert.train.config import TrainConfig


def apply_ddp(model: torch.nn.Module, cfg: TrainConfig, loss_scale: LossScale = lambda: 1.0) -> DDP:
    """DDP with `cfg.bucket_cap_mb` buckets; `before`/`bucket` clipping runs inside its communication hook."""
    # device_ids=None: batches arrive on the device already, and DDP must not re-build the Batch dataclass.
    ddp = DDP(model, device_ids=None, bucket_cap_mb=cfg.bucket_cap_mb,
              gradient_as_bucket_view=True)  # no second copy of the gradients; Samsung did the same
    register_clip_hook(ddp, cfg.grad_clip, cfg.max_grad_norm, loss_scale)
    return ddp
