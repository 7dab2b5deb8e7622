"""Data parallelism: wrap the model in DDP (clipping is installed on it by `bert.dist.clip.install_clipping`)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.config import DistConfig


def apply_ddp(model: torch.nn.Module, cfg: DistConfig) -> DDP:
    """DDP with `cfg.bucket_cap_mb` buckets; gradients are views into the buckets."""
    # device_ids=None: batches arrive on the device already, and DDP must not re-build the Batch dataclass.
    return DDP(model, device_ids=None, bucket_cap_mb=cfg.bucket_cap_mb,
               gradient_as_bucket_view=True)  # no second copy of the gradients; Samsung did the same
