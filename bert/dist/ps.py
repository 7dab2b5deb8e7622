"""Parameter-server reduction (`GRAD_REDUCE=ps`): extra CPU processes sum sharded gradient buffers
(Herring [003] §III-A, balanced fusion buffers).

Every flat buffer a worker reduces (one DDP bucket, or all of them under GRAD_CLIP=before) is cut into
S shards of equal size, one per server, so every server carries the same load for every buffer. Shard s
goes to server s, which waits for it from all W workers, sums and sends the sum back (a Reduce sums;
the mean's 1/W comes with the gradients, bert.dist.reduce):
two hops and M bytes each way per worker, whatever W (an allreduce moves about 2M, Herring [003] §I).

Layout. `PS_SERVERS` is the number of servers per node; the launcher starts DGXNGPU + PS_SERVERS
processes per node (`run_and_time.sh`, `run.sub`), and on every node the last PS_SERVERS local ranks
are servers. The workers keep the usual rank layout among themselves (`worker_env`), so everything
else in the driver sees a job of W ranks. The servers never build a model.

Process groups (torch.distributed only). The job's W + S processes meet at one rendezvous store.
The workers' default group (NCCL on GPUs, gloo on CPUs) lives under the "workers/" prefix and holds
the workers only, so DDP, evaluation and the stop agreement never wait on a server. The PS traffic has
its own gloo group of all W + S processes under "ps/": it carries host tensors, so a CUDA bucket is
copied to the host before it is sent and back after (Herring [003] §III-A, steps 2 and 4), and the
servers need no GPU.

Protocol, per worker-server pair, in order: a header (sequence number, kind, shard length, dtype), then
the shard (none when empty); the server answers with the summed shard. Headers carry the length, so DDP
rebuilding its buckets after the first step needs no agreement, and the sequence number makes a worker
that fell out of step an error instead of a wrong sum. When training ends each worker sends a STOP
header (`disconnect`); a server returns once all workers have stopped.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as real objects.
import os
import queue
import signal
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from bert.config import DistConfig
from bert.console import say
from bert.dist.env import DistEnv

BUCKET, STOP = 0, 1
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HEADER, DATA, RESULT = 0, 1, 2  # message tags
IDLE_WAIT = timedelta(hours=24)  # a server waits this long for the next buffer (evaluation, data loading)


@dataclass(frozen=True)
class Layout:
    """Who is who in a job of workers plus parameter servers. PS ranks: workers 0..W-1, then servers."""
    workers: int
    servers: int
    is_server: bool
    index: int  # worker rank, or server number

    @property
    def ps_rank(self) -> int:
        return self.workers + self.index if self.is_server else self.index


def layout(job: DistEnv, servers_per_node: int) -> Layout:
    """The last `servers_per_node` local ranks of every node are servers; ranks are node-major (torchrun,
    srun's block distribution)."""
    per_node = job.local_world_size
    if servers_per_node >= per_node or job.world_size % per_node:
        raise ValueError(f"GRAD_REDUCE=ps: {job.world_size} processes, {per_node} per node, cannot hold "
                         f"PS_SERVERS={servers_per_node} servers and at least one worker on every node")
    nodes, workers_per_node = job.world_size // per_node, per_node - servers_per_node
    node, local = job.rank // per_node, job.local_rank
    if local >= workers_per_node:
        return Layout(nodes * workers_per_node, nodes * servers_per_node, True,
                      node * servers_per_node + local - workers_per_node)
    return Layout(nodes * workers_per_node, nodes * servers_per_node, False, node * workers_per_node + local)


def uses_ps(cfg: DistConfig) -> bool:
    return cfg.grad_reduce == "ps"


def is_server(job: DistEnv, cfg: DistConfig) -> bool:
    return uses_ps(cfg) and layout(job, cfg.ps_servers).is_server


def worker_env(job: DistEnv, cfg: DistConfig) -> DistEnv:
    """The rank layout the rest of the driver sees: the job itself, or its workers when it holds servers."""
    if not uses_ps(cfg):
        return job
    me = layout(job, cfg.ps_servers)
    return DistEnv(me.index, me.workers, job.local_rank, job.local_world_size - cfg.ps_servers, job.master_addr,
                   job.master_port)


def join(job: DistEnv, me: Layout, timeout_s: float) -> tuple[dist.Store, dist.ProcessGroup]:
    """Meet every process of the job at its rendezvous (torchrun's agent store, or rank 0's); returns the
    store for the workers' own group and the gloo group of the PS traffic."""
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous(f"tcp://{job.master_addr}:{job.master_port}", rank=job.rank,
                                       world_size=job.world_size, timeout=timeout))
    group = dist.ProcessGroupGloo(dist.PrefixStore("ps/", store), me.ps_rank, me.workers + me.servers, timeout)
    return dist.PrefixStore("workers/", store), group


def shard_sizes(numel: int, servers: int) -> list[int]:
    """Balanced shards: sizes differ by at most one element."""
    return [numel // servers + (s < numel % servers) for s in range(servers)]


def _header(seq: int, kind: int, numel: int, dtype: torch.dtype) -> Tensor:
    return torch.tensor([seq, kind, numel, DTYPES.index(dtype)], dtype=torch.int64)


class Client:
    """A worker's side: sends shards, receives sums. A background thread does the (blocking) exchange,
    buffer after buffer in the order `reduce` was called, so that DDP's backward pass goes on meanwhile
    (gloo's point-to-point Work has no future)."""

    def __init__(self, group: dist.ProcessGroup, me: Layout):
        self.group, self.me, self.seq = group, me, 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[tuple, torch.cuda.Stream] = {}  # (device, "out" | "back"): the copies to and from a GPU
        self._thread = threading.Thread(target=self._run, name="ps-client", daemon=True)
        self._thread.start()

    def reduce(self, flat: Tensor) -> Future[Tensor]:
        if flat.dtype not in DTYPES:
            raise TypeError(f"GRAD_REDUCE=ps: cannot send {flat.dtype} gradients")
        ready = None
        if flat.is_cuda:
            # Into pinned memory, on a stream of its own that waits for the kernels that made the bucket: a plain
            # .to("cpu") would hold this (the autograd) thread until the GPU had run every kernel launched so far,
            # once per bucket, and on the backward's stream the copy would hold back the kernels launched after it.
            # The client thread waits for `ready` (a blocking event: it sleeps rather than spins a core the
            # parameter servers need).
            out = self._stream(flat.device, "out")
            out.wait_stream(torch.cuda.current_stream(flat.device))
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            with torch.cuda.stream(out):
                host.copy_(flat.detach(), non_blocking=True)
            ready = torch.cuda.Event(blocking=True)
            ready.record(out)
        else:
            host = flat.detach().to("cpu", copy=True)  # taken now: after this, DDP may reuse nothing of ours
        result: Future[Tensor] = Future(devices=[flat.device]) if flat.is_cuda else Future()
        self._jobs.put((flat, host, ready, result))
        return result

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            flat, host, ready, result = job
            try:
                if ready is not None:
                    ready.synchronize()
                self._return(flat, self._exchange(BUCKET, host), result)  # into the bucket itself
            except Exception as e:  # noqa: BLE001 - DDP re-raises it in the training thread
                result.set_exception(e)

    def _return(self, flat: Tensor, total: Tensor, result: Future[Tensor]) -> None:
        if not flat.is_cuda:
            result.set_result(flat.copy_(total))
            return
        # On a stream of this thread's own: on the default stream, which the backward uses, the copy would wait for
        # every kernel queued there. The future records its event on this stream; DDP's stream waits for it. The
        # bucket's last reader, the copy out, is done (`ready`), and the pinned `total` is kept until the copy has run
        # (torch's pinned-memory cache records the copy).
        with torch.cuda.device(flat.device), torch.cuda.stream(self._stream(flat.device, "back")):
            flat.copy_(total, non_blocking=True)
            result.set_result(flat)

    def _stream(self, device: torch.device, role: str) -> torch.cuda.Stream:
        if (device, role) not in self._streams:
            self._streams[device, role] = torch.cuda.Stream(device)
        return self._streams[device, role]

    def _exchange(self, kind: int, host: Tensor) -> Tensor:
        """Shard s of `host` to server s; returns the sums. Every server gets a header, even for an empty
        shard, so that all servers see every sequence number."""
        sizes = shard_sizes(host.numel(), self.me.servers)
        total = torch.empty(host.shape, dtype=host.dtype, pin_memory=host.is_pinned())  # pinned: copied back async
        works, headers = [], []  # the headers must live until their sends are done
        # Receives first: a server can answer as soon as the last worker's shard is in.
        for s, part in enumerate(total.split(sizes)):
            if part.numel():
                works.append(self.group.recv([part], self.me.workers + s, RESULT))
        for s, shard in enumerate(host.split(sizes)):
            headers.append(_header(self.seq, kind, shard.numel(), host.dtype))
            works.append(self.group.send([headers[-1]], self.me.workers + s, HEADER))
            if shard.numel():
                works.append(self.group.send([shard], self.me.workers + s, DATA))
        for work in works:
            work.wait()
        self.seq += 1
        return total

    def close(self) -> None:
        """Wait for the buffers in flight, then tell every server this worker is done."""
        self._jobs.put(None)
        self._thread.join()
        self._exchange(STOP, torch.empty(0))


_client: Client | None = None


def connect_worker(job: DistEnv, cfg: DistConfig) -> dist.Store | None:
    """For a worker of a PS job: join the PS group, keep the client that GRAD_REDUCE=ps reduces with, and return
    the store of the workers' default group (for `init_distributed`). None without parameter servers."""
    global _client
    if not uses_ps(cfg):
        return None
    me = layout(job, cfg.ps_servers)
    store, group = join(job, me, cfg.dist_timeout_s)
    _client = Client(group, me)
    return store


def client() -> Client:
    if _client is None:
        raise RuntimeError("GRAD_REDUCE=ps: this worker has not joined the parameter servers (connect_worker)")
    return _client


def disconnect() -> None:
    """Stop the servers' loops (every worker must call this once, at the end); nothing without servers."""
    global _client
    if _client is not None:
        _client.close()
        _client = None


def serve_loop(group: dist.ProcessGroup, me: Layout) -> int:
    """Sum shard after shard until every worker has sent STOP; returns the number of buffers served."""
    served, workers = 0, range(me.workers)
    while True:
        headers = [torch.empty(4, dtype=torch.int64) for _ in workers]
        works = [group.recv([h], w, HEADER) for w, h in zip(workers, headers)]
        works[0].wait(IDLE_WAIT)  # the workers may be evaluating or loading data: that is not a failure
        for work in works[1:]:
            work.wait()
        first = headers[0].tolist()
        for w, h in zip(workers, headers):
            if h.tolist() != first:
                raise RuntimeError(f"ps server {me.index}: worker {w} sent {h.tolist()}, worker 0 {first} "
                                   "(sequence, kind, length, dtype): the workers are out of step")
        seq, kind, numel, dtype = first
        if kind == STOP:
            return served
        if numel:
            shards = [torch.empty(numel, dtype=DTYPES[dtype]) for _ in workers]
            for work in [group.recv([t], w, DATA) for w, t in zip(workers, shards)]:
                work.wait()
            total = torch.zeros(numel, dtype=torch.promote_types(DTYPES[dtype], torch.float32))
            for t in shards:  # worker order: the sum is the same on every run
                total += t
            total = total.to(DTYPES[dtype])  # the shards came divided by W: a float16 sum stays in range
            for work in [group.send([total], w, RESULT) for w in workers]:
                work.wait()
        served += 1


def serve(job: DistEnv, cfg: DistConfig) -> int:
    """A server process's whole life: join, serve until the workers stop, exit status 0."""
    # Pre-emption (SIGTERM to every task) is the workers' to handle: they finish the step, checkpoint, then
    # stop the servers, which must still be there for that step. A dead worker still ends a server (its
    # connection closes); the launcher's SIGKILL too.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "OMP_NUM_THREADS" not in os.environ:  # srun sets no thread count: share the cores as the workers do
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.local_world_size))
    me = layout(job, cfg.ps_servers)
    _, group = join(job, me, cfg.dist_timeout_s)
    served = serve_loop(group, me)
    say(f"ps server {me.index}: {served} buffers from {me.workers} workers, stopped cleanly")
    return 0
