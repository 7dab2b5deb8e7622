"""Run under torchrun: each rank writes the sample ids of its first batches as JSON.

    python -m torch.distributed.run ... tests/multiproc/loader_ranks.py INPUT_DIR OUT_DIR STEPS STRATEGY LOCAL_BATCH
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from id_shards import batch_ids  # noqa: E402

from bert.data.pipeline import TrainLoader  # noqa: E402


def main() -> None:
    input_dir, out_dir, steps, strategy, local_batch = sys.argv[1:6]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("gloo")
    loader = TrainLoader(input_dir, int(local_batch), world, rank, per_node, strategy=strategy, seed=7,
                         shuffle_buffer=64)
    ids = [batch_ids(batch) for batch, _ in zip(loader, range(int(steps)))]
    loader.close()
    # The plan needs no collective; this one only checks that all ranks really ran as one job.
    everyone = [None] * world
    dist.all_gather_object(everyone, (rank, int(os.environ["LOCAL_RANK"])))
    record = {"rank": rank, "world": world, "per_node": per_node, "ids": ids, "group": everyone}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
