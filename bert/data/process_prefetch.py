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
is (gloo, NCCL, CUDA); what the child runs takes none of their locks, as with DataLoader's forked workers. Nor
does it free what holds them: a gloo process group's destructor waits for threads the fork did not copy (the
suite's child hung or crashed so, freeing the trainer's replaced SIGTERM handler and collecting an inherited
garbage cycle), so the child keeps the handlers it replaces and the objects alive at the fork are frozen out of
its collector (`gc.freeze`). With NCCL over InfiniBand, a fork needs a kernel >= 5.13 or rdma-core's fork
support (IBV_FORK_SAFE=1), as those workers do. The batches wait in shared memory: (depth + 3) batches a rank in
/dev/shm (docker: --ipc=host).

An exception in the child (a corrupt shard) comes back as the next item and is raised by `next`, its message
unchanged, which also ends the child; one that cannot be pickled comes back as a RuntimeError naming it. The child
ends when told (`close`, `next` raising, or the trainer's exit) or when the trainer that forked it dies (the kernel
kills it), not before: a batch's tensors reach the trainer as file descriptors this process hands over when the
trainer takes the batch. A child that died (killed for memory) is one RuntimeError saying so. It ignores SIGTERM
and SIGINT, which Slurm and Ctrl-C send the whole job: the trainer handles them and stops it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import queue
import signal
import traceback
from collections.abc import Callable
from itertools import count
from multiprocessing.reduction import ForkingPickler
from multiprocessing.util import Finalize

import torch
import torch.multiprocessing as mp

from bert.batch import Batch
from bert.data.prefetch import _POLL_S, Prefetcher

LOADER_WORKERS = ("thread", "process")  # LOADER_WORKER's choices
_INHERITED: list = []  # in the child: what it must never free (`_work`); it ends by os._exit, freeing nothing


class _Stopped(Exception):
    """The trainer closed the loader while its pinning thread waited for the child."""


def _packed(item: Batch | BaseException) -> tuple[bytes, bool]:
    """`item` pickled for the queue (a batch's tensors moved to shared memory) and whether the trainer is to raise
    it. Pickled here, not by the queue's own thread, where a failure would be printed and the item lost. An
    exception must also come back whole (an `__init__` at odds with its args would fail in the trainer, in place
    of the message): one that does not becomes a RuntimeError naming it. The child's traceback goes with it as a
    note (DEBUG=1 prints it)."""
    if isinstance(item, BaseException):
        try:
            pickle.loads(pickle.dumps(item))
        except Exception:
            item = RuntimeError(f"{type(item).__name__}: {item}")
        if hasattr(item, "add_note"):  # Python >= 3.11
            item.add_note("in the data loader process:\n" + "".join(traceback.format_exception(item)))
    try:
        return bytes(ForkingPickler.dumps(item)), isinstance(item, BaseException)
    except Exception as e:
        return bytes(ForkingPickler.dumps(RuntimeError(f"a batch not sent ({e})"))), True


def _die_with(trainer: int) -> None:
    """Have the kernel kill this process when the trainer dies (Linux), even inside a long read or the epoch's
    layout, where polling for the parent would not notice: it holds the trainer's inherited sockets and device
    files. Elsewhere the polling in `_work` remains."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != trainer:  # it died before the request
        os._exit(0)


def _work(produce: Callable[[int], Batch], start: int, items: mp.Queue, go: mp.Event, stop: mp.Event,
          trainer: int) -> None:
    """The child: wait for the first `next`, then produce batches until told to stop (module doc)."""
    # Slurm and Ctrl-C signal every process of the job: the trainer handles them (a pre-emption checkpoints) and
    # then stops this one. Set here, not inherited: the trainer's SIGTERM handler would only set its own flag.
    # The trainer's handlers are kept alive: dropping the last reference to one (a bound method of its stop
    # agreement) would destroy a gloo process group here, whose threads were not forked: a hang or a crash.
    _INHERITED.extend(signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT))
    _die_with(trainer)
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
        # The child must free nothing it inherits that holds a thread it does not have (a gloo process group,
        # whose destructor waits for its threads): frozen, the objects alive at the fork are never collected there
        gc.freeze()
        try:
            self._process.start()
        finally:
            gc.unfreeze()
        self._start, self._pin = start, pin
        self._pinner: Prefetcher | None = None
        # A trainer leaving without `close` (an exception on its way out) would otherwise hang: multiprocessing's
        # exit handler joins daemon children without a timeout, and this one ignores the SIGTERM it sends first
        Finalize(self, _end_child, args=(self._stop, self._process), exitpriority=100)

    def _receive(self, step: int) -> Batch:
        while not self._stop.is_set():
            try:
                item = ForkingPickler.loads(self._items.get(timeout=_POLL_S))
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(self._exited()) from None
                continue
            except (OSError, EOFError) as e:  # a batch whose shared memory a dead child can no longer hand over
                self._process.join(1)
                if self._process.is_alive():
                    raise
                raise RuntimeError(self._exited()) from e
            if isinstance(item, BaseException):
                raise item
            return item
        raise _Stopped

    def _exited(self) -> str:
        code = self._process.exitcode
        killed = f", killed by signal {-code}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
        return f"the data loader process exited (code {code}{killed if code and code < 0 else ''})"

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
        _end_child(self._stop, self._process)
        self._items.close()


def _end_child(stop: mp.Event, process: mp.Process, wait_s: float = 5.0) -> None:
    """Ask the child to stop, and kill it if it has not within `wait_s` (stuck inside a read: it holds nothing the
    trainer needs)."""
    stop.set()
    process.join(timeout=wait_s)
    if process.is_alive():
        process.kill()
        process.join()
