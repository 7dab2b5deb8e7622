"""One epoch laid out as global batches: the sample order every rank agrees on.

The training stream is the concatenation of epochs, each a permutation of all N sample ids;
global step t is positions `t*W*L .. (t+1)*W*L - 1` of that stream, reshaped (W, L), row r
being rank r's draw (W ranks, local batch L). So every sample is drawn exactly once per
epoch, nothing is dropped, and no batch is short; when W*L does not divide N, the step that
straddles an epoch boundary holds the end of one epoch and the start of the next. An epoch
that starts `offset` positions into a step is laid out as

* head: the rest of that straddling step, rank rows filled from each rank's own stream;
* body: whole steps; row r takes the next L ids of rank r's stream, or, when stratified,
  exactly `counts[k]` ids of stratum k from rank r's stream (its stratum-k ids, in stream
  order). The body ends at the first step some rank cannot fill: in the stratified case,
  as soon as any one stratum of any one rank runs out;
* tail: every id left over (the other ranks' and strata's surplus) in a seeded random
  order, dealt as ordinary unstratified steps.

So with stratification every body step has the exact per-stratum counts; only the tail
(a few percent of an epoch when the counts round the histogram, see `strata_counts`) and
the straddling steps do not. If the streams cannot even fill the head (tiny data), the
whole epoch is tail; if N < W*L, one step spans several epochs and so repeats samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def head_sizes(world: int, local_batch: int, offset: int) -> np.ndarray:
    """Ids each rank contributes to the straddling step, whose first `offset` positions are taken."""
    if offset == 0:
        return np.zeros(world, dtype=np.int64)
    starts = np.arange(world) * local_batch
    return np.clip(starts + local_batch - np.maximum(starts, offset), 0, local_batch)


def _body_plain(streams: list[np.ndarray], local_batch: int) -> tuple[np.ndarray, list[np.ndarray]]:
    steps = min(len(s) for s in streams) // local_batch
    body = np.stack([s[: steps * local_batch].reshape(steps, local_batch) for s in streams], axis=1)
    return body, [s[steps * local_batch :] for s in streams]


def _body_stratified(
    streams: list[np.ndarray], strata: np.ndarray, counts: Sequence[int]
) -> tuple[np.ndarray, list[np.ndarray]]:
    split = [[s[strata[s] == k] for k in range(len(counts))] for s in streams]
    used = [k for k, c in enumerate(counts) if c > 0]
    steps = min(len(by_stratum[k]) // counts[k] for by_stratum in split for k in used)
    rows = [
        np.concatenate([by_stratum[k][: steps * counts[k]].reshape(steps, counts[k]) for k in used], axis=1)
        for by_stratum in split
    ]
    left = [np.concatenate([by_stratum[k][steps * counts[k] :] for k in range(len(counts))]) for by_stratum in split]
    return np.stack(rows, axis=1), left


def lay_out_epoch(
    streams: list[np.ndarray],
    local_batch: int,
    offset: int,
    rng: np.random.Generator,
    strata: np.ndarray | None = None,
    counts: Sequence[int] | None = None,
) -> np.ndarray:
    """The epoch's ids in stream order (head, body, tail); see the module docstring.

    `streams[r]` is rank r's draw order (`bert.data.streams`), `offset` the position inside
    a global step at which the epoch starts, `strata[id]` the stratum of every sample id and
    `counts` the per-stratum ids of a local batch (both None: unstratified).
    """
    if (strata is None) != (counts is None):
        raise ValueError("stratified layout needs both the strata and the counts")
    if counts is not None and sum(counts) != local_batch:
        raise ValueError(f"stratum counts {tuple(counts)} do not sum to the local batch {local_batch}")
    take = head_sizes(len(streams), local_batch, offset)
    if any(len(s) < n for s, n in zip(streams, take)):
        return rng.permutation(np.concatenate(streams))
    head = [s[:n] for s, n in zip(streams, take)]
    rest = [s[n:] for s, n in zip(streams, take)]
    body, left = _body_plain(rest, local_batch) if counts is None else _body_stratified(rest, strata, counts)
    tail = rng.permutation(np.concatenate(left))
    return np.concatenate([*head, body.ravel(), tail])
