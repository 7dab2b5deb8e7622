"""A shuffle buffer (TPU [004] §3.5, `tf.data.shuffle`), computed in bulk with numpy.

The buffer holds `size` elements; each output is a uniformly chosen slot, whose place is
taken by the next input; when the input runs dry the buffer is emitted in random order.
A larger buffer mixes a rank's files more thoroughly (the paper's cure for run-to-run
spread). Simulated element by element this is a Python loop over every sample of an
epoch; instead, note that the element leaving slot `j` at draw `k` is the one that entered
slot `j` at the previous draw of `j` (or slot `j`'s initial element), which a stable sort of
the draws by slot finds for all draws at once.
"""

from __future__ import annotations

import numpy as np


def buffer_order(slots: np.ndarray, drain: np.ndarray) -> np.ndarray:
    """Output order of a shuffle buffer given its random choices.

    `drain` is a permutation of the `size` slots (the final emptying order); `slots[k]` is
    the slot read at draw k, when input `size + k` enters. Returns a permutation of
    `0 .. size + len(slots) - 1`.
    """
    size, draws = len(drain), len(slots)
    by_slot = np.argsort(slots, kind="stable")  # draws grouped by slot, in time order
    sorted_slots = slots[by_slot]
    repeat = np.zeros(draws, dtype=bool)
    repeat[1:] = sorted_slots[1:] == sorted_slots[:-1]
    leaving = np.where(repeat, size + np.roll(by_slot, 1), sorted_slots)  # occupant before this draw
    out = np.empty(size + draws, dtype=np.int64)
    out[by_slot] = leaving
    final = np.ones(draws, dtype=bool)  # the last draw of each slot
    final[:-1] = sorted_slots[1:] != sorted_slots[:-1]
    last = np.arange(size, dtype=np.int64)  # what each slot holds at the end
    last[sorted_slots[final]] = size + by_slot[final]
    out[draws:] = last[drain]
    return out


def shuffle_buffer_order(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of `range(n)`: the order a shuffle buffer of `size` emits `0 .. n-1` in."""
    if size < 1:
        raise ValueError(f"shuffle buffer size must be >= 1, got {size}")
    size = min(size, n)
    slots = rng.integers(0, size, n - size) if size else np.zeros(0, dtype=np.int64)
    return buffer_order(slots, rng.permutation(size))
