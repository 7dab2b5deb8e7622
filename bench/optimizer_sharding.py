"""Optimizer-state memory per rank with and without weight-update sharding (TPU [004] §3.2).

Two parts:
  * computed for BERT-large's parameter shapes at world sizes 1, 2, 3, 4, 8: the elements each rank
    updates, its LAMB/AdamW state (exp_avg + exp_avg_sq, fp32), the sharded update's work buffers, and
    the bytes each rank sends per step (ring collectives) for allreduce vs reduce-scatter + all-gather;
  * measured at world 3 (gloo) on the `tiny` BERT: the bytes of the state tensors each rank's optimizer
    actually holds after one step, sharded and unsharded, for LAMB and AdamW; and under MASTER_WEIGHTS=1
    (bf16 model, flat LAMB, bert.optim.sharded_master) every buffer the optimizer keeps (fp32 masters, moments,
    gradient; the sharded one's bf16 gradient buffers) and the step's time per rank on the host clock.

    .venv/bin/python bench/optimizer_sharding.py       # writes results/bench/optimizer_sharding.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model.pretraining import shapes_only
from bert.optim import build_optimizer, build_schedule
from bert.optim.param_groups import decay_groups
from bert.optim.sharded import ShardedOptimizer
from bert.optim.sharded_master import ShardedMasters

ROOT = Path(__file__).resolve().parents[1]
FP32, BF16 = 4, 2
MiB = 2**20


def shapes(name: str) -> tuple[int, int]:
    """(trainable elements, tensors with weight decay) of a named BERT, built on the meta device."""
    model = shapes_only(BertConfig.load(name))
    decay, _ = decay_groups(model, 0.01)
    return sum(p.numel() for p in model.parameters() if p.requires_grad), len(decay["params"])


def computed(elements: int, decay_tensors: int, world: int) -> dict:
    shard = -(-elements // world)
    ring = (world - 1) / world
    return {
        **computed_masters(elements, world),
        "world": world,
        "updated_elements_per_rank": shard,
        "state_MiB_unsharded": 2 * elements * FP32 / MiB,
        "state_MiB_sharded": 2 * shard * FP32 / MiB,
        "kept_buffer_MiB_sharded": shard * FP32 / MiB,  # the gradient/weight shard
        "step_temporary_MiB_sharded": world * shard * FP32 / MiB,  # flat gradient/weights, inside step() only
        "sent_MiB_allreduce": 2 * ring * elements * FP32 / MiB,
        "sent_MiB_reduce_scatter_all_gather": 2 * ring * elements * FP32 / MiB,
        "sent_bytes_lamb_norms": 2 * ring * 2 * decay_tensors * 8,  # 2 float64 per tensor with decay
    }


def computed_masters(elements: int, world: int) -> dict:
    """MASTER_WEIGHTS=1, flat LAMB: what the optimizer keeps besides the bf16 model (the flat layout's row padding
    left out), and the bytes each rank sends: bf16 gradients either way."""
    shard = -(-elements // world)
    ring = (world - 1) / world
    return {
        "master_kept_MiB_unsharded": 4 * elements * FP32 / MiB,  # masters, m, v, the fp32 gradient
        "master_kept_MiB_sharded": (4 * shard * FP32 + elements * BF16 + shard * BF16) / MiB,  # + bf16 grad buffers
        "master_sent_MiB": 2 * ring * elements * BF16 / MiB,  # allreduce, or reduce-scatter + all-gather
    }


def master_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every buffer a master-weights optimizer keeps between steps."""
    if isinstance(optimizer, ShardedMasters):
        kept = [optimizer.masters, optimizer.grad, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.low_grad,
                optimizer.grad_shard]
    else:
        inner = optimizer.inner
        kept = [inner.weights, inner.grad, inner.exp_avg, inner.exp_avg_sq]
    return sum(t.numel() * t.element_size() for t in kept)


def master_row(sharding: bool, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.load("tiny"), attention="padded")
    cfg = from_flat(learning_rate=1e-3, max_steps=10, optimizer_sharding=sharding, master_weights=True,
                    precision="bf16", optimizer_layout="flat").optim
    opt = build_optimizer(model, cfg, torch.bfloat16)
    build_schedule(opt, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    name = f"lamb_master_{'sharded' if sharding else 'unsharded'}"
    return {f"{name}_kept_bytes": master_bytes(opt), f"{name}_step_ms": round((time.perf_counter() - start) / steps
                                                                                * 1e3, 1)}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    row = {}
    for optimizer in ("lamb", "adam"):
        for sharding in (False, True):
            torch.manual_seed(0)
            model = BertForPreTraining(BertConfig.load("tiny"), attention="padded")
            cfg = from_flat(learning_rate=1e-3, max_steps=10, optimizer=optimizer, optimizer_sharding=sharding).optim
            opt = build_optimizer(model, cfg)
            build_schedule(opt, cfg)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
            row[f"{optimizer}_{'sharded' if sharding else 'unsharded'}_state_bytes"] = state_bytes(opt)
    for sharding in (False, True):
        row.update(master_row(sharding))
    torch.save(row, f"{out}.{rank}")
    dist.destroy_process_group()


def measured(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row")
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), out), nprocs=world)
        return [{"rank": r, **torch.load(f"{out}.{r}")} for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--measure-world", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "results" / "bench" / "optimizer_sharding.json"))
    args = parser.parse_args()

    elements, decay_tensors = shapes("large")
    table = [computed(elements, decay_tensors, w) for w in args.worlds]
    print(f"BERT-large: {elements:,} trainable elements, {decay_tensors} tensors with weight decay")
    print(f"{'world':>5} {'state MiB':>10} {'sharded':>9} {'+shard':>7} {'in step':>8} {'sent MiB':>9} {'RS+AG':>7} "
          f"{'norms B':>8}")
    for r in table:
        print(f"{r['world']:>5} {r['state_MiB_unsharded']:>10.1f} {r['state_MiB_sharded']:>9.1f} "
              f"{r['kept_buffer_MiB_sharded']:>7.1f} {r['step_temporary_MiB_sharded']:>8.1f} "
              f"{r['sent_MiB_allreduce']:>9.1f} "
              f"{r['sent_MiB_reduce_scatter_all_gather']:>7.1f} {r['sent_bytes_lamb_norms']:>8.0f}")
    print("MASTER_WEIGHTS=1 (bf16 model, flat LAMB): what the optimizer keeps, MiB per rank, and bf16 MiB sent")
    print(f"{'world':>5} {'unsharded':>10} {'sharded':>9} {'sent':>7}")
    for r in table:
        print(f"{r['world']:>5} {r['master_kept_MiB_unsharded']:>10.1f} {r['master_kept_MiB_sharded']:>9.1f} "
              f"{r['master_sent_MiB']:>7.1f}")
    rows = measured(args.measure_world)
    tiny, _ = shapes("tiny")
    print(f"measured, tiny BERT ({tiny:,} elements), world {args.measure_world}: optimizer-state bytes per rank")
    for r in rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in r.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "what": "optimizer state per rank: exp_avg + exp_avg_sq (fp32) for LAMB/AdamW, unsharded vs "
                "OPTIMIZER_SHARDING=1; bytes sent per rank per step with ring collectives",
        "command": "python bench/optimizer_sharding.py",
        "bert_large": {"elements": elements, "decay_tensors": decay_tensors, "by_world": table},
        "measured_tiny": {"elements": tiny, "world": args.measure_world, "by_rank": rows},
    }, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
