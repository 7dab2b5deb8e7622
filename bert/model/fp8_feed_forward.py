"""The float8 FFN as one autograd Function, under `PRECISION=fp8 FP8_RECIPE=delayed` with `BIAS_GELU=fused` and
`RESIDUAL_NORM=fused`: the first float8 linear, the GELU, the second float8 linear and its dropout + residual +
LayerNorm. The GELU's kernel (`bert::gelu_fp8`) writes its output in e4m3, the second linear's input, and that
copy transposed, the second linear's weight-gradient operand.

Why: compiled for an H100 (bench/gpu_compile.py, the per-layer float8 step with all three of our passes, BERT-large
at 24,576 tokens), the FFN's two float8 units each did their half of the hand-over between them. Inductor fused
the GELU with the second linear's e4m3 cast and amax, a kernel that wrote the (T, 4096) copy; then
`bert::fp8_transpose` read the copy back to write it transposed for the weight gradient (a read and a write of
100 MB a layer, 4.8 GB of the step's transposes). Here one Triton kernel reads the pre-activation and writes both
copies, 16 tokens of a column at a time for the transposed one, as the GELU's backward kernel does
(bert.model.fp8_bias_gelu). The second linear's input scale is its own delayed one (the previous step's amax of
that input); the kernel gives this step's amax, kept for the next.

The arithmetic is the two units' (bert.model.fp8_bias_gelu's Float8BiasGELU, then bert.model.fp8_residual_norm's
Float8ResidualOutput) step for step. The GELU is GELU=rational's formula in fp32, rounded to h's dtype, scaled,
saturated to e4m3; its amax is of the rounded values, a non-finite one keeping the old. The backward is the two
units' backwards in turn. So every output, gradient and amax equals theirs bit for bit on the CPU, where the same
runs in torch's ops. `apply_fp8_feed_forward` swaps each layer's FFN close for `Float8FeedForwardOutput`, whose
`ends` BertLayer calls with the FFN's opening unit, after the other float8 swaps; parameters and their names are
the two units'.

The layer's output. Where the next layer's attention sublayer is one Function too (bert.model.fp8_attention_block;
`hands_on`), the norm hands it on as the attention's close hands the FFN its input: cast to e4m3 with the next QKV
linear's delayed scale in the norm's kernel (`bert::dropout_add_layer_norm_fp8`), where inductor cast it again
(1.8 GB of the all-ours float8 step), and written twice, two tensors apart (`twice`), so that the next layer's two
gradients, its QKV's input gradient and its norm's residual gradient, reach this norm's backward kernel apart
(`dy2`), where inductor added them in a pass of their own (3.5 GB). Within a compiled graph an alias would do; this
output leaves the layer's graph under COMPILE_SCOPE=layers, where AOT autograd folds an alias back into one
gradient, hence the second write (1.2 GB, against the add's 3.5).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bert.model.bias_gelu import TILE, triton
from bert.model.compile_keys import key_on_source
from bert.model.fp8_bias_gelu import Float8BiasGELU, linear_gelu_backward
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
from bert.model.fp8_residual_norm import Float8ResidualOutput, first_read, linear_norm_backward, norm_saved
from bert.model.gelu import rational_gelu_reference
from bert.model.layers import BertLayer, Stream
from bert.model.philox import dropout_seed

if triton is not None:
    import triton.language as tl

    from bert.model.bias_gelu import _half_erfc, _where

    @triton.jit
    def _forward_kernel(H, Q, QT, SCALE, AMAXES, tokens, width, BT: tl.constexpr, BN: tl.constexpr,
                        ROWS: tl.constexpr):
        """ROWS rows x BN columns of e4m3(round(GELU(h)) x scale) into Q and transposed into QT (BT tokens
        contiguous a column), their largest magnitude into AMAXES[program] (infinity for a NaN: not kept)."""
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        scale = tl.load(SCALE)
        top = tl.zeros((BT, BN), tl.float32)
        for r0 in tl.range(0, ROWS, BT):
            rows = tl.program_id(0) * ROWS + r0 + tl.arange(0, BT)
            at, inside = _where(rows, cols, tokens, width)
            x = tl.load(H + at, mask=inside, other=0.0).to(tl.float32)
            half_erfc, _ = _half_erfc(x)
            r = (x * tl.where(x >= 0, 1.0 - half_erfc, half_erfc)).to(H.dtype.element_ty).to(tl.float32)
            e4m3 = tl.clamp(r * scale, -448.0, 448.0).to(tl.float8e4nv)  # e4m3's largest: saturated
            tl.store(Q + at, e4m3, mask=inside)
            tl.store(QT + cols.to(tl.int64)[None, :] * tokens + rows[:, None], e4m3, mask=inside)
            top = tl.maximum(top, tl.where(r == r, tl.abs(r), float("inf")))
        tl.store(AMAXES + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.max(tl.max(top, 1), 0))


def gelu_fp8_torch(h: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(e4m3 GELU(h), its transpose, the amax in fp32) in torch's ops (module doc)."""
    rounded = rational_gelu_reference(h)
    q = saturated_cast(rounded, scale, E4M3)
    return q, q.t().contiguous(), amax_of(rounded)


def launch_forward(h: Tensor, scale: Tensor, tile: tuple[int, int, int, int] = TILE) -> tuple[Tensor, Tensor, Tensor]:
    bt, bn, rows, warps = tile
    tokens, width = h.shape
    q = torch.empty(h.shape, dtype=E4M3, device=h.device)
    q_t = torch.empty((width, tokens), dtype=E4M3, device=h.device)
    grid = (triton.cdiv(tokens, rows), triton.cdiv(width, bn))
    amaxes = torch.empty(grid, dtype=torch.float32, device=h.device)
    _forward_kernel[grid](h, q, q_t, scale, amaxes, tokens, width, BT=bt, BN=bn, ROWS=rows, num_warps=warps)
    return q, q_t, amaxes.amax()


@torch.library.custom_op("bert::gelu_fp8", mutates_args=())
def gelu_fp8(h: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From the pre-activation h (contiguous (T, N)) and the e4m3 scale (fp32, 0-dim): GELU(h) in e4m3, the same
    transposed ((N, T) contiguous: the next linear's weight-gradient operand), and its amax (module doc)."""
    if h.dim() != 2 or not h.is_contiguous() or scale.shape != ():
        raise ValueError(f"gelu_fp8 takes a contiguous (T, N) h and a 0-dim scale, got {tuple(h.shape)} and "
                         f"{tuple(scale.shape)}")
    if not (h.is_cuda and triton is not None and h.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return gelu_fp8_torch(h, scale)
    if not h.numel():
        return (*gelu_fp8_torch(h, scale)[:2], scale.new_zeros((), dtype=torch.float32))
    with torch.cuda.device(h.device):  # Triton launches on the current device
        return launch_forward(h, scale.float())


@gelu_fp8.register_fake
def _(h: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return (h.new_empty(h.shape, dtype=E4M3), h.new_empty(h.shape[::-1], dtype=E4M3),
            scale.new_empty((), dtype=torch.float32))


# traced into compiled graphs by the op's name: an edit here (or of bert.model.bias_gelu's `_half_erfc`, keyed
# there) must miss them
key_on_source("bert::gelu_fp8", __file__)


class _Float8FeedForward(torch.autograd.Function):
    """LayerNorm(dropout(GELU(x @ w1^T + b1) @ w2^T + b2) + residual), both GEMMs in float8 with delayed scaling
    (module doc); also the GELU output's amax, for the caller to keep (not an input mutated here)."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor, amax_x: Tensor, amax_g1: Tensor, w2: Tensor, b2: Tensor,
                amax_a: Tensor, amax_g2: Tensor, residual: Tensor, gamma: Tensor, beta: Tensor,
                seed: Tensor | None, p: float, eps: float, x_q: Tensor | None, inv_x: Tensor | None,
                x_qt: Tensor | None, amax_next: Tensor | None, transposed: bool, from_output: bool
                ) -> tuple[Tensor, ...]:
        if x_q is None:  # else x came cast (a Stream's float8: the close before cast it where it made it)
            x_q, inv_x = scaled_cast(x, amax_x, E4M3)
        h, saved1 = float8_linear(x_q, inv_x, w1, b1, ctx.needs_input_grad[:2], x.dtype, x_qt)
        scale_a = cast_scale(amax_a, E4M3)  # the previous step's amax of the GELU's output
        a_q, a_qt, amax = torch.ops.bert.gelu_fp8(h, scale_a)
        # the GELU output's gradient wherever anything before it wants one
        needs2 = (any(ctx.needs_input_grad[:3]), ctx.needs_input_grad[5])
        h2, saved2 = float8_linear(a_q, scale_a.reciprocal(), w2, b2, needs2, x.dtype, a_qt)
        # with the next layer's QKV's amax: y again, apart, and cast for that linear, 1 / its scale, amax, and with
        # `transposed` the cast copy transposed (else 0 rows)
        handed = ()
        if amax_next is None:
            y, s, bits, mean, rstd = torch.ops.bert.dropout_add_layer_norm(h2, residual, gamma, beta, None, seed, p,
                                                                           eps, from_output)
        else:
            scale_next = cast_scale(amax_next, E4M3)
            y, s, bits, mean, rstd, y_q, amax_y, y2, y_qt = torch.ops.bert.dropout_add_layer_norm_fp8(
                h2, residual, gamma, beta, seed, p, eps, scale_next, True, transposed, from_output)
            handed = (y2, y_q, scale_next.reciprocal(), amax_y, y_qt)
        ctx.save_for_backward(*saved1, h, *saved2, *norm_saved(y, s, bits, mean, rstd, gamma, beta, from_output))
        ctx.mark_non_differentiable(amax, *handed[1:])
        ctx.set_materialize_grads(False)
        ctx.amax_grads, ctx.p = (amax_g1, amax_g2), p  # not saved: written in backward
        ctx.dtypes = (linear_dtypes(x, w1, b1), linear_dtypes(x, w2, b2))
        return y, amax, *handed

    @staticmethod
    def backward(ctx, grad: Tensor | None, _amax: None, grad2: Tensor | None = None, *_unused: None):
        grad, grad2 = first_read(grad, grad2)
        if grad is None:
            return (None,) * 21
        saved = ctx.saved_tensors
        (amax_g1, amax_g2), (dtypes1, dtypes2) = ctx.amax_grads, ctx.dtypes
        # the norm and the second linear (Float8ResidualOutput's backward), then the GELU and the first linear
        # (Float8BiasGELU's), where anything before it wants a gradient
        da, dw2, db2, ds, dgamma, dbeta = linear_norm_backward(grad, grad2, saved[9:], ctx.p, saved[5:9], dtypes2,
                                                               amax_g2, ctx.needs_input_grad[6])
        dx = dw1 = db1 = None
        if da is not None:
            dx, dw1, db1 = linear_gelu_backward(da, saved[4], saved[:4], dtypes1, amax_g1, ctx.needs_input_grad[2])
        return (dx, dw1, db1, None, None, dw2, db2, None, None, ds, dgamma, dbeta,
                None, None, None, None, None, None, None, None, None)


class Float8FeedForwardOutput(Float8ResidualOutput):
    """A layer's FFN close (a Float8ResidualOutput, the same submodules) that runs the whole FFN with its opening
    Float8BiasGELU as `_Float8FeedForward` (`ends`)."""

    @classmethod
    def from_module(cls, module: Float8ResidualOutput) -> Float8FeedForwardOutput:
        if type(module) is not Float8ResidualOutput:
            raise ValueError(f"Float8FeedForwardOutput takes a Float8ResidualOutput, not {type(module).__name__}")
        return super().from_module(module)

    hands_on = False  # whether the next layer's attention takes its output in e4m3 (`apply_fp8_attention_block`)

    def ends(self, opening: Float8BiasGELU, stream: Stream, into: nn.Module | None = None) -> Stream:
        fc1, fc2, norm, residual = opening.dense, self.dense, self.LayerNorm, stream.residual
        p = self.dropout.p if self.training else 0.0
        flat = fc1.flat_input(stream.x)
        x_q, inv_x, amax_x, x_qt = stream.float8 or (None, None, None, None)
        # the next layer's QKV, where its attention sublayer is one Function too (and not under autocast, whose
        # copy of the input that linear would cast)
        next_linear = into.self.qkv if into is not None and self.hands_on and not autocast_on(flat) else None
        transposed = wants_transpose(next_linear)
        w1, b1, w2, b2, gamma, beta = without_grad(fc1.weight, fc1.bias, fc2.weight, fc2.bias, norm.weight,
                                                   norm.bias)
        y, amax, *handed = _Float8FeedForward.apply(
            flat, w1, b1, fc1.amax_input, fc1.amax_grad, w2, b2, fc2.amax_input,
            fc2.amax_grad, residual.reshape(-1, residual.shape[-1]).contiguous(), gamma, beta,
            dropout_seed(p, flat.device), p, norm.eps, x_q, inv_x, x_qt,
            None if next_linear is None else next_linear.amax_input, transposed, self.from_output)
        if fc1.records():  # each linear's input amax, as DelayedFloat8Linear.through records them
            with torch.no_grad():
                if x_q is None:
                    record_amax(fc1.amax_input, flat)
                else:  # the close that cast it took its amax
                    keep_amax(fc1.amax_input, amax_x)
                keep_amax(fc2.amax_input, amax)
        y = y.view(residual.shape)
        if not handed:  # one tensor twice: no layer after it takes two (the last), or the two would fold again
            return Stream(y, y)
        y2, *float8 = handed
        return Stream(y, y2.view(residual.shape), handed_on(float8, transposed))


def apply_fp8_feed_forward(model: nn.Module) -> list[str]:
    """Swap the FFN close of every BertLayer of `model` whose FFN is a Float8BiasGELU then a Float8ResidualOutput
    for a Float8FeedForwardOutput, in place (after the other float8 swaps); the names swapped."""
    swapped = []
    for name, layer in model.named_modules():
        if isinstance(layer, BertLayer) and type(layer.intermediate) is Float8BiasGELU \
                and type(layer.output) is Float8ResidualOutput:
            layer.output = Float8FeedForwardOutput.from_module(layer.output)
            swapped.append(f"{name}.output")
    return swapped
