"""`RESIDUAL_NORM=fused` under `PRECISION=fp8` with `FP8_RECIPE=delayed`: a sublayer's closing float8 linear and its
dropout + residual + LayerNorm as one autograd Function, whose backward casts the dense layer's output gradient to
float8 in the norm backward's pass (`bert::dropout_add_layer_norm_backward_fp8`).

Why: compiled for an H100 (bench/gpu_compile.py, BERT-large's per-layer delayed-float8 step at 24,576 tokens), the
fused norm moved more than inductor's own LayerNorm (107.8 GB against 102.6 with ATTENTION=triton): our kernels are
opaque to inductor, so the float8 linear before the norm read the norm's bf16 gradient again, to cast it to e5m2, to
take its amax (the next step's scale) and to sum its columns (the bias gradient), passes that inductor's LayerNorm
backward takes into its own kernel. Here the norm's backward kernel (bert.model.dropout_add_norm's, FLOAT8) writes
the e5m2 gradient instead of the bf16 one, with each program's largest magnitude; it already sums the dense bias's
gradient. The forward is the float8 GEMM with the bias in its epilogue (`float8_matmul_forward`), then the norm's
forward kernel unchanged.

The arithmetic is the unfused path's (a FusedResidualOutput over a DelayedFloat8Linear), step for step: h's gradient
in fp32, rounded to h's dtype, its amax of that (a non-finite one keeps the old), scaled by the previous step's amax
and saturated to e5m2. The bias gradient sums the unrounded fp32 values, as the bf16 kernel's does (the unfused path
sums the rounded gradient). Here the norm's output leaves in bf16 and its float8 copy, for the next sublayer's
linear, is cast there; `dropout_add_layer_norm_fp8` is the norm that casts it too, given the consumer's scale (the
attention sublayer's close uses it for the FFN, bert.model.fp8_attention_block). On the CPU (and for float64) the
same runs in torch's ops.

On the fake H100 the step with it moves 103.1 GB (ATTENTION=triton; results/bench/gpu_compile_fp8_norm.json): about
even with inductor's own LayerNorm, no longer behind it. The residual gradient's add before our op (6.9 GB:
autograd summed the next sublayer's two gradients first) is half ours now: the attention's norm returns its output
as a Stream (`paired`, bert.model.layers), whose two gradients the kernel adds (`dy2`;
results/bench/gpu_compile_fp8_stream.json); the layer's output, which leaves a COMPILE_SCOPE=layers graph, is two
tensors apart where the FFN is one Function (bert.model.fp8_feed_forward, `twice` below). The output's float8 cast
(3.6 GB) is the norm's own there too (`dropout_add_layer_norm_fp8`). Both kernels also write their float8 output
transposed (`transposed`, the kernels' TRANSPOSE), the weight gradient's operand, where `bert::fp8_transpose` read
the copy back for it (96 calls, 2.4 GB of the step).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bert.model.compile_keys import key_on_source
from bert.model.dropout_add_norm import (
    FusedResidualOutput,
    _on_triton,
    _outputs,
    backward_torch,
    check_forward,
    forward_torch,
    launch_backward,
    launch_forward,
    saved_norm,
)
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
from bert.model.layers import Stream
from bert.model.philox import dropout_seed
from bert.model.swap import swap_modules


@torch.library.custom_op("bert::dropout_add_layer_norm_backward_fp8", mutates_args=())
def dropout_add_layer_norm_backward_fp8(dy: Tensor, s: Tensor, bits: Tensor, mean: Tensor, rstd: Tensor,
                                        weight: Tensor, p: float, h_dtype: torch.dtype, scale: Tensor,
                                        dy2: Tensor | None = None, transposed: bool = False,
                                        beta: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`bert::dropout_add_layer_norm_backward`'s gradients with d h in e5m2 (rounded to `h_dtype` first, times
    `scale`, 0-dim fp32, saturated), and its amax (fp32, of the rounded values): d h, d s, the column sums (3, N),
    the amax, and with `transposed` d h transposed ((N, T) contiguous: the dense layer's weight-gradient operand,
    written by the same kernel; else 0 rows) (module doc). `dy2`: y's gradient is dy + dy2, added in the kernel's
    pass (the paired output's). With `beta` (the norm's), `s` is the forward's output y (RESIDUAL_NORM=fused-lean)."""
    if scale.shape != ():
        raise ValueError(f"the e5m2 scale must be 0-dim, got {tuple(scale.shape)}")
    if dy2 is not None and (dy2.shape != dy.shape or dy2.dtype != dy.dtype):
        raise ValueError(f"the second gradient {tuple(dy2.shape)} {dy2.dtype} must be the first's "
                         f"{tuple(dy.shape)} {dy.dtype}")
    dh, ds, sums = _grads(dy, s, mean)
    dht = _transposed(dh, transposed)
    if not _on_triton(s, mean) or h_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        rounded = torch.empty_like(s, dtype=h_dtype)
        backward_torch(dy if dy2 is None else dy + dy2, s, bits, mean, rstd, weight, p, (rounded, ds, sums), beta)
        dh.copy_(saturated_cast(rounded, scale, E5M2))
        return dh, ds, sums, amax_of(rounded), dht.copy_(dh.t()[:len(dht)])
    if not s.shape[0]:
        return dh, ds, sums.zero_(), scale.new_zeros((), dtype=torch.float32), dht
    with torch.cuda.device(s.device):  # Triton launches on the current device
        amax = launch_backward(dy, s, bits, mean, rstd, weight, p, (dh, ds, sums), (scale.float(), h_dtype), dy2,
                               dht if transposed else None, beta)
    return dh, ds, sums, amax, dht


def _grads(dy: Tensor, s: Tensor, mean: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(s, dtype=E5M2), torch.empty_like(s),
            torch.empty((3, s.shape[1]), dtype=mean.dtype, device=s.device))


def _transposed(t: Tensor, transposed: bool, dtype: torch.dtype | None = None) -> Tensor:
    """An (N, T) tensor (of `dtype`, else `t`'s) for (T, N) `t` transposed, or (0, T) without `transposed`."""
    return t.new_empty((t.shape[1] if transposed else 0, t.shape[0]), dtype=dtype or t.dtype)


@dropout_add_layer_norm_backward_fp8.register_fake
def _(dy, s, bits, mean, rstd, weight, p, h_dtype, scale, dy2=None, transposed=False, beta=None):
    dh, ds, sums = _grads(dy, s, mean)
    return dh, ds, sums, scale.new_empty((), dtype=torch.float32), _transposed(dh, transposed)


# traced into compiled graphs by the op's name: an edit here (or of the norm's kernels, keyed there) must miss them
key_on_source("bert::dropout_add_layer_norm_backward_fp8", __file__)


@torch.library.custom_op("bert::dropout_add_layer_norm_fp8", mutates_args=())
def dropout_add_layer_norm_fp8(h: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, seed: Tensor | None,
                               p: float, eps: float, scale: Tensor, twice: bool = False, transposed: bool = False,
                               from_output: bool = False
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`bert::dropout_add_layer_norm`'s (y, s, bits, mean, rstd), y in e4m3 (rounded to its dtype, times `scale`,
    0-dim fp32, saturated) with its amax (fp32, of the rounded values): the next float8 linear's input, cast where
    y is made (bert.model.fp8_attention_block hands it to the FFN, bert.model.fp8_feed_forward to the next layer);
    with `twice` y again, a tensor apart (else 0 rows): the layer's output as two tensors (bert.model.layers'
    Stream); and with `transposed` the e4m3 copy transposed ((N, T) contiguous, else 0 rows): the next linear's
    weight-gradient operand. All written in the same kernel. `from_output`: s has 0 rows (unwritten), the backward
    works from y."""
    check_forward(h, residual, p, seed)
    if scale.shape != ():
        raise ValueError(f"the e4m3 scale must be 0-dim, got {tuple(scale.shape)}")
    out = _outputs(h, residual, p, from_output)
    y2 = _second(out[0], twice)
    y_qt = _transposed(out[0], transposed, E4M3)
    if not _on_triton(h, out[3]):  # the torch path: the norm's, then torch's cast
        forward_torch(h, residual, weight, bias, None, seed, p, eps, out)
        y_q = saturated_cast(out[0], scale, E4M3)
        return (*out, y_q, amax_of(out[0]), y2.copy_(out[0][:len(y2)]), y_qt.copy_(y_q.t()[:len(y_qt)]))
    if not h.shape[0]:
        return (*out, torch.empty_like(out[0], dtype=E4M3), scale.new_zeros((), dtype=torch.float32), y2, y_qt)
    y_q, amaxes = torch.empty_like(out[0], dtype=E4M3), torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    with torch.cuda.device(h.device):  # Triton launches on the current device
        launch_forward(h, residual, weight, bias, None, seed, p, eps, out, (y_q, scale.float(), amaxes),
                       y2 if twice else None, y_qt if transposed else None)
    return (*out, y_q, amaxes.amax(), y2, y_qt)


def _second(y: Tensor, twice: bool) -> Tensor:
    return y.new_empty((y.shape[0] if twice else 0, y.shape[1]))


@dropout_add_layer_norm_fp8.register_fake
def _(h, residual, weight, bias, seed, p, eps, scale, twice=False, transposed=False, from_output=False):
    out = _outputs(h, residual, p, from_output)
    y_q = torch.empty_like(out[0], dtype=E4M3)
    return (*out, y_q, scale.new_empty((), dtype=torch.float32), _second(out[0], twice), _transposed(y_q, transposed))


key_on_source("bert::dropout_add_layer_norm_fp8", __file__)


class _Float8MatmulResidualNorm(torch.autograd.Function):
    """LayerNorm(dropout(x @ w^T + b) + residual), the GEMM in float8 with delayed scaling (bert.model.fp8_delayed),
    its output gradient cast to e5m2 in the norm backward's pass (module doc). With `twice`, the output twice, an
    alias (a Stream), whose two gradients the kernel adds. `from_output`: the norm's backward from y (no sum kept)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None, amax_input: Tensor, amax_grad: Tensor,
                residual: Tensor, gamma: Tensor, beta: Tensor, seed: Tensor | None, p: float, eps: float,
                twice: bool, from_output: bool) -> Tensor | tuple[Tensor, Tensor]:
        h, saved = float8_matmul_forward(ctx, x, w, bias, amax_input, amax_grad)
        y, s, bits, mean, rstd = torch.ops.bert.dropout_add_layer_norm(h, residual, gamma, beta, None, seed, p, eps,
                                                                       from_output)
        ctx.save_for_backward(*saved, *norm_saved(y, s, bits, mean, rstd, gamma, beta, from_output))
        ctx.set_materialize_grads(False)  # an output unread: no zeros to add
        ctx.p = p
        return (y, y.view_as(y)) if twice else y

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad2: Tensor | None = None):
        grad, grad2 = first_read(grad, grad2)
        if grad is None:  # no output read
            return (None,) * 13
        dx, dw, db, ds, dgamma, dbeta = linear_norm_backward(
            grad, grad2, ctx.saved_tensors[4:], ctx.p, ctx.saved_tensors[:4], ctx.dtypes, ctx.amax_grad,
            ctx.needs_input_grad[2])
        return dx, dw, db, None, None, ds, dgamma, dbeta, None, None, None, None, None


def norm_saved(y: Tensor, s: Tensor, bits: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, beta: Tensor,
               from_output: bool) -> tuple[Tensor | None, ...]:
    """What a norm's backward reads (`linear_norm_backward`'s `norm_saved`): y and beta with `from_output`, else
    s (beta None)."""
    x, beta_or_none = saved_norm(y, s, beta, from_output)
    return x, bits, mean, rstd, gamma, beta_or_none


def first_read(grad: Tensor | None, grad2: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """A paired output's two gradients (either None where unread) with the first one a tensor if either is."""
    return (grad2, None) if grad is None else (grad, grad2)


def linear_norm_backward(grad: Tensor, grad2: Tensor | None, norm_saved, p: float, linear_saved, dtypes,
                         amax_grad: Tensor, needs_bias: bool) -> tuple[Tensor | None, ...]:
    """The backward of LayerNorm(dropout(a float8 linear's output) + residual), from y's gradient (in two parts
    where `grad2` is given) and what the forward saved (the norm's `norm_saved`; the linear's four,
    `float8_linear`; its `linear_dtypes`): (dx, dw, db, d residual, d gamma, d beta), the output gradient's amax kept
    in `amax_grad`. Autograd casts d residual and the norm's sums to their inputs' dtypes."""
    s, bits, mean, rstd, gamma, beta = norm_saved  # s: y where beta is given
    h_dtype = dtypes[0]  # the GEMM's output: the input's dtype
    scale = cast_scale(amax_grad, E5M2)  # the previous step's amax
    wants_dw = linear_saved[0] is not None  # the input's transpose saved: the weight's gradient is wanted
    g_q, ds, sums, amax, g_qt = torch.ops.bert.dropout_add_layer_norm_backward_fp8(
        grad.contiguous(), s, bits, mean, rstd, gamma, p, h_dtype, scale,
        None if grad2 is None else grad2.contiguous(), wants_dw, beta)
    keep_amax(amax_grad, amax)  # the next step's scale
    dx, dw = float8_grads(linear_saved, dtypes, g_q, scale.reciprocal(), h_dtype, g_qt if wants_dw else None)
    return dx, dw, sums[2].to(dtypes[2]) if needs_bias else None, ds, sums[0], sums[1]


class Float8ResidualOutput(FusedResidualOutput):
    """FusedResidualOutput over a DelayedFloat8Linear dense (the same submodules): `_Float8MatmulResidualNorm` of
    the input and the residual."""

    @classmethod
    def from_module(cls, module: FusedResidualOutput) -> Float8ResidualOutput:
        new = super().from_module(module)
        if not isinstance(new.dense, DelayedFloat8Linear):
            raise ValueError("Float8ResidualOutput takes a FusedResidualOutput whose dense is a DelayedFloat8Linear")
        return new

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        return self._through(h, residual, False).view(residual.shape)

    def paired(self, h: Tensor, residual: Tensor) -> Stream:
        """The output twice, each with its gradient, added in the backward's kernel (`Stream`): where the next
        sublayer's first linear is a float8 one, whose input gradient `torch._scaled_mm` cannot add to the
        residual's as cuBLAS's addmm does for a bf16 one (inductor's rewrite there)."""
        return Stream(*(y.view(residual.shape) for y in self._through(h, residual, True)))

    def _through(self, h: Tensor, residual: Tensor, twice: bool):
        p = self.dropout.p if self.training else 0.0
        norm = self.LayerNorm
        flat = residual.reshape(-1, residual.shape[-1]).contiguous()
        return self.dense.through(_Float8MatmulResidualNorm, h, flat, norm.weight, norm.bias,
                                  dropout_seed(p, h.device), p, norm.eps, twice, self.from_output)


def apply_fp8_residual_norm(model: nn.Module) -> list[str]:
    """Swap every FusedResidualOutput of `model` whose dense is a DelayedFloat8Linear for a Float8ResidualOutput, in
    place (after the float8 conversion); the names swapped."""
    return swap_modules(model, lambda module, _: type(module) is FusedResidualOutput
                        and isinstance(module.dense, DelayedFloat8Linear), Float8ResidualOutput.from_module)
