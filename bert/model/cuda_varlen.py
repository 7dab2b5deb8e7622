"""CUDA flash attention directly on the unpadded tokens (the FMHA of NVIDIA's and Baidu's BERT).

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) has no dropout argument (it passes 0), but BERT
trains with attention-probability dropout 0.1. With dropout we therefore call the same aten flash
kernels it wraps, which do take `dropout_p`, through a small autograd function; the backward replays
the forward's dropout mask from the philox `rng_state` the forward returns.
Flash kernels need CUDA and fp16/bf16 inputs (run the model under `torch.autocast`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from bert.batch import SeqLayout


def _varlen_attn() -> Callable | None:
    """torch's varlen_attn, imported on first use: the import pulls in torch._dynamo (~1.3 s per process)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10: the dropout path below serves dropout 0 as well
        return None
    return varlen_attn


class FlashVarlenDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, False, False
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, ctx.dropout_p,
            False, rng_state, unused,
        )
        return dq, dk, dv, None, None, None


def require_cuda_batch(seq: SeqLayout, backend: str) -> None:
    """The fused CUDA backends (varlen, cudnn) plan only batches on a CUDA device."""
    if seq.cu_seqlens.device.type != "cuda":
        raise ValueError(f"attention backend '{backend}' needs the batch on a CUDA device; use 'loop' on CPU")


def require_half(q: Tensor, backend: str) -> None:
    """Their kernels take fp16/bf16 only."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend '{backend}' needs fp16/bf16 q, k, v (got {q.dtype}): use torch.autocast")


def flash_varlen(seq: SeqLayout) -> Callable[[Tensor, Tensor, Tensor, float], Tensor]:
    require_cuda_batch(seq, "varlen")
    cu, longest = seq.cu_seqlens, seq.max_seqlen
    varlen_attn = _varlen_attn()

    def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        require_half(q, "varlen")
        if dropout_p == 0.0 and varlen_attn is not None:
            return varlen_attn(q, k, v, cu, cu, longest, longest)
        # q, k and v as they come (views of the fused QKV output): the kernels take any row and head strides
        # with a unit last one, as varlen_attn's do; .contiguous() would copy 3 x (T, hidden) per layer each way
        return FlashVarlenDropout.apply(q, k, v, cu, longest, dropout_p)

    return attend
