"""Per-step cost of the input pipeline for every balance strategy: plan, load, collate.

    .venv/bin/python bench/input_pipeline.py [--quick]

* plan: what every rank computes each step with no collective: the (world, 16) draw of the
  step and the strategy's assignment, on a length index of Wikipedia-like lengths (no files),
  for 8, 64 and 1024 ranks; plus the once-per-epoch layout (file dealing, shuffle buffers,
  strata), reported per epoch and per sample.
* load + collate: one rank of 8 reading its 16 assigned sequences from real varlength shards
  (written to a temporary directory) and concatenating them into a `Batch`.
* loader: steps/s a consumer gets from `TrainLoader` (plan + load + collate in its thread).
* strat: for stratified strategies, the share of an epoch's steps with the exact per-stratum
  counts on every rank (the rest is the epoch's tail, see `bert.data.epoch`).

Strategies are timed interleaved, repeat by repeat, and the median is reported, because
other processes share the machine. Writes results/bench/input_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bert.balance import STRATEGIES
from bert.batch import collate
from bert.data.format import write_varlength_shard
from bert.data.index import LengthIndex
from bert.data.pipeline import TrainLoader
from bert.data.plan import TrainPlan
from bert.data.reader import SampleReader
from bert.lengths import WIKI_PHASE2
from bert.synthetic import random_sample

LOCAL_BATCH, RANKS_PER_NODE = 16, 8
OUT = Path(__file__).resolve().parent.parent / "results" / "bench" / "input_pipeline.json"


def fake_index(num_samples: int, num_shards: int, seed: int = 0) -> LengthIndex:
    lengths = WIKI_PHASE2.sample(num_samples, np.random.default_rng(seed))
    return LengthIndex.from_lengths([Path(f"fake_{i}.hdf5") for i in range(num_shards)],
                                    np.array_split(lengths, num_shards))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stratified_share(plan: TrainPlan) -> float:
    """Share of epoch 0's whole steps in which every rank has exactly the stratum counts."""
    steps = plan.index.num_samples // plan.global_batch_size
    draws = plan.epoch(0)[: steps * plan.global_batch_size].reshape(steps, plan.world_size, -1)
    per_row = np.stack([(plan.strata[draws] == k).sum(axis=2) for k in range(len(plan.counts))], axis=2)
    return float((per_row == np.array(plan.counts)).all(axis=(1, 2)).mean())


def bench_plan(world: int, num_samples: int, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    index = fake_index(num_samples, num_shards=max(64, world))
    plans = {name: TrainPlan(index, world, LOCAL_BATCH, min(RANKS_PER_NODE, world), name, seed=1)
             for name in STRATEGIES}
    epoch_s = {name: timed(lambda p=plan: p.epoch(0)) for name, plan in plans.items()}
    for plan in plans.values():
        plan.draw(repeats * steps - 1)  # lay out every epoch the timed steps touch beforehand
    per_step: dict[str, list[float]] = {name: [] for name in plans}
    for rep in range(repeats):
        for name, plan in plans.items():
            first = rep * steps
            per_step[name].append(timed(lambda p=plan, f=first: [p.assignment(t) for t in range(f, f + steps)]) / steps)
    return {
        name: {
            "stratified_step_share": stratified_share(plan) if plan.counts else None,
            "step_ms": 1e3 * statistics.median(per_step[name]),
            "epoch_layout_s": epoch_s[name],
            "epoch_layout_us_per_sample": 1e6 * epoch_s[name] / num_samples,
        }
        for name, plan in plans.items()
    }


def write_shards(directory: Path, num_shards: int, per_shard: int) -> None:
    rng = np.random.default_rng(0)
    for s in range(num_shards):
        lengths = WIKI_PHASE2.sample(per_shard, rng)
        write_varlength_shard(directory / f"part_{s:05d}.hdf5", [random_sample(int(n), rng) for n in lengths])


def bench_load(directory: Path, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    index = LengthIndex.scan(directory)
    plans = {name: TrainPlan(index, 8, LOCAL_BATCH, RANKS_PER_NODE, name, seed=1) for name in STRATEGIES}
    readers = {name: SampleReader(index) for name in plans}
    load: dict[str, list[float]] = {name: [] for name in plans}
    coll: dict[str, list[float]] = {name: [] for name in plans}
    for rep in range(repeats):
        for name, plan in plans.items():
            for t in range(rep * steps, (rep + 1) * steps):
                ids = plan.rank_ids(t, 0)
                start = time.perf_counter()
                samples = readers[name].read(ids)
                mid = time.perf_counter()
                collate(samples)
                load[name].append(mid - start)
                coll[name].append(time.perf_counter() - mid)
    for reader in readers.values():
        reader.close()
    return {name: {"load_ms": 1e3 * statistics.median(load[name]), "collate_ms": 1e3 * statistics.median(coll[name])}
            for name in plans}


def bench_loader(directory: Path, steps: int, repeats: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    for rep in range(repeats):
        for name in STRATEGIES:
            loader = TrainLoader(directory, LOCAL_BATCH, 8, 0, RANKS_PER_NODE, name, seed=rep, prefetch=4)
            it = iter(loader)
            next(it)  # thread start and first epoch layout are not per-step costs
            rates[name].append(steps / timed(lambda it=it: [next(it) for _ in range(steps)]))
            loader.close()
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats (smoke run)")
    args = parser.parse_args()
    repeats, steps = (2, 5) if args.quick else (5, 20)
    torch.set_num_threads(1)

    worlds = (8, 64, 1024)
    plan = {w: bench_plan(w, 200_000 if args.quick else 1_000_000, steps, repeats) for w in worlds}
    with tempfile.TemporaryDirectory() as tmp:
        write_shards(Path(tmp), num_shards=8, per_shard=300 if args.quick else 1500)
        load = bench_load(Path(tmp), steps, repeats)
        loader = bench_loader(Path(tmp), steps, repeats)

    header = f"{'strategy':<16}" + "".join(f"{'plan ' + str(w) + 'r ms':>14}" for w in worlds)
    header += f"{'epoch 1024r us/smp':>20}{'load ms':>10}{'collate ms':>12}{'loader steps/s':>16}"
    header += "".join(f"{'strat ' + str(w) + 'r':>12}" for w in worlds)
    print(f"local batch {LOCAL_BATCH}, {RANKS_PER_NODE} ranks per node; medians of {repeats} interleaved repeats")
    print(header)
    for name in STRATEGIES:
        row = f"{name:<16}" + "".join(f"{plan[w][name]['step_ms']:>14.3f}" for w in worlds)
        row += f"{plan[1024][name]['epoch_layout_us_per_sample']:>20.3f}"
        row += f"{load[name]['load_ms']:>10.3f}{load[name]['collate_ms']:>12.3f}{loader[name]:>16.1f}"
        share = [plan[w][name]["stratified_step_share"] for w in worlds]
        row += "".join(f"{'-' if x is None else f'{x:.3f}':>12}" for x in share)
        print(row)

    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, 1 torch thread",
        "load_average_1min_at_end": os.getloadavg()[0],  # other work on a shared machine inflates times
        "quick": args.quick,
        "local_batch": LOCAL_BATCH,
        "ranks_per_node": RANKS_PER_NODE,
        "repeats": repeats,
        "plan_per_step": {str(w): plan[w] for w in worlds},
        "load_collate_per_step_rank0_of_8": load,
        "loader_steps_per_s_rank0_of_8": loader,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
