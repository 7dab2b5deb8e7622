"""Where gradients are clipped by norm (Samsung [000] §2.3, §3.2, §4.2, Algorithm 1).

    after   DDP averages the buckets as usual; the optimizer step clips the averaged gradient
            by its global norm (`clip_after_allreduce`). Communication overlaps the backward pass.
    before  every rank clips its *local* gradient by its local global norm, then averages. The
            norm needs every bucket, so no allreduce can start before the backward pass ends.
    bucket  every bucket is clipped to c/sqrt(B) by its own norm the moment it is ready, then
            averaged asynchronously: clip-before's sample efficiency with clip-after's overlap.

`install_clipping(ddp, mode, max_norm, scaler)` sets a mode up once and returns the `Clipper` that the
training loop calls before every optimizer step, whatever the mode: `after` clips there; the other
modes did their work inside the allreduce, so their step is empty. `CLIP_MODES` is the registry.
It also places the mean's 1/W on a hook path (`bert.dist.reduce`): with `mean_at="loss"` the Reduce
only sums and the Clipper's `loss_factor` (1/W) is what the loop multiplies the loss by.

`before` and `bucket` are DDP communication hooks. Under fp16 loss scaling the buckets hold
scaled gradients; norms are compared after dividing by the scale, and the clipped bucket stays
scaled so that the GradScaler's unscale and inf check work unchanged. A 1/W the loss carries is part
of that scale: the hooks clip each rank's own gradient, as without it. With gradient
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

from bert.dist.fusion import FusedDataParallel
from bert.dist.reduce import MEAN_PLACEMENTS, Reduce, allreduce_sum, divided, reduce_hook

LossScale = Callable[[], Tensor | float]  # the current fp16 loss scale; 1.0 without scaling


def local_norm(t: Tensor) -> Tensor:
    """||t|| accumulated in at least float32 (a bf16/fp16 sum of squares overflows), in float64 for
    float64 gradients, which the exact-reference tests use."""
    return torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32))


def clip_after_allreduce(params: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """Clip the (averaged, unscaled) gradient by its global norm; returns the norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(list(params), max_norm, foreach=True)


def clip_factor(grad: Tensor, max_norm: float) -> Tensor:
    """What `clip_after_allreduce` would multiply the one gradient `grad` by, as torch's clip_grad_norm_ computes it
    (min(1, max_norm / (norm + 1e-6))), without multiplying: the flat update folds it into its read of the gradient
    (bert.optim.flat.lamb_rows)."""
    norm = torch.nn.utils.get_total_norm([grad], 2.0, foreach=True)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def clip_shards_(shard: Tensor, max_norm: float, group: dist.ProcessGroup | None = None) -> None:
    """`clip_after_allreduce` where each rank holds a shard of the averaged gradient (weight-update sharding): the
    global norm from one allreduce of the shards' squared norms (float64), then the shard scaled in place as
    `clip_grad_norm_` scales (max_norm / (norm + 1e-6), at most 1)."""
    square = torch.linalg.vector_norm(shard, dtype=torch.float64).square().reshape(1)
    dist.all_reduce(square, group=group)
    norm = square.sqrt().to(torch.promote_types(shard.dtype, torch.float32))
    shard.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0).to(shard.dtype))


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
    reduce: Reduce  # a sum; install_clipping has placed the 1/W


def bucket_clip_hook(state: BucketClipState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Algorithm 1, lines 6-10: clip this bucket to c/sqrt(B), then start its allreduce."""
    grad = bucket.buffer()
    limit = state.max_norm / math.sqrt(state.num_buckets())
    factor = _clip_factor(local_norm(grad), limit, state.loss_scale)
    grad.mul_(factor)
    return state.reduce(grad)


@dataclass
class BeforeClipState:
    max_norm: float
    loss_scale: LossScale
    reduce: Reduce  # a sum; install_clipping has placed the 1/W
    pending: list[tuple[Tensor, Future]] = field(default_factory=list)


def clip_before_hook(state: BeforeClipState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Hold every bucket until the last one is ready, clip all by the local global norm, then average."""
    result: Future[Tensor] = Future()
    state.pending.append((bucket.buffer(), result))
    if not bucket.is_last():
        return result
    grads = [g for g, _ in state.pending]
    norm = torch.linalg.vector_norm(torch.stack([local_norm(g) for g in grads]))
    factor = _clip_factor(norm, state.max_norm, state.loss_scale)
    flat = torch.cat(grads).mul_(factor.to(grads[0].dtype))  # one reduction: nothing is left to overlap with
    flat = state.reduce(flat).wait()
    # Results go back into the buckets' own buffers: DDP reads a result by absolute storage offset,
    # so views into `flat` would be misread.
    for (g, fut), part in zip(state.pending, flat.split([g.numel() for g in grads])):
        fut.set_result(g.copy_(part))
    state.pending.clear()
    return result


class Clipper:
    """What the loop calls before every optimizer step. The base does nothing: `none` never clips, and
    `before`/`bucket` already clipped inside DDP's allreduce hook. `loss_factor` is what the loop multiplies
    the loss by before backward: 1/W when the hook only sums (`mean_at="loss"`), else 1."""

    loss_factor: float = 1.0

    def before_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        return None


class ClipAfterAllreduce(Clipper):
    """`after`: unscale (fp16), then clip the averaged gradient by its global norm."""

    def __init__(self, params: Iterable[torch.nn.Parameter], max_norm: float):
        self.params, self.max_norm = list(params), max_norm

    def before_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        scaler.unscale_(optimizer)
        clip_after_allreduce(self.params, self.max_norm)


def loss_scale_of(scaler: torch.amp.GradScaler | None) -> LossScale:
    """The current scale as a device tensor for the hooks (get_scale() would sync the host); 1.0 unscaled."""
    if scaler is None or not scaler.is_enabled():
        return lambda: 1.0
    return scaler._get_scale_async


def _times(loss_scale: LossScale, factor: float) -> LossScale:
    return lambda: loss_scale() * factor


# `reduce` is None only where no hook reduces (DDP's own allreduce); the HOOK_MODES always get one.
Installer = Callable[[DDP, float, LossScale, Reduce | None], Clipper]
HOOK_MODES = ("before", "bucket")  # they clip inside a comm hook, so a hook reduces whatever `reduce` is


def _install_none(ddp: DDP, max_norm: float, loss_scale: LossScale, reduce: Reduce | None) -> Clipper:
    if reduce is not None:  # otherwise DDP's own allreduce
        ddp.register_comm_hook(None, reduce_hook(reduce))
    return Clipper()


def _install_after(ddp: DDP, max_norm: float, loss_scale: LossScale, reduce: Reduce | None) -> Clipper:
    _install_none(ddp, max_norm, loss_scale, reduce)
    return ClipAfterAllreduce(ddp.parameters(), max_norm)


def _install_before(ddp: DDP, max_norm: float, loss_scale: LossScale, reduce: Reduce | None) -> Clipper:
    ddp.register_comm_hook(BeforeClipState(max_norm, loss_scale, reduce), clip_before_hook)
    return Clipper()


def _install_bucket(ddp: DDP, max_norm: float, loss_scale: LossScale, reduce: Reduce | None) -> Clipper:
    # Balanced fusion buffers (bert.dist.fusion) have a constant B; DDP's may change once, at its rebuild.
    count = ddp.num_buckets if isinstance(ddp, FusedDataParallel) else DdpBucketCount(ddp)
    state = BucketClipState(max_norm, count, loss_scale, reduce)
    ddp.register_comm_hook(state, bucket_clip_hook)
    return Clipper()


CLIP_MODES: dict[str, Installer] = {
    "none": _install_none,
    "after": _install_after,
    "before": _install_before,
    "bucket": _install_bucket,
}


def install_clipping(ddp: DDP | FusedDataParallel, mode: str, max_norm: float,
                     scaler: torch.amp.GradScaler | None = None, reduce: Reduce | None = None,
                     mean_at: str = "bucket") -> Clipper:
    """Set up clipping `mode` on `ddp` once and return the step-side Clipper. `reduce` is how gradients are
    summed (`bert.dist.reduce`); None keeps DDP's flat allreduce, or a hook's `allreduce_sum`. DDP takes one
    comm hook, so this is the one place that registers it. `mean_at` is where a hook path divides by the
    world size (`mean_placement`): "bucket" (each bucket before its sum: every hook's result is the mean,
    as DDP's), "loss" (the returned Clipper's `loss_factor`), "optimizer" (the sharded optimizer's)."""
    if mode not in CLIP_MODES:
        raise ValueError(f"grad_clip must be one of {', '.join(CLIP_MODES)}, got {mode!r}")
    if mean_at not in MEAN_PLACEMENTS:
        raise ValueError(f"mean_at must be one of {', '.join(MEAN_PLACEMENTS)}, got {mean_at!r}")
    loss_scale, loss_factor = loss_scale_of(scaler), 1.0
    if reduce is not None or mode in HOOK_MODES or isinstance(ddp, FusedDataParallel):  # a hook reduces
        group = ddp.group if isinstance(ddp, FusedDataParallel) else ddp.process_group
        reduce = reduce or allreduce_sum(group)
        if mean_at == "bucket":
            reduce = divided(reduce, dist.get_world_size(group))
        elif mean_at == "loss":
            loss_factor = 1.0 / dist.get_world_size(group)
            loss_scale = _times(loss_scale, loss_factor)  # the hooks' norms are of g/W: clip g by its own norm
    clipper = CLIP_MODES[mode](ddp, max_norm, loss_scale, reduce)
    clipper.loss_factor = loss_factor
    return clipper
