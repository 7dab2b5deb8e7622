"""Does the data loader hold up the training thread's kernel launches? `LOADER_WORKER` thread against process.

A compiled step's host work is mostly Python launching kernels (~1,000 a step: inductor's wrapper, the optimizer).
Each launch needs the interpreter lock, which a thread reading shards with h5py holds while it reads. This times
that host work beside the real loader: per step, the main thread dispatches `--ops` small torch ops on the CPU in
`--chunks` bursts (timed), sleeping `--gpu-ms` / chunks after each (a host that has filled the GPU's launch queue
waits for room, so its launches spread over the step), then takes the next batch. The loader reads the training
set through `TrainLoader` (random-token shards with the phase-2 length mix, `--batch` sequences per rank, balanced
by `samsung` over `--world` ranks, so a batch comes from many shards):

    .venv/bin/python bench/loader_gil.py                  # 400 shards of 1,000 samples, 96 sequences a step
    .venv/bin/python bench/loader_gil.py --steps 10 --shards 40   # a quick look

Variants: `none` (the bursts alone, batches made beforehand), `thread` (bert.data.prefetch), `process`
(bert.data.process_prefetch). Writes results/bench/loader_gil.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bert.data.pipeline import TrainLoader

ROOT = Path(__file__).resolve().parents[1]


def launch_burst(x: torch.Tensor, ops: int) -> float:
    """Milliseconds to dispatch `ops` small in-place ops (each one interpreter-to-dispatcher round trip)."""
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    return (time.perf_counter() - start) * 1e3


def run(data: Path, variant: str, args: argparse.Namespace) -> dict:
    loader = TrainLoader(data, args.batch, args.world, 0, min(args.world, 8), strategy="samsung", seed=1,
                         worker="process" if variant == "process" else "thread")
    x = torch.zeros(16)
    bursts, waits = [], []
    try:
        loader.plan_ahead()
        ready = [next(loader) for _ in range(args.steps)] if variant == "none" else None
        for step in range(args.steps):
            launches = 0.0
            for _ in range(args.chunks):
                launches += launch_burst(x, args.ops // args.chunks)
                time.sleep(args.gpu_ms / args.chunks / 1e3)
            bursts.append(launches)
            start = time.perf_counter()
            batch = ready[step] if ready else next(loader)
            waits.append((time.perf_counter() - start) * 1e3)
            assert batch.input_ids.numel() > 0
    finally:
        loader.close()
    b = np.array(bursts[1:])  # the first step's launches meet the loader's start
    return {"variant": variant, "launch_ms_median": round(float(np.median(b)), 2),
            "launch_ms_p90": round(float(np.percentile(b, 90)), 2), "launch_ms_max": round(float(b.max()), 2),
            "wait_for_batch_ms_median": round(float(np.median(waits[1:])), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=400)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--batch", type=int, default=96, help="sequences per rank per step")
    p.add_argument("--world", type=int, default=8, help="ranks the plan balances over (this is rank 0)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ops", type=int, default=1100, help="torch ops dispatched per step (the launch burst)")
    p.add_argument("--chunks", type=int, default=11, help="bursts the step's ops come in")
    p.add_argument("--gpu-ms", type=float, default=110.0, help="sleep per step, spread after the bursts")
    p.add_argument("--variants", nargs="+", default=["none", "thread", "process"],
                   choices=["none", "thread", "process"])
    p.add_argument("--data", type=Path, help="train_varlength/ shards already written; else written to a temp dir")
    p.add_argument("--json", type=Path, default=ROOT / "results" / "bench" / "loader_gil.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="loader_gil_") as tmp:
        data = args.data
        if data is None:
            sys.path.insert(0, str(ROOT / "data"))
            from make_random_shards import length_mix, write_shards

            write_shards(Path(tmp), args.shards * args.samples_per_shard, args.shards, 10, length_mix(5), 0)
            data = Path(tmp) / "train_varlength"
        rows = [run(data, v, args) for v in args.variants]
    print(f"{'loader':<10}{'launch ms median':>17}{'p90':>9}{'max':>9}{'wait for batch ms':>19}   ({args.ops} ops a "
          f"step in {args.chunks} bursts, {args.gpu_ms:g} ms of sleep, {args.batch} sequences)")
    for r in rows:
        print(f"{r['variant']:<10}{r['launch_ms_median']:>17.2f}{r['launch_ms_p90']:>9.2f}{r['launch_ms_max']:>9.2f}"
              f"{r['wait_for_batch_ms_median']:>19.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("data", "json")}
    args.json.write_text(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(),
                                     "load_average": os.getloadavg(), "settings": settings, "rows": rows},
                                    indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
