"""The float8 attention sublayer as one autograd Function, under `PRECISION=fp8 FP8_RECIPE=delayed` with
`ATTENTION=triton` and `RESIDUAL_NORM=fused`: the float8 QKV linear, our flash attention, the float8 output
projection and its dropout + residual + LayerNorm. The attention's forward kernel writes its output in e4m3 too,
the projection's input, and that copy transposed, the projection's weight-gradient operand
(`bert::triton_attention_fp8`).

Why: compiled for an H100 (bench/gpu_compile.py, the per-layer float8 step with all three of our passes, BERT-large
at 24,576 tokens), the attention's output left our kernel in bf16 and the projection's unit read it back: inductor
cast it to e4m3 with its amax (1.7 GB of the step) and `bert::fp8_transpose` read the copy back to write it
transposed (1.2 GB). The two were two autograd Functions (bert.model.fp8_attention's Float8SelfAttention, then
bert.model.fp8_residual_norm's Float8ResidualOutput), so neither could hand the other the copy. Here the forward
kernel's epilogue rounds each output tile to its dtype, scales it by the projection's delayed scale (the previous
step's amax of that input), saturates it and stores it in e4m3 twice, as it is and transposed (BM tokens contiguous
a row), with the tile's amax, kept for the next step.

The bf16 output is not written at all. Its only reader was the attention's backward, for delta = rowsum(dO * O),
and that now reads the e4m3 copy, times 1 / its scale (`bert::triton_attention_backward_fp8`'s `out_inv`), as
cuDNN's float8 attention reads its float8 output. On the fake H100 (bench/gpu_compile.py, the per-layer float8
step at 24,576 tokens) that took 1.7 GB off BERT-large's step, our ops' 64.2 GB becoming 62.5: the bf16 write, 1.16
GB, and half the backward's read; and 0.6 GB off the saved activations. The copy's rounding, at most 2^-4 of
each element, moves delta by a rounding-sized sum, and dS = P (dP - delta) by as little: on BERT tiny the encoder's
gradients moved by 0.14 % of float8's own error against float64, and that error stayed as it was
(tests/test_fp8_attention_block.py).

Otherwise the arithmetic is the two units' step for step, so on the CPU, where the same runs in torch's ops, every
output, gradient and amax equals theirs bit for bit once their attention's backward reads the same copy (the QKV
bias's sums as the float8 attention's). The backward is theirs in turn, the norm's two gradients apart (the output
is a Stream, bert.model.layers). `apply_fp8_attention_block`
swaps each attention sublayer's close for `Float8AttentionOutput`, whose `after` BertAttention calls with
its opening unit; with another attention backend than ours (the planner is not `TritonAttend`), or on the last
layer's kept rows (`LAST_LAYER_SUBSET`: the rows are cut between the two), it runs the two units as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bert.model.compile_keys import key_on_source
from bert.model.fp8_attention import Float8SelfAttention, linear_attention_backward
from bert.model.fp8_delayed import (
    E4M3,
    amax_of,
    autocast_on,
    cast_scale,
    float8_linear,
    handed_on,
    keep_amax,
    linear_dtypes,
    record_amax,
    saturated_cast,
    scaled_cast,
    wants_transpose,
    without_grad,
)
from bert.model.fp8_feed_forward import Float8FeedForwardOutput
from bert.model.fp8_residual_norm import Float8ResidualOutput, first_read, linear_norm_backward, norm_saved
from bert.model.layers import QKV_PARTS, BertEncoder, BertLayer, Stream
from bert.model.philox import dropout_seed
from bert.model.triton_attention import (
    TritonAttend,
    _check,
    _compute_dtype,
    _on_triton,
    _views,
    attention_torch,
    groups_per_row,
    launch_forward,
)


@torch.library.custom_op("bert::triton_attention_fp8", mutates_args=())
def triton_attention_fp8(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float, seed: Tensor | None,
                         scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`bert::triton_attention`'s log-sum-exp and bits, and its out in e4m3 only (rounded to q's dtype, times
    `scale`, 0-dim fp32, saturated; (T, H, D)), the same transposed ((H D, T) contiguous) and its amax (fp32, of the
    rounded values) (module doc)."""
    q, k, v = _views(qkv)
    _check(q, k, v, dropout_p, seed)
    if scale.shape != ():
        raise ValueError(f"the e4m3 scale must be 0-dim, got {tuple(scale.shape)}")
    if not _on_triton(q):  # the torch path: the CPU, float64
        out, lse, bits = attention_torch(q, k, v, cu_seqlens.diff().tolist(), max_seqlen, dropout_p, seed)
        o_q = saturated_cast(out, scale, E4M3)
        return lse, bits, o_q, o_q.flatten(1).t().contiguous(), amax_of(out)
    with torch.cuda.device(q.device):  # Triton launches on the current device
        return launch_forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed, scale=scale.float())


@triton_attention_fp8.register_fake
def _(qkv, cu_seqlens, max_seqlen, dropout_p, seed, scale):
    tokens, _, heads, dim = qkv.shape
    return (qkv.new_empty((heads, tokens), dtype=_compute_dtype(qkv.dtype)),
            qkv.new_empty((heads, tokens if dropout_p > 0 else 0, groups_per_row(max_seqlen)), dtype=torch.uint8),
            qkv.new_empty((tokens, heads, dim), dtype=E4M3), qkv.new_empty((heads * dim, tokens), dtype=E4M3),
            scale.new_empty((), dtype=torch.float32))


# traced into compiled graphs by the op's name: an edit here (or of the attention's kernels, keyed there) must miss
# them
key_on_source("bert::triton_attention_fp8", __file__)


class _Float8AttentionBlock(torch.autograd.Function):
    """LayerNorm(dropout(attention(x @ wqkv^T + bqkv) @ wo^T + bo) + residual) over the batch's sequences, both
    GEMMs in float8 with delayed scaling (module doc); the output twice, an alias (a Stream), and the attention
    output's amax, for the caller to keep."""

    @staticmethod
    def forward(ctx, x: Tensor, w_qkv: Tensor, b_qkv: Tensor | None, amax_x: Tensor, amax_g_qkv: Tensor,
                w_o: Tensor, b_o: Tensor | None, amax_o: Tensor, amax_g_o: Tensor, residual: Tensor, gamma: Tensor,
                beta: Tensor, cu_seqlens: Tensor, max_seqlen: int, heads: int, p_attention: float,
                seed_attention: Tensor | None, p: float, seed: Tensor | None, eps: float, amax_next: Tensor | None,
                transposed: bool, x_q: Tensor | None, inv_x: Tensor | None, x_qt: Tensor | None,
                from_output: bool) -> tuple[Tensor, ...]:
        if x_q is None:  # else x came cast (a Stream's float8: the layer before cast it where it made it)
            x_q, inv_x = scaled_cast(x, amax_x, E4M3)
        flat, saved_qkv = float8_linear(x_q, inv_x, w_qkv, b_qkv, ctx.needs_input_grad[:2], x.dtype, x_qt)
        qkv = torch.unflatten(flat, -1, (len(QKV_PARTS), heads, -1))
        scale_o = cast_scale(amax_o, E4M3)  # the previous step's amax of the attention's output
        lse, bits, o_q, o_qt, amax = torch.ops.bert.triton_attention_fp8(
            qkv, cu_seqlens, max_seqlen, p_attention, seed_attention, scale_o)
        # the attention output's gradient wherever anything before it wants one
        needs_o = (any(ctx.needs_input_grad[:3]), ctx.needs_input_grad[5])
        h, saved_o = float8_linear(o_q.flatten(1), scale_o.reciprocal(), w_o, b_o, needs_o, x.dtype, o_qt)
        # with the next linear's amax: y cast for it where the norm makes it, 1 / the scale, the amax, and with
        # `transposed` the cast copy transposed (else 0 rows), that linear's weight-gradient operand
        handed = ()
        if amax_next is None:
            y, s, norm_bits, mean, rstd = torch.ops.bert.dropout_add_layer_norm(h, residual, gamma, beta, None, seed,
                                                                                p, eps, from_output)
        else:
            scale_next = cast_scale(amax_next, E4M3)
            y, s, norm_bits, mean, rstd, y_q, amax_y, _, y_qt = torch.ops.bert.dropout_add_layer_norm_fp8(
                h, residual, gamma, beta, seed, p, eps, scale_next, False, transposed, from_output)
            handed = (y_q, scale_next.reciprocal(), amax_y, y_qt)
        # the e4m3 output for the attention's backward (its delta), 1 / its scale among the projection's saved
        ctx.save_for_backward(*saved_qkv, qkv, o_q, lse, bits, cu_seqlens, *saved_o,
                              *norm_saved(y, s, norm_bits, mean, rstd, gamma, beta, from_output))
        ctx.mark_non_differentiable(amax, *handed)
        ctx.set_materialize_grads(False)  # an output unread: no zeros to add
        ctx.amax_grads, ctx.max_seqlen, ctx.p_attention, ctx.p = (amax_g_qkv, amax_g_o), max_seqlen, p_attention, p
        ctx.dtypes = (linear_dtypes(x, w_qkv, b_qkv), linear_dtypes(x, w_o, b_o))
        return y, y.view_as(y), amax, *handed

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad2: Tensor | None, *_unused: None):
        grad, grad2 = first_read(grad, grad2)
        if grad is None:  # no output read
            return (None,) * 26
        saved = ctx.saved_tensors
        (amax_g_qkv, amax_g_o), (dtypes_qkv, dtypes_o) = ctx.amax_grads, ctx.dtypes
        # the norm and the projection (Float8ResidualOutput's backward, both of the output's gradients), then the
        # attention and the QKV (Float8SelfAttention's), where anything before it wants a gradient
        d_out, dw_o, db_o, ds, dgamma, dbeta = linear_norm_backward(grad, grad2, saved[13:], ctx.p, saved[9:13],
                                                                    dtypes_o, amax_g_o, ctx.needs_input_grad[6])
        dx = dw_qkv = db_qkv = None
        if d_out is not None:
            dx, dw_qkv, db_qkv = linear_attention_backward(d_out, saved[4:9], ctx.max_seqlen, ctx.p_attention,
                                                           saved[:4], dtypes_qkv, amax_g_qkv, ctx.needs_input_grad[2],
                                                           out_inv=saved[11])
        return (dx, dw_qkv, db_qkv, None, None, dw_o, db_o, None, None, ds, dgamma, dbeta,
                None, None, None, None, None, None, None, None, None, None, None, None, None, None)


class Float8AttentionOutput(Float8ResidualOutput):
    """An attention sublayer's close (a Float8ResidualOutput, the same submodules) that runs the whole sublayer with
    its opening Float8SelfAttention as `_Float8AttentionBlock`, under our attention's planner (`after`). A Stream whose
    float8 the layer before cast (bert.model.fp8_feed_forward) gives the QKV its input in e4m3 and its amax."""

    @classmethod
    def from_module(cls, module: Float8ResidualOutput) -> Float8AttentionOutput:
        if type(module) is not Float8ResidualOutput:
            raise ValueError(f"Float8AttentionOutput takes a Float8ResidualOutput, not {type(module).__name__}")
        return super().from_module(module)

    hands_on = False  # whether the FFN after it takes its output in e4m3 (`apply_fp8_attention_block`)

    def after(self, opening: Float8SelfAttention, stream: Stream, attend, into: nn.Module | None = None) -> Stream:
        if not isinstance(attend, TritonAttend):  # another backend's attention: the two units
            return super().after(opening, stream, attend)
        qkv, proj, norm = opening.qkv, self.dense, self.LayerNorm
        x = stream.x
        p_attention = opening.dropout_p if opening.training else 0.0
        p = self.dropout.p if self.training else 0.0
        flat = qkv.flat_input(x)
        seed_attention = dropout_seed(p_attention, x.device)  # drawn in the two units' order
        # the FFN's first linear casts its input itself under autocast (into autocast's dtype, not y's)
        next_linear = into.dense if self.hands_on and not autocast_on(x) else None
        x_q, inv_x, amax_x, x_qt = stream.float8 or (None, None, None, None)
        transposed = wants_transpose(next_linear)
        w_qkv, b_qkv, w_o, b_o, gamma, beta = without_grad(qkv.weight, qkv.bias, proj.weight, proj.bias,
                                                            norm.weight, norm.bias)
        y, alias, amax, *handed = _Float8AttentionBlock.apply(
            flat, w_qkv, b_qkv, qkv.amax_input, qkv.amax_grad, w_o, b_o, proj.amax_input,
            proj.amax_grad, stream.residual.reshape(-1, x.shape[-1]).contiguous(), gamma, beta,
            attend.cu_seqlens, attend.max_seqlen, opening.heads, p_attention, seed_attention, p,
            dropout_seed(p, x.device), norm.eps, None if next_linear is None else next_linear.amax_input,
            transposed, x_q, inv_x, x_qt, self.from_output)
        if qkv.records():  # each linear's input amax, as DelayedFloat8Linear.through records them
            with torch.no_grad():
                if x_q is None:
                    record_amax(qkv.amax_input, flat)
                else:  # the layer before cast it, and took the amax of what it cast
                    keep_amax(qkv.amax_input, amax_x)
                keep_amax(proj.amax_input, amax)
        return Stream(y.view(x.shape), alias.view(x.shape), handed_on(handed, transposed))


def apply_fp8_attention_block(model: nn.Module) -> list[str]:
    """Swap the close of every layer's BertAttention of `model` whose opening is a Float8SelfAttention and whose
    close a Float8ResidualOutput for a Float8AttentionOutput, in place (after the other float8 swaps, the FFN's
    first); the names swapped. Where a layer's FFN is one Function, the close hands it its input in e4m3; where the
    next layer's attention is one Function too, the FFN hands that its input (`hands_on`)."""
    swapped = []
    for name, layer in model.named_modules():
        block = getattr(layer, "attention", None)
        if isinstance(layer, BertLayer) and type(block.self) is Float8SelfAttention \
                and type(block.output) is Float8ResidualOutput:
            block.output = Float8AttentionOutput.from_module(block.output)
            block.output.hands_on = isinstance(layer.output, Float8FeedForwardOutput)
            swapped.append(f"{name}.attention.output")
    for encoder in model.modules():
        if isinstance(encoder, BertEncoder):
            for layer, following in zip(encoder.layer[:-1], encoder.layer[1:]):
                if isinstance(layer.output, Float8FeedForwardOutput):
                    layer.output.hands_on = isinstance(following.attention.output, Float8AttentionOutput)
    return swapped
