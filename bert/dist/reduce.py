"""How a gradient buffer is averaged over the ranks: the `Reduce` that every gradient comm hook ends in.

A `Reduce` takes a flat gradient tensor (one DDP bucket, or all of them at once) and returns a Future
of that same tensor holding the mean over the world. Clipping (`bert.dist.clip`) decides *what* is
sent and when; a Reduce decides *how* it travels. Keeping the two apart lets every clipping mode
compose with every reduction strategy.

    allreduce_mean     the flat allreduce DDP itself runs (ring/tree inside NCCL or gloo)
    HierarchicalMean   intra-node reduce-scatter, inter-node allreduce, intra-node all-gather
                       (`bert.dist.hierarchical`)
    ps                 parameter servers sum the shards of every buffer (`bert.dist.ps`, Herring [003] §III-A)

`GRAD_COMM_DTYPE` wraps whichever one is chosen in a bf16/fp16 cast (`bert.dist.compress`).

`REDUCTIONS` is the registry behind `GRAD_REDUCE` (name -> builder of a Reduce from the config's dist
section and the rank layout); `build_reduce` returns None for DDP's own flat allreduce, which needs no hook.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as real objects.
from collections.abc import Callable

import torch.distributed as dist

from bert.config import DistConfig
from bert.dist import ps
from bert.dist.compress import COMM_DTYPES, compressed
from bert.dist.env import DistEnv
from bert.dist.hierarchical import HierarchicalMean
from torch import Tensor
from torch.futures import Future

Reduce = Callable[[Tensor], Future[Tensor]]
Hook = Callable[[object, dist.GradBucket], Future[Tensor]]


def allreduce_mean(group: dist.ProcessGroup | None = None) -> Reduce:
    """Divide by the world size, then one asynchronous allreduce over `group` (default: the world)."""

    def reduce(flat: Tensor) -> Future[Tensor]:
        flat.div_(dist.get_world_size(group))
        return dist.all_reduce(flat, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])

    return reduce


def reduce_hook(reduce: Reduce) -> Hook:
    """A DDP comm hook that only averages each bucket with `reduce` (no clipping inside the hook)."""

    def hook(state: object, bucket: dist.GradBucket) -> Future[Tensor]:
        return reduce(bucket.buffer())

    return hook


ReduceBuilder = Callable[[DistConfig, DistEnv], Reduce | None]


def _flat(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    return None  # DDP's built-in allreduce (C++), or allreduce_mean inside the clipping hooks


def _hierarchical(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    return HierarchicalMean(cfg.grad_reduce_node_size or env.local_world_size)


def _ps(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    return ps.client().reduce  # the client the driver connected in init (`ps.connect_worker`)


REDUCTIONS: dict[str, ReduceBuilder] = {"flat": _flat, "hierarchical": _hierarchical, "ps": _ps}


def build_reduce(cfg: DistConfig, env: DistEnv) -> Reduce | None:
    """The gradient reduction `cfg.grad_reduce` for this rank layout, sent in `cfg.grad_comm_dtype`
    (None: DDP's flat allreduce in the gradients' own dtype)."""
    reduce = REDUCTIONS[cfg.grad_reduce](cfg, env)
    dtype = COMM_DTYPES[cfg.grad_comm_dtype]
    if dtype == COMM_DTYPES["fp32"]:
        return reduce
    return compressed(reduce or allreduce_mean(), dtype)
