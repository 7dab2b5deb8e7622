"""`ATTENTION=triton` under `PRECISION=fp8` with `FP8_RECIPE=delayed`: the layer's float8 QKV linear and our flash
attention as one autograd Function, whose backward kernels store the QKV's gradient in float8 themselves
(`bert::triton_attention_backward_fp8`).

Why: compiled for an H100 (bench/gpu_compile.py, BERT-large's per-layer delayed-float8 step at 24,576 tokens), the
QKV's gradient left our attention's backward in bf16, (T, 3072) a layer, and inductor read it back to cast it to
e5m2, take its amax (the next step's scale) and sum its columns (the QKV bias's gradient): 5.2 GB of the step, and
the bf16 writes twice the float8 ones. Here the two backward kernels (bert.model.triton_attention's, FLOAT8) round
each dq, dk and dv tile to q's dtype, scale it by the previous step's amax, saturate it and store it in e5m2, and
write the tile's largest magnitude and column sums into a slot of their own; small sums and a max of the slots
finish them. They store each tile transposed too, the weight gradient's operand (B tokens contiguous a row), so
`bert::fp8_transpose` does not read the gradient back for it. The forward is delayed float8's GEMM with the bias in
its epilogue (`float8_matmul_forward`), then the attention's forward op unchanged.

The arithmetic is the unfused path's (a DelayedFloat8Linear QKV, then ATTENTION=triton), step for step: the
gradient as q's dtype holds it, its amax of that (a non-finite one keeps the old), scaled and saturated. The bias
gradient sums the unrounded fp32 values on the GPU (the unfused path sums the rounded gradient). On the CPU (and for
float64) the same runs in torch's ops. The swapped module takes this path only with our attention's planner
(`TritonAttend`); with any other backend it is BertSelfAttention's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bert.model.compile_keys import key_on_source
from bert.model.fp8_delayed import (
    E4M3,
    E5M2,
    DelayedFloat8Linear,
    amax_of,
    cast_scale,
    float8_grads,
    float8_matmul_forward,
    keep_amax,
    saturated_cast,
)
from bert.model.layers import QKV_PARTS, BertSelfAttention
from bert.model.philox import dropout_seed
from bert.model.swap import swap_modules
from bert.model.triton_attention import (
    TritonAttend,
    _check,
    _compute_dtype,
    _on_triton,
    _views,
    backward_torch,
    launch_backward,
)


@torch.library.custom_op("bert::triton_attention_backward_fp8", mutates_args=())
def triton_attention_backward_fp8(grad: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, bits: Tensor,
                                  cu_seqlens: Tensor, max_seqlen: int, dropout_p: float, scale: Tensor,
                                  out_inv: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`bert::triton_attention_backward`'s gradient of the packed QKV in e5m2 ((T, 3, H, D), rounded to q's dtype,
    times `scale`, 0-dim fp32, saturated), the same transposed ((3 H D, T) contiguous: the weight gradient's
    operand), its column sums (3, H, D) in the compute dtype and its amax (fp32, of the rounded values) (module
    doc). With `out_inv` (0-dim fp32), `out` is the forward's output in e4m3 and this 1 / its scale
    (bert.model.fp8_attention_block): the output the backward's delta = rowsum(dO * O) reads is that copy's."""
    q, k, v = _views(qkv)
    _check(q, k, v, dropout_p, forward=False)
    if scale.shape != () or (out_inv is not None and out_inv.shape != ()):
        raise ValueError(f"the e5m2 scale and out's must be 0-dim, got {tuple(scale.shape)} and "
                         f"{None if out_inv is None else tuple(out_inv.shape)}")
    if (out.dtype == E4M3) != (out_inv is not None):
        raise ValueError(f"an e4m3 output comes with 1 / its scale and only it does, got {out.dtype} and "
                         f"{'one' if out_inv is not None else 'none'}")
    if not _on_triton(q):  # the torch path: the CPU, float64
        if out_inv is not None:  # the kernel's delta: each element times 1 / the scale (in fp32 there)
            compute = _compute_dtype(q.dtype)
            out = out.to(compute) * out_inv.to(compute)
        rounded = torch.stack(backward_torch(grad, q, k, v, out, bits, cu_seqlens.diff().tolist(), dropout_p), 1)
        q8 = saturated_cast(rounded, scale, E5M2)
        return q8, q8.flatten(1).t().contiguous(), rounded.sum(0, dtype=_compute_dtype(q.dtype)), amax_of(rounded)
    with torch.cuda.device(q.device):  # Triton launches on the current device
        return launch_backward(grad.contiguous(), q, k, v, out, lse, bits, cu_seqlens, max_seqlen, dropout_p,
                               scale=scale.float(), out_inv=None if out_inv is None else out_inv.float())


@triton_attention_backward_fp8.register_fake
def _(grad, qkv, out, lse, bits, cu_seqlens, max_seqlen, dropout_p, scale, out_inv=None):
    tokens = qkv.shape[0]
    return (qkv.new_empty(qkv.shape, dtype=E5M2), qkv.new_empty((qkv[0].numel(), tokens), dtype=E5M2),
            qkv.new_empty(qkv.shape[1:], dtype=_compute_dtype(qkv.dtype)), scale.new_empty((), dtype=torch.float32))


# traced into compiled graphs by the op's name: an edit here (or of the attention's kernels, keyed there) must miss
# them
key_on_source("bert::triton_attention_backward_fp8", __file__)


class _Float8QKVAttention(torch.autograd.Function):
    """attention(x @ w^T + b) over the batch's sequences, the QKV GEMM in float8 with delayed scaling
    (bert.model.fp8_delayed), its output gradient stored in e5m2 by the attention's backward kernels (module doc)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None, amax_input: Tensor, amax_grad: Tensor,
                cu_seqlens: Tensor, max_seqlen: int, heads: int, dropout_p: float, seed: Tensor | None) -> Tensor:
        flat, saved = float8_matmul_forward(ctx, x, w, bias, amax_input, amax_grad)
        qkv = torch.unflatten(flat, -1, (len(QKV_PARTS), heads, -1))
        out, lse, bits = torch.ops.bert.triton_attention(qkv, cu_seqlens, max_seqlen, dropout_p, seed)
        ctx.save_for_backward(*saved, qkv, out, lse, bits, cu_seqlens)
        ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p
        return out.flatten(-2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        dx, dw, db = linear_attention_backward(grad, ctx.saved_tensors[4:], ctx.max_seqlen, ctx.dropout_p,
                                               ctx.saved_tensors[:4], ctx.dtypes, ctx.amax_grad,
                                               ctx.needs_input_grad[2])
        return dx, dw, db, None, None, None, None, None, None, None


def linear_attention_backward(grad: Tensor, attention_saved, max_seqlen: int, dropout_p: float, linear_saved,
                              dtypes, amax_grad: Tensor, needs_bias: bool, out_inv: Tensor | None = None
                              ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The backward of our attention over a float8 QKV linear's output, from the attention output's gradient and
    what the forward saved (qkv, out, lse, bits, cu_seqlens; the linear's four, `float8_linear`; its
    `linear_dtypes`): (dx, dw, db), the QKV gradient's amax kept in `amax_grad`. `out_inv`: `out` is the output's
    e4m3 copy, and this 1 / its scale (bert.model.fp8_attention_block)."""
    qkv, out, lse, bits, cu = attention_saved
    scale = cast_scale(amax_grad, E5M2)  # the previous step's amax
    g_q, g_qt, sums, amax = torch.ops.bert.triton_attention_backward_fp8(
        grad.reshape(out.shape), qkv, out, lse, bits, cu, max_seqlen, dropout_p, scale, out_inv)
    keep_amax(amax_grad, amax)  # the next step's scale
    dx, dw = float8_grads(linear_saved, dtypes, g_q.flatten(1), scale.reciprocal(), dtypes[0], g_qt)
    return dx, dw, sums.flatten().to(dtypes[2]) if needs_bias else None


class Float8SelfAttention(BertSelfAttention):
    """BertSelfAttention over a DelayedFloat8Linear QKV (the same submodule): with our attention's planner,
    `_Float8QKVAttention` of the input; with another backend's, BertSelfAttention's forward."""

    @classmethod
    def from_module(cls, module: BertSelfAttention) -> Float8SelfAttention:
        if not isinstance(module.qkv, DelayedFloat8Linear):
            raise ValueError("Float8SelfAttention takes a BertSelfAttention whose qkv is a DelayedFloat8Linear")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.heads, new.dropout_p, new.qkv = module.heads, module.dropout_p, module.qkv
        return new.train(module.training)

    def forward(self, x: Tensor, attend) -> Tensor:
        if not isinstance(attend, TritonAttend):
            return super().forward(x, attend)
        p = self.dropout_p if self.training else 0.0
        return self.qkv.through(_Float8QKVAttention, x, attend.cu_seqlens, attend.max_seqlen, self.heads, p,
                                dropout_seed(p, x.device))


def apply_fp8_attention(model: nn.Module) -> list[str]:
    """Swap every BertSelfAttention of `model` whose qkv is a DelayedFloat8Linear for a Float8SelfAttention, in
    place (after the float8 conversion); the names swapped."""
    return swap_modules(model, lambda module, _: type(module) is BertSelfAttention
                        and isinstance(module.qkv, DelayedFloat8Linear), Float8SelfAttention.from_module)
