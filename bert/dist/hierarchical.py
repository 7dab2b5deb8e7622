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

Inside the node, steps 1 and 3 exchange chunks either by reduce_scatter/all_gather (NCCL's default; the
buffer is zero-padded to a multiple of n) or by sends and receives to every node peer (gloo's default:
gloo's reduce-scatter and all-gather cost about twice the CPU per byte of its ring allreduce; chunks may
then differ in size, so nothing is padded).

Ordering and overlap. Collectives (and sends) on one group must be issued in the same order on every rank.
Step 1 is issued by the hook itself, the moment DDP hands over a bucket (DDP calls hooks in bucket order
on every rank). Step 2 runs on one thread and step 3 on another, each taking the buckets in that same
order, and each of the three steps has its own group (two intra-node groups: one shared group would see
the hook's and the step-3 thread's exchanges interleaved differently on different ranks). So bucket k's
inter-node allreduce overlaps the backward pass, bucket k+1's reduce-scatter and bucket k-1's all-gather;
the future DDP waits on is completed by the step-3 thread.

On one host (bench/comm.py: 2 simulated nodes x 2 over loopback) there is no slow link to spare: per rank
and bucket of b bytes, flat's 4-rank ring and steps 1-3 each send 1.5b and sum 0.75b; the hierarchy saves
two of the ring's six message latencies and adds two thread hand-offs, so the two cost about the same.
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


class _Job:
    """One buffer on its way through the three steps; `work` is the step in flight."""

    def __init__(self, flat: Tensor, padded: Tensor, chunks: tuple[Tensor, ...], shard: Tensor, work: "_Pending"):
        self.flat, self.padded, self.chunks, self.shard, self.work = flat, padded, chunks, shard, work
        self.result: Future[Tensor] = Future(devices=[flat.device]) if flat.is_cuda else Future()

    def finish(self) -> None:
        if self.padded is not self.flat:
            self.flat.copy_(self.padded[:self.flat.numel()])
        self.result.set_result(self.flat)


class _Pending:
    """Collectives or sends/receives in flight, and what to do once they are done."""

    def __init__(self, works: list, then=None):
        self.works, self.then = works, then

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()


class HierarchicalMean:
    """A `Reduce` (bert.dist.reduce): the world mean of a flat tensor, in place, by steps 1-3 above.

    `exchange` is how steps 1 and 3 move data inside the node: "collective" (reduce_scatter / all_gather,
    the NCCL default) or "p2p" (each rank sends every node peer its chunk and sums what it receives, the
    gloo default: gloo's reduce-scatter, all-to-all and all-gather cost about twice the CPU per byte of
    its ring allreduce, its sends/receives about the same per byte; measured with 4 MB on 4 processes).
    The p2p exchange works in place: this rank's shard is its own chunk of the bucket, summed into where
    it lies, all-reduced there, and the peers' shards are received straight into their chunks.

    Sends, receives and the step-2 allreduce call the process groups' own methods: `dist.isend`,
    `dist.all_reduce` & co. add ~0.2 ms of Python checks per call on a loaded 2-core host (bench/comm.py's
    37 buckets make 185 of them per rank and step).
    """

    def __init__(self, node_size: int, exchange: str | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        intra, inter = node_groups(world, node_size)
        self.world, self.node_size = world, node_size
        # Three enumerations, every rank in the same order: each returns this rank's group.
        self.scatter_group, _ = dist.new_subgroups_by_enumeration(intra)
        self.inter_group, _ = dist.new_subgroups_by_enumeration(inter)
        self.gather_group, _ = dist.new_subgroups_by_enumeration(intra)
        self.local = rank % node_size
        # (chunk index, the peer's rank in the intra-node groups) for every other rank of the node
        self.peers = [(j, dist.get_group_rank(self.scatter_group, r))
                      for j, r in enumerate(intra[rank // node_size]) if j != self.local]
        self.exchange = exchange or ("p2p" if dist.get_backend() == "gloo" else "collective")
        if self.exchange not in ("p2p", "collective"):
            raise ValueError(f"exchange must be p2p or collective, got {self.exchange!r}")
        self._sum = dist.AllreduceOptions()
        self._sum.asyncOp = True
        self._to_inter: queue.SimpleQueue = queue.SimpleQueue()
        self._to_gather: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # Receive buffers of step 1, kept for the next step's bucket of the same size: a fresh CPU buffer
        # is page-faulted in by the kernel while gloo receives into it.
        self._spare: dict[tuple, list[Tensor]] = {}

    def _buffer(self, like: Tensor) -> Tensor:
        spare = self._spare.get(_key(like))
        return spare.pop() if spare else torch.empty_like(like)

    def __call__(self, flat: Tensor) -> Future[Tensor]:
        flat.div_(self.world)
        n = self.node_size
        if self.exchange == "p2p":  # chunks may differ in size by one element: nothing padded, nothing copied
            chunks = flat.tensor_split(n)
            job = _Job(flat, flat, chunks, chunks[self.local], self._reduce_scatter(flat, chunks, chunks[self.local]))
        else:  # reduce_scatter/all_gather take n equal chunks (pad) and a separate shard
            padded = flat if flat.numel() % n == 0 else torch.cat([flat, flat.new_zeros(n - flat.numel() % n)])
            chunks = padded.tensor_split(n)
            shard = padded.new_empty(chunks[self.local].numel())
            job = _Job(flat, padded, chunks, shard, self._reduce_scatter(padded, chunks, shard))
        self._start_threads()
        self._to_inter.put(job)
        return job.result

    def _reduce_scatter(self, padded: Tensor, chunks: tuple[Tensor, ...], shard: Tensor) -> _Pending:
        group = self.scatter_group
        if self.exchange == "collective":
            return _Pending([dist.reduce_scatter_single(shard, padded, group=group, async_op=True)])
        received = [self._buffer(shard) for _ in self.peers]  # p2p: `shard` is chunks[self.local]
        works = []
        for buf, (j, peer) in zip(received, self.peers):
            works.append(group.recv([buf], peer, 0))
            works.append(group.send([chunks[j]], peer, 0))

        def node_sum() -> None:
            for buf in received:
                shard.add_(buf)
            self._spare.setdefault(_key(shard), []).extend(received)

        return _Pending(works, node_sum)

    def _all_gather(self, padded: Tensor, chunks: tuple[Tensor, ...], shard: Tensor) -> _Pending:
        group = self.gather_group
        if self.exchange == "collective":
            return _Pending([dist.all_gather_single(padded, shard, group=group, async_op=True)])
        works = []  # p2p: our shard is already in its place; the peers' land in theirs
        for j, peer in self.peers:
            works.append(group.recv([chunks[j]], peer, 0))
            works.append(group.send([shard], peer, 0))
        return _Pending(works)

    def _start_threads(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=run, name=f"hierarchical-{run.__name__}", daemon=True)
                             for run in (self._inter_steps, self._gather_steps)]
            for t in self._threads:
                t.start()

    def _inter_steps(self) -> None:
        """Step 2 for every buffer in arrival order: one thread, so every rank issues them alike."""
        while True:
            job = self._to_inter.get()
            try:
                with _on_device(job.flat):
                    job.work.wait()
                    job.work = _Pending([self.inter_group.allreduce([job.shard], self._sum)])
            except Exception as e:  # DDP's wait on the future raises it in the training thread
                job.result.set_exception(e)
                continue
            self._to_gather.put(job)

    def _gather_steps(self) -> None:
        """Step 3 in arrival order; the buffer is handed back when its all-gather is done."""
        while True:
            job = self._to_gather.get()
            try:
                with _on_device(job.flat):
                    job.work.wait()
                    self._all_gather(job.padded, job.chunks, job.shard).wait()
                    job.finish()
            except Exception as e:
                job.result.set_exception(e)


def _key(t: Tensor) -> tuple:
    return t.numel(), t.dtype, t.device


def _on_device(t: Tensor):
    """The comm threads issue collectives on the tensor's GPU (a new thread starts on GPU 0)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()
