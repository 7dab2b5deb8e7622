"""The eval set: this rank's slice of the first `num_examples` samples, read at the first evaluation and kept.

MLPerf evaluates the same 10,000 samples every time, so they are read and collated once and cached on the
device, as NVIDIA's `--cache_eval_data` does. Once means at the first use, inside the timed run: "the clock
must start before any part of the system touches the dataset" ([MLPerf-rules], "Run Results"), and the
eval set is part of the dataset. Before the clock only metadata is read, which the rules allow ("processing
metadata like the number of documents, or document sizes"): the length index, which says how many samples
there are and so how many batches of which sizes each rank will evaluate (the compile warm-up runs synthetic
batches of those sizes).

Ranks take contiguous, near-equal slices (sizes differ by at most one) that together cover every sample
exactly once, so the eval set's size over all ranks is `num_examples`; NVIDIA's `num_eval_examples //
world_size` per rank would drop the remainder, which changes the reported accuracy.

With STATIC_TOKENS the eval batches are padded to token buckets as the training batches are
(`bert.static_shapes`; the padding changes no prediction that is counted), so under a CUDA-graph COMPILE
mode the eval replays graphs too: `shapes` names every padded shape from the length index alone, and the
warm-up records each of them before the clock starts (`bert.train.warmup`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

from bert.batch import Batch, collate
from bert.data.index import LengthIndex
from bert.data.limits import SampleLimits
from bert.data.reader import SampleReader
from bert.static_shapes import pad_static, padded_tokens


def eval_slice(num_examples: int, world_size: int, rank: int) -> np.ndarray:
    """Global ids of `rank`'s share of samples 0 .. num_examples-1."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return np.array_split(np.arange(num_examples, dtype=np.int64), world_size)[rank]


def batch_shapes(lengths: np.ndarray, batch_size: int, static_tokens: int = 0) -> list[tuple[int, int]]:
    """(sequences, tokens) of the batches of `batch_size` consecutive samples of `lengths`, the tokens padded as
    `pad_to_buckets` pads them when `static_tokens` is set."""
    starts = range(0, len(lengths), batch_size)
    tokens = [int(lengths[i : i + batch_size].sum()) for i in starts]
    if static_tokens:
        tokens = [padded_tokens(t, static_tokens) for t in tokens]
    return [(min(batch_size, len(lengths) - i), t) for i, t in zip(starts, tokens)]


class EvalSet:
    """This rank's eval batches (at most `batch_size` sequences each, on `device`), iterable any number of times.

    Building it checks the request against the length index (metadata: a missing directory, or more examples
    than the set holds, fails here, before the run); the samples themselves are read on the first iteration."""

    def __init__(self, eval_dir: str | os.PathLike, batch_size: int, world_size: int, rank: int,
                 num_examples: int, device: torch.device | str = "cpu", static_tokens: int = 0,
                 limits: SampleLimits | None = None):
        if batch_size < 1 or num_examples < 1:
            raise ValueError(f"batch size ({batch_size}) and number of eval examples ({num_examples}) must be >= 1")
        self.index = LengthIndex.scan(eval_dir)
        if num_examples > self.index.num_samples:
            raise ValueError(f"{eval_dir}: asked for {num_examples} eval examples, the set holds "
                             f"{self.index.num_samples}")
        self.num_examples, self.batch_size, self.device = num_examples, batch_size, device
        self.static_tokens = static_tokens  # STATIC_TOKENS: pad to token buckets (bert.static_shapes), 0 = off
        self.ids = eval_slice(num_examples, world_size, rank)
        self.limits = limits  # what the model takes (bert.data.limits): the set is checked against it when read
        if limits is not None:
            limits.check_index(self.index)
        self._batches: list[Batch] | None = None

    @property
    def batch_sizes(self) -> list[int]:
        """Sequences in each of this rank's batches (known without reading a sample)."""
        return [n for n, _ in self.shapes]

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(sequences, tokens) of each of this rank's batches as the model gets them, padding included (from the
        length index: no sample is read). With STATIC_TOKENS the tokens are a bucket and, with the sequences, fix
        every shape of the batch (`pad_to_buckets` ties the masked rows to them)."""
        return batch_shapes(self.index.lengths[self.ids], self.batch_size, self.static_tokens)

    @property
    def loaded(self) -> bool:
        return self._batches is not None

    def __iter__(self) -> Iterator[Batch]:
        if self._batches is None:
            reader = SampleReader(self.index)
            try:
                self._batches = [self._read(reader, self.ids[i : i + self.batch_size])
                                 for i in range(0, len(self.ids), self.batch_size)]
            finally:
                reader.close()
        return iter(self._batches)

    def _read(self, reader: SampleReader, ids: np.ndarray) -> Batch:
        batch = collate(reader.read(ids))
        if self.limits is not None:
            self.limits.check(batch, self.index, ids)
        return pad_static(batch, self.static_tokens).to(self.device)


def eval_batches(
    eval_dir: str | os.PathLike,
    batch_size: int,
    world_size: int,
    rank: int,
    num_examples: int,
    device: torch.device | str = "cpu",
) -> list[Batch]:
    """This rank's eval samples as batches of at most `batch_size`, on `device`, read now."""
    return list(EvalSet(eval_dir, batch_size, world_size, rank, num_examples, device))
