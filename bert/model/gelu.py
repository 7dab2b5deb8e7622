"""BERT's exact (erf) GELU with erfc as a rational function of one exp2 (GELU=rational), for fewer instructions
an element in the compiled step's GELU kernels.

On the H200 the FFN's GELU kernels moved their bytes at 53 and 57 % of the card's bandwidth, forward and backward:
libdevice's erf (and the backward's exp) bound them at the issue rate, not at memory. Compiled for an H100 they run
38.6 and 53.1 SASS instructions an element, this module's 26.0 and 31.0 (bench/gelu_sass.py). Here

    GELU(x) = x Phi(x),  Phi(x) = 1 - erfc(a) / 2 for x >= 0, erfc(a) / 2 below,  a = |x| / sqrt(2),
    erfc(a) = t exp(-a^2 + P(t)),  t = 1 / (1 + a / 2) = rsqrt((1 + a / 2)^2),

P a polynomial of degree 9 (Numerical Recipes' erfcc: fractional error under 1.2e-7 for every a >= 0), so
|GELU - exact| <= 6e-8 |x|, below float32's rounding of x itself; the fp32 F.gelu, 1 + erf of a negative argument,
cancels where this does not. The exponential is a power of 2, whose exponent also halves erfc. The backward takes
the exact derivative's form, Phi(x) + x phi(x) with phi(x) = exp(-a^2) / sqrt(2 pi): an autograd Function, so
autograd does not differentiate through the polynomial. Inductor fuses each way into one pointwise kernel, as it does
F.gelu; eagerly it is a dozen kernels each way, so it is for compiled runs (every device computes the same formula).

bf16 and fp16 inputs are computed in float32 and returned in their own dtype, as inductor computes F.gelu.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bert.model.cast import cast
from bert.model.swap import swap_modules

GELUS = ("torch", "rational")  # GELU: torch's F.gelu (erf, libdevice's on a GPU), or this module's


def arithmetic_dtype(x: Tensor) -> torch.dtype:
    """What the formula computes `x` in: float32 for half and float32 inputs, float64 for float64 (the torch path of
    bert.model.bias_gelu too)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _half_erfc(x: Tensor) -> tuple[Tensor, Tensor]:
    """(erfc(|x| / sqrt 2) / 2, -x^2 / 2 in base 2) for x in its compute dtype; the second is phi's exponent too.

    Every number is a literal: a module-level float read inside an autograd Function became a symbolic input under
    `dynamic=True` (the driver's compile), which dynamo could not lift into the Function's graph ("lift_tracked_
    freevar_to_input should not be called on root SubgraphTracer", torch 2.11 and 2.13)."""
    d = 1.0 + 0.35355339059327373 * x.abs()  # 1 + a / 2, a = |x| / sqrt 2
    # t = 1 / d as rsqrt(d^2): on a GPU one MUFU.RSQ and a multiply, where a division is the reciprocal, its
    # refinement and range checks (6 SASS instructions an element more); rsqrt.approx's error, 2^-22.9 by PTX's
    # manual, moves GELU by under 6e-8 max(1, |x|) (docs/journal.md, "GELU's instructions"); d^2 overflows only
    # where t is 0 to fp32 anyway
    t = torch.rsqrt(d * d)
    # Numerical Recipes' erfcc, erfc(a) = t exp(-a^2 + P(t)), in base 2 for libdevice's exp2 (one MUFU.EX2; its exp
    # is a range reduction more): P's coefficients times log2 e, and 1 off the constant term to halve the power
    # (tests/test_gelu.py derives them from the book's). Horner's rule: one multiply-add a coefficient.
    p = ((((((((0.24651729790196045 * t - 1.1861149450768025) * t + 2.147474463933521) * t - 1.637753152343414) * t
              + 0.40232158165127635) * t - 0.2687568603388257) * t + 0.1396300565225048) * t + 0.5397006155284324)
         * t + 1.4427292039075317) * t - 2.825748218405333
    minus_a2 = (x * x) * -0.7213475204444817  # -x^2 / 2 times log2 e
    return t * torch.exp2(p + minus_a2), minus_a2


def _phi_from(x: Tensor, half_erfc: Tensor) -> Tensor:
    """Phi(x), the normal distribution's CDF, from erfc(|x| / sqrt 2) / 2."""
    return torch.where(x >= 0, 1.0 - half_erfc, half_erfc)


def rational_gelu_reference(x: Tensor) -> Tensor:
    """The forward's arithmetic, outside autograd's Function (its forward, and what the tests hold to the bounds)."""
    xc = cast(x, arithmetic_dtype(x))
    half_erfc, _ = _half_erfc(xc)
    return cast(xc * _phi_from(xc, half_erfc), x.dtype)


def gelu_slope(x: Tensor) -> Tensor:
    """GELU'(x) = Phi(x) + x phi(x) for x in its compute dtype, with Phi from the same erfc (the backward's)."""
    half_erfc, minus_a2 = _half_erfc(x)
    # phi = exp(-x^2 / 2) / sqrt(2 pi) = 2^(minus_a2 + log2(1 / sqrt(2 pi)))
    return _phi_from(x, half_erfc) + x * torch.exp2(minus_a2 - 1.3257480647361592)


class _RationalGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return rational_gelu_reference(x)

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        xc = cast(x, arithmetic_dtype(x))
        return cast(cast(dy, xc.dtype) * gelu_slope(xc), dy.dtype)


def rational_gelu(x: Tensor) -> Tensor:
    """GELU(x) with erfc as a rational function of one exp2; its gradient by the exact derivative's form."""
    return _RationalGELU.apply(x)


class RationalGELU(nn.Module):
    """nn.GELU's place in the model (`apply_gelu`): no parameters, so checkpoints are unchanged."""

    def forward(self, x: Tensor) -> Tensor:
        return rational_gelu(x)


def check_gelu(kind: str) -> str:
    """A ValueError naming GELU unless `kind` is one of GELUS; the kind."""
    if kind not in GELUS:
        raise ValueError(f"GELU={kind!r} is not one of {', '.join(GELUS)}")
    return kind


def apply_gelu(model: nn.Module, kind: str) -> list[str]:
    """GELU: with `rational`, swap every exact nn.GELU of `model` (the FFNs' and the MLM head's) for RationalGELU,
    in place; the names swapped (none for `torch`)."""
    if check_gelu(kind) == "torch":
        return []
    exact = lambda module, _: type(module) is nn.GELU and module.approximate == "none"  # noqa: E731
    return swap_modules(model, exact, lambda _: RationalGELU())
