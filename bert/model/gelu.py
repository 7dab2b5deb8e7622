"""BERT's exact (erf) GELU with erfc as a rational function of one exp (GELU=rational), for fewer instructions
per element in the compiled step's GELU kernels.

On the H200 the FFN's GELU kernels (forward and backward, inductor's, fused with nothing else but the casts) moved
their bytes at 53 and 57 % of the card's bandwidth: libdevice's erf and exp, 42 and 65 SASS instructions an element,
bound them at the issue rate, not at memory (docs/journal.md, "The Triton attention's tiles"). Here

    GELU(x) = x Phi(x),  Phi(x) = 1 - erfc(a) / 2 for x >= 0, erfc(a) / 2 below,  a = |x| / sqrt(2),
    erfc(a) = t exp(-a^2 + P(t)),  t = 1 / (1 + a / 2),

P a polynomial of degree 9 (Numerical Recipes' erfcc, after Chebyshev: fractional error under 1.2e-7 for every
a >= 0), so |GELU - exact| <= 6e-8 |x|, below float32's rounding of x itself; the fp32 F.gelu, 1 + erf of a
negative argument, cancels where this does not. The backward takes the exact derivative's form,
Phi(x) + x phi(x) with phi(x) = exp(-a^2) / sqrt(2 pi), the same erfc for Phi: an autograd.Function, so autograd
does not differentiate through the polynomial. Inductor fuses each way into one pointwise kernel, as it does
F.gelu; eagerly it is a dozen kernels each way, so it is for compiled runs (any device computes it the same way).

bf16 and fp16 inputs are computed in float32 and returned in their own dtype, as inductor computes F.gelu.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from bert.model.swap import swap_modules

GELUS = ("torch", "rational")  # GELU: torch's F.gelu (erf, libdevice's on a GPU), or this module's

# Numerical Recipes' erfcc: erfc(a) = t exp(-a^2 + P(t)), P's coefficients from the constant term up
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
         0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)
# The same in base 2, as exp2 (one MUFU.EX2 with libdevice; exp is a range reduction more), with 1 taken off the
# constant term: 2^(u - 1) is half of 2^u, and Phi needs erfc / 2
_LOG2E = 1.0 / math.log(2.0)
_HALF_ERFC2 = (_ERFC[0] * _LOG2E - 1.0, *(c * _LOG2E for c in _ERFC[1:]))
_T_SLOPE = 0.5 / math.sqrt(2.0)  # t = 1 / (1 + a / 2) with a = |x| / sqrt 2
_PHI2 = -0.5 * _LOG2E  # phi's exponent, -x^2 / 2, in base 2
_LOG2_INV_SQRT_2PI = math.log2(1.0 / math.sqrt(2.0 * math.pi))


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` in `dtype`, itself where it is already: torch 2.11's dynamo (the GPU machines') routes the gradient of an
    autograd Function whose output aliases one of its intermediates, as a no-op `.to` returns, to the wrong output
    (zeros here; pytorch/pytorch#180642). Fixed by 2.13."""
    return t if t.dtype == dtype else t.to(dtype)


def _half_erfc(x: Tensor) -> tuple[Tensor, Tensor]:
    """(erfc(|x| / sqrt 2) / 2, -x^2 / 2 in base 2) for x in its compute dtype; the second is phi's exponent too."""
    t = 1.0 / (1.0 + _T_SLOPE * x.abs())
    p = t * _HALF_ERFC2[-1] + _HALF_ERFC2[-2]
    for c in reversed(_HALF_ERFC2[:-2]):  # Horner's rule: one multiply-add a coefficient
        p = p * t + c
    minus_a2 = (x * x) * _PHI2
    return t * torch.exp2(p + minus_a2), minus_a2


def _phi_from(x: Tensor, half_erfc: Tensor) -> Tensor:
    """Phi(x), the normal distribution's CDF, from erfc(|x| / sqrt 2) / 2."""
    return torch.where(x >= 0, 1.0 - half_erfc, half_erfc)


def rational_gelu_reference(x: Tensor) -> Tensor:
    """The forward's arithmetic without autograd's Function around it (what the tests and the counts compare)."""
    xc = _cast(x, _compute_dtype(x))
    half_erfc, _ = _half_erfc(xc)
    return _cast(xc * _phi_from(xc, half_erfc), x.dtype)


class _RationalGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return rational_gelu_reference(x)

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        xc = _cast(x, _compute_dtype(x))
        half_erfc, minus_a2 = _half_erfc(xc)
        slope = _phi_from(xc, half_erfc) + xc * torch.exp2(minus_a2 + _LOG2_INV_SQRT_2PI)  # Phi + x phi
        return _cast(_cast(dy, xc.dtype) * slope, dy.dtype)


def rational_gelu(x: Tensor) -> Tensor:
    """GELU(x) with erfc as a rational function of one exp; its gradient by the exact derivative's form."""
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
