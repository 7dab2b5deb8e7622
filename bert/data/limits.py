"""What the model can take, checked on every sample before it reaches the model.

A token id beyond the model's vocabulary, a segment id beyond its token types or a sequence longer than its
position table becomes an index error inside an embedding: "index out of range in self" on the CPU, a
device-side assert on a GPU (which also leaves the CUDA context unusable). Neither names the shard, and both
come after `run_start`. Shards tokenized with another vocabulary, or cut at another length, are the usual cause.
So a `SampleLimits` is checked

* lengths against the length index when a loader or the eval set is built (metadata, before the clock starts:
  every batch is drawn from that index, so they are not checked again), and
* ids and labels against every batch the loader collates, in its background thread, before the batch is padded
  or pinned: vectorised over the batch's concatenated tokens (about 50 microseconds for 96 phase-2 sequences,
  25,000 tokens, hidden behind the training step), naming the first bad sample's shard and row.

Either failure is a `ShardError` (exit status 2, as for a corrupt shard). A masked label must be a token of the
vocabulary too: the MLM loss reads the label's logit. Next-sentence labels are 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bert.batch import Batch
from bert.data.format import ShardError
from bert.data.index import LengthIndex


@dataclass(frozen=True)
class SampleLimits:
    vocab_size: int  # token ids and masked labels are below this (the tokenizer's vocabulary, not its padding)
    type_vocab_size: int  # segment ids are below this
    max_length: int  # tokens per sequence: the position table, and the data set's MAX_SEQ_LENGTH

    def check_index(self, index: LengthIndex) -> None:
        """Every sample's length, from the length index alone (no sample is read)."""
        too_long = np.flatnonzero(index.lengths > self.max_length)
        if too_long.size:
            shard, row = index.locate(too_long[:1])
            raise ShardError(f"{index.paths[shard[0]]}: sample {row[0]} has {index.lengths[too_long[0]]} tokens, more "
                             f"than the model takes ({self.max_length}: max_position_embeddings and MAX_SEQ_LENGTH)")

    def violation(self, batch: Batch) -> tuple[int, str] | None:
        """(the first bad sample's position in `batch`, what is wrong with it), or None. `batch` is on the CPU."""
        starts = batch.seq.cu_seqlens[1:].to(torch.int64)
        sample_of_token = lambda t: int(torch.searchsorted(starts, t, right=True))  # noqa: E731
        for name, values, limit in (("token id", batch.input_ids, self.vocab_size),
                                    ("segment id", batch.segment_ids, self.type_vocab_size)):
            bad = _first_outside(values, limit)
            if bad is not None:
                return sample_of_token(bad), f"{name} {int(values[bad])} is outside the model's 0..{limit - 1}"
        bad = _first_outside(batch.masked_labels, self.vocab_size)
        if bad is not None:
            return (sample_of_token(int(batch.masked_positions[bad])),
                    f"masked label {int(batch.masked_labels[bad])} is outside the model's 0..{self.vocab_size - 1}")
        bad = _first_outside(batch.nsp_labels, 2)
        if bad is not None:
            return bad, f"next-sentence label {int(batch.nsp_labels[bad])} is not 0 or 1"
        return None  # lengths: `check_index`, once, on the index every batch is drawn from

    def check(self, batch: Batch, index: LengthIndex, ids: np.ndarray) -> None:
        """Raise a ShardError naming the shard and row of the first bad sample of `batch`, read as `ids`."""
        found = self.violation(batch)
        if found is not None:
            position, why = found
            shard, row = index.locate(ids[position : position + 1])
            raise ShardError(f"{index.paths[shard[0]]}: sample {row[0]}: {why}")


def _first_outside(values: torch.Tensor, limit: int) -> int | None:
    """Index of the first value outside 0..limit-1 (one pass when all are inside, as they should be)."""
    if values.numel() == 0 or (int(values.min()) >= 0 and int(values.max()) < limit):
        return None
    return int(torch.nonzero((values < 0) | (values >= limit))[0, 0])
