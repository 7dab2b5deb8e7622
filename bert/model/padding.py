"""Pad and unpad: move the tokens of some sequences between the (T, ...) axis and a (rows, width, ...) block.

The unpadded model never pads; these helpers serve the padded reference path, the padded and
length-grouped attention backends, and the tests. Plans are built on the host from
`SeqLayout.lengths`, so nothing is read back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from bert.batch import SeqLayout


@dataclass(frozen=True)
class PadLayout:
    """Where the tokens of chosen sequences sit in a zero-padded (rows, width) block."""

    tokens: Tensor  # (n,) int64: indices into the T axis, sequence by sequence
    slots: Tensor  # (n,) int64: row * width + position of each of those tokens in the block
    key_mask: Tensor  # (rows, width) bool: True at real tokens
    rows: int
    width: int

    @classmethod
    def build(cls, seq: SeqLayout, sequences: Sequence[int] | None = None, width: int | None = None) -> PadLayout:
        """Layout of `sequences` (default: all, in order), padded to `width` (default: their longest)."""
        lengths = np.asarray(seq.lengths, dtype=np.int64)
        chosen = np.arange(len(lengths)) if sequences is None else np.asarray(sequences, dtype=np.int64)
        lens = lengths[chosen]
        width = int(lens.max()) if width is None else width
        if lens.max() > width:
            raise ValueError(f"a sequence of {lens.max()} tokens does not fit in width {width}")
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[chosen]
        pos = np.arange(width)
        inside = pos[None, :] < lens[:, None]  # (rows, width)
        tokens = (starts[:, None] + pos[None, :])[inside]
        slots = (np.arange(len(chosen))[:, None] * width + pos[None, :])[inside]
        device = seq.cu_seqlens.device
        to_dev = lambda a: torch.from_numpy(a).to(device, non_blocking=True)
        return cls(to_dev(tokens), to_dev(slots), to_dev(inside), len(chosen), width)


def pad(x: Tensor, layout: PadLayout, value: float = 0) -> Tensor:
    """(T, ...) -> (rows, width, ...): the layout's tokens, `value` elsewhere."""
    block = x.new_full((layout.rows * layout.width, *x.shape[1:]), value)
    block = block.index_copy(0, layout.slots, x.index_select(0, layout.tokens))
    return block.view(layout.rows, layout.width, *x.shape[1:])


def unpad(block: Tensor, layout: PadLayout) -> Tensor:
    """(rows, width, ...) -> (n, ...): the real tokens, in the layout's token order."""
    return block.flatten(0, 1).index_select(0, layout.slots)
