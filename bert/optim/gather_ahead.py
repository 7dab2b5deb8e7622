"""`OPTIMIZER_SHARD_GATHER=forward`: the sharded masters' all-gather of the updated weights overlaps the next forward.

Weight-update sharding ends each step with an all-gather: every rank's slice of the updated weights to every rank
(bert.optim.sharded_master, step 5). Waited for in the step, it is exposed: no rank computes while the weights
travel. The TPU paper broadcasts the updated shard "in the next step" ([004] §3.2, after Xu et al., "Automatic
cross-replica sharding of weight update in data-parallel training", 2020), where it can hide behind the forward:
the flat layout runs in the model's order, so the first layers' weights arrive in the first blocks, and the
forward can start on them while the later blocks are on the way.

So `step` starts each block's all-gather and returns (in block order, the order the forward reads them), and a
forward pre-hook on each unit of the model (the embeddings, each encoder layer, the pooler, the two heads) waits
for the blocks holding that unit's parameters, before its first read of them. On a GPU the wait is the compute
stream waiting on the collective's (no host sync); on the CPU, gloo's wait holds the host. The hooks are
`torch.compiler.disable`d: under COMPILE, dynamo calls them eagerly between the units, in order, each a graph
break, so COMPILE_SCOPE=model is cut at every unit as `layers` is (nothing fuses across two units either way).

Everything else that touches the model's weights waits for what is left first: the next `step` (before it writes
this rank's rows), `masters_in_model` (checkpoints), and `settle` before an evaluation (a rank with no eval batch
runs no forward, and under the 2d plan on gloo a wait issues the second stage: every rank must wait alike) and at
the end of training.

With one block the first unit waits for the whole all-gather, which is the step's wait moved later; the config
therefore asks for OPTIMIZER_SHARD_BLOCKS > 1. The blocks are the reduce-scatter's: B blocks of the flat layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from bert.model.pretraining import BertForPreTraining
from bert.optim.sharded_master import ShardedMasters


def forward_units(model: BertForPreTraining) -> list[nn.Module]:
    """The modules the forward calls one after another, whose parameters together are the model's."""
    bert, cls = model.bert, model.cls
    return [bert.embeddings, *bert.encoder.layer, bert.pooler, cls.predictions, cls.seq_relationship]


def unit_blocks(units: list[nn.Module], optimizer: ShardedMasters) -> list[list[int]]:
    """For each unit, the layout blocks its parameters lie in. Each unit waits for all of its own: a block an
    earlier unit waited for is no second wait, and which unit runs first is the forward's business (the MLM head
    runs before the pooler; the tied word embeddings are read by the embeddings and the MLM head)."""
    blocks_of = {id(p): optimizer.blocks_of[i] for i, p in enumerate(optimizer.params)}
    covered = {id(p) for unit in units for p in unit.parameters()}
    missing = [i for i, p in enumerate(optimizer.params) if id(p) not in covered]
    if missing:
        raise ValueError(f"OPTIMIZER_SHARD_GATHER=forward: {len(missing)} parameters lie in no forward unit, so "
                         "no hook would wait for their all-gather")
    return [sorted({b for p in unit.parameters() for b in blocks_of[id(p)]}) for unit in units]


def gather_in_forward(model: BertForPreTraining, optimizer: ShardedMasters) -> list[RemovableHandle]:
    """Register the waits (module doc) on `model`'s units; returns the hooks' handles."""
    if optimizer.gather != "forward":
        raise ValueError("gather_in_forward needs sharded masters built with gather='forward'")
    handles = []
    units = forward_units(model)
    for unit, blocks in zip(units, unit_blocks(units, optimizer)):
        handles.append(unit.register_forward_pre_hook(_waiter(optimizer, blocks)))
    return handles


def _waiter(optimizer: ShardedMasters, blocks: list[int]):
    @torch.compiler.disable
    def wait(module: nn.Module, args: tuple) -> None:
        optimizer.wait_gathered(blocks)

    return wait


def settle(optimizer: torch.optim.Optimizer) -> None:
    """The last step's all-gathers, which no forward waited for (training ended): every rank's weights whole."""
    wait = getattr(optimizer, "wait_gathered", None)
    if wait is not None:
        wait()
