"""data/parallel_map.py: results in order, a worker's error raised in the caller, and no hang when a worker dies."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))

from parallel_map import parallel_imap  # noqa: E402


def _square(x: int) -> int:
    return x * x


def _fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError(f"item {x} is bad")
    return x


@pytest.mark.parametrize("workers,chunksize", [(1, 1), (2, 1), (2, 5), (3, 64)])
def test_results_come_in_order_from_a_list_or_a_generator(workers, chunksize):
    expected = [x * x for x in range(23)]
    assert list(parallel_imap(_square, list(range(23)), workers, "t", chunksize=chunksize)) == expected
    assert list(parallel_imap(_square, (x for x in range(23)), workers, "t", chunksize=chunksize)) == expected


def test_a_worker_error_is_raised_in_the_caller_after_the_items_before_it():
    got = []
    with pytest.raises(ValueError, match="item 3 is bad"):
        for y in parallel_imap(_fail_on_three, list(range(40)), 2, "t"):
            got.append(y)
    assert got == [0, 1, 2]


_STREAM = """
import sys
sys.path.insert(0, {data!r})
from parallel_map import parallel_imap
started = []
def items():
    for i in range(10_000):
        started.append(i)
        yield i
it = parallel_imap(abs, items(), 2, "t", chunksize=4)
assert next(it) == 0
it.close()
print(len(started))
"""


def test_items_are_read_lazily_and_a_closed_map_reads_no_more():
    """A corpus larger than memory must stream: only a window of chunks (2 per worker) is ever read ahead."""
    out = subprocess.run([sys.executable, "-c", _STREAM.format(data=str(ROOT / "data"))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) <= 4 * (2 * 2 + 1)


_DIE = """
import os, sys
sys.path.insert(0, {data!r})
from parallel_map import parallel_imap
def die(x):
    if x == 2:
        os._exit(3)  # an OOM kill, a segfault in a native library
    return x
try:
    print(list(parallel_imap(die, list(range(8)), 2, "t")))
except Exception as e:
    print(type(e).__name__)
    sys.exit(2)
"""


def test_a_worker_that_dies_is_an_error_not_a_hang():
    """multiprocessing.Pool waits for ever on a worker that dies mid-item; the caller must see an error instead."""
    script = _DIE.format(data=str(ROOT / "data"))
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        pytest.fail("parallel_imap hung on a worker that died")
    assert (out.returncode, out.stdout.strip()) == (2, "BrokenProcessPool"), out.stderr
