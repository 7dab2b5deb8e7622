"""One epoch laid out as global batches: the sample order every rank agrees on.

The training stream is the concatenation of epochs, each a permutation of all N sample ids;
global step t is positions `t*W*L .. (t+1)*W*L - 1` of that stream, reshaped (W, L), row r
being rank r's draw (W ranks, local batch L). So every sample is drawn exactly once per
epoch, nothing is dropped, and no batch is short; when W*L does not divide N, the step that
straddles an epoch boundary holds the end of one epoch and the start of the next. An epoch
that starts `offset` positions into a step is laid out as

* head: the rest of that straddling step, rank rows filled from each rank's own stream;
* body: whole steps (`bert.balance.stratify.stratified_steps`). Row r takes the next chunk of
  L ids of rank r's stream; once a rank's stream is used up, the chunks of the ranks that
  still have ids move up to fill the rows, so uneven shard sizes cost no steps. Stratified,
  the same is done per stratum with chunks of `counts[k]` ids, and every body step has
  exactly `counts[k]` ids of stratum k in every row; the body ends when the first stratum
  has fewer than `world * counts[k]` ids left;
* tail: the ids left over in a seeded random order: fewer than a step's worth unstratified;
  stratified, the other strata's surplus once the scarcest one (relative to its count) is
  used up, a few percent of an epoch when the counts round the histogram (`strata_counts`).
  Tail steps are ordinary unstratified steps; the last one straddles into the next epoch.

If the streams cannot even fill the head (tiny data), the whole epoch is tail; if N < W*L,
one step spans several epochs and so repeats samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bert.balance.stratify import stratified_steps


def head_sizes(world: int, local_batch: int, offset: int) -> np.ndarray:
    """Ids each rank contributes to the straddling step, whose first `offset` positions are taken."""
    if offset == 0:
        return np.zeros(world, dtype=np.int64)
    starts = np.arange(world) * local_batch
    return np.clip(starts + local_batch - np.maximum(starts, offset), 0, local_batch)


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
    body, left = stratified_steps(rest, (local_batch,) if counts is None else counts, strata)
    return np.concatenate([*head, body, rng.permutation(left)])
