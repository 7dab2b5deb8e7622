"""What every attention backend's planner returns: an `Attend`, called by each layer with the packed QKV.

The layer's one QKV GEMM makes (T, 3 x hidden); its (T, 3, heads, head_dim) view goes to the backend whole, so a
backend whose backward writes one packed gradient (ATTENTION=triton) saves the copy that stacks dq, dk and dv
into the QKV's gradient (7.2 GB of BERT-large's step on the fake H100, bench/gpu_compile.py). The others take the
three views (`unpacked`), whose gradients autograd stacks as before.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

Attend = Callable[[Tensor, float], Tensor]  # (qkv (T, 3, H, D), dropout_p) -> out (T, H, D)
AttendViews = Callable[[Tensor, Tensor, Tensor, float], Tensor]  # (q, k, v, dropout_p), each (T, H, D)


def unpacked(attend: AttendViews) -> Attend:
    """An attention of q, k and v apart as an `Attend`: the packed tensor's three views (no copy)."""

    def attend_packed(qkv: Tensor, dropout_p: float) -> Tensor:
        q, k, v = qkv.unbind(-3)  # (..., 3, H, D): the padded reference model's (B, L, 3, H, D) too
        return attend(q, k, v, dropout_p)

    return attend_packed
