"""Where a step's CPU goes, thread by thread: flat DDP allreduce vs the same allreduce through a Python comm
hook vs GRAD_REDUCE=hierarchical (issue 10: hierarchical within 10 % of flat on 4 gloo processes).

bench/comm.py's setup (4 gloo processes as 2 nodes x 2, BERT-large / --scale gradients in DDP's buckets,
a trivial backward), the variants taking turns in every round. Every Reduce sums; where the mean's 1/W
goes is `install_clipping`'s `mean_at` (bert.dist.reduce):

    flat                  DDP's own allreduce: one C++ call per bucket, the division by the world fused into
                          DDP's copy of each gradient into its bucket
    flat-hook             `allreduce_sum` from a Python comm hook, the 1/W on the loss (the driver in fp32/bf16
                          with GRAD_CLIP=before/bucket): what the hook mechanism itself costs, a Python call and a
                          Future callback per bucket
    flat-hook-divided     the same, the 1/W on each bucket (`divided`, PRECISION=fp16): plus a pass over every
                          bucket, which DDP without a hook fuses into its copy
    hierarchical          the `HierarchicalSum` hook (bert/dist/hierarchical.py), the 1/W on the loss
    hierarchical-divided  the same, the 1/W on each bucket

Per variant, the mean over ranks of every thread's CPU per step (user + system, from /proc/self/task: the
training thread, gloo's TCP loop and per-group run loops, the hierarchical worker), the median step, and on
rank 0 the CPU of one hierarchical hook call (the training thread's share: step 1 issued, the bucket
queued for the worker). On a host whose cores are all busy the wall time follows the CPU time.

    .venv/bin/python bench/comm_profile.py            # writes results/bench/comm_profile.json
    .venv/bin/python bench/comm_profile.py --rounds 2 --steps 2 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import comm  # bench/comm.py: its model, scaled sizes and bucket cap
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bert.config import from_flat
from bert.dist.clip import install_clipping
from bert.dist.ddp import apply_ddp
from bert.dist.env import DistEnv
from bert.dist.reduce import allreduce_sum, build_reduce

ROOT = Path(__file__).resolve().parents[1]

# variant: (the Reduce's name, where the 1/W goes)
VARIANTS = {"flat": ("flat", "loss"), "flat-hook": ("allreduce_sum", "loss"),
            "flat-hook-divided": ("allreduce_sum", "bucket"), "hierarchical": ("hierarchical", "loss"),
            "hierarchical-divided": ("hierarchical", "bucket")}
TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=4, help="divide BERT-large's dimensions by this")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "comm_profile.json")
    return p.parse_args(argv)


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """{thread id: (its name as the kernel has it, user + system CPU seconds so far)} of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICKS)  # utime, stime
    return out


class HookTimer:
    """Wraps a Reduce; notes the calling thread's CPU nanoseconds of every call."""

    def __init__(self, reduce):
        self.reduce, self.cpu_ns = reduce, []

    def __call__(self, flat):
        start = time.thread_time_ns()
        fut = self.reduce(flat)
        self.cpu_ns.append(time.thread_time_ns() - start)
        return fut


def worker(rank: int, args: argparse.Namespace, shapes: list, cap_mb: float, store: str, out: str) -> None:
    torch.set_num_threads(1)
    world = 4
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    env = DistEnv(rank, world, rank % 2, 2, "localhost", 0)
    cfg = from_flat(grad_reduce="hierarchical", grad_buckets="ddp", bucket_cap_mb=cap_mb).dist
    hierarchical = HookTimer(build_reduce(cfg, env))
    reduces = {"flat": None, "allreduce_sum": allreduce_sum(), "hierarchical": hierarchical}
    labels = {threading.get_native_id(): "training thread"}
    cpu = {v: collections.Counter() for v in VARIANTS}
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            model = comm.Gradients(shapes, rank)
            wrapper = apply_ddp(model, cfg)
            reduce_name, mean_at = VARIANTS[name]
            clipper = install_clipping(wrapper, "none", 1.0, None, reduce=reduces[reduce_name], mean_at=mean_at)

            def step(wrapper=wrapper, model=model, factor=clipper.loss_factor) -> None:
                (wrapper() * factor).backward()
                model.zero_grad(set_to_none=True)

            for _ in range(2):  # DDP rebuilds its buckets in the second step
                step()
            hierarchical.cpu_ns.clear()
            if hierarchical.reduce._worker is not None:
                labels[hierarchical.reduce._worker.native_id] = "hierarchical worker"
            dist.barrier()
            before = thread_cpu_s()
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                step()
                wall[name].append(time.perf_counter() - start)
            for tid, (kernel_name, seconds) in thread_cpu_s().items():
                spent = seconds - before.get(tid, (None, 0.0))[1]
                cpu[name][labels.get(tid, kernel_name)] += spent / (args.steps * args.rounds)
            if name == "hierarchical" and rank == 0:
                hook_us = [ns / 1e3 for ns in hierarchical.cpu_ns]
            del wrapper, model, clipper
    gathered = [None] * world
    dist.all_gather_object(gathered, {"cpu": cpu, "wall": wall})
    if rank == 0:
        torch.save({"ranks": gathered, "hook_us": hook_us}, out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = comm.bucket_report(25.0)
    scaled = comm.meta_model(comm.scaled_config(args.scale))
    shapes = [tuple(p.shape) for p in scaled.parameters()]
    cap_mb = 25.0 * sum(p.numel() for p in scaled.parameters()) / report["params"]  # 37 buckets, as BERT-large
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(worker, args=(args, shapes, cap_mb, os.path.join(tmp, "store"), out), nprocs=4)
        raw = torch.load(out)
    ranks = raw["ranks"]
    result = {}
    for name in VARIANTS:
        threads: collections.Counter = collections.Counter()
        for r in ranks:
            for thread, seconds in r["cpu"][name].items():
                threads[thread] += seconds * 1e3 / len(ranks)
        steps = [s for r in ranks for s in r["wall"][name]]
        result[name] = {"median_step_ms": statistics.median(steps) * 1e3,
                        "cpu_ms_per_step_per_rank": sum(threads.values()),
                        "threads_cpu_ms_per_step": {k: v for k, v in threads.most_common() if v >= 0.05}}
    hook = raw["hook_us"]
    print(f"4 gloo processes as 2 nodes x 2, BERT-large / {args.scale}, DDP's buckets ({len(hook) // args.steps} "
          f"per step); {args.rounds} rounds x {args.steps} steps; {uptime_before}")
    for name, r in result.items():
        print(f"{name:<20} median step {r['median_step_ms']:7.1f} ms, CPU per step and rank "
              f"{r['cpu_ms_per_step_per_rank']:6.1f} ms "
              f"({r['cpu_ms_per_step_per_rank'] / result['flat']['cpu_ms_per_step_per_rank']:.2f}x flat):")
        for thread, ms in r["threads_cpu_ms_per_step"].items():
            print(f"    {thread:<22}{ms:7.1f} ms")
    print(f"hierarchical hook call (training thread, rank 0): median {statistics.median(hook):.0f} us CPU")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "setup": {"world": 4, "local_world": 2, "scale": args.scale, "bucket_cap_mb_scaled": cap_mb,
                  "rounds": args.rounds, "steps": args.steps, "uptime_before": uptime_before,
                  "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                  "cpu": "user + system seconds per thread from /proc/self/task, mean over the 4 ranks"},
        "variants": result,
        "hierarchical_hook_call_cpu_us": {"median": statistics.median(hook), "calls": len(hook)},
    }, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
