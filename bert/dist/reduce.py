"""How a gradient buffer is summed over the ranks: the `Reduce` that every gradient comm hook ends in.

A `Reduce` takes a flat gradient tensor (one DDP bucket, or all of them at once) and returns a Future
of that same tensor holding the sum over the world. Clipping (`bert.dist.clip`) decides *what* is
sent and when; a Reduce decides *how* it travels. Keeping the two apart lets every clipping mode
compose with every reduction strategy.

    allreduce_sum      the flat allreduce DDP itself runs (ring/tree inside NCCL or gloo)
    HierarchicalSum    intra-node reduce-scatter, inter-node allreduce, intra-node all-gather
                       (`bert.dist.hierarchical`)
    ps                 parameter servers sum the shards of every buffer (`bert.dist.ps`, Herring [003] §III-A)

Where the mean's 1/W goes (`MEAN_PLACEMENTS`, chosen by `mean_placement`, applied by `install_clipping`).
DDP's own allreduce (no hook) divides each gradient while copying it into its bucket: one pass for both.
A hook cannot reach that copy, so on a hook path the division is put where it costs no pass:
    loss       the loss is multiplied by 1/W before backward, and the backward itself yields g/W (Horovod's
               and apex's gradient_predivide_factor): the Reduces only sum. Exact for a power-of-two W.
    bucket     `divided`: each bucket is divided, then summed (a pass; what DDP's sum does in fp16). Kept for
               PRECISION=fp16, whose backward would otherwise run W times closer to fp16's underflow, and
               for callers that want a mean from a Reduce.
    optimizer  nothing in the hook: the sharded optimizer's reduce-scatter sums and divides (OPTIMIZER_SHARDING).

`GRAD_COMM_DTYPE` wraps whichever Reduce is chosen in a bf16/fp16 cast (`bert.dist.compress`).

`REDUCTIONS` is the registry behind `GRAD_REDUCE` (name -> builder of a Reduce from the config's dist
section and the rank layout); `build_reduce` returns None for DDP's own flat allreduce, which needs no hook.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as real objects.
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from bert.config import DistConfig
from bert.dist import ps
from bert.dist.compress import COMM_DTYPES, compressed
from bert.dist.env import DistEnv
from bert.dist.hierarchical import HierarchicalSum

Reduce = Callable[[Tensor], Future[Tensor]]
Hook = Callable[[object, dist.GradBucket], Future[Tensor]]


def allreduce_sum(group: dist.ProcessGroup | None = None) -> Reduce:
    """One asynchronous allreduce (sum) over `group` (default: the world)."""

    def reduce(flat: Tensor) -> Future[Tensor]:
        return dist.all_reduce(flat, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])

    return reduce


def divided(reduce: Reduce, world: int) -> Reduce:
    """`reduce` on the buffer divided by `world` first: the mean, and an fp16 sum that stays in range whenever
    every rank's term does (the `bucket` placement)."""

    def mean(flat: Tensor) -> Future[Tensor]:
        return reduce(flat.div_(world))

    return mean


def allreduce_mean(group: dist.ProcessGroup | None = None) -> Reduce:
    """Divide by the group's size, then one asynchronous allreduce: DDP's own mean, from a hook."""
    return divided(allreduce_sum(group), dist.get_world_size(group))


def reduce_hook(reduce: Reduce) -> Hook:
    """A DDP comm hook that only reduces each bucket with `reduce` (no clipping inside the hook)."""

    def hook(state: object, bucket: dist.GradBucket) -> Future[Tensor]:
        return reduce(bucket.buffer())

    return hook


ReduceBuilder = Callable[[DistConfig, DistEnv], Reduce | None]


def _flat(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    return None  # DDP's built-in allreduce (C++), or allreduce_sum inside the clipping hooks


def _hierarchical(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    return HierarchicalSum(cfg.grad_reduce_node_size or env.local_world_size,
                           timeout=timedelta(seconds=cfg.dist_timeout_s))


def _ps(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    return ps.client().reduce  # the client the driver connected in init (`ps.connect_worker`)


REDUCTIONS: dict[str, ReduceBuilder] = {"flat": _flat, "hierarchical": _hierarchical, "ps": _ps}


def build_reduce(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    """The gradient sum `cfg.grad_reduce` for this rank layout, sent in `cfg.grad_comm_dtype`
    (None: DDP's flat allreduce in the gradients' own dtype)."""
    reduce = REDUCTIONS[cfg.grad_reduce](cfg, env)
    dtype = COMM_DTYPES[cfg.grad_comm_dtype]
    if dtype == COMM_DTYPES["fp32"]:
        return reduce
    return compressed(reduce or allreduce_sum(), dtype)


MEAN_PLACEMENTS = ("loss", "bucket", "optimizer")


def mean_placement(precision: str, optimizer_sharding: bool) -> str:
    """Where a hook path divides by the world size (see the module docstring): the loss, unless the compute is
    fp16 (each bucket, before the sum) or the optimizer reduce-scatters (it divides)."""
    if optimizer_sharding:
        return "optimizer"
    return "bucket" if precision == "fp16" else "loss"
