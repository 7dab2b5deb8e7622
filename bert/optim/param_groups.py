"""Weight decay only where it belongs: never on biases or LayerNorm parameters (BERT, MLPerf)."""

from __future__ import annotations

from torch import nn

NO_DECAY = ("bias", "LayerNorm", "layer_norm")


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: with `weight_decay`, and with 0 for names containing bias/LayerNorm."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if any(key in name for key in NO_DECAY) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
