"""Step time of gradient clipping after vs before vs bucket-wise (Samsung [000] §5.3, Figure 9).

W processes (gloo on CPU; NCCL when there is one GPU per process) train copies of the same BERT
on the same random unpadded batches. Each process holds one DDP model per mode, and the modes
take turns in every repeat (interleaved, so a load change on the shared machine hits all modes
alike). Reported: median step time per mode and its ratio to `after`. Goal: bucket <= 1.05x
after; before visibly slower, since its allreduce cannot start before the backward pass ends.

    .venv/bin/python bench/clip.py                       # 2 gloo processes, writes results/bench/clip_cpu.json
    .venv/bin/python bench/clip.py --world 4 --repeats 7 --bucket-cap-mb 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.config import from_flat
from bert.dist.clip import Clipper, install_clipping
from bert.dist.ddp import apply_ddp
from bert.lengths import WIKI_PHASE2
from bert.model import BertConfig, BertForPreTraining
from bert.optim import build_optimizer, build_schedule
from bert.synthetic import random_batch

MODES = ("after", "before", "bucket")
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192, help="small, so the encoder (not the embedding) dominates")
    p.add_argument("--local-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--max-len", type=int, default=128, help="lengths: the Wikipedia mix, truncated here")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="default: results/bench/clip_<device>.json")
    return p.parse_args(argv)


NO_SCALING = torch.amp.GradScaler("cpu", enabled=False)  # fp32: unscale_ is a no-op


def step(ddp: DDP, clipper: Clipper, optimizer: torch.optim.Optimizer, batch) -> None:
    ddp(batch).loss.backward()
    clipper.before_step(optimizer, NO_SCALING)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def worker(rank: int, args: argparse.Namespace, store: str, result_path: str) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world)
    cfg = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                     num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden)
    runs = {}
    for mode in MODES:  # the driver's own builders, one config section each
        train = from_flat(bucket_cap_mb=args.bucket_cap_mb, grad_clip=mode, max_grad_norm=1.0, optimizer="lamb",
                          learning_rate=1e-4, max_steps=10**6, weight_decay_rate=0.01)
        torch.manual_seed(0)
        model = BertForPreTraining(cfg, device=device).to(device)
        ddp = apply_ddp(model, train.dist)
        optimizer = build_optimizer(model, train.optim)
        build_schedule(optimizer, train.optim)  # sets the LR (a device tensor) on the optimizer
        runs[mode] = (ddp, install_clipping(ddp, mode, train.optim.max_grad_norm), optimizer)
    lengths = [min(int(n), args.max_len) for n in WIKI_PHASE2.sample(args.local_batch, np.random.default_rng(rank))]
    batch = random_batch(lengths, seed=rank, vocab_size=cfg.vocab_size - 8).to(device)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:  # warm-up: DDP rebuilds its buckets in the second iteration
        for _ in range(3):
            step(*runs[mode], batch)
    for _ in range(args.repeats):
        for mode in MODES:
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(*runs[mode], batch)
            if cuda:
                torch.cuda.synchronize()
            times[mode].append((time.perf_counter() - start) / args.steps * 1e3)
    buckets = len(runs["bucket"][0].reducer._get_zeros_like_grad_buckets())
    if rank == 0:
        Path(result_path).write_text(json.dumps({"times_ms": times, "buckets": buckets, "device": str(device),
                                                 "params": sum(p.numel() for p in runs["after"][0].parameters())}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        load_before = os.getloadavg()
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), result_path), nprocs=args.world)
        raw = json.loads(Path(result_path).read_text())
    kind = "cuda" if raw["device"].startswith("cuda") else "cpu"
    medians = {m: statistics.median(raw["times_ms"][m]) for m in MODES}
    print(f"{args.world} {'NCCL' if kind == 'cuda' else 'gloo'} processes, {raw['params'] / 1e6:.1f}M parameters, "
          f"{raw['buckets']} DDP buckets, local batch {args.local_batch}, load {load_before[0]:.1f}")
    print(f"{'mode':<8}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'vs after':>10}")
    for m in MODES:
        ts = raw["times_ms"][m]
        print(f"{m:<8}{medians[m]:>11.1f}{min(ts):>9.1f}{max(ts):>9.1f}{medians[m] / medians['after']:>9.3f}x")
    out = args.out or ROOT / "results" / "bench" / f"clip_{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "setup": {**{k: v for k, v in vars(args).items() if k != "out"}, "buckets": raw["buckets"],
                  "params": raw["params"], "backend": "nccl" if kind == "cuda" else "gloo",
                  "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0]},
        "median_ms": medians,
        "ratio_to_after": {m: medians[m] / medians["after"] for m in MODES},
        "times_ms": raw["times_ms"],
    }, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
