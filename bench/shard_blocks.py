"""When each block of the sharded masters' gradient leaves during the backward (OPTIMIZER_SHARD_BLOCKS).

With B > 1 blocks, a block's reduce-scatter starts once every gradient in it is accumulated
(bert.optim.sharded_master). This runs one eager backward of a named BERT through DDP (one gloo rank, a batch of 4
sequences) and records, for each block, after how many of the model's gradients it started: the blocks that start
before the last gradient travel while the backward computes the rest. The order of the gradients, not their
timing, is what this measures (the CPU's backward is not the GPU's).

    .venv/bin/python bench/shard_blocks.py            # BERT-large and base, 2 and 5 blocks
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.model import BertConfig, BertForPreTraining
from bert.optim.param_groups import decay_groups
from bert.optim.sharded_master import ShardedMasters
from bert.train.warmup import warmup_batch

ROOT = Path(__file__).resolve().parents[1]


def launches(name: str, blocks: int) -> dict:
    """One backward: (block, gradients accumulated when it started), in the order the blocks started."""
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.load(name), attention="padded")
    opt = ShardedMasters(decay_groups(model, 0.01), torch.bfloat16, torch.tensor(1e-3), blocks=blocks)
    ddp = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt.attach(ddp)
    ready, started = [0], []
    for p in opt.params:  # registered after attach's hooks, so it counts a gradient once they have seen it
        p.register_post_accumulate_grad_hook(lambda p: ready.__setitem__(0, ready[0] + 1))
    reduce_block = opt._reduce_block

    def record(b: int, async_op: bool = False):
        started.append((b, ready[0] + 1))  # the gradient whose hook starts it is the (ready + 1)-th
        return reduce_block(b, async_op)

    opt._reduce_block = record
    ddp(warmup_batch(4, 64, torch.device("cpu"), model.config.vocab_size)).loss.backward()
    total = len(opt.params)
    return {"model": name, "blocks": blocks, "gradients": total, "started": started,
            "before_the_end": sum(at < total for _, at in started)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["large", "base"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 5])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "shard_blocks.json")
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    rows = [launches(name, b) for name in args.models for b in args.blocks]
    print(f"{'model':8} {'blocks':>6} {'gradients':>9} {'started before the end':>23}  block (after n gradients)")
    for r in rows:
        order = ", ".join(f"{b} ({at})" for b, at in r["started"])
        print(f"{r['model']:8} {r['blocks']:>6} {r['gradients']:>9} {r['before_the_end']:>23}  {order}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": __doc__.splitlines()[0], "command": "python bench/shard_blocks.py",
                                    "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
