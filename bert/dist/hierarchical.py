"""Hierarchical gradient averaging: reduce inside the node, then across nodes, then share inside the node
(Herring [003] §III-A steps 1-5; the 2-D reduce-scatter of TPU [004] §3.3).

    1. intra-node reduce-scatter   each of the n local ranks gets the node's sum of 1/n of the bucket
    2. inter-node allreduce        that shard is summed among the ranks holding it (same local rank, every node)
    3. intra-node all-gather       the n averaged shards are shared inside the node again

Only 1/n of each bucket crosses the slow network per rank, and the inter-node rings are n times shorter
than one flat ring over the world. The result equals the flat allreduce up to summation order.

Ranks are laid out node by node: node k holds ranks k*n .. k*n+n-1, which is what torchrun and Slurm's
block distribution give (`DistEnv.local_world_size` = n, or `GRAD_REDUCE_NODE_SIZE` to simulate nodes).
The process groups are built once, on every rank in the same order (`dist.new_group` is collective).

Ordering. Collectives on one group must be issued in the same order on every rank. The reduce-scatter
is issued by the hook itself (DDP calls hooks in bucket order on every rank); steps 2-3 run on one
communication thread per reduction that takes the buckets in that same order, so bucket k's inter-node
allreduce overlaps the backward pass and bucket k+1's reduce-scatter. Steps 1 and 3 use two distinct
intra-node groups: one shared group would see the hook thread's reduce-scatters and the comm thread's
all-gathers interleaved differently on different ranks.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as real objects.
import queue
import threading
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future


def node_groups(world: int, node_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node rank lists, inter-node rank lists): nodes are consecutive blocks of `node_size` ranks;
    inter-node group j holds local rank j of every node."""
    if node_size < 1 or world % node_size:
        raise ValueError(f"node size {node_size} does not divide the world size {world}")
    intra = [list(range(k, k + node_size)) for k in range(0, world, node_size)]
    inter = [list(range(j, world, node_size)) for j in range(node_size)]
    return intra, inter


class HierarchicalMean:
    """A `Reduce` (bert.dist.reduce): the world mean of a flat tensor, in place, by steps 1-3 above."""

    def __init__(self, node_size: int):
        world = dist.get_world_size()
        intra, inter = node_groups(world, node_size)
        self.world, self.node_size = world, node_size
        # Three enumerations, every rank in the same order: each returns this rank's group.
        self.scatter_group, _ = dist.new_subgroups_by_enumeration(intra)
        self.inter_group, _ = dist.new_subgroups_by_enumeration(inter)
        self.gather_group, _ = dist.new_subgroups_by_enumeration(intra)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __call__(self, flat: Tensor) -> Future[Tensor]:
        flat.div_(self.world)
        n = self.node_size
        padded = flat if flat.numel() % n == 0 else torch.cat(  # equal shards need a multiple of n
            [flat, flat.new_zeros(n - flat.numel() % n)])
        shard = padded.new_empty(padded.numel() // n)
        scatter = dist.reduce_scatter_single(shard, padded, group=self.scatter_group, async_op=True)
        result: Future[Tensor] = Future(devices=[flat.device]) if flat.is_cuda else Future()
        self._start_thread()
        self._jobs.put((flat, padded, shard, scatter, result))
        return result

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hierarchical-reduce", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            flat, padded, shard, scatter, result = self._jobs.get()
            try:
                with torch.cuda.device(flat.device) if flat.is_cuda else nullcontext():
                    scatter.wait()
                    dist.all_reduce(shard, group=self.inter_group, async_op=True).wait()
                    dist.all_gather_single(padded, shard, group=self.gather_group, async_op=True).wait()
                    if padded is not flat:
                        flat.copy_(padded[:flat.numel()])
                result.set_result(flat)
            except Exception as e:  # DDP's wait on the future raises it in the training thread
                result.set_exception(e)

