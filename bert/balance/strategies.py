"""Registry of load-balancing strategies (see the package docstring for the contract)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from bert.balance.greedy import assign_greedy
from bert.balance.presort import assign_global, assign_local, assign_snake

Assign = Callable[[np.ndarray, int], np.ndarray]
# Whose lengths `assign` needs: the rank's own, its node's, or the whole world's. With a shared
# seed and a length index every rank knows them without a collective; the lab's α-β model
# (`bert.balance.lab.exchange_model`) prices the exchange the papers run instead.
Scope = Literal["rank", "node", "world"]


def assign_none(lengths: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """Every rank keeps the sequences it drew."""
    world, per_rank = lengths.shape
    return np.arange(world * per_rank, dtype=np.int64).reshape(world, per_rank)


@dataclass(frozen=True)
class Strategy:
    name: str
    stratified: bool  # the sampler draws `strata_counts` sequences per stratum for each rank
    assign: Assign
    doc: str = ""
    scope: Scope = "rank"


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("none", False, assign_none, "no balancing"),
        Strategy("global", False, assign_global, "NVIDIA exchange padding: world-wide sort, round-robin", "world"),
        Strategy("stratified", True, assign_none, "stratified draw (6/3/2/5 of 16), no reassignment"),
        Strategy("local", False, assign_local, "sort inside each node, round-robin", "node"),
        Strategy("stratified_local", True, assign_local, "stratified draw + node-local sort, round-robin", "node"),
        Strategy("snake", False, assign_snake, "sort inside each node, boustrophedon ([000] Fig. 4)", "node"),
        Strategy("samsung", True, assign_snake, "stratified draw + node-local sort + snake ([000])", "node"),
        Strategy("lpt", False, assign_greedy, "world-wide longest-first into least-loaded, equal counts", "world"),
        Strategy("stratified_lpt", True, assign_greedy, "stratified draw + lpt", "world"),
    )
}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown balance strategy {name!r}; choose one of {sorted(STRATEGIES)}") from None
