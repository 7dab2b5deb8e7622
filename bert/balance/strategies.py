"""Registry of load-balancing strategies (see the package docstring for the contract)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Assign = Callable[[np.ndarray, int], np.ndarray]


def assign_none(lengths: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """Every rank keeps the sequences it drew."""
    world, per_rank = lengths.shape
    return np.arange(world * per_rank, dtype=np.int64).reshape(world, per_rank)


@dataclass(frozen=True)
class Strategy:
    name: str
    stratified: bool
    assign: Assign
    doc: str = ""


# Filled in by the balance modules (global presort, local presort, snake, ...).
STRATEGIES: dict[str, Strategy] = {
    "none": Strategy("none", stratified=False, assign=assign_none, doc="no balancing"),
}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown balance strategy {name!r}; choose one of {sorted(STRATEGIES)}") from None
