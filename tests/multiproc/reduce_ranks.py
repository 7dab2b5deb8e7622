"""Run under torchrun: the hierarchical reduction with the node layout the launcher gives.

    python -m torch.distributed.run ... tests/multiproc/reduce_ranks.py OUT_DIR

The config is parsed from the real torchrun environment (so the parse-time node-size check sees
WORLD_SIZE/LOCAL_WORLD_SIZE) and the rank layout comes from `read_env`, as in the trainer.
Each rank writes its process groups and the reduced tensors as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bert.config import from_env_and_args
from bert.dist.env import read_env
from bert.dist.reduce import build_reduce

NUMEL = 1001  # odd: the node's shards are padded


def rank_values(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank), dtype=torch.float64) * (1 + rank)


def main() -> None:
    out_dir = sys.argv[1]
    required = ["--input_dir", "x", "--eval_dir", "x", "--bert_config_path", "tiny", "--train_batch_size", "1",
                "--learning_rate", "1", "--max_steps", "1"]
    env = read_env()
    dist.init_process_group("gloo")
    record = {"rank": env.rank}
    for comm in ("fp32", "bf16"):
        cfg = from_env_and_args([*required, "--grad_reduce", "hierarchical", "--grad_comm_dtype", comm])
        reduce = build_reduce(cfg.dist, env)
        record[comm] = reduce(rank_values(env.rank)).wait().tolist()  # the sum (the mean's 1/W comes with the loss)
        if comm == "fp32":
            record["intra"] = dist.get_process_group_ranks(reduce.scatter_group)
            record["inter"] = dist.get_process_group_ranks(reduce.inter_group)
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
