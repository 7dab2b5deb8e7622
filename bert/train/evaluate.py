"""Distributed MLM-accuracy evaluation on the rules' schedule (TPU [004] §3.4; cadence: [MLPerf-BERT-ref]).

Each rank evaluates its own slice of the eval set; the (correct, total) counts are summed with
one allreduce, so every rank gets the same accuracy and the same stop decision.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from bert.batch import Batch


def rules_eval_interval(global_batch_size: int) -> int:
    """MLPerf BERT: evaluate every floor(0.05 * (230.23 * GBS + 3e6) / 25000) * 25000 samples."""
    return int(0.05 * (230.23 * global_batch_size + 3_000_000) // 25_000) * 25_000


@dataclass
class EvalSchedule:
    """Evaluate at the first step whose sample count reaches start, start + interval, ... (never at 0)."""

    interval: int
    next_at: int

    @classmethod
    def from_config(cls, global_batch_size: int, start: int = 0, interval: int = 0) -> EvalSchedule:
        interval = interval or rules_eval_interval(global_batch_size)
        return cls(interval, start or interval)

    def due(self, samples: int) -> bool:
        if samples < self.next_at:
            return False
        while self.next_at <= samples:
            self.next_at += self.interval
        return True


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], autocast: torch.autocast) -> float:
    """MLM accuracy over every rank's slice; `model` is the bare module (no DDP hooks in eval)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    with autocast:
        for batch in batches:
            out = model(batch)
            counts += torch.stack([out.mlm_correct, out.mlm_total])
    if dist.is_initialized():
        dist.all_reduce(counts)
    model.train(was_training)
    correct, total = counts.tolist()  # the one host sync of an evaluation
    if total == 0:
        raise ValueError("the eval set has no masked tokens")
    return correct / total
