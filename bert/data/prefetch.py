"""Build batches ahead of the training step in a background thread (Baidu [001] §IV-B).

A thread (LOADER_WORKER=thread, the default) shares memory with the training loop, so the batch it pins is the
one copied to the device: no pickling, no shared-memory segments, no second process. But it shares the interpreter
lock too, which h5py holds while it reads: under balancing a batch is a row or two from each of many shards, about
0.8 ms a sample on the 2-core VM, and beside such a thread the training thread's kernel launches took twice as long
(bench/loader_gil.py). LOADER_WORKER=process (bert.data.process_prefetch) reads in a child process instead, and
uses this thread only to pin what the child sends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from itertools import count

from bert.batch import Batch

_POLL_S = 0.1  # how often a waiting queue operation looks whether to stop (bert.data.process_prefetch too)


class Prefetcher:
    """Runs `produce(step)` for step = start, start+1, ... in a thread, `depth` batches ahead."""

    def __init__(self, produce: Callable[[int], Batch], start: int, depth: int, pin: bool):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._produce, self._pin = produce, pin
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start,), name="bert-data-prefetch", daemon=True)
        self._thread.start()

    def _run(self, start: int) -> None:
        for step in count(start):
            try:
                batch = self._produce(step)
                # Pinned (page-locked) memory lets the device copy run asynchronously.
                item: Batch | BaseException = batch.pin_memory() if self._pin else batch
            except BaseException as e:  # handed to the consumer, which re-raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, BaseException):
                return

    def next(self) -> Batch:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._thread.is_alive():
                    continue
            try:  # the thread may have put its last item just before it ended
                item = self._queue.get_nowait()
                break
            except queue.Empty:
                raise RuntimeError("the data prefetch thread stopped") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
