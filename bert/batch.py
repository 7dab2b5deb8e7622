"""The one batch type of the project: unpadded BERT pre-training batches.

Every producer (the shard reader, the synthetic generator, the eval loader) returns a
`Batch`, and every consumer (the model, the loss, the benchmarks) takes one. Sequences
are concatenated along a single token axis of length T and delimited by `cu_seqlens`,
as in Baidu's and NVIDIA's unpadded BERT (Baidu [001] §IV-A).

Layout of a batch of B sequences with T tokens and M masked positions in total:

    input_ids        (T,)   int64   token ids, sequences back to back
    segment_ids      (T,)   int64   0 for sentence A, 1 for sentence B
    position_ids     (T,)   int64   0..len-1 inside each sequence
    seq.cu_seqlens   (B+1,) int32   prefix sums of the lengths, leading 0
    seq.max_seqlen   int            longest sequence (a host value: no device sync)
    seq.lengths      tuple[int]     host copy of the lengths, for backends that plan on the CPU
    masked_positions (M,)   int64   indices into the T axis (not into a sequence)
    masked_labels    (M,)   int64   original token ids at those positions
    nsp_labels       (B,)   int64   1 = sentence B is random (not the next one)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch import Tensor

from bert.sample import Sample  # noqa: F401  (re-exported: collate's input type)


@dataclass(frozen=True)
class SeqLayout:
    """Where each sequence starts and ends in the concatenated token axis."""

    cu_seqlens: Tensor  # (B+1,) int32, on the compute device
    max_seqlen: int
    lengths: tuple[int, ...]  # host copy; never read back from the device

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str = "cpu") -> SeqLayout:
        lengths = tuple(int(n) for n in lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every sequence needs at least one token, got lengths {lengths}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        return cls(cu.to(device), max(lengths), lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SeqLayout:
        return replace(self, cu_seqlens=self.cu_seqlens.to(device, non_blocking=non_blocking))


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor
    segment_ids: Tensor
    position_ids: Tensor
    seq: SeqLayout
    masked_positions: Tensor
    masked_labels: Tensor
    nsp_labels: Tensor

    @property
    def num_sequences(self) -> int:
        return self.seq.num_sequences

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    def _map(self, fn) -> Batch:
        changes = {f.name: fn(getattr(self, f.name)) for f in fields(self) if f.name != "seq"}
        return replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        moved = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        return replace(moved, seq=self.seq.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        pinned = self._map(lambda t: t.pin_memory())
        return replace(pinned, seq=replace(self.seq, cu_seqlens=self.seq.cu_seqlens.pin_memory()))


def collate(samples: Sequence[Sample]) -> Batch:
    """Concatenate samples into one unpadded `Batch` (on the CPU; the loader pins and copies it)."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    for s, n in zip(samples, lengths):
        if len(s.segment_ids) != n:
            raise ValueError(f"segment_ids has {len(s.segment_ids)} entries for a sequence of {n} tokens")
        if len(s.masked_positions) != len(s.masked_labels):
            raise ValueError("masked_positions and masked_labels differ in length")
    seq = SeqLayout.from_lengths(lengths)
    starts = np.cumsum(lengths) - lengths
    input_ids = np.concatenate([s.input_ids for s in samples]).astype(np.int64)
    segment_ids = np.concatenate([s.segment_ids for s in samples]).astype(np.int64)
    position_ids = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
    # Checked on the concatenation, not per sample: this runs in the loader thread every step, holding the GIL.
    local = np.concatenate([np.asarray(s.masked_positions, dtype=np.int64) for s in samples])
    per_sample = np.array([len(s.masked_positions) for s in samples], dtype=np.int64)
    outside = (local < 0) | (local >= np.repeat(lengths, per_sample))
    if outside.any():
        raise ValueError(f"masked position {local[outside][0]} outside a sequence of "
                         f"{np.repeat(lengths, per_sample)[outside][0]} tokens")
    masked_positions = local + np.repeat(starts, per_sample)
    masked_labels = np.concatenate([np.asarray(s.masked_labels, dtype=np.int64) for s in samples])
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        segment_ids=torch.from_numpy(segment_ids),
        position_ids=torch.from_numpy(position_ids),
        seq=seq,
        masked_positions=torch.from_numpy(masked_positions),
        masked_labels=torch.from_numpy(masked_labels),
        nsp_labels=torch.tensor([int(s.nsp_label) for s in samples], dtype=torch.int64),
    )
