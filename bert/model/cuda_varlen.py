"""CUDA flash attention directly on the unpadded tokens (the FMHA of NVIDIA's and Baidu's BERT).

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) has no dropout argument (it passes 0), but BERT
trains with attention-probability dropout 0.1. With dropout we therefore call the same aten flash
kernels it wraps, which do take `dropout_p`; the backward replays the forward's dropout mask from the philox
`rng_state` the forward returns. Flash kernels need CUDA and fp16/bf16 inputs (run the model under `torch.autocast`).

Why a `torch.library` custom op (`bert::flash_varlen`) and not an autograd Function: AOT autograd does not cache a
compiled graph holding an autograd Function by default (torch 2.11), so a driver that loaded its graphs from a
compile cache (COMPILE_CACHE) still re-traced the whole model's forward and backward. A custom op is called by name
from the compiled graph, its Python body run as it is now. Its fake implementation states the outputs' metadata
(`CONTRACT`: torch's own meta function for the aten op, and the CUDA kernel's allocation, which puts the philox state
on the device); the real kernels' outputs are checked against it on every call (host-side metadata, no device sync),
as `bert.model.cudnn_varlen`'s are. The caches key a graph holding it on a hash of this file
(`bert.model.compile_keys`), as its fake and backward are traced into the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from bert.batch import SeqLayout
from bert.model.attend import Attend, unpacked
from bert.model.compile_keys import key_on_source


@dataclasses.dataclass(frozen=True)
class Contract:
    """What a custom op's fake implementation states about the outputs of the aten kernels it wraps, and the one-line
    error naming the setting when a torch build's kernels return something else (a compiled graph would run on
    wrong shapes)."""

    backend: str  # its ATTENTION value
    kernels: str
    module: str
    outputs: str
    fallback: str  # the ATTENTION value to use instead

    def expect(self, got: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, like: Tensor, name: str) -> None:
        if got is None or tuple(got.shape) != shape or got.dtype != dtype or got.device != like.device \
                or not got.is_contiguous():
            what = "no tensor" if got is None else f"{tuple(got.shape)} {got.dtype} on {got.device}"
            raise RuntimeError(
                f"ATTENTION={self.backend}: this torch build's {self.kernels} returned {name} {what}, not what "
                f"{self.module} states for torch.compile ({self.outputs}); use ATTENTION={self.fallback}"
            )


CONTRACT = Contract("varlen", "flash attention", "bert.model.cuda_varlen",
                 "out (T, H, D) in q's dtype, logsumexp (H, T) float32, a philox state (2,) and an unused () uint64, "
                 "all on q's device and contiguous; gradients contiguous, shaped as q, k, v", "padded")


def _varlen_attn() -> Callable | None:
    """torch's varlen_attn, imported on first use: the import pulls in torch._dynamo (~1.3 s per process)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10: the dropout path below serves dropout 0 as well
        return None
    return varlen_attn


def _aten_forward(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, dropout_p: float):
    """(out, logsumexp, philox state, unused). q, k, v as they come (views of the fused QKV output): the kernels
    take any row and head strides with a unit last one; .contiguous() would copy 3 x (T, hidden) per layer each way."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p, False, False
    )
    return out, lse, rng_state, unused


def _aten_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: Tensor,
                   max_seqlen: int, dropout_p: float, rng_state: Tensor, unused: Tensor):
    return torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu, cu, max_seqlen, max_seqlen, dropout_p, False, rng_state, unused
    )


@torch.library.custom_op("bert::flash_varlen", mutates_args=())
def flash_varlen_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, logsumexp, philox state, unused): the last three are what the backward replays the dropout from. The
    state's two are handed on as int64, the same bits: inductor does not take uint64 tensors everywhere (its CPU
    code cannot promote them)."""
    out, lse, rng_state, unused = _aten_forward(q, k, v, cu_seqlens, max_seqlen, dropout_p)
    tokens, heads = q.shape[0], q.shape[1]
    CONTRACT.expect(out, (tokens, heads, v.shape[-1]), q.dtype, q, "out")
    CONTRACT.expect(lse, (heads, tokens), torch.float32, q, "logsumexp")
    CONTRACT.expect(rng_state, (2,), torch.uint64, q, "philox state")
    CONTRACT.expect(unused, (), torch.uint64, q, "unused")
    return out, lse, rng_state.view(torch.int64), unused.view(torch.int64)


@flash_varlen_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float):
    tokens, heads = q.shape[0], q.shape[1]
    return (
        q.new_empty((tokens, heads, v.shape[-1])),
        q.new_empty((heads, tokens), dtype=torch.float32),
        q.new_empty(2, dtype=torch.int64),
        q.new_empty((), dtype=torch.int64),
    )


@torch.library.custom_op("bert::flash_varlen_backward", mutates_args=())
def flash_varlen_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor, unused: Tensor,
    cu_seqlens: Tensor, max_seqlen: int, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    grads = _aten_backward(grad.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p,
                           rng_state.view(torch.uint64), unused.view(torch.uint64))
    for got, like, name in zip(grads, (q, k, v), ("dq", "dk", "dv")):
        CONTRACT.expect(got, tuple(like.shape), like.dtype, like, name)
    return grads


@flash_varlen_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor, unused: Tensor,
      cu_seqlens: Tensor, max_seqlen: int, dropout_p: float):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, max_seqlen, dropout_p = inputs
    out, lse, rng_state, unused = output
    ctx.mark_non_differentiable(lse, rng_state, unused)
    ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, cu_seqlens)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p


def _backward(ctx, grad_out: Tensor, *_no_grads: Tensor | None):
    q, k, v, out, lse, rng_state, unused, cu = ctx.saved_tensors
    dq, dk, dv = flash_varlen_backward(grad_out, q, k, v, out, lse, rng_state, unused, cu, ctx.max_seqlen,
                                       ctx.dropout_p)
    return dq, dk, dv, None, None, None


flash_varlen_op.register_autograd(_backward, setup_context=_setup_context)
# the fake and the backward are traced into cached graphs, which torch keys on the op's name: an edit of this
# module must miss them (bert.model.compile_keys, applied when the model is compiled)
key_on_source("bert::flash_varlen", __file__)


def require_cuda_batch(seq: SeqLayout, backend: str) -> None:
    """The fused CUDA backends (varlen, cudnn) plan only batches on a CUDA device."""
    if seq.cu_seqlens.device.type != "cuda":
        raise ValueError(f"attention backend '{backend}' needs the batch on a CUDA device; use 'loop' on CPU")


def require_half(q: Tensor, backend: str) -> None:
    """Their kernels take fp16/bf16 only."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend '{backend}' needs fp16/bf16 q, k, v (got {q.dtype}): use torch.autocast")


def flash_varlen(seq: SeqLayout) -> Attend:
    require_cuda_batch(seq, "varlen")
    cu, longest = seq.cu_seqlens, seq.max_seqlen
    varlen_attn = _varlen_attn()

    def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        require_half(q, "varlen")
        if dropout_p == 0.0 and varlen_attn is not None:
            return varlen_attn(q, k, v, cu, cu, longest, longest)
        return flash_varlen_op(q, k, v, cu, longest, dropout_p)[0]

    return unpacked(attend)
