"""`BIAS_GELU=fused` under `PRECISION=fp8` with `FP8_RECIPE=delayed`: the FFN's first float8 linear and its GELU as
one autograd Function, whose backward casts the GELU's gradient to float8 in the pass that computes it
(`bert::gelu_backward_fp8`).

Why: compiled for an H100 (bench/gpu_compile.py, `fp8-delayed-layers-step`, BERT-large at 24,576 tokens), the
float8 FFN's GELU backward is two passes over the (T, 4096) gradient and pre-activation: inductor's pointwise kernel
that computes the gradient and writes its float8 copy for the linear's GEMMs (11.6 GB a step), and a reduction that
computes it again for its amax (the next step's scale) and its column sums (the bias gradient), 9.3 GB. One Triton
kernel here does all three: a program takes 256 columns of 512 rows, writes its part of the float8 gradient, and
its part's column sums and largest magnitude; small sums and a max of those finish them. It also writes the float8
gradient transposed, the weight gradient's operand (`bert::fp8_transpose` would read the copy back for it: 2.4 GB of
the step), 16 tokens of a column at a time, through shared memory (6 more instructions an element). The forward is the
float8 GEMM with the bias in its epilogue, then the GELU in torch's ops, which inductor fuses with the next
linear's float8 cast, as it did before (this Function's forward is traced into the graph).

The arithmetic is the unfused path's (a DelayedFloat8Linear, then GELU=rational), step for step: the gradient
dy GELU'(h) in fp32 with GELU=rational's slope, rounded to dy's dtype, its amax of that (a non-finite one keeps the
old), scaled by the previous step's amax and saturated to e5m2. The bias gradient sums the unrounded fp32 values, as
BIAS_GELU=fused's bf16 kernel does (the unfused path sums the rounded gradient). The forward's GELU is GELU=rational's
formula whatever GELU says, as BIAS_GELU=fused's kernels are. On the CPU (and for float64) the same runs in torch's
ops. Only our delayed float8 linear: torchao's Float8Linear keeps the module's own activation
(bert.model.bias_gelu's fallback; the config refuses BIAS_GELU=fused with torchao's recipes).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bert.model.bias_gelu import TILE, FusedBiasGELU, triton
from bert.model.compile_keys import key_on_source
from bert.model.fp8_delayed import (
    E5M2,
    DelayedFloat8Linear,
    amax_of,
    cast_scale,
    float8_grads,
    float8_matmul_forward,
    keep_amax,
    saturated_cast,
)
from bert.model.gelu import arithmetic_dtype, gelu_slope, rational_gelu_reference
from bert.model.swap import swap_modules

if triton is not None:
    import triton.language as tl

    from bert.model.bias_gelu import _slope, _where

    @triton.jit
    def _backward_kernel(G, H, DQ, DQT, SCALE, PARTS, AMAXES, tokens, width, BT: tl.constexpr, BN: tl.constexpr,
                         ROWS: tl.constexpr):
        """ROWS rows x BN columns of e5m2(round(dy GELU'(h)) x scale), into DQ and transposed into DQT (BT tokens
        contiguous a column), their column sums into PARTS[program row] and their largest magnitude into
        AMAXES[program] (infinity for a NaN, so that it is not kept)."""
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        scale = tl.load(SCALE)
        sums = tl.zeros((BT, BN), tl.float32)
        top = tl.zeros((BT, BN), tl.float32)
        for r0 in tl.range(0, ROWS, BT):
            rows = tl.program_id(0) * ROWS + r0 + tl.arange(0, BT)
            at, inside = _where(rows, cols, tokens, width)
            x = tl.load(H + at, mask=inside, other=0.0).to(tl.float32)
            d = tl.load(G + at, mask=inside, other=0.0).to(tl.float32) * _slope(x)  # 0 outside
            r = d.to(G.dtype.element_ty).to(tl.float32)  # the gradient as the unfused path holds it
            q = tl.clamp(r * scale, -57344.0, 57344.0)  # e5m2's largest: saturated, as scaled_cast does
            e5m2 = q.to(tl.float8e5)
            tl.store(DQ + at, e5m2, mask=inside)
            tl.store(DQT + cols.to(tl.int64)[None, :] * tokens + rows[:, None], e5m2, mask=inside)
            sums += d
            top = tl.maximum(top, tl.where(r == r, tl.abs(r), float("inf")))
        tl.store(PARTS + tl.program_id(0) * width + cols, tl.sum(sums, 0), mask=cols < width)
        tl.store(AMAXES + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.max(tl.max(top, 1), 0))


def gelu_backward_fp8_torch(grad: Tensor, h: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(e5m2 gradient, its transpose, bias gradient in the compute dtype, amax in fp32) in torch's ops (module
    doc)."""
    compute = arithmetic_dtype(h)
    d = grad.to(compute) * gelu_slope(h.to(compute))
    rounded = d.to(grad.dtype)
    q = saturated_cast(rounded, scale, E5M2)
    return q, q.t().contiguous(), d.sum(0), amax_of(rounded)


def launch_backward(grad: Tensor, h: Tensor, scale: Tensor, tile: tuple[int, int, int, int] = TILE
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    bt, bn, rows, warps = tile
    tokens, width = h.shape
    q = torch.empty(h.shape, dtype=E5M2, device=h.device)
    q_t = torch.empty((width, tokens), dtype=E5M2, device=h.device)
    grid = (triton.cdiv(tokens, rows), triton.cdiv(width, bn))
    parts = torch.empty((grid[0], width), dtype=torch.float32, device=h.device)
    amaxes = torch.empty(grid, dtype=torch.float32, device=h.device)
    _backward_kernel[grid](grad, h, q, q_t, scale, parts, amaxes, tokens, width, BT=bt, BN=bn, ROWS=rows,
                           num_warps=warps)
    return q, q_t, parts.sum(0), amaxes.amax()


@torch.library.custom_op("bert::gelu_backward_fp8", mutates_args=())
def gelu_backward_fp8(grad: Tensor, h: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """From the GELU output's gradient and the pre-activation h (contiguous (T, N)) and the e5m2 scale (fp32,
    0-dim): h's gradient in e5m2, the same transposed ((N, T) contiguous: the weight gradient's operand), its column
    sums (the bias gradient) and its amax (module doc)."""
    if h.dim() != 2 or not h.is_contiguous() or grad.shape != h.shape or scale.shape != ():
        raise ValueError(f"gelu_backward_fp8 takes a (T, N) gradient and contiguous h and a 0-dim scale, got "
                         f"{tuple(grad.shape)}, {tuple(h.shape)} and {tuple(scale.shape)}")
    if not (h.is_cuda and triton is not None and h.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return gelu_backward_fp8_torch(grad, h, scale)
    with torch.cuda.device(h.device):  # Triton launches on the current device
        return launch_backward(grad.contiguous(), h, scale.float())


@gelu_backward_fp8.register_fake
def _(grad: Tensor, h: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (h.new_empty(h.shape, dtype=E5M2), h.new_empty(h.shape[::-1], dtype=E5M2),
            h.new_empty(h.shape[1:], dtype=arithmetic_dtype(h)), scale.new_empty((), dtype=torch.float32))


# traced into compiled graphs by the op's name: an edit here (or of bert.model.bias_gelu's `_slope`, keyed there)
# must miss them
key_on_source("bert::gelu_backward_fp8", __file__)


class _Float8MatmulGELU(torch.autograd.Function):
    """GELU(x @ w^T + b), the GEMM in float8 with delayed scaling (bert.model.fp8_delayed), its output gradient cast
    to e5m2 in the GELU backward's pass (module doc)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None, amax_input: Tensor, amax_grad: Tensor) -> Tensor:
        h, saved = float8_matmul_forward(ctx, x, w, bias, amax_input, amax_grad)
        ctx.save_for_backward(*saved, h)
        return rational_gelu_reference(h)

    @staticmethod
    def backward(ctx, grad: Tensor):
        dx, dw, db = linear_gelu_backward(grad, ctx.saved_tensors[4], ctx.saved_tensors[:4], ctx.dtypes,
                                          ctx.amax_grad, ctx.needs_input_grad[2])
        return dx, dw, db, None, None


def linear_gelu_backward(grad: Tensor, h: Tensor, linear_saved, dtypes, amax_grad: Tensor, needs_bias: bool
                         ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The backward of GELU(a float8 linear's output h), from the GELU output's gradient and what the forward saved
    (the linear's four, `float8_linear`; its `linear_dtypes`): (dx, dw, db), the gradient's amax kept in
    `amax_grad`."""
    scale = cast_scale(amax_grad, E5M2)  # the previous step's amax
    g_q, g_qt, db, amax = torch.ops.bert.gelu_backward_fp8(grad.contiguous(), h, scale)
    keep_amax(amax_grad, amax)  # the next step's scale
    dx, dw = float8_grads(linear_saved, dtypes, g_q, scale.reciprocal(), grad.dtype, g_qt)
    return dx, dw, db.to(dtypes[2]) if needs_bias else None


class Float8BiasGELU(FusedBiasGELU):
    """FusedBiasGELU over a DelayedFloat8Linear dense (the same submodules): `_Float8MatmulGELU` of the input."""

    @classmethod
    def from_module(cls, module: FusedBiasGELU) -> Float8BiasGELU:
        new = super().from_module(module)
        if not isinstance(new.dense, DelayedFloat8Linear) or new.dense.bias is None:
            raise ValueError("Float8BiasGELU takes a FusedBiasGELU whose dense is a DelayedFloat8Linear with a bias")
        return new

    def forward(self, x: Tensor) -> Tensor:
        return self.dense.through(_Float8MatmulGELU, x)


def apply_fp8_bias_gelu(model: nn.Module) -> list[str]:
    """Swap every FusedBiasGELU of `model` whose dense is a DelayedFloat8Linear for a Float8BiasGELU, in place (after
    the float8 conversion); the names swapped."""
    return swap_modules(model, lambda module, _: type(module) is FusedBiasGELU
                        and isinstance(module.dense, DelayedFloat8Linear), Float8BiasGELU.from_module)
