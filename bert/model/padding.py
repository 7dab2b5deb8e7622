"""Pad and unpad: move the tokens of some sequences between the (T, ...) axis and a (rows, width, ...) block.

The unpadded model never pads; these helpers serve the padded reference path, the padded and
length-grouped attention backends, and the tests. Plans are built on the host from
`SeqLayout.lengths`, so nothing is read back from the device.

    PadLayout       chosen sequences in one (rows, width) block: `pad`, `unpad`
    GroupedLayout   every token in one buffer of blocks, a (rows, width) block per group of sequences:
                    `pad_groups`, `unpad_groups`, one scatter and one gather of (T, ...) however many groups
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from bert.batch import SeqLayout


def host_tensor(a: np.ndarray, device: torch.device) -> Tensor:
    """`a` as a host tensor to copy to `device` with non_blocking=True: pinned when `device` is CUDA, since a copy
    from pageable memory may make the host wait for the stream; as it is (no copy) otherwise."""
    host = torch.from_numpy(a)
    return host.pin_memory() if device.type == "cuda" else host


def to_device(a: np.ndarray, device: torch.device) -> Tensor:
    return host_tensor(a, device).to(device, non_blocking=True)


def block_positions(lengths: np.ndarray, chosen: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, slots, inside) of the `chosen` sequences in a (len(chosen), width) block: each token's index on the
    T axis, its row * width + position in the block, and the (rows, width) mask of real tokens."""
    lens = lengths[chosen]
    if lens.max() > width:
        raise ValueError(f"a sequence of {lens.max()} tokens does not fit in width {width}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[chosen]
    pos = np.arange(width)
    inside = pos[None, :] < lens[:, None]  # (rows, width)
    tokens = (starts[:, None] + pos[None, :])[inside]
    slots = (np.arange(len(chosen))[:, None] * width + pos[None, :])[inside]
    return tokens, slots, inside


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
        width = int(lengths[chosen].max()) if width is None else width
        tokens, slots, inside = block_positions(lengths, chosen, width)
        device = seq.cu_seqlens.device
        return cls(to_device(tokens, device), to_device(slots, device), to_device(inside, device), len(chosen), width)


def pad(x: Tensor, layout: PadLayout, value: float = 0) -> Tensor:
    """(T, ...) -> (rows, width, ...): the layout's tokens, `value` elsewhere."""
    block = x.new_full((layout.rows * layout.width, *x.shape[1:]), value)
    block = block.index_copy(0, layout.slots, x.index_select(0, layout.tokens))
    return block.view(layout.rows, layout.width, *x.shape[1:])


def unpad(block: Tensor, layout: PadLayout) -> Tensor:
    """(rows, width, ...) -> (n, ...): the real tokens, in the layout's token order."""
    return block.flatten(0, 1).index_select(0, layout.slots)


@dataclass(frozen=True)
class GroupedLayout:
    """Every token of a batch in one zero-padded buffer: block g, (rows_g, width_g), holds group g's sequences,
    each padded to the group's longest."""

    slots: Tensor  # (T,) int64: each token's row of the buffer (its block's offset + row * width + position)
    key_masks: tuple[Tensor, ...]  # per block, (rows, width) bool: True at real tokens (views of one tensor)
    shapes: tuple[tuple[int, int], ...]  # per block, (rows, width)

    @property
    def sizes(self) -> list[int]:
        return [rows * width for rows, width in self.shapes]

    @classmethod
    def build(cls, seq: SeqLayout, groups: Sequence[Sequence[int]]) -> GroupedLayout:
        """Blocks for `groups` (lists of sequence indices; together every sequence once, none empty)."""
        lengths = np.asarray(seq.lengths, dtype=np.int64)
        slots = np.full(int(lengths.sum()), -1, dtype=np.int64)
        masks, shapes, offset = [], [], 0
        for group in groups:
            chosen = np.asarray(group, dtype=np.int64)
            width = int(lengths[chosen].max())
            tokens, local, inside = block_positions(lengths, chosen, width)
            if (slots[tokens] >= 0).any():
                raise ValueError(f"a sequence of group {list(group)} is in an earlier group too")
            slots[tokens] = offset + local
            masks.append(inside.ravel())
            shapes.append((len(chosen), width))
            offset += inside.size
        if (slots < 0).any():
            raise ValueError(f"the groups {[list(g) for g in groups]} leave out some of the {len(lengths)} sequences")
        device = seq.cu_seqlens.device
        # one host-to-device copy per array, however many groups
        flat_masks = to_device(np.concatenate(masks), device).split([m.size for m in masks])
        key_masks = tuple(m.view(shape) for m, shape in zip(flat_masks, shapes))
        return cls(to_device(slots, device), key_masks, tuple(shapes))


def pad_groups(x: Tensor, layout: GroupedLayout) -> list[Tensor]:
    """(T, ...) -> a zero-padded (rows, width, ...) block per group, views of one buffer. One scatter of x: its
    backward is one gather of (T, ...), where padding each group from x would write a zero-filled (T, ...)
    gradient per group."""
    trailing = x.shape[1:]
    buffer = x.new_zeros((sum(layout.sizes), *trailing)).index_copy_(0, layout.slots, x)
    return [b.view(*shape, *trailing) for b, shape in zip(buffer.split(layout.sizes), layout.shapes)]


def unpad_groups(blocks: Sequence[Tensor], layout: GroupedLayout) -> Tensor:
    """A (rows, width, ...) block per group -> (T, ...), the real tokens in T order: one cat and one gather."""
    return torch.cat([b.flatten(0, 1) for b in blocks]).index_select(0, layout.slots)
