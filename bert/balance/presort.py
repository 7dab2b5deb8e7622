"""Presorting: sort a group's sequences by length and deal them back to the group's ranks.

NVIDIA's exchange padding (`exchange_padding_fast` in [NVIDIA-BERT]) does it over the whole
world: gather, sort descending, rank r takes sorted positions r, r + world, r + 2 world, ...
(raster).
Samsung ([000] §4.1, Figure 4; [Samsung-BERT]) does it per node only (`--group_exchange_padding`), and
deals every second row of the sorted order backwards (`--reverse_indices`, "snake"), so the
rank that got the longest sequence of one row gets the shortest of the next.
"""

from __future__ import annotations

import numpy as np


def presort(lengths: np.ndarray, group_size: int, snake: bool = False) -> np.ndarray:
    """Assignment (world, b) of `lengths` (world, b) after a per-group sort, raster or snake dealt.

    Groups are consecutive blocks of `group_size` ranks; nothing crosses a group.
    """
    world, per_rank = lengths.shape
    if group_size < 1 or world % group_size:
        raise ValueError(f"world size {world} is not a multiple of the group size {group_size}")
    groups = world // group_size
    flat = lengths.reshape(groups, group_size * per_rank)
    # Stable sort of the negated lengths: descending, ties in draw order, so every rank agrees.
    order = np.argsort(-flat, axis=1, kind="stable")
    order += (np.arange(groups, dtype=np.int64) * group_size * per_rank)[:, None]
    rows = order.reshape(groups, per_rank, group_size)  # row j = sorted positions j*g .. j*g+g-1
    if snake:
        rows[:, 1::2, :] = rows[:, 1::2, ::-1]
    return np.ascontiguousarray(rows.transpose(0, 2, 1)).reshape(world, per_rank).astype(np.int64, copy=False)


def assign_global(lengths: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """NVIDIA exchange padding: one sort over the whole world, raster dealt."""
    return presort(lengths, group_size=lengths.shape[0])


def assign_local(lengths: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """Sort inside each node only, raster dealt."""
    return presort(lengths, group_size=min(ranks_per_node, lengths.shape[0]))


def assign_snake(lengths: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """Sort inside each node only, dealt boustrophedon (Samsung)."""
    return presort(lengths, group_size=min(ranks_per_node, lengths.shape[0]), snake=True)
