"""The eval set: this rank's slice of the first `num_examples` samples, batched once and kept.

MLPerf evaluates the same 10,000 samples every time, so they are read and collated once and
cached on the device. Ranks take contiguous, near-equal slices (sizes differ by at most one)
that together cover every sample exactly once; NVIDIA's `num_eval_examples // world_size`
per rank would drop the remainder, which changes the reported accuracy.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from bert.batch import Batch, collate
from bert.data.index import LengthIndex
from bert.data.reader import SampleReader


def eval_slice(num_examples: int, world_size: int, rank: int) -> np.ndarray:
    """Global ids of `rank`'s share of samples 0 .. num_examples-1."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return np.array_split(np.arange(num_examples, dtype=np.int64), world_size)[rank]


def eval_batches(
    eval_dir: str | os.PathLike,
    batch_size: int,
    world_size: int,
    rank: int,
    num_examples: int,
    device: torch.device | str = "cpu",
) -> list[Batch]:
    """This rank's eval samples as batches of at most `batch_size`, on `device`."""
    if batch_size < 1 or num_examples < 1:
        raise ValueError(f"batch size ({batch_size}) and number of eval examples ({num_examples}) must be >= 1")
    index = LengthIndex.scan(eval_dir)
    if num_examples > index.num_samples:
        raise ValueError(f"{eval_dir}: asked for {num_examples} eval examples, the set holds {index.num_samples}")
    ids = eval_slice(num_examples, world_size, rank)
    reader = SampleReader(index)
    try:
        return [collate(reader.read(ids[i : i + batch_size])).to(device) for i in range(0, len(ids), batch_size)]
    finally:
        reader.close()
