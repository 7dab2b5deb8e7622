"""Reduction time of GRAD_REDUCE=flat vs hierarchical, in fp32 and bf16 (Herring [003] §III-A, TPU [004] §3.3).

W gloo processes on one host, laid out as nodes of --node ranks (simulated: loopback is the only link, so
"intra" and "inter" cost the same here; what is measured is the algorithms' step count and overhead).
Every timed round issues all buckets back to back, as DDP's hooks do during the backward pass, and waits
for all of them; the strategies take turns in every repeat so that load on the shared machine hits all
alike. Reported: median round time per strategy and its ratio to flat fp32, and the CPU seconds all ranks
spent (every thread), which is the more stable figure on an oversubscribed machine.

    .venv/bin/python bench/grad_reduce.py     # 4 processes = 2 nodes x 2, results/bench/grad_reduce_cpu.json
    .venv/bin/python bench/grad_reduce.py --bucket-mb 1 --buckets 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bert.config import from_flat
from bert.dist.env import DistEnv
from bert.dist.reduce import allreduce_sum, build_reduce

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {"flat": ("flat", "fp32"), "hierarchical": ("hierarchical", "fp32"),
              "flat_bf16": ("flat", "bf16"), "hierarchical_bf16": ("hierarchical", "bf16")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--node", type=int, default=2, help="ranks per simulated node")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="fp32 MB per bucket")
    p.add_argument("--buckets", type=int, default=8, help="buckets per round (one backward pass)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--odd", action="store_true", help="bucket sizes not divisible by the node size (padded)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "grad_reduce_cpu.json")
    return p.parse_args(argv)


def worker(rank: int, args: argparse.Namespace, store: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world)
    env = DistEnv(rank, args.world, rank % args.node, args.node, "localhost", 0)
    # sums, as every Reduce on a hook path where the loss carries the 1/W (the driver in fp32/bf16)
    reduces = {name: build_reduce(from_flat(grad_reduce=s, grad_comm_dtype=c).dist, env) or allreduce_sum()
               for name, (s, c) in STRATEGIES.items()}
    numel = int(args.bucket_mb * 2**20 / 4)
    buckets = [torch.randn(numel + (b if args.odd else 0)) for b in range(args.buckets)]
    times: dict[str, list[float]] = {name: [] for name in reduces}
    cpu: dict[str, list[float]] = {name: [] for name in reduces}
    for repeat in range(args.repeats + 1):  # the first round warms up connections and is dropped
        for name, reduce in reduces.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for fut in [reduce(b) for b in buckets]:
                fut.wait()
            elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu])
            dist.all_reduce(elapsed[:1], op=dist.ReduceOp.MAX)  # a round ends when the slowest rank has its sum
            dist.all_reduce(elapsed[1:])  # CPU seconds of all ranks (all threads): the work, whatever the load
            if repeat:
                times[name].append(float(elapsed[0]))
                cpu[name].append(float(elapsed[1]))
    if rank == 0:
        queue.put((times, cpu))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), queue), nprocs=args.world)
    times, cpu = queue.get()
    flat, flat_cpu = statistics.median(times["flat"]), statistics.median(cpu["flat"])
    rows = {name: {"median_s": statistics.median(t), "ratio_to_flat": statistics.median(t) / flat,
                   "cpu_s": statistics.median(cpu[name]), "cpu_ratio_to_flat": statistics.median(cpu[name]) / flat_cpu,
                   "all_s": t} for name, t in times.items()}
    print(f"{args.world} gloo processes = {args.world // args.node} nodes x {args.node}, "
          f"{args.buckets} buckets x {args.bucket_mb:g} MB, median of {args.repeats}")
    print(f"{'strategy':<20}{'round (ms)':>12}{'vs flat':>10}{'CPU (ms)':>12}{'vs flat':>10}")
    for name, row in rows.items():
        print(f"{name:<20}{1e3 * row['median_s']:>12.1f}{row['ratio_to_flat']:>10.2f}"
              f"{1e3 * row['cpu_s']:>12.1f}{row['cpu_ratio_to_flat']:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    load = {"load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    args.out.write_text(json.dumps({"setup": setup, "cpus": os.cpu_count(), **load, "strategies": rows}, indent=1))


if __name__ == "__main__":
    main()
