"""Data parallelism: wrap the model in DDP, or in balanced fusion buffers (`bert.dist.fusion`); clipping is
installed on the wrapper by `bert.dist.clip.install_clipping`. `GRAD_BUCKETS` is the registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.config import DistConfig
from bert.dist.fusion import FusedDataParallel

# torch >= 2.13 names it `forward_sync_buffers` and warns on `broadcast_buffers` (the amaxes are equal at init, so
# its init-time sync is harmless); 2.11 has only `broadcast_buffers`
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                          else {"broadcast_buffers": False})


def _ddp(model: torch.nn.Module, cfg: DistConfig) -> DDP:
    # device_ids=None: batches arrive on the device already, and DDP must not re-build the Batch dataclass.
    # No buffer sync before each forward: the only buffers are FP8_RECIPE=delayed's amaxes, each rank's own (rank 0's
    # would saturate the others' larger values), and syncing them would cost a collective per step
    return DDP(model, device_ids=None, bucket_cap_mb=cfg.bucket_cap_mb, **NO_FORWARD_BUFFER_SYNC,
               gradient_as_bucket_view=True)  # .grad becomes its bucket view: no second copy in memory; as Samsung


def _balanced(model: torch.nn.Module, cfg: DistConfig) -> FusedDataParallel:
    return FusedDataParallel(model, cfg.bucket_cap_mb)


GRAD_BUCKETS: dict[str, Callable[[torch.nn.Module, DistConfig], DDP | FusedDataParallel]] = {
    "ddp": _ddp,  # whole parameters per bucket, up to bucket_cap_mb each
    "balanced": _balanced,  # ceil(total / bucket_cap_mb) slices of equal size (Herring [003] §III-1)
}


def apply_ddp(model: torch.nn.Module, cfg: DistConfig) -> DDP | FusedDataParallel:
    """The data-parallel wrapper `cfg.grad_buckets`; gradients are views into its buckets."""
    return GRAD_BUCKETS[cfg.grad_buckets](model, cfg)
