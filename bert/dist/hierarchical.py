"""Hierarchical gradient sum: reduce inside the node, then across nodes, then share inside the node
(Herring [003] §III-A steps 1-5; the 2-D reduce-scatter of TPU [004] §3.3).

    1. intra-node reduce-scatter   each of the n local ranks gets the node's sum of 1/n of the bucket
    2. inter-node allreduce        that shard is summed among the ranks holding it (same local rank, every node)
    3. intra-node all-gather       the n summed shards are shared inside the node again

Only 1/n of each bucket crosses the slow network per rank, and the inter-node rings are n times shorter
than one flat ring over the world. The result equals the flat allreduce up to summation order.

Ranks are laid out node by node: node k holds ranks k*n .. k*n+n-1, which is what torchrun and Slurm's
block distribution give (`DistEnv.local_world_size` = n, or `GRAD_REDUCE_NODE_SIZE` to simulate nodes).
The process groups are built once, on every rank in the same order (`dist.new_group` is collective). On NCCL each
partition of the world (the nodes; the same local rank across nodes) is one communicator split (`split_group`), not
one `new_group` per part, each of which is a world-wide split: 3 at 128 x 8 instead of 264.

Inside the node, steps 1 and 3 exchange chunks either by reduce_scatter/all_gather (NCCL's default; the
buffer is zero-padded to a multiple of n) or by sends and receives to every node peer (gloo's default:
gloo's reduce-scatter and all-gather cost about twice the CPU per byte of its ring allreduce; chunks may
then differ in size, so nothing is padded).

Who issues the steps (`issue`). On NCCL ("caller", its default) the hook issues all three steps of a bucket itself,
in the order DDP hands the buckets over, the same on every rank, and returns at once: NCCL's `wait()` only makes a
stream wait, so the steps are chained on the GPU, each on a stream of its own (`_steps_on_streams`), and step 1 of a
bucket can run while step 2 of the one before does; the backward's stream waits for none of them, only DDP's final
wait on the futures. Every rank then issues the same collectives in the same order on each of the three groups and
across them, which is what NCCL needs of several communicators used at once. On gloo ("worker", its default and only
backend) a `wait()` blocks the host, so a worker thread waits, as below.

Ordering and overlap on gloo. Collectives (and sends) on one group must be issued in the same order on every rank.
Step 1 is issued by the hook itself, the moment DDP hands over a bucket (DDP calls hooks in bucket order on every
rank). Steps 2 and 3 are issued by one worker thread taking the buckets in that same order; steps 1 and 3 have
separate intra-node groups, because the hook's and the worker's exchanges interleave differently on different ranks.
The worker posts step 2 for every bucket that has arrived before it waits for any of them, then waits for the oldest
and posts its step 3, and finishes the step 3s (completing the futures DDP waits on) once no step 2 is in flight; so
steps 2 and 3 of different buckets overlap each other, the backward pass and the next buckets' step 1, and a burst
of buckets costs the worker one wake-up per step rather than three per bucket. (It used to take one bucket at a time
and waited for step 1, then step 2, then the previous bucket's step 3: 1.08-1.11x flat's CPU on bench/comm.py's
burst of 37 buckets; earlier still it was two threads, one per step: a thread hand-off per bucket more.)

It only sums, as every Reduce does (bert.dist.reduce): the mean's 1/W comes with the gradients, from the
loss (bf16/fp32) or from `divided` (PRECISION=fp16, where the bucket is divided before any fp16 sum).

On one host (bench/comm.py: 2 simulated nodes x 2 over loopback) there is no slow link to spare: per rank
and bucket of b bytes, flat's 4-rank ring and steps 1-3 each send 1.5b and sum 0.75b; the hierarchy saves
two of the ring's six message latencies, but takes five gloo calls per bucket where flat takes one. Measured
there over seven runs of bench/comm.py (112 rounds pooled by bench/comm_pool.py): wall time 1.01x flat's
(95 % interval 0.99-1.04; the runs' medians 0.96-1.07), CPU of all ranks 1.07x (1.06-1.08). The CPU left
is the steps running at once, not their bytes: in a probe on 37 buckets of 2 MB, steps 1, 2 and 3 timed
apart summed to 0.90-0.94x flat's CPU, and run phase after phase over the whole burst 0.90x, but
interleaved per bucket (as overlapping them needs) 1.02-1.19x. With the worker taking one bucket at
a time it was 1.01-1.13x wall (median 1.09 over nine runs) and 1.10-1.13x CPU.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as real objects.
import collections
import queue
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from bert.dist.flat_collectives import all_gather_single, reduce_scatter_single


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

    def __init__(self, flat: Tensor, padded: Tensor, chunks: tuple[Tensor, ...], shard: Tensor, work: "Pending"):
        self.flat, self.padded, self.chunks, self.shard, self.work = flat, padded, chunks, shard, work
        self.result: Future[Tensor] = Future()

    def finish(self) -> None:
        """Wait for the all-gather in flight and hand the buffer back to DDP."""
        try:
            self.work.wait()
            if self.padded is not self.flat:
                self.flat.copy_(self.padded[:self.flat.numel()])
        except Exception as e:  # DDP's wait on the future raises it in the training thread
            self.result.set_exception(e)
            return
        self.result.set_result(self.flat)


class Pending:
    """Collectives or sends/receives in flight, and what to do once they are done."""

    def __init__(self, works: list, then=None):
        self.works, self.then = works, then

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()


def own_subgroup(parts: list[list[int]], timeout: timedelta | None) -> dist.ProcessGroup:
    """This rank's group of `parts` (a partition of the world's ranks), every rank calling alike. On NCCL with the
    default group bound to a GPU, one split of the world communicator for the whole partition; elsewhere torch's
    enumeration, a `new_group` per part."""
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    if dist.get_backend() == "nccl" and bound is not None and hasattr(dist, "split_group"):
        return dist.split_group(split_ranks=parts, timeout=timeout)
    group, _ = dist.new_subgroups_by_enumeration(parts, timeout=timeout)
    return group


class HierarchicalSum:
    """A `Reduce` (bert.dist.reduce): the world sum of a flat tensor, in place, by steps 1-3 above.

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

    def __init__(self, node_size: int, exchange: str | None = None, timeout: timedelta | None = None,
                 issue: str | None = None):
        """`timeout`: the groups' (DIST_TIMEOUT); None leaves torch's default (10 min for NCCL, 30 for gloo).
        `issue`: "caller" (NCCL's default: the hook issues every step, chained on the GPU) or "worker" (gloo's: a
        thread waits for steps 1 and 2 and issues 2 and 3)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        intra, inter = node_groups(world, node_size)
        self.world, self.node_size = world, node_size
        # Three enumerations, every rank in the same order: each returns this rank's group.
        self.scatter_group = own_subgroup(intra, timeout)
        self.inter_group = own_subgroup(inter, timeout)
        self.gather_group = own_subgroup(intra, timeout)
        self.local = rank % node_size
        # (chunk index, the peer's rank in the intra-node groups) for every other rank of the node
        self.peers = [(j, dist.get_group_rank(self.scatter_group, r))
                      for j, r in enumerate(intra[rank // node_size]) if j != self.local]
        self.exchange = exchange or ("p2p" if dist.get_backend() == "gloo" else "collective")
        if self.exchange not in ("p2p", "collective"):
            raise ValueError(f"exchange must be p2p or collective, got {self.exchange!r}")
        if self.exchange == "p2p" and dist.get_backend() == "nccl":
            # every rank posts a receive, then a send, to the same peer: on NCCL each receive holds the GPU until
            # the peer's send, queued behind the peer's own receive (a deadlock); gloo posts them as they come
            raise ValueError("the p2p exchange is for gloo; NCCL takes the collective one")
        self.issue = issue or ("caller" if dist.get_backend() == "nccl" else "worker")
        if self.issue not in ("caller", "worker"):
            raise ValueError(f"issue must be caller or worker, got {self.issue!r}")
        if self.issue == "caller" and self.exchange != "collective":
            raise ValueError("the caller issues the collective exchange only")
        if self.issue == "worker" and dist.get_backend() == "nccl":
            # its thread would wait on streams, not on the host, and interleave the groups' collectives per rank
            raise ValueError("the worker thread is for gloo, whose wait() blocks the host; NCCL takes issue=caller")
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, ...]] = {}  # steps 1-3 per GPU ("caller")
        self._sum = dist.AllreduceOptions()
        self._sum.asyncOp = True
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        # Receive buffers of step 1, kept for the next step's bucket of the same size: a fresh CPU buffer
        # is page-faulted in by the kernel while gloo receives into it.
        self._spare: dict[tuple, list[Tensor]] = {}

    def _buffer(self, like: Tensor) -> Tensor:
        spare = self._spare.get(_key(like))
        return spare.pop() if spare else torch.empty_like(like)

    def __call__(self, flat: Tensor) -> Future[Tensor]:
        if self.issue == "caller":
            return self._steps_on_streams(flat)
        n = self.node_size
        if self.exchange == "p2p":  # chunks may differ in size by one element: nothing padded, nothing copied
            chunks = flat.tensor_split(n)
            padded, shard = flat, chunks[self.local]
        else:  # reduce_scatter/all_gather take n equal chunks (pad) and a separate shard
            padded = flat if flat.numel() % n == 0 else torch.cat([flat, flat.new_zeros(n - flat.numel() % n)])
            chunks = padded.tensor_split(n)
            shard = padded.new_empty(chunks[self.local].numel())
        job = _Job(flat, padded, chunks, shard, self._reduce_scatter(padded, chunks, shard))
        if self._worker is None:
            self._worker = threading.Thread(target=self._steps, name="hierarchical-steps", daemon=True)
            self._worker.start()
        self._jobs.put(job)
        return job.result

    def _steps_on_streams(self, flat: Tensor) -> Future[Tensor]:
        """Steps 1-3 issued here, now; on a GPU each step on its own stream, waiting for the step before (and step 1
        for the bucket, on the caller's stream), so nothing holds the caller or its stream. On the CPU (gloo, for the
        tests) each `wait()` blocks instead: the same sums, no overlap."""
        n, cuda = self.node_size, flat.is_cuda
        streams = self._step_streams(flat) if cuda else ()

        def step(i: int) -> AbstractContextManager:  # step i + 1's stream, after step i's (step 1: the bucket's)
            if not cuda:
                return nullcontext()
            streams[i].wait_stream(streams[i - 1] if i else torch.cuda.current_stream(flat.device))
            return _on_stream(streams[i])

        with step(0):
            padded = flat if flat.numel() % n == 0 else torch.cat([flat, flat.new_zeros(n - flat.numel() % n)])
            shard = padded.new_empty(padded.numel() // n)
            reduce_scatter_single(shard, padded, group=self.scatter_group, async_op=True).wait()
        with step(1):
            self.inter_group.allreduce([shard], self._sum).wait()
        with step(2):
            all_gather_single(padded, shard, group=self.gather_group, async_op=True).wait()
            if padded is not flat:
                flat.copy_(padded[:flat.numel()])
            if cuda:  # made on step 1's stream, used on the later ones: not reused before they are done
                shard.record_stream(streams[1])
                for t in (padded, shard):
                    t.record_stream(streams[2])
            result: Future[Tensor] = Future(devices=[flat.device]) if cuda else Future()
            result.set_result(flat)  # on step 3's stream: DDP's stream waits for it
        return result

    def _step_streams(self, t: Tensor) -> tuple[torch.cuda.Stream, ...]:
        if t.device not in self._streams:
            self._streams[t.device] = tuple(torch.cuda.Stream(t.device) for _ in range(3))
        return self._streams[t.device]

    def _reduce_scatter(self, padded: Tensor, chunks: tuple[Tensor, ...], shard: Tensor) -> Pending:
        group = self.scatter_group
        if self.exchange == "collective":
            return Pending([reduce_scatter_single(shard, padded, group=group, async_op=True)])
        received = [self._buffer(shard) for _ in self.peers]  # p2p: `shard` is chunks[self.local]
        works = []
        for buf, (j, peer) in zip(received, self.peers):
            works.append(group.recv([buf], peer, 0))
            works.append(group.send([chunks[j]], peer, 0))

        def node_sum() -> None:
            for buf in received:
                shard.add_(buf)
            self._spare.setdefault(_key(shard), []).extend(received)

        return Pending(works, node_sum)

    def _all_gather(self, padded: Tensor, chunks: tuple[Tensor, ...], shard: Tensor) -> Pending:
        group = self.gather_group
        if self.exchange == "collective":
            return Pending([all_gather_single(padded, shard, group=group, async_op=True)])
        works = []  # p2p: our shard is already in its place; the peers' land in theirs
        for j, peer in self.peers:
            works.append(group.recv([chunks[j]], peer, 0))
            works.append(group.send([shard], peer, 0))
        return Pending(works)

    def _steps(self) -> None:
        """Steps 2 and 3 for every buffer in arrival order: one thread, so every rank issues them alike.

        Every buffer that has arrived gets its inter-node allreduce posted before the worker waits for any
        of them; then the oldest allreduce is waited for and its all-gather posted; the all-gathers are
        finished (the futures DDP waits on completed) once no allreduce is left in flight. The worker
        blocks on a new buffer only when nothing is in flight."""
        reducing: collections.deque[tuple[_Job, object]] = collections.deque()  # step 2 in flight
        gathering: collections.deque[_Job] = collections.deque()  # step 3 in flight
        while True:
            block = not reducing and not gathering
            while True:  # every buffer that has arrived: step 2 posted
                try:
                    job = self._jobs.get(block=block)
                except queue.Empty:
                    break
                block = False
                try:
                    job.work.wait()  # step 1 and the node sum
                    reducing.append((job, self.inter_group.allreduce([job.shard], self._sum)))
                except Exception as e:  # DDP's wait on the future raises it in the training thread
                    job.result.set_exception(e)
            if reducing:  # the oldest step 2 waited for, its step 3 posted
                job, inter = reducing.popleft()
                try:
                    inter.wait()
                    job.work = self._all_gather(job.padded, job.chunks, job.shard)
                except Exception as e:
                    job.result.set_exception(e)
                    continue
                gathering.append(job)
                continue
            while gathering:  # nothing left to reduce: hand the buffers back
                gathering.popleft().finish()


@contextmanager
def _on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def _key(t: Tensor) -> tuple:
    return t.numel(), t.dtype, t.device
