"""What laying out an epoch costs one rank at scale: time and memory of `TrainPlan.draw(0)` (bert.data.plan).

Every rank lays out the whole epoch's order before run_start (`TrainLoader.plan_ahead`), from the length index
alone. This builds a length index of N synthetic phase-2 lengths (`bert.lengths.WIKI_PHASE2`) over 2,048 shards and
times the first draw for each strategy, with numpy's allocations traced (tracemalloc sees them; it slows the run):

    .venv/bin/python bench/plan_memory.py                      # phase 2: 156.7 M samples, 1024 ranks, 16 a node
    .venv/bin/python bench/plan_memory.py --samples 1e6 --strategies none   # a quick look

Writes results/bench/plan_memory.json. A DGX node runs 8 to 16 ranks: multiply the peak by that for the node.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
import tracemalloc
from pathlib import Path

import numpy as np

from bert.data.index import LengthIndex
from bert.data.plan import TrainPlan
from bert.lengths import WIKI_PHASE2

SHARDS = 2048


def synthetic_index(samples: int, seed: int = 0) -> LengthIndex:
    rng = np.random.default_rng(seed)
    sizes = np.full(SHARDS, samples // SHARDS)
    sizes[: samples - sizes.sum()] += 1
    return LengthIndex.from_lengths([Path(f"part_{i:05d}.hdf5") for i in range(SHARDS)],
                                    [WIKI_PHASE2.sample(int(n), rng) for n in sizes])


def measure(index: LengthIndex, world: int, per_node: int, local_batch: int, strategy: str) -> dict:
    tracemalloc.start()
    start = time.perf_counter()
    plan = TrainPlan(index, world, local_batch, per_node, strategy, seed=1, shuffle_buffer=10_000)
    plan.draw(0)
    seconds = time.perf_counter() - start
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"strategy": strategy, "seconds": round(seconds, 1), "numpy_peak_gb": round(peak / 1e9, 2),
            "kept_gb": round(kept / 1e9, 2), "id_dtype": str(plan.epoch(0).dtype)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=float, default=156.7e6, help="samples in the epoch (phase 2: 156.7 M)")
    p.add_argument("--world", type=int, default=1024)
    p.add_argument("--per-node", type=int, default=16)
    p.add_argument("--local-batch", type=int, default=16)
    p.add_argument("--strategies", nargs="+", default=["samsung", "global", "none"])
    p.add_argument("--json", type=Path, default=Path("results/bench/plan_memory.json"))
    args = p.parse_args(argv)
    index = synthetic_index(int(args.samples))
    rows = [measure(index, args.world, args.per_node, args.local_batch, s) for s in args.strategies]
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    print(f"{int(args.samples):,} samples, {args.world} ranks ({args.per_node} a node), local batch "
          f"{args.local_batch}; length index {index.lengths.nbytes / 1e9:.2f} GB ({index.lengths.dtype})")
    print(f"{'strategy':>10} {'s':>7} {'numpy peak GB':>14} {'kept GB':>8} {'ids':>6}")
    for r in rows:
        print(f"{r['strategy']:>10} {r['seconds']:>7.1f} {r['numpy_peak_gb']:>14.2f} {r['kept_gb']:>8.2f} "
              f"{r['id_dtype']:>6}")
    print(f"process peak RSS {rss_gb:.2f} GB (the index and every strategy's plan in one process)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"samples": int(args.samples), "world": args.world, "per_node": args.per_node,
                                     "local_batch": args.local_batch, "machine": platform.node(),
                                     "length_index_gb": round(index.lengths.nbytes / 1e9, 2),
                                     "peak_rss_gb": round(rss_gb, 2), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
