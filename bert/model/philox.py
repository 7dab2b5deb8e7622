"""Philox4x32 in torch's int64 arithmetic: the words Triton's `tl.randint4x(seed, offset, n_rounds)` makes, on any
device (10 rounds unless told, as Triton's and Random123's default; our attention's mask takes 7, FlashAttention-2's).

The fused dropout kernel (bert.model.dropout_add_norm) draws its mask on the GPU with Triton's Philox; this draws
the same words where there is no Triton (the CPU), so one seed gives one mask everywhere and the kernel can be
checked against the CPU bit for bit. Philox (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11)
is a counter-based generator: word i of counter c under key k is a pure function, no state to carry. Triton keys
it with the seed's low and high 32 bits and counts with the offset's (low, high, 0, 0).

Every value is a uint32 held in an int64 tensor. A 32 x 32-bit product needs 64 unsigned bits, one more than int64
has, so the multiplier's operand is split into 16-bit halves (`_mulhilo`).
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
ROUND_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)  # Philox4x32's M0, M1
KEY_INCREMENTS = (0x9E3779B9, 0xBB67AE85)  # the Weyl sequence bumping the key each round
ROUNDS = 10  # Triton's N_ROUNDS_DEFAULT, and Random123's philox4x32 default


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """The high and low 32 bits of a * b, for a uint32 constant `a` and uint32 values `b` (int64)."""
    low_part = a * (b & 0xFFFF)  # < 2^48
    carried = a * (b >> 16) + (low_part >> 16)  # a * b = carried * 2^16 + (low_part mod 2^16); < 2^49
    return carried >> 16, ((carried & 0xFFFF) << 16) | (low_part & 0xFFFF)


def philox4x32(counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[Tensor, Tensor],
               rounds: int = ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-`rounds` of `counter` (four uint32 words) under `key` (two): four uint32 words, int64 tensors."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(ROUND_MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo(ROUND_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + KEY_INCREMENTS[0]) & MASK32, (k1 + KEY_INCREMENTS[1]) & MASK32
    return c0, c1, c2, c3


def randint4x(seed: Tensor, offset: Tensor, rounds: int = ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton's `tl.randint4x(seed, offset, rounds)` for a non-negative int64 `seed` (0-d) and int64 offsets: four
    words per offset, uint32 values in int64 tensors of the offsets' shape."""
    offset = offset.to(torch.int64)
    zero = torch.zeros_like(offset)
    seed = seed.to(device=offset.device, dtype=torch.int64)
    return philox4x32((offset & MASK32, (offset >> 32) & MASK32, zero, zero), (seed & MASK32, (seed >> 32) & MASK32),
                      rounds)


def dropout_seed(p: float, device: torch.device) -> Tensor | None:
    """A call's mask seed for our dropout kernels (62 bits, from torch's generator on `device`, so a rank's masks
    follow its seed, as nn.Dropout's do, and a CUDA graph's replays draw fresh ones), or None without dropout."""
    return torch.randint(2**62, (), device=device) if p > 0 else None
