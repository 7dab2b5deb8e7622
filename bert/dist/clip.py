"""Where gradients are clipped by norm (Samsung [000] §2.3, §3.2, §4.2, Algorithm 1).

    after   DDP averages the buckets as usual; the optimizer step clips the averaged gradient
            by its global norm (`clip_after_allreduce`). Communication overlaps the backward pass.
    before  every rank clips its *local* gradient by its local global norm, then averages. The
            norm needs every bucket, so no allreduce can start before the backward pass ends.
    bucket  every bucket is clipped to c/sqrt(B) by its own norm the moment it is ready, then
            averaged asynchronously: clip-before's sample efficiency with clip-after's overlap.

`before` and `bucket` are DDP communication hooks. Under fp16 loss scaling the buckets hold
scaled gradients; norms are compared after dividing by the scale, and the clipped bucket stays
scaled so that the GradScaler's unscale and inf check work unchanged. With gradient
accumulation the hooks run only on the sync micro-step, so they clip the accumulated gradient.
"""

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel as DDP

LossScale = Callable[[], Tensor | float]  # the current fp16 loss scale; 1.0 without scaling


def clip_after_allreduce(params: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """Clip the (averaged, unscaled) gradient by its global norm; returns the norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(list(params), max_norm, foreach=True)


def _clip_factor(norm_scaled: Tensor, limit: float, loss_scale: LossScale) -> Tensor:
    """min(1, limit / ||g||) with ||g|| the unscaled norm. A zero norm gives inf -> 1; an inf norm gives
    0 and the bucket turns NaN, which the GradScaler then sees and skips."""
    return (limit / (norm_scaled / loss_scale())).clamp(max=1.0)


class DdpBucketCount:
    """B, the number of DDP buckets, read from DDP at run time.

    DDP starts with one layout and rebuilds its buckets in gradient-ready order inside the forward
    of the second iteration, so B can change once and never after. The reducer cannot be queried
    from inside a hook (it holds its lock there), so B is read after each forward until the
    rebuild has happened. The query allocates one zero-filled copy of the gradients, twice per run.
    """

    def __init__(self, ddp: DDP):
        self._count = len(ddp.reducer._get_zeros_like_grad_buckets())
        self._handle = ddp.register_forward_hook(self._refresh)

    def _refresh(self, ddp: DDP, *_) -> None:
        self._count = len(ddp.reducer._get_zeros_like_grad_buckets())
        if ddp._has_rebuilt_buckets:
            self._handle.remove()

    def __call__(self) -> int:
        return self._count


@dataclass
class BucketClipState:
    max_norm: float
    num_buckets: Callable[[], int]
    loss_scale: LossScale
    group: dist.ProcessGroup | None = None


def bucket_clip_hook(state: BucketClipState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Algorithm 1, lines 6-10: clip this bucket to c/sqrt(B), then start its allreduce."""
    grad = bucket.buffer()
    limit = state.max_norm / math.sqrt(state.num_buckets())
    factor = _clip_factor(torch.linalg.vector_norm(grad, dtype=torch.float32), limit, state.loss_scale)
    grad.mul_(factor / dist.get_world_size(state.group))
    work = dist.all_reduce(grad, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclass
class BeforeClipState:
    max_norm: float
    loss_scale: LossScale
    group: dist.ProcessGroup | None = None
    pending: list[tuple[Tensor, Future]] = field(default_factory=list)


def clip_before_hook(state: BeforeClipState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Hold every bucket until the last one is ready, clip all by the local global norm, then average."""
    result: Future[Tensor] = Future()
    state.pending.append((bucket.buffer(), result))
    if not bucket.is_last():
        return result
    grads = [g for g, _ in state.pending]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    factor = _clip_factor(norm, state.max_norm, state.loss_scale) / dist.get_world_size(state.group)
    flat = torch.cat(grads).mul_(factor.to(grads[0].dtype))  # one allreduce: nothing is left to overlap with
    dist.all_reduce(flat, group=state.group)
    # Results go back into the buckets' own buffers: DDP reads a result by absolute storage offset,
    # so views into `flat` would be misread.
    for (g, fut), part in zip(state.pending, flat.split([g.numel() for g in grads])):
        fut.set_result(g.copy_(part))
    state.pending.clear()
    return result


def register_clip_hook(ddp: DDP, mode: str, max_norm: float, loss_scale: LossScale) -> None:
    """Install the hook of `mode` ('before' or 'bucket'); 'after' and 'none' keep DDP's own allreduce."""
    if mode == "bucket":
        ddp.register_comm_hook(BucketClipState(max_norm, DdpBucketCount(ddp), loss_scale), bucket_clip_hook)
    elif mode == "before":
        ddp.register_comm_hook(BeforeClipState(max_norm, loss_scale), clip_before_hook)
    elif mode not in ("after", "none"):
        raise ValueError(f"grad_clip must be none, after, before or bucket, got {mode!r}")
