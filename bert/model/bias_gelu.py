"""`BIAS_GELU=fused`: the FFN's bias and GELU in one Triton kernel each way, the bias gradient summed in the
backward's pass (`bert::bias_gelu`, `bert::bias_gelu_backward`).

Why: compiled for an H100 (bench/gpu_compile.py, `model-step`, BERT-large at 24,576 tokens) the FFN's bias gradient
is a kernel of its own, `triton_red_fused_sum`: it reads the GELU backward's (T, 4096) output again to sum its
columns, 4.6 GB of the step's 67.2 GB, about 1.4 ms at an H100's 3.35 TB/s. Inductor fuses a column sum into the
pointwise kernel before it only when it leaves the reduction unsplit, and then a program takes a block of columns
down all T rows: 4096 columns are 64 programs for 132 SMs. Here a program takes 256 columns of 512 rows, writes its
part of the GELU's gradient and the column sums of that part (fp32); a (T / 512, 4096) sum of those is the bias
gradient, under 1 MB a layer. The forward adds the bias where it computes the GELU, so the FFN's first GEMM runs
without one (cuBLAS's epilogue added it for free, so the forward's bytes are unchanged).

Both kernels compute BERT's exact GELU with erfc as Numerical Recipes' rational function of one exp2, as GELU=rational
does (bert.model.gelu: within 6e-8 |x| of the erf GELU; its instruction counts), the backward by the exact
derivative's form Phi(x) + x phi(x). The pre-activation h + b is formed in fp32, not rounded to the GEMM's dtype
first. On the CPU (and for float64) the same formula runs in torch's ops.

The MLM head's GELU (a few thousand rows) is left to GELU. Under delayed float8 (PRECISION=fp8, FP8_RECIPE=delayed)
the FFN swaps again, for bert.model.fp8_bias_gelu's form: the bias in the float8 GEMM, the GELU's gradient cast to
float8 in its backward's pass. torchao's float8 linear keeps its bias in its own GEMM and the module's activation
(the config refuses BIAS_GELU=fused with torchao's recipes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bert.model.compile_keys import key_on_source
from bert.model.gelu import arithmetic_dtype, gelu_slope, rational_gelu_reference
from bert.model.layers import BertIntermediate
from bert.model.swap import swap_modules

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheel has no Triton: the CPU path needs none
    triton = None

BIAS_GELUS = ("torch", "fused")  # BIAS_GELU: the FFN's nn.Linear bias + GELU module, or this module's kernels
# rows and columns a program takes: (BT rows at a time, BN columns, rows a backward program sums, warps); chosen
# for the partial sums' size and the programs' count at BERT-large's shapes, and for what sm_90's compile gives
# (bench/bias_gelu_sass.py): 16 rows at a time, 80 registers a thread in the backward, three blocks an SM, where 32
# took 162 (one); not timed on a GPU
TILE = (16, 256, 512, 8)

if triton is not None:

    @triton.jit
    def _half_erfc(x):
        """(erfc(|x| / sqrt 2) / 2, -x^2 / 2 in base 2): bert.model.gelu's `_half_erfc`, the same literals."""
        d = 1.0 + 0.35355339059327373 * tl.abs(x)
        t = tl.math.rsqrt(d * d)
        p = ((((((((0.24651729790196045 * t - 1.1861149450768025) * t + 2.147474463933521) * t - 1.637753152343414)
                  * t + 0.40232158165127635) * t - 0.2687568603388257) * t + 0.1396300565225048) * t
              + 0.5397006155284324) * t + 1.4427292039075317) * t - 2.825748218405333
        minus_a2 = (x * x) * -0.7213475204444817
        return t * tl.math.exp2(p + minus_a2), minus_a2

    @triton.jit
    def _slope(x):
        """GELU'(x) = Phi(x) + x phi(x): bert.model.gelu's `gelu_slope`, the same literals."""
        half_erfc, minus_a2 = _half_erfc(x)
        return tl.where(x >= 0, 1.0 - half_erfc, half_erfc) + x * tl.math.exp2(minus_a2 - 1.3257480647361592)

    @triton.jit
    def _where(rows, cols, tokens, width):
        """A (rows, cols) tile's offsets in a contiguous (tokens, width) tensor, and its mask."""
        return rows.to(tl.int64)[:, None] * width + cols[None, :], (rows < tokens)[:, None] & (cols < width)[None, :]

    @triton.jit
    def _tile(H, B, rows, cols, tokens, width):
        """The tile's offsets, its mask, and h + b in fp32 (0 outside)."""
        at, inside = _where(rows, cols, tokens, width)
        bias = tl.load(B + cols, mask=cols < width, other=0.0).to(tl.float32)
        return at, inside, tl.load(H + at, mask=inside, other=0.0).to(tl.float32) + bias[None, :]

    @triton.jit
    def _forward_kernel(H, B, Y, tokens, width, BT: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        at, inside, x = _tile(H, B, rows, cols, tokens, width)
        half_erfc, _ = _half_erfc(x)
        tl.store(Y + at, (x * tl.where(x >= 0, 1.0 - half_erfc, half_erfc)).to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _backward_kernel(G, H, B, DH, PARTS, tokens, width, BT: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr):
        """dH of ROWS rows x BN columns, and their column sums into PARTS[program row]."""
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        sums = tl.zeros((BT, BN), tl.float32)
        for r0 in tl.range(0, ROWS, BT):
            rows = tl.program_id(0) * ROWS + r0 + tl.arange(0, BT)
            at, inside, x = _tile(H, B, rows, cols, tokens, width)
            d = tl.load(G + at, mask=inside, other=0.0).to(tl.float32) * _slope(x)  # 0 outside
            tl.store(DH + at, d.to(DH.dtype.element_ty), mask=inside)
            sums += d
        tl.store(PARTS + tl.program_id(0) * width + cols, tl.sum(sums, 0), mask=cols < width)


def bias_gelu_torch(h: Tensor, bias: Tensor) -> Tensor:
    """GELU(h + b) in torch's ops, h + b in the compute dtype (fp32; float64 for float64)."""
    compute = arithmetic_dtype(h)
    return rational_gelu_reference(h.to(compute) + bias.to(compute)).to(h.dtype)


def bias_gelu_backward_torch(grad: Tensor, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(dh, db) in torch's ops: the gradient in the compute dtype, db its column sums before rounding."""
    compute = arithmetic_dtype(h)
    d = grad.to(compute) * gelu_slope(h.to(compute) + bias.to(compute))
    return d.to(h.dtype), d.sum(0).to(bias.dtype)


def _on_triton(h: Tensor) -> bool:
    return h.is_cuda and triton is not None and h.dtype in (torch.float16, torch.bfloat16, torch.float32)


def launch_forward(h: Tensor, bias: Tensor, tile: tuple[int, int, int, int] = TILE) -> Tensor:
    bt, bn, _, warps = tile
    tokens, width = h.shape
    y = torch.empty_like(h)
    _forward_kernel[(triton.cdiv(tokens, bt), triton.cdiv(width, bn))](h, bias, y, tokens, width, BT=bt, BN=bn,
                                                                num_warps=warps)
    return y


def launch_backward(grad: Tensor, h: Tensor, bias: Tensor, tile: tuple[int, int, int, int] = TILE
                    ) -> tuple[Tensor, Tensor]:
    bt, bn, rows, warps = tile
    tokens, width = h.shape
    dh = torch.empty_like(h)
    parts = torch.empty((triton.cdiv(tokens, rows), width), dtype=torch.float32, device=h.device)
    _backward_kernel[(parts.shape[0], triton.cdiv(width, bn))](grad, h, bias, dh, parts, tokens, width, BT=bt, BN=bn,
                                                        ROWS=rows, num_warps=warps)
    return dh, parts.sum(0).to(bias.dtype)


def _check(h: Tensor, bias: Tensor) -> None:
    if h.dim() != 2 or not h.is_contiguous() or bias.shape != (h.shape[1],):
        raise ValueError(f"bias_gelu takes a contiguous (T, N) h and an (N,) bias, got {tuple(h.shape)} and "
                         f"{tuple(bias.shape)}")


@torch.library.custom_op("bert::bias_gelu", mutates_args=())
def bias_gelu_op(h: Tensor, bias: Tensor) -> Tensor:
    """GELU(h + bias) of a contiguous (T, N) h, in h's dtype."""
    _check(h, bias)
    if not _on_triton(h):
        return bias_gelu_torch(h, bias)
    with torch.cuda.device(h.device):  # Triton launches on the current device
        return launch_forward(h, bias)


@bias_gelu_op.register_fake
def _(h: Tensor, bias: Tensor) -> Tensor:
    return h.new_empty(h.shape)


@torch.library.custom_op("bert::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(dh in h's dtype, db in the bias's) from the output's gradient."""
    _check(h, bias)
    if not _on_triton(h):
        return bias_gelu_backward_torch(grad, h, bias)
    with torch.cuda.device(h.device):
        return launch_backward(grad.contiguous(), h, bias)


@bias_gelu_backward.register_fake
def _(grad: Tensor, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    return h.new_empty(h.shape), bias.new_empty(bias.shape)


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    h, bias = inputs
    ctx.save_for_backward(h, bias)


def _backward(ctx, grad: Tensor):
    h, bias = ctx.saved_tensors
    dh, db = torch.ops.bert.bias_gelu_backward(grad, h, bias)
    return dh, db


bias_gelu_op.register_autograd(_backward, setup_context=_setup_context)
# traced into compiled graphs by the ops' names, with this module's fakes and backward: an edit here must miss them
key_on_source("bert::bias_gelu", __file__)


class FusedBiasGELU(BertIntermediate):
    """BertIntermediate through `bert::bias_gelu`, with the same submodules (names, checkpoints and optimizer groups
    unchanged): the dense's GEMM without its bias, the bias added and its gradient summed in the kernels. Another
    dense (torchao's float8 linear) keeps its bias in its own GEMM and the module's activation; our delayed float8
    linear is bert.model.fp8_bias_gelu's."""

    @classmethod
    def from_module(cls, module: BertIntermediate) -> FusedBiasGELU:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.dense, new.activation = module.dense, module.activation
        return new.train(module.training)

    def forward(self, x: Tensor) -> Tensor:
        if type(self.dense) is not nn.Linear or self.dense.bias is None:
            return self.activation(self.dense(x))
        h = F.linear(x, self.dense.weight).reshape(-1, self.dense.out_features)
        return torch.ops.bert.bias_gelu(h, self.dense.bias).reshape(*x.shape[:-1], -1)


def check_bias_gelu(kind: str, device: torch.device) -> str:
    """A ValueError naming BIAS_GELU unless `kind` is one of BIAS_GELUS and runs on `device` (the fused kernels
    are Triton's on CUDA); the kind."""
    if _known(kind) == "fused" and device.type == "cuda" and triton is None:
        raise ValueError("BIAS_GELU=fused needs Triton on CUDA (it ships with torch's CUDA wheels); it is not "
                         "installed here")
    return kind


def apply_bias_gelu(model: nn.Module, kind: str) -> list[str]:
    """BIAS_GELU: with `fused`, swap every BertIntermediate of `model` for a FusedBiasGELU, in place; the names
    swapped (none for `torch`)."""
    if _known(kind) == "torch":
        return []
    return swap_modules(model, lambda module, _: type(module) is BertIntermediate, FusedBiasGELU.from_module)


def _known(kind: str) -> str:
    if kind not in BIAS_GELUS:
        raise ValueError(f"BIAS_GELU={kind!r} is not one of {', '.join(BIAS_GELUS)}")
    return kind
