"""cuDNN's fused attention on the unpadded tokens (`ATTENTION=cudnn`): the ragged ("THD") layout of cuDNN's SDPA.

The flash kernels behind `varlen` are FlashAttention-2, written before Hopper; cuDNN's SDPA has Hopper kernels
(warpgroup MMA, the tensor memory accelerator) and takes variable-length batches as ragged tensors, which
torch exposes as `aten::_cudnn_attention_forward` / `_cudnn_attention_backward` with cumulative sequence lengths
and dropout (a philox seed and offset that the backward replays). TransformerEngine's `FusedAttention`, which
NVIDIA's H100 BERT results use, is the same cuDNN operation.

Why it is not `auto`: not measured on a GPU yet (`bench/model.py --device cuda --variants unpadded/varlen
unpadded/cudnn`). cuDNN builds an execution plan per problem shape and caches it, so a run should have few
shapes: with `STATIC_TOKENS` (`bert.static_shapes`) every step of a bucket is the same problem. A report on
GH200 (pytorch/pytorch#187770) found cuDNN varlen slower than flash for an encoder, and torch's own
`varlen_attn` leaves cuDNN off by default; the bench decides.
Needs CUDA and fp16/bf16 q, k, v, as `varlen` does.

Why a custom op: torch 2.11-2.13 give the aten op no fake (meta) implementation, so `torch.compile` cannot trace
it and would break the graph at every layer (24 breaks in BERT-large, so 25 graphs forward and 25 backward).
`bert::cudnn_varlen` wraps the two aten calls as `torch.library` custom ops whose fake implementations state the
outputs' metadata (`CONTRACT`). The ragged log-sum-exp's shape, (T, H, 1) float32, is what torch's cuDNN
frontend glue (`run_cudnn_SDP_fprop_nestedtensor`) allocates; it is not a documented interface, so the real
kernels check their outputs against the contract on every call (host-side metadata, no device sync) and fail
with one line naming `ATTENTION=cudnn` if a torch build differs, instead of letting a compiled graph run on
wrong shapes. The CPU tests run the ops, fake and autograd included, with a float64 reference put in place of
the aten calls; the CUDA tests run the real ones.

Which torch: the ragged backward is broken before the fixes of June 2026, so this backend refuses an older torch
(`MIN_TORCH`) in one line, before anything runs (`check_torch`, from `bert.model.attention.check_attention`; the
per-batch planner does not repeat it). Until then `_cudnn_attention_backward` took the longest sequence
from q's third dimension, on the ragged (T, H, D) layout the head dimension: cuDNN sized its dq accumulator for 64
tokens and wrote past it for every longer sequence, an illegal address (pytorch/pytorch#186142). And it wrote dq,
dk and dv with q, k and v's strides into contiguous buffers: the fused QKV's views are 3 x hidden apart
(pytorch/pytorch#172108, merged on 16 June 2026, after 2.13's branch cut). 2.14 is the first release cut after
both; the GPU machines' 2.11 is not, so the CUDA tests of this backend skip there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bert.batch import SeqLayout
from bert.model.attend import Attend, unpacked
from bert.model.compile_keys import key_on_source
from bert.model.cuda_varlen import Contract, require_cuda_batch, require_half
from bert.release import major_minor

MIN_TORCH = (2, 14)  # the first release with pytorch#186142 and #172108 (see the docstring)
CONTRACT = Contract("cudnn", "cuDNN attention", "bert.model.cudnn_varlen",
                    "out (T, H, Dv) in q's dtype, logsumexp (T, H, 1) float32, with dropout a philox seed and offset "
                    "of one int64 each, all on q's device and contiguous; gradients contiguous, shaped as q, k, v",
                    "varlen")


def backward_is_fixed(version: str | None = None) -> bool:
    """Whether torch `version` (default: the running one) has the ragged backward's fixes (`MIN_TORCH`)."""
    release = major_minor(version or torch.__version__)
    return release is not None and release >= MIN_TORCH


def check_torch(version: str | None = None) -> None:
    """A one-line ValueError naming ATTENTION=cudnn on a torch whose cuDNN ragged backward is broken."""
    if not backward_is_fixed(version):
        raise ValueError(f"ATTENTION=cudnn needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}: torch "
                         f"{version or torch.__version__}'s cuDNN ragged backward writes past its buffers for "
                         "sequences longer than the head dimension (pytorch/pytorch#186142, #172108): use "
                         "ATTENTION=varlen")


def _aten_forward(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, dropout_p: float):
    """(out, logsumexp, philox seed, philox offset). q, k, v as they come (views of the fused QKV output): the
    ragged offsets are taken from their token stride. compute_log_sumexp: the backward needs it."""
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_seqlen, max_seqlen, True, dropout_p
    )
    return out, lse, seed, offset


def _aten_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
                   offset: Tensor, cu: Tensor, max_seqlen: int, dropout_p: float):
    return torch.ops.aten._cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, cu, cu, max_seqlen, max_seqlen, dropout_p, False
    )


@torch.library.custom_op("bert::cudnn_varlen", mutates_args=())
def cudnn_varlen_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, logsumexp, philox seed and offset as one int64 pair)."""
    out, lse, seed, offset = _aten_forward(q, k, v, cu_seqlens, max_seqlen, dropout_p)
    tokens, heads = q.shape[0], q.shape[1]
    CONTRACT.expect(out, (tokens, heads, v.shape[-1]), q.dtype, q, "out")
    CONTRACT.expect(lse, (tokens, heads, 1), torch.float32, q, "logsumexp")
    if dropout_p == 0.0:  # no mask to replay: whatever comes back as the seed and offset (maybe nothing) is unused
        return out, lse, q.new_zeros(2, dtype=torch.int64)
    for scalar, name in ((seed, "philox seed"), (offset, "philox offset")):
        CONTRACT.expect(None if scalar is None else scalar.reshape(1), (1,), torch.int64, q, name)
    return out, lse, torch.stack((seed.reshape(()), offset.reshape(())))


@cudnn_varlen_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float):
    tokens, heads = q.shape[0], q.shape[1]
    return (
        q.new_empty((tokens, heads, v.shape[-1])),
        q.new_empty((tokens, heads, 1), dtype=torch.float32),
        q.new_empty(2, dtype=torch.int64),
    )


@torch.library.custom_op("bert::cudnn_varlen_backward", mutates_args=())
def cudnn_varlen_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng: Tensor, cu_seqlens: Tensor,
    max_seqlen: int, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    grads = _aten_backward(grad.contiguous(), q, k, v, out, lse, rng[0], rng[1], cu_seqlens, max_seqlen, dropout_p)
    for got, like, name in zip(grads, (q, k, v), ("dq", "dk", "dv")):
        CONTRACT.expect(got, tuple(like.shape), like.dtype, like, name)
    return grads


@cudnn_varlen_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng: Tensor, cu_seqlens: Tensor,
      max_seqlen: int, dropout_p: float):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, max_seqlen, dropout_p = inputs
    out, lse, rng = output
    ctx.mark_non_differentiable(lse, rng)
    ctx.save_for_backward(q, k, v, out, lse, rng, cu_seqlens)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor | None, _grad_rng: Tensor | None):
    q, k, v, out, lse, rng, cu = ctx.saved_tensors
    dq, dk, dv = cudnn_varlen_backward(grad_out, q, k, v, out, lse, rng, cu, ctx.max_seqlen, ctx.dropout_p)
    return dq, dk, dv, None, None, None


cudnn_varlen_op.register_autograd(_backward, setup_context=_setup_context)
# the fake and the backward are traced into cached graphs, which torch keys on the op's name: an edit of this
# module must miss them (bert.model.compile_keys, applied when the model is compiled)
key_on_source("bert::cudnn_varlen", __file__)


def cudnn_varlen(seq: SeqLayout) -> Attend:
    require_cuda_batch(seq, "cudnn")
    cu, longest = seq.cu_seqlens, seq.max_seqlen

    def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        require_half(q, "cudnn")
        return cudnn_varlen_op(q, k, v, cu, longest, dropout_p)[0]

    return unpacked(attend)
