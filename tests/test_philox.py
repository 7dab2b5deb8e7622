"""bert.model.philox: Philox4x32 in torch's int64 arithmetic, 10 rounds and the attention mask's 7. References: the
known-answer vectors of Random123 (the generator's authors' library, `kat_vectors`: counter, key, result), and
Python's unbounded integers for the 32 x 32-bit product. Triton's own `tl.randint4x` is compared in
tests/test_dropout_add_norm.py (10 rounds) and tests/test_triton_attention.py (7), in its interpreter."""

import random

import pytest
import torch

from bert.model.philox import MASK32, _mulhilo, philox4x32, randint4x

# Random123 kat_vectors, philox4x32 with 10 rounds: counter (4 words), key (2), result (4)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


# the same, 7 rounds (FlashAttention-2's, our attention mask's)
KNOWN_ANSWERS_7 = [
    ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


@pytest.mark.parametrize("rounds,counter,key,expected",
                         [(10, *case) for case in KNOWN_ANSWERS] + [(7, *case) for case in KNOWN_ANSWERS_7])
def test_philox4x32_gives_random123s_known_answers(rounds, counter, key, expected):
    words = philox4x32(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key), rounds)
    assert tuple(int(w) for w in words) == expected


def test_the_32_bit_product_is_exact_at_the_edges_and_at_random():
    rng = random.Random(0)
    values = [0, 1, 0xFFFF, 0x10000, MASK32, MASK32 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    for a in (0xD2511F53, 0xCD9E8D57, MASK32, 1):
        hi, lo = _mulhilo(a, torch.tensor(values))
        assert hi.tolist() == [(a * v) >> 32 for v in values]
        assert lo.tolist() == [(a * v) & MASK32 for v in values]


def test_randint4x_counts_with_the_offset_and_keys_with_the_seed():
    """Triton's layout (triton.language.random): counter (offset low, offset high, 0, 0), key (seed low, high)."""
    seed, offset = (7 << 32) | 5, (3 << 32) | 11
    words = randint4x(torch.tensor(seed), torch.tensor([offset]))
    direct = philox4x32(tuple(torch.tensor([c]) for c in (11, 3, 0, 0)), (torch.tensor(5), torch.tensor(7)))
    assert [int(w) for w in words] == [int(w) for w in direct]
    fewer = randint4x(torch.tensor(seed), torch.tensor([offset]), 7)
    direct = philox4x32(tuple(torch.tensor([c]) for c in (11, 3, 0, 0)), (torch.tensor(5), torch.tensor(7)), 7)
    assert [int(w) for w in fewer] == [int(w) for w in direct] != [int(w) for w in words]
    assert all(0 <= int(w) <= MASK32 for w in words)


def test_neighbouring_offsets_and_seeds_give_unrelated_words():
    """Each of the four streams is uniform over 32 bits (its mean within 5 standard errors of 2^31 over 40,000
    words), and two seeds a step apart give different words at every position."""
    a = torch.stack(randint4x(torch.tensor(1), torch.arange(10_000)))
    b = torch.stack(randint4x(torch.tensor(2), torch.arange(10_000)))
    for words in (a, b):
        mean = words.double().mean().item()
        assert abs(mean - 2**31) < 5 * (2**32 / 12**0.5) / (words.numel() ** 0.5)
    assert (a == b).sum() == 0
