"""`LOADER_WORKER=process`: training batches read and collated in a child process, handed over in shared memory.

Why: h5py holds the interpreter lock while it reads, and under balancing a step's batch is a row or two from each
of many shards, about 0.8 ms a sample of mostly lock-holding work on the 2-core VM (bench/reader_memory.py). A
reading thread (bert.data.prefetch) then takes the lock from the training thread, whose Python launches the
step's kernels: 1,100 small torch ops spread over a step took 3.7 ms (median) with the batches made beforehand,
8.3 ms beside the thread reading 96 sequences a step and 3.8 ms beside this process (p90 4.9, 14.0, 4.4 ms;
bench/loader_gil.py). A GPU whose launches come late idles. In a process of its own the reader shares no lock.

    child    produce(step) for step = start, start+1, ...: read, collate, check, pad; each Batch onto a queue of
             `depth`, its tensors moved to shared memory by torch.multiprocessing
    trainer  a thread takes them off the queue and pins them (bert.data.prefetch.Prefetcher), `next` hands them over

The child is forked when the loader is made ready (`TrainLoader.plan_ahead`, before run_start: the fork and the
epoch's layout it inherits stay untimed), and waits for the first `next` before it reads a sample, so no sample is
read before the clock starts. Forked, not spawned: it inherits the plan and the reader (nothing pickled, the
epoch's layout not computed twice) and starts in milliseconds. It touches no GPU and sets torch to one thread
(torch's DataLoader workers do the same: an OpenMP pool used by the parent can hang a forked child). The
trainer reads no training shard while it runs (the eval set is other files), so they share no open HDF5 file.
Python 3.12 warns (DeprecationWarning, hidden by default) on any fork of a process with threads, as the trainer
is (gloo, NCCL, CUDA); what the child runs takes none of their locks, as with DataLoader's forked workers.

An exception in the child (a corrupt shard) comes back as the next item and is raised by `next`, its message
unchanged, which also ends the child; one that cannot be pickled comes back as a RuntimeError naming it. The child
ends when told (`close`, or `next` raising) or when the trainer that forked it has gone, not before: a batch's
tensors reach the trainer as file descriptors this process hands over when the trainer takes the batch.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from itertools import count
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

from bert.batch import Batch
from bert.data.prefetch import Prefetcher

LOADER_WORKERS = ("thread", "process")  # LOADER_WORKER's choices
_POLL_S = 0.1


class _Stopped(Exception):
    """The trainer closed the loader while its pinning thread waited for the child."""


def _packed(item: Batch | BaseException) -> tuple[bytes, bool]:
    """`item` pickled for the queue (a batch's tensors moved to shared memory) and whether the trainer is to raise
    it. Pickled here, not by the queue's own thread, where a failure would be printed and the item lost: one that
    cannot be pickled becomes a RuntimeError naming it."""
    try:
        return bytes(ForkingPickler.dumps(item)), isinstance(item, BaseException)
    except Exception as e:
        what = f"{type(item).__name__}: {item}" if isinstance(item, BaseException) else f"a batch not sent ({e})"
        return bytes(ForkingPickler.dumps(RuntimeError(what))), True


def _work(produce: Callable[[int], Batch], start: int, items: mp.Queue, go: mp.Event, stop: mp.Event,
          trainer: int) -> None:
    """The child: wait for the first `next`, then produce batches until told to stop (module doc)."""
    torch.set_num_threads(1)

    def running() -> bool:
        if not stop.is_set() and os.getppid() == trainer:
            return True
        items.cancel_join_thread()  # told to stop: leave now, not after the queue's last batches reach the trainer
        return False

    while running() and not go.wait(_POLL_S):
        pass
    for step in count(start):
        if not running():
            return
        try:
            payload, failed = _packed(produce(step))
        except BaseException as e:
            payload, failed = _packed(e)
        while running():
            try:
                items.put(payload, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if failed:
            # Stay until told: the trainer fetches each batch's shared memory from this process (torch passes file
            # descriptors through it) when it takes the batch off the queue, and batches before the error may wait
            while running():
                stop.wait(_POLL_S)
            return


class ProcessPrefetcher:
    """`produce(step)` for step = start, start+1, ... in a forked child, `depth` batches ahead; the same `next` and
    `close` as Prefetcher, whose thread here takes the child's batches and pins them."""

    def __init__(self, produce: Callable[[int], Batch], start: int, depth: int, pin: bool):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        context = mp.get_context("fork")
        self._items = context.Queue(maxsize=depth)
        self._go, self._stop = context.Event(), context.Event()
        self._process = context.Process(target=_work, name="bert-data-loader", daemon=True,
                                        args=(produce, start, self._items, self._go, self._stop, os.getpid()))
        self._process.start()
        self._start, self._pin = start, pin
        self._pinner: Prefetcher | None = None

    def _receive(self, step: int) -> Batch:
        while not self._stop.is_set():
            try:
                item = ForkingPickler.loads(self._items.get(timeout=_POLL_S))
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"the data loader process exited (code {self._process.exitcode})") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item
        raise _Stopped

    def next(self) -> Batch:
        if self._pinner is None:  # the first batch asked for: the child starts reading now
            self._go.set()
            self._pinner = Prefetcher(self._receive, self._start, depth=1, pin=self._pin)
        try:
            return self._pinner.next()
        except BaseException:
            self.close()  # the child waits after an error until told (`_work`)
            raise

    def close(self) -> None:
        self._stop.set()
        if self._pinner is not None:
            self._pinner.close()
        self._process.join(timeout=10)
        if self._process.is_alive():  # stuck inside a read: it holds nothing the trainer needs
            self._process.kill()
            self._process.join()
        self._items.close()
