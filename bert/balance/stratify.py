"""Stratified sampling: every local batch holds a fixed count of sequences from each length stratum.

Samsung ([000] §4.1, Figure 3) fills each local batch with a fixed count of sequences from each of
the (0,128] / (128,256] / (256,384] / (384,512] strata, in proportion to the data's histogram. The
paper's text gives 5/2/3/6 of 16 for its data; Samsung's code draws 6/3/2/5
(`SplitRandomSampler(batch_ratio=[6,3,2,5])` in [Samsung-BERT]), which is also what our phase-2 mix
(`bert.lengths.WIKI_PHASE2`) rounds to. A stratum whose count rounds to 0 is refused
(`bert.data.plan.check_every_stratum_drawn`; the paper warns of small batches in §6). The whole technique is here:

* `stratum_of`: the stratum of each length;
* `strata_counts`: the counts, from the data's own histogram by largest-remainder rounding of
  `local_batch * share`, so they always sum to `local_batch`;
* `stratified_steps`: the draw, laying per-rank id streams out as whole global steps in which
  every rank's row holds exactly `counts[k]` ids of stratum k (`bert.data.epoch` calls it for
  the body of every epoch; unstratified is the one-stratum case).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bert.lengths import LengthMix, histogram

EDGES = (128, 256, 384, 512)


def stratum_of(lengths: Sequence[int] | np.ndarray, edges: Sequence[int] = EDGES) -> np.ndarray:
    """Index of the stratum (0, e0], (e0, e1], ... of every length (int64)."""
    lengths = np.asarray(lengths)
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"sequence length {lengths.min()} is below 1")
    idx = np.searchsorted(np.asarray(edges), lengths, side="left").astype(np.int64)
    if lengths.size and idx.max() >= len(edges):
        raise ValueError(f"sequence length {lengths.max()} is above the last stratum edge {edges[-1]}")
    return idx


def strata_counts(
    lengths_or_histogram: Sequence[int] | np.ndarray | LengthMix,
    edges: Sequence[int] = EDGES,
    local_batch: int = 16,
) -> tuple[int, ...]:
    """Per-stratum counts of a local batch, proportional to the data's histogram.

    Takes a `LengthMix`, a histogram (a 1-D array with exactly one entry per stratum) or
    the lengths themselves (anything else).
    """
    if local_batch < 1:
        raise ValueError(f"local batch size must be positive, got {local_batch}")
    if isinstance(lengths_or_histogram, LengthMix):
        if tuple(lengths_or_histogram.edges) != tuple(edges):
            raise ValueError(f"length mix edges {lengths_or_histogram.edges} differ from the strata edges {edges}")
        counts = np.asarray(lengths_or_histogram.probs, dtype=np.float64)
    else:
        data = np.asarray(lengths_or_histogram)
        counts = data.astype(np.float64) if data.shape == (len(edges),) else histogram(data.ravel(), edges)
    if counts.min() < 0 or counts.sum() <= 0:
        raise ValueError(f"the length histogram {counts.tolist()} is empty or negative")
    quota = local_batch * counts / counts.sum()
    whole = np.floor(quota).astype(np.int64)
    # Largest remainder; ties go to the lower stratum (stable sort) so the result is deterministic.
    order = np.argsort(-(quota - whole), kind="stable")
    whole[order[: local_batch - whole.sum()]] += 1
    return tuple(int(c) for c in whole)


def interleave(streams: Sequence[np.ndarray], chunk: int) -> np.ndarray:
    """Chunks of `chunk` ids ordered by (chunk number, rank): rank 0's first, rank 1's first, ...

    While every stream has chunks left, chunk j of rank r lands at position (j*W + r)*chunk,
    i.e. in rank r's row; exhausted streams drop out and the others close up.

    The rounds every stream fills are a transposed copy, written straight into the result; only the rest (the
    rounds after the shortest stream runs out: a few chunks per rank where streams differ by a few ids) is
    ordered by sorting those keys. Sorting all of phase 2's keys at 1024 ranks held ~5 GB of int64 keys and
    indices for 0.63 GB of ids.
    """
    world = len(streams)
    full = min((len(s) for s in streams), default=0) // chunk  # rounds with a whole chunk from every rank
    dtype = np.result_type(*streams) if streams else np.int64
    out = np.empty(sum(len(s) for s in streams), dtype=dtype)
    head = out[: full * world * chunk].reshape(full, world, chunk)
    for r, s in enumerate(streams):
        head[:, r, :] = s[: full * chunk].reshape(full, chunk)
    tails = [s[full * chunk :] for s in streams]
    keys = [np.arange(len(t)) // chunk * world + r for r, t in enumerate(tails)]
    if tails:
        out[full * world * chunk :] = np.concatenate(tails)[np.argsort(np.concatenate(keys), kind="stable")]
    return out


def stratified_steps(
    streams: list[np.ndarray], counts: Sequence[int], strata: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Whole global steps drawn from per-rank id streams, and the ids left over.

    Row r of a step takes, for every stratum k, the next `counts[k]` ids of stratum k from rank
    r's stream; once a rank's stream is used up, the chunks of the ranks that still have ids
    move up to fill the rows (`interleave`), so uneven shard sizes cost no steps. The steps end
    when the first stratum has fewer than `world * counts[k]` ids left. `strata[id]` is the
    stratum of every sample id; None means one stratum (`counts = (local_batch,)`, unstratified).
    Returns (steps * world * sum(counts) ids in step order, the rest stratum by stratum).
    """
    world = len(streams)
    if strata is None:
        if len(counts) != 1:
            raise ValueError(f"{len(counts)} stratum counts but no strata")
        per_stratum = {0: interleave(streams, counts[0])}
    else:
        # A stratum with a zero count is never drawn in the body: all of it goes to the tail.
        per_stratum = {
            k: interleave([s[strata[s] == k] for s in streams], max(counts[k], 1)) for k in range(len(counts))
        }
    used = [k for k, c in enumerate(counts) if c > 0]
    steps = min(len(per_stratum[k]) // (world * counts[k]) for k in used)
    # (steps, world, counts[k]) blocks side by side: each row holds counts[k] ids of stratum k.
    body = np.concatenate(
        [per_stratum[k][: steps * world * counts[k]].reshape(steps, world, counts[k]) for k in used], axis=2
    )
    left = [per_stratum[k][steps * world * counts[k] :] for k in range(len(counts))]
    return body.ravel(), np.concatenate(left)
