"""cuDNN's fused attention on the unpadded tokens (`ATTENTION=cudnn`): the ragged ("THD") layout of cuDNN's SDPA.

The flash kernels behind `varlen` are FlashAttention-2, written before Hopper; cuDNN's SDPA has Hopper kernels
(warpgroup MMA, the tensor memory accelerator) and takes variable-length batches as ragged tensors, which
torch exposes as `aten::_cudnn_attention_forward` with cumulative sequence lengths, dropout included (a philox
seed and offset the backward replays), and with a derivative (`_cudnn_attention_backward`), so autograd needs
nothing from us. TransformerEngine's `FusedAttention`, which NVIDIA's H100 BERT results use, is the same cuDNN
operation.

Why it is not `auto`: not measured on a GPU yet (`bench/model.py --device cuda --variants unpadded/varlen
unpadded/cudnn`). cuDNN builds an execution plan per problem shape and caches it, so a run should have few
shapes: with `STATIC_TOKENS` (`bert.static_shapes`) every step of a bucket is the same problem. A report on
GH200 (pytorch/pytorch#187770) found cuDNN varlen slower than flash for an encoder, and torch's own
`varlen_attn` leaves cuDNN off by default; the bench decides.
Needs CUDA and fp16/bf16 q, k, v, as `varlen` does.

Under COMPILE the call stays outside the compiled graphs (a graph break per layer): the op has no fake
implementation in torch 2.11-2.13 (it fails on meta tensors), so dynamo cannot trace through it, and a
`torch.library` wrapper would have to state the shape of cuDNN's ragged log-sum-exp, which is not documented.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from bert.batch import SeqLayout
from bert.model.cuda_varlen import require_cuda_batch, require_half


def cudnn_varlen(seq: SeqLayout) -> Callable[[Tensor, Tensor, Tensor, float], Tensor]:
    require_cuda_batch(seq, "cudnn")
    cu, longest = seq.cu_seqlens, seq.max_seqlen

    def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        require_half(q, "cudnn")
        # compute_log_sumexp: the backward needs it. q, k, v as they come (views of the fused QKV output): the
        # ragged offsets are taken from their token stride.
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, True, dropout_p)[0]

    return torch.compiler.disable(attend)
