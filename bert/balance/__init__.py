"""Load balancing of the global batch across ranks (Samsung [000] §3-4, Baidu [001] §IV-B).

A strategy has two halves, both pure functions of per-sample lengths so that every rank can
compute them identically from a shared seed and a length index, with no collective and no
sample data moved between ranks:

* sampling: whether each rank's local batch is *stratified* (a fixed count per length
  stratum, e.g. 6/3/2/5 of 16 on Wikipedia; see `bert.balance.stratify.strata_counts`);
* assignment: `Strategy.assign(lengths, ranks_per_node)` takes the lengths of the global
  batch as drawn, shape (world, local_batch) with row r = rank r's draw, and returns an int64
  array of the same shape whose row r holds the indices (into `lengths.ravel()`) of the
  sequences rank r trains on. Every index appears exactly once.

`get_strategy(name)` returns the `Strategy` registered under `name`; `STRATEGIES` lists them:
none, global (NVIDIA exchange padding), stratified, local, stratified_local, snake, samsung (stratified + local
presort + snake), lpt and stratified_lpt (world-wide longest-first greedy, `greedy.py`).
`Strategy.scope` says whose lengths `assign` reads (the rank's, its node's, the world's).
"""

from bert.balance.strategies import STRATEGIES, Strategy, get_strategy
from bert.balance.stratify import strata_counts, stratum_of

__all__ = ["STRATEGIES", "Strategy", "get_strategy", "strata_counts", "stratum_of"]
