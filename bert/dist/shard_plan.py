"""How the sharded masters' gradient reaches the rank that updates it, and the weights come back:
`OPTIMIZER_SHARD_PLAN` (bert.optim.sharded_master).

N = R x G ranks: R nodes of G ranks, consecutive (`bert.dist.hierarchical.node_groups`); S bytes of gradient in
the compute dtype. Each block of the flat layout is cut into `owners` equal slices, and each rank owns one:

    flat   one reduce-scatter over all N ranks, one all-gather back: the TPU paper's weight-update sharding, "a global
           reduce-scatter after which each accelerator has a shard of summed gradients" ([004] §3.2). Rank r owns
           slice r of N.
    2d     the TPU Multipod's summation ([004] §3.3): a reduce-scatter inside the node (on its fast links), then one
           across the nodes on the node's 1/G share; LAMB on 1/N; the weights all-gathered across the nodes, then
           inside the node. Each rank sends (G-1)/G S inside its node and (R-1)/R S/G over the network each way,
           where one ring over all N ranks takes its S across node boundaries too. Rank (node j, local l) owns slice
           l R + j: the node's reduce-scatter hands local rank l the node's sum of slices l R to l R + R - 1, and
           the network one splits those among the R nodes.
    node   NVIDIA's DistributedFusedLAMB (`--dwu-group-size`, a node's GPUs by default; [NVIDIA-BERT]): a reduce-
           scatter inside the node, then an allreduce of the node's share across the nodes ("reduce_scatter and
           all_reduce"); every node updates a whole copy of the masters, 1/G a rank, the same rows on each node; the
           all-gather stays inside the node. It sends 2 (R-1)/R S/G over the network (the allreduce) and none back,
           and keeps 16 S/G bytes of fp32 state a rank instead of 16 S/N. Local rank l owns slice l of G.

With one node, or one rank a node, `2d` and `node` do what `flat` does, plus collectives of one rank. A norm over
the update's rows (the clip's, LAMB's per-tensor ones) sums one copy of each row: over all ranks, but over the
node alone under `node`, whose nodes hold the same rows (`norm_group`). The fp16 overflow agreement is over all
ranks (each rank's GradScaler saw its own gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from bert.dist.flat_collectives import all_gather_single, reduce_scatter_single
from bert.dist.hierarchical import Pending, node_groups, own_subgroup


def gather_owned(block: Tensor, owners: int, owner: int, group: dist.ProcessGroup | None, async_op: bool
                 ) -> Pending | None:
    """In place over `group`: slice `owner` of `owners` equal slices of `block`, from each member to every member."""
    n = block.numel() // owners
    work = all_gather_single(block, block[owner * n:(owner + 1) * n], group=group, async_op=async_op)
    return Pending([work]) if async_op else None


class FlatPlan:
    """One reduce-scatter over `group` (None: every rank), one all-gather back ([004] §3.2)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.owners = self.ranks = dist.get_world_size(group)
        self.owner = dist.get_rank(group)
        self.norm_group = self.flag_group = group

    def middle(self, n: int) -> int:
        """Elements of the scratch a block of n elements needs between its two reduce-scatters (none here)."""
        return 0

    def reduce_scatter(self, out: Tensor, block: Tensor, middle: Tensor, async_op: bool = False) -> Pending | None:
        """The sum over every rank of this rank's slice of `block`, into `out`; waited on by `.wait()` if async."""
        work = reduce_scatter_single(out, block, group=self.group, async_op=async_op)
        return Pending([work]) if async_op else None

    def all_gather(self, block: Tensor, async_op: bool = False) -> Pending | None:
        """In place: every owner's slice of `block` to every rank; waited on by `.wait()` if async."""
        return gather_owned(block, self.owners, self.owner, self.group, async_op)


class _NodePlans:
    """The node and network groups of R nodes of G consecutive ranks, and this rank's place in them."""

    def __init__(self, node_size: int, timeout: timedelta | None = None):
        world = dist.get_world_size()
        intra, inter = node_groups(world, node_size)  # a ValueError where node_size does not divide the world
        self.node_group, self.net_group = own_subgroup(intra, timeout), own_subgroup(inter, timeout)
        self.local, self.node = dist.get_rank() % node_size, dist.get_rank() // node_size
        self.size, self.nodes, self.ranks = node_size, world // node_size, world
        self.flag_group = None  # every rank
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _chain(self, first: Callable[[bool], Any], second: Callable[[bool], Any], on: Tensor, async_op: bool
               ) -> Pending | None:
        """Stage one, then stage two (each called with its async_op). Not async: both now. Async on a GPU: both
        issued now, on a stream of the plan's that follows the caller's, the second after the first, so the
        backward that goes on computing meanwhile waits for neither (its stream waits for both in `wait()`).
        Async on the CPU (gloo, whose `wait` holds the host): the first now, the second in `wait()`."""
        if not async_op:
            first(False)
            second(False)
            return None
        if not on.is_cuda:
            started = first(True)
            return Pending([started], then=lambda: second(False))
        if on.device not in self._streams:
            self._streams[on.device] = torch.cuda.Stream(on.device)
        stream = self._streams[on.device]
        stream.wait_stream(torch.cuda.current_stream(on.device))
        with torch.cuda.device(on.device), torch.cuda.stream(stream):
            first(True).wait()  # the plan's stream waits for stage one; the caller's does not
            return Pending([second(True)])


class TwoDPlan(_NodePlans):
    """Reduce-scatter inside the node, then across the nodes; all-gather across the nodes, then inside ([004] §3.3)."""

    def __init__(self, node_size: int, timeout: timedelta | None = None):
        super().__init__(node_size, timeout)
        self.owners, self.owner = self.ranks, self.local * self.nodes + self.node
        self.norm_group = None

    def middle(self, n: int) -> int:
        return n // self.size  # the node's sum of this local rank's R slices

    def reduce_scatter(self, out: Tensor, block: Tensor, middle: Tensor, async_op: bool = False) -> Pending | None:
        return self._chain(lambda a: reduce_scatter_single(middle, block, group=self.node_group, async_op=a),
                           lambda a: reduce_scatter_single(out, middle, group=self.net_group, async_op=a),  # 1/G
                           block, async_op)

    def all_gather(self, block: Tensor, async_op: bool = False) -> Pending | None:
        n = block.numel() // self.owners
        share = block[self.local * self.nodes * n:(self.local + 1) * self.nodes * n]  # local rank l's R slices
        return self._chain(lambda a: gather_owned(share, self.nodes, self.node, self.net_group, a),
                           lambda a: gather_owned(block, self.size, self.local, self.node_group, a),
                           block, async_op)


class NodePlan(_NodePlans):
    """Reduce-scatter inside the node, allreduce of the share across the nodes; all-gather inside the node (NVIDIA's
    DistributedFusedLAMB with a group of one node)."""

    def __init__(self, node_size: int, timeout: timedelta | None = None):
        super().__init__(node_size, timeout)
        self.owners, self.owner = self.size, self.local
        self.norm_group = self.node_group  # every node holds the same rows: one copy of each in a node

    def middle(self, n: int) -> int:
        return 0

    def reduce_scatter(self, out: Tensor, block: Tensor, middle: Tensor, async_op: bool = False) -> Pending | None:
        return self._chain(lambda a: reduce_scatter_single(out, block, group=self.node_group, async_op=a),
                           lambda a: dist.all_reduce(out, group=self.net_group, async_op=a),  # every node's sum
                           block, async_op)

    def all_gather(self, block: Tensor, async_op: bool = False) -> Pending | None:
        return gather_owned(block, self.owners, self.owner, self.node_group, async_op)


ShardPlan = FlatPlan | TwoDPlan | NodePlan
SHARD_PLANS = {"flat": FlatPlan, "2d": TwoDPlan, "node": NodePlan}


def build_shard_plan(name: str, node_size: int, timeout: timedelta | None = None) -> ShardPlan:
    """OPTIMIZER_SHARD_PLAN `name` over every rank, nodes of `node_size` ranks (a collective: every rank calls it)."""
    if name == "flat":
        return FlatPlan()
    return SHARD_PLANS[name](node_size, timeout)
