"""Swap a model's submodules in place, by name: how a technique applies itself to a built model (delayed float8's
linears, the fused residual LayerNorm), torchtitan's way, so the model's own code never branches on a flag."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_modules(model: nn.Module, keep: Callable[[nn.Module, str], bool],
                 make: Callable[[nn.Module], nn.Module]) -> list[str]:
    """Replace every submodule that `keep(module, name)` accepts with `make(module)`; the names replaced."""
    names = [name for name, module in model.named_modules() if keep(module, name)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
    return names
