"""Where the sharded masters' all-gather is waited for (OPTIMIZER_SHARD_GATHER, bert/optim/gather_ahead.py): the
time a step stands still for it.

Measured in 2 gloo processes (one thread each) on BERT `base` with bf16 weights, fp32 masters in B blocks, one
batch of phase-2 lengths a rank per step, through DDP with the reduce-scatters started from the backward. gloo's
`wait` holds the host until the collective is done, so the host time spent in the all-gather's waits is the time
the step could not compute:
  * `step`: the all-gather inside `optimizer.step`, every block at once;
  * `forward`: `step` starts the blocks' all-gathers and returns; each unit of the next forward waits for its own
    blocks (the sum of those waits is reported).
Per row: the median over the timed steps of the step's wall time (forward, backward, update) and of the host time
in the all-gather's waits; `hidden` is the share of the `step` row's waits (the whole collectives) that the
`forward` row did not wait for.

    .venv/bin/python bench/shard_gather.py     # writes results/bench/shard_gather.json

On the 2-core VM each rank's gloo thread shares a core with its compute: the all-gather's copies then slow the
forward they overlap, and the step's wall time (7.6 to 9.1 s for BERT base, about 3 % of it the all-gather) moves
more from run to run than the waits could move it. The waits are the measure here; the figures are not a GPU's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.dist.clip import install_clipping
from bert.dist.reduce import mean_placement
from bert.dist.shard_plan import FlatPlan
from bert.lengths import WIKI_PHASE2
from bert.model import BertConfig, BertForPreTraining
from bert.optim.gather_ahead import gather_in_forward, settle
from bert.optim.param_groups import decay_groups
from bert.optim.sharded import local_only
from bert.optim.sharded_master import ShardedMasters
from bert.synthetic import random_batch

ROOT = Path(__file__).resolve().parents[1]


def run(rank: int, initial: BertForPreTraining, gather: str, blocks: int, steps: int, sequences: int) -> dict:
    """One configuration on this rank, from a copy of `initial`: per timed step, the wall time and the host time in
    all-gather waits."""
    model = copy.deepcopy(initial)
    opt = ShardedMasters(decay_groups(model, 0.01), torch.bfloat16, torch.tensor(1e-4), blocks=blocks,
                         plan=FlatPlan(), gather=gather)
    ddp = DDP(model)
    opt.attach(ddp)
    clipper = install_clipping(ddp, "none", 1.0, None, reduce=local_only(), mean_at=mean_placement("bf16", True))
    if gather == "forward":
        gather_in_forward(model, opt)
    waited = [0.0]
    wait_gathered, all_gather = opt.wait_gathered, opt.plan.all_gather

    def timed_wait(blocks=None):
        start = time.perf_counter()
        wait_gathered(blocks)
        waited[0] += time.perf_counter() - start

    def timed_gather(block, async_op=False):  # `step`: the whole collective is a wait
        start = time.perf_counter()
        work = all_gather(block, async_op)
        waited[0] += 0.0 if async_op else time.perf_counter() - start
        return work

    opt.wait_gathered, opt.plan.all_gather = timed_wait, timed_gather
    rng = np.random.default_rng(rank)
    rows = []
    lengths = [[int(n) for n in WIKI_PHASE2.sample(sequences, rng)] for _ in range(steps + 1)]
    batches = [random_batch(n, seed=100 * rank + i, vocab_size=model.config.real_vocab_size)
               for i, n in enumerate(lengths)]
    dist.barrier()  # once: a barrier between steps would wait for the all-gathers in flight, outside the clock
    start = time.perf_counter()
    for step, batch in enumerate(batches):  # the first is a warm-up; a step's time runs to the next one's start
        waited[0] = 0.0
        loss = ddp(batch).loss
        (loss * clipper.loss_factor).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        rows.append({"step_s": now - start, "waited_s": waited[0], "tokens": sum(lengths[step])})
        start = now
    settle(opt)  # the last step's all-gathers, which a next forward would have waited for (off the clock)
    return {"gather": gather, "blocks": blocks, "gathered_bytes": opt.low.numel() * 2, "steps": rows[1:]}


def worker(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)  # one initialisation, copied by each configuration: the same start for all, at less cost
    initial = BertForPreTraining(BertConfig.load(args.config).with_dropout(0.0), attention="padded")
    rows = [run(rank, initial, gather, blocks, args.steps, args.sequences)
            for blocks in args.blocks for gather in ("step", "forward")]
    torch.save(rows, f"{out}.{rank}")
    dist.destroy_process_group()


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="base")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=4, help="sequences a rank per step")
    parser.add_argument("--json", default=str(ROOT / "results" / "bench" / "shard_gather.json"))
    args = parser.parse_args(argv)
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(worker, args=(world, args, os.path.join(tmp, "store"), out), nprocs=world)
        ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    table = []
    for i, row in enumerate(ranks[0]):
        per_rank = [rows[i]["steps"] for rows in ranks]
        table.append({"gather": row["gather"], "blocks": row["blocks"], "gathered_MiB": row["gathered_bytes"] / 2**20,
                      "step_ms": 1e3 * median([s["step_s"] for steps in per_rank for s in steps]),
                      "waited_ms": 1e3 * median([s["waited_s"] for steps in per_rank for s in steps])})
    for row in table:  # the same collectives waited for at once: their whole time
        whole = next(r["waited_ms"] for r in table if r["blocks"] == row["blocks"] and r["gather"] == "step")
        row["hidden_share"] = 1 - row["waited_ms"] / whole if whole else 0.0
    print(f"BERT {args.config}, 2 gloo ranks of one thread, bf16 weights, {args.sequences} sequences a rank a step "
          f"(phase-2 lengths), median of {args.steps} steps over both ranks")
    print(f"{'gather':>8} {'blocks':>6} {'MiB':>6} {'step ms':>9} {'waited ms':>10} {'hidden':>7}")
    for r in table:
        print(f"{r['gather']:>8} {r['blocks']:>6} {r['gathered_MiB']:>6.0f} {r['step_ms']:>9.0f} "
              f"{r['waited_ms']:>10.1f} {r['hidden_share']:>7.0%}")
    print("(waited: host time in the all-gather's waits, which gloo holds; the 2-core VM, not a GPU)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "what": "OPTIMIZER_SHARD_GATHER step / forward: step wall time and host time in the all-gather's waits",
        "machine": "CPU (2-core VM)", "command": "python bench/shard_gather.py",
        "config": args.config, "world": world, "sequences": args.sequences, "steps": args.steps,
        "rows": table, "by_rank": ranks,
    }, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
