"""Map a function over work items in worker processes, lazily and in order, with a progress bar."""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import islice
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


def parallel_imap(
    fn: Callable[[T], R], items: Iterable[T], workers: int, desc: str, unit: str = "file", chunksize: int = 1
) -> Iterator[R]:
    """Yield `fn(x)` for each item in order, computed on `workers` processes (here when workers <= 1).

    Lazy: at most 2 * workers chunks are in flight, so a corpus larger than memory streams through. An
    exception in a worker is re-raised here, so the caller reports it and exits non-zero; the chunks being
    computed finish, the queued ones are dropped, and a worker that dies raises BrokenProcessPool.

    Not multiprocessing.Pool: on an error its terminate() SIGTERMs the workers, and one killed while holding
    a queue's lock hangs the pool for ever (cpython#96995, #78178): a prepare.py that never exits.
    """
    total = len(items) if isinstance(items, list) else None
    if workers <= 1 or (total is not None and total <= 1):  # no fork for one item or none
        yield from map(fn, tqdm(items, total=total, desc=desc, unit=unit))
        return
    # fork: workers inherit sys.path (data/ modules are imported as top-level scripts) without re-importing. All
    # fork at the first submit, before the bar starts its monitor thread.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    try:
        rest = iter(items)
        chunks = iter(lambda: list(islice(rest, chunksize)), [])
        in_flight: deque[Future] = deque(pool.submit(_map_chunk, fn, c) for c in islice(chunks, 2 * workers))
        with tqdm(total=total, desc=desc, unit=unit) as bar:
            while in_flight:
                results = in_flight.popleft().result()
                for c in islice(chunks, 1):
                    in_flight.append(pool.submit(_map_chunk, fn, c))
                for r in results:
                    yield r
                    bar.update()
    finally:  # also when the caller stops early or the items raise: nothing more is started
        pool.shutdown(wait=True, cancel_futures=True)


def _map_chunk(fn: Callable[[T], R], chunk: list[T]) -> list[R]:
    return [fn(x) for x in chunk]
