"""Map a function over work items in worker processes, lazily and in order, with a progress bar."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


def parallel_imap(
    fn: Callable[[T], R], items: Iterable[T], workers: int, desc: str, unit: str = "file", chunksize: int = 1
) -> Iterator[R]:
    """Yield `fn(x)` for each item in order, computed on `workers` processes (here when workers <= 1).

    Lazy, so a corpus larger than memory streams through. An exception in a worker is re-raised
    here, so the caller reports it and exits non-zero.
    """
    total = len(items) if isinstance(items, list) else None
    if workers <= 1 or (total is not None and total <= 1):  # no fork for one item or none
        yield from map(fn, tqdm(items, total=total, desc=desc, unit=unit))
        return
    # fork: workers inherit sys.path (data/ modules are imported as top-level scripts) without re-importing.
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield from tqdm(pool.imap(fn, items, chunksize=chunksize), total=total, desc=desc, unit=unit)
