"""Sequence packing for the lab only: several sequences share one fixed-size row (NVIDIA v2.0+).

The training pipeline does not pack (it unpads and balances instead); the lab packs a length
histogram offline, as NVIDIA's packed data set is made before training (up to 3 sequences per
512 tokens, 1.999 sequences per row on Wikipedia), and then draws whole packs per GPU.

Best-fit decreasing on the histogram (Krell et al., "Packing: towards 2x NLP BERT
acceleration", work on histograms because equal lengths are interchangeable): longest
lengths first, each into the open pack with the least room that still fits it and fewer
than `max_per_pack` sequences, else into a new pack.
"""

from __future__ import annotations

import numpy as np


def pack_histogram(counts: np.ndarray, capacity: int = 512, max_per_pack: int = 3) -> np.ndarray:
    """Packs per token count: result[t - 1] = number of packs holding t tokens.

    `counts[i]` is the number of sequences of length i + 1; none may exceed `capacity`.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) > capacity and counts[capacity:].any():
        raise ValueError(f"sequences longer than the pack capacity {capacity}")
    if max_per_pack < 2:
        raise ValueError(f"packing needs max_per_pack >= 2, got {max_per_pack}")
    # packs[k, room]: packs holding k sequences with `room` tokens free (row 0: fresh packs).
    packs = np.zeros((max_per_pack + 1, capacity + 1), dtype=np.int64)

    def fill(k: int, room: int, length: int, todo: int) -> int:
        """Put up to `todo` sequences into the packs[k, room] packs one pack after another; return the rest."""
        per = min(max_per_pack - k, room // length)
        whole, part = divmod(min(todo, int(packs[k, room]) * per), per)
        for n_packs, added in ((whole, per), (int(part > 0), part)):
            packs[k, room] -= n_packs
            packs[k + added, room - added * length] += n_packs
        return todo - whole * per - part

    for length in range(min(len(counts), capacity), 0, -1):
        todo = int(counts[length - 1])
        # Open packs that fit, least room first, then fullest. Best fit fills the chosen pack as far
        # as it goes before the next one, since after each placement it has the least room left.
        candidates = packs[max_per_pack - 1 : 0 : -1, length:].T  # (room - length, k descending)
        for flat in np.flatnonzero(candidates):
            if todo == 0:
                break
            room, col = divmod(int(flat), max_per_pack - 1)
            todo = fill(max_per_pack - 1 - col, length + room, length, todo)
        if todo:  # offer one fresh pack per sequence; the ones left empty are dropped
            packs[0, capacity] = todo
            fill(0, capacity, length, todo)
            packs[0, capacity] = 0
    tokens = np.zeros(capacity + 1, dtype=np.int64)
    tokens[::-1] = packs[1:].sum(axis=0)  # room r holds capacity - r tokens
    return tokens[1:]
