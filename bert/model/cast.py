"""`cast`: a tensor in a dtype, itself where it already has it, never a no-op `.to`.

Why: torch 2.11's dynamo (the GPU machines' torch) routes the gradient of an autograd Function whose output aliases
one of its intermediates, as a no-op `.to` returns, to the wrong output: zeros (pytorch/pytorch#180642; torch 2.13
gets it right). Every Function of ours that may return a cast of its own result casts through this.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` in `dtype`: `t` itself where it is already, else a converted copy."""
    return t if t.dtype == dtype else t.to(dtype)
