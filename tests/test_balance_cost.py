"""The lab's α-β model of the papers' balancing exchanges, against Herring [003]'s formula and hand-computed bytes."""

from __future__ import annotations

import math

import pytest

from bert.balance.lab.exchange_model import PADDED_SEQUENCE_BYTES, Link, model_paper_exchange
from bert.balance.lab.exchange_model import modelled_all_gather_seconds as all_gather_s

UNIT = Link("unit", alpha=1.0, bandwidth=1.0)  # seconds = hops + bytes, easy to read


def test_all_gather_is_the_herring_formula() -> None:
    # Herring [003] §IV: 100 MB over 64 ranks moves (p - 1) n / p = 98.4375 MB per rank in lg(64) = 6 steps.
    assert all_gather_s(100e6, 64, UNIT) == pytest.approx(6 + 63 * 100e6 / 64)
    assert all_gather_s(100e6, 1, UNIT) == 0.0


def test_nvidia_world_exchange_bytes_and_time() -> None:
    # 2 nodes x 8 GPUs x 16 padded int16 sequences of 4 x 512 + 1 values each.
    assert PADDED_SEQUENCE_BYTES == 4098
    total = 16 * 16 * 4098
    ex = model_paper_exchange("global", world=16, ranks_per_node=8, local_batch=16, intra=UNIT, inter=UNIT)
    assert (ex.group, ex.ranks, ex.collectives) == ("world", 16, 1)
    assert ex.bytes_in == total * 15 // 16
    # Across the 2 nodes, peers swap their eighth: 1 hop + total/8/2 bytes; then 8 ranks in the node.
    assert ex.seconds == pytest.approx((1 + total / 8 / 2) + (math.log2(8) + total * 7 / 8))


def test_samsung_exchange_stays_in_the_node() -> None:
    small = model_paper_exchange("samsung", world=1024, ranks_per_node=8, local_batch=16)
    assert (small.group, small.ranks) == ("node", 8)
    # Independent of the world size.
    assert small == model_paper_exchange("samsung", world=16, ranks_per_node=8, local_batch=16)


@pytest.mark.parametrize("name", ["none", "stratified", "lpt", "stratified_lpt"])
def test_strategies_without_exchange(name: str) -> None:
    ex = model_paper_exchange(name, world=1024, ranks_per_node=8, local_batch=16)
    assert (ex.collectives, ex.bytes_in, ex.seconds) == (0, 0, 0.0)


def test_a_world_smaller_than_a_node_gathers_over_its_own_ranks() -> None:
    # 4 GPUs in one 8-GPU node: Samsung's node all-gather spans the 4, on NVLink only: lg(4) hops + 3/4 of the data.
    total = 4 * 16 * 4098
    ex = model_paper_exchange("samsung", world=4, ranks_per_node=8, local_batch=16, intra=UNIT, inter=UNIT)
    assert (ex.group, ex.ranks, ex.bytes_in) == ("node", 4, total * 3 // 4)
    assert ex.seconds == pytest.approx(2 + total * 3 / 4)
