"""The sharded masters' three plans (OPTIMIZER_SHARD_PLAN, bert/dist/shard_plan.py): bytes, ring steps, memory.

Two parts:
  * computed for BERT-large (bf16 gradients, S bytes) on R nodes of 8 GPUs: per plan, the bf16 bytes each rank sends
    per step, the bytes that leave each node over the network, the steps of the rings (a latency each: one ring
    over all N ranks takes N - 1 per collective), and the fp32 state each rank keeps (masters, gradient and LAMB's
    two moments, 16 bytes a parameter over the ranks that share one copy). The flat plan's ring is taken as placed
    node by node, so R of its N hops cross the network;
  * measured in 4 gloo processes taken as 2 nodes of 2 ranks, BERT `tiny`, bf16 model, 3 steps: the size of every
    collective each plan issues (wrapping the plan's collectives), turned into the bytes a ring sends, per group;
    the fp32 buffers each rank's optimizer keeps; the host time of a step; and the largest difference of the
    masters from the flat plan's after the 3 steps, beside the same for an unsharded run whose gradients are
    all-reduced (each collective rounds its bf16 partial sums in its own order: the yardstick for that rounding).

    .venv/bin/python bench/shard_plans.py     # writes results/bench/shard_plans.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bert.dist.shard_plan as shard_plan
from bert.config import from_flat
from bert.dist.shard_plan import SHARD_PLANS, build_shard_plan
from bert.model import BertConfig, BertForPreTraining
from bert.model.pretraining import shapes_only
from bert.optim import build_optimizer, build_schedule
from bert.optim.master import fp32_weights
from bert.optim.param_groups import decay_groups

ROOT = Path(__file__).resolve().parents[1]
MiB, BF16, FP32_KEPT = 2**20, 2, 16  # fp32 masters, gradient, exp_avg, exp_avg_sq


def computed(params: int, nodes: int, gpus: int, plan: str) -> dict:
    """Per rank and per node, one step of `plan` on `params` bf16 gradients (ring collectives)."""
    n, s = nodes * gpus, params * BF16
    if plan == "flat":  # reduce-scatter + all-gather over one ring of n ranks
        sent, network, steps, owners = 2 * (n - 1) / n * s, 2 * (n - 1) / n * s if nodes > 1 else 0.0, 2 * (n - 1), n
    else:  # inside the node: reduce-scatter + all-gather of s; across: RS + AG (2d) or an allreduce (node) of s/g
        across = 2 * (nodes - 1) / nodes * s / gpus
        sent, network = 2 * (gpus - 1) / gpus * s + across, across * gpus
        steps, owners = 2 * (gpus - 1) + 2 * (nodes - 1), n if plan == "2d" else gpus
    return {"plan": plan, "nodes": nodes, "gpus": gpus, "sent_MiB_per_rank": sent / MiB,
            "network_MiB_per_node": network / MiB, "ring_steps": steps,
            "fp32_kept_MiB_per_rank": FP32_KEPT * params / owners / MiB}


class Recorder:
    """Wraps the plan module's collectives: (group kind, elements sent by a ring) per call."""

    def __init__(self, plan):
        self.plan, self.calls = plan, []

    def kind(self, group) -> str:
        for name in ("node_group", "net_group"):
            if group is not None and group is getattr(self.plan, name, None):
                return name.removesuffix("_group")
        return "world"

    def record(self, group, elements: float) -> None:
        self.calls.append((self.kind(group), elements))

    def install(self) -> None:
        rs, ag, ar = shard_plan.reduce_scatter_single, shard_plan.all_gather_single, dist.all_reduce
        size = dist.get_world_size

        def reduce_scatter(out, inp, group=None, async_op=False):
            self.record(group, (size(group) - 1) * out.numel())
            return rs(out, inp, group=group, async_op=async_op)

        def all_gather(out, inp, group=None, async_op=False):
            self.record(group, (size(group) - 1) * inp.numel())
            return ag(out, inp, group=group, async_op=async_op)

        class Dist:  # the module's `dist` with its allreduce counted
            def __getattr__(self, name):
                return getattr(dist, name)

            @staticmethod
            def all_reduce(t, group=None, **kw):
                g = size(group)
                recorder.record(group, 2 * (g - 1) / g * t.numel())
                return ar(t, group=group, **kw)

        recorder = self
        shard_plan.reduce_scatter_single, shard_plan.all_gather_single, shard_plan.dist = reduce_scatter, all_gather, \
            Dist()


def worker(rank: int, world: int, node_size: int, steps: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = []
    originals = shard_plan.reduce_scatter_single, shard_plan.all_gather_single, shard_plan.dist
    initial = initial_model()
    for name in SHARD_PLANS:
        model = copy.deepcopy(initial)
        cfg = from_flat(learning_rate=1e-3, max_steps=10, optimizer_sharding=True, master_weights=True,
                        precision="bf16", optimizer_layout="flat", optimizer_shard_plan=name).optim
        plan = build_shard_plan(name, node_size)
        opt = build_optimizer(model, cfg, torch.bfloat16, plan)
        build_schedule(opt, cfg)
        recorder = Recorder(plan)
        recorder.install()
        seconds = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * rank + step)
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            seconds.append(time.perf_counter() - start)
        shard_plan.reduce_scatter_single, shard_plan.all_gather_single, shard_plan.dist = originals
        sent = {}
        for kind, elements in recorder.calls:
            sent[kind] = sent.get(kind, 0.0) + elements * BF16 / steps
        with fp32_weights(opt):
            masters = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        rows.append({"plan": name, "owner": plan.owner, "owners": plan.owners,
                     "sent_bytes_per_step": {k: round(v) for k, v in sorted(sent.items())},
                     "fp32_kept_bytes": sum(t.numel() * 4 for t in (opt.masters, opt.grad, opt.exp_avg,
                                                                    opt.exp_avg_sq)),
                     "gradient_bytes": opt.low_grad.numel() * BF16,
                     "step_ms_median": round(sorted(seconds)[len(seconds) // 2] * 1e3, 2), "masters": masters})
    rows.append(unsharded_row(initial, rank, world, steps))
    flat = rows[0]["masters"]
    for row in rows:
        row["max_master_diff_vs_flat"] = (row.pop("masters") - flat).abs().max().item()
    torch.save(rows, f"{out}.{rank}")
    dist.destroy_process_group()


def initial_model() -> BertForPreTraining:
    """BERT tiny as every run starts it: each takes a copy (initialising it costs more host time than the steps)."""
    torch.manual_seed(0)
    return BertForPreTraining(BertConfig.load("tiny"), attention="padded")


def unsharded_row(initial: BertForPreTraining, rank: int, world: int, steps: int) -> dict:
    """The yardstick for the masters' differences: no sharding, each bf16 gradient all-reduced (another summation
    order again) and divided, then the unsharded flat update (MasterWeights over FlatLamb)."""
    model = copy.deepcopy(initial)
    cfg = from_flat(learning_rate=1e-3, max_steps=10, master_weights=True, precision="bf16",
                    optimizer_layout="flat").optim
    opt = build_optimizer(model, cfg, torch.bfloat16)
    build_schedule(opt, cfg)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
    with fp32_weights(opt):
        masters = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return {"plan": "unsharded allreduce", "owner": None, "owners": None, "sent_bytes_per_step": {},
            "fp32_kept_bytes": None, "gradient_bytes": None, "step_ms_median": None, "masters": masters}


def measured(world: int = 4, node_size: int = 2, steps: int = 3) -> list[list[dict]]:
    """Each rank's rows (one per plan)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(worker, args=(world, node_size, steps, os.path.join(tmp, "store"), out), nprocs=world)
        return [torch.load(f"{out}.{r}") for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "results" / "bench" / "shard_plans.json"))
    args = parser.parse_args(argv)

    model = shapes_only(BertConfig.load("large"))
    params = sum(p.numel() for g in decay_groups(model, 0.01) for p in g["params"])
    table = [computed(params, nodes, 8, plan) for nodes in args.nodes for plan in SHARD_PLANS]
    print(f"BERT-large, {params:,} parameters, bf16 gradients; nodes of 8 GPUs; per step")
    print(f"{'nodes':>5} {'plan':>5} {'sent MiB/rank':>14} {'network MiB/node':>17} {'ring steps':>11} "
          f"{'fp32 MiB/rank':>14}")
    for r in table:
        print(f"{r['nodes']:>5} {r['plan']:>5} {r['sent_MiB_per_rank']:>14.0f} {r['network_MiB_per_node']:>17.0f} "
              f"{r['ring_steps']:>11} {r['fp32_kept_MiB_per_rank']:>14.1f}")
    ranks = measured(steps=args.steps)
    print("measured: BERT tiny, 4 gloo ranks as 2 nodes of 2, bf16 model, bytes a ring sends per rank per step")
    print(f"{'rank':>4} {'plan':>5} {'owner':>5} {'world B':>9} {'node B':>9} {'network B':>10} {'fp32 kept B':>12} "
          f"{'step ms':>8} {'vs flat':>9}")
    for rank, rows in enumerate(ranks):
        for r in rows[:-1]:
            sent = r["sent_bytes_per_step"]
            print(f"{rank:>4} {r['plan']:>5} {r['owner']:>5} {sent.get('world', 0):>9} {sent.get('node', 0):>9} "
                  f"{sent.get('net', 0):>10} {r['fp32_kept_bytes']:>12} {r['step_ms_median']:>8} "
                  f"{r['max_master_diff_vs_flat']:>9.1e}")
    print("the masters' largest difference from the flat plan's, after the bf16 sums in another order: "
          + ", ".join(f"{r['plan']} {max(rows[i]['max_master_diff_vs_flat'] for rows in ranks):.1e}"
                      for i, r in enumerate(ranks[0]) if i))
    print("(step ms: the host clock of 4 processes on the 2-core VM, not a speed; gloo)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "what": "OPTIMIZER_SHARD_PLAN flat / 2d / node: computed for BERT-large, measured for BERT tiny on 4 gloo "
                "ranks as 2 nodes of 2 (collective sizes recorded from the plan's calls, ring bytes per rank per step)",
        "machine": "CPU (2-core VM)", "command": "python bench/shard_plans.py",
        "bert_large": {"params": params, "gpus_per_node": 8, "rows": table},
        "measured_tiny": {"world": 4, "node_size": 2, "steps": args.steps, "by_rank": ranks},
    }, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
