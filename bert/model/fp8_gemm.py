"""The float8 GEMM of delayed float8 (`scaled_mm`): `torch._scaled_mm` on a GPU, an fp32 GEMM of the same products on
the CPU.

Why: torch's CPU `_scaled_mm` is a reference loop. On the 2-core VM it ran a 1024 x 128 x 384 GEMM in 1.3 s (about
0.07 GFLOP/s; torch 2.13), so a 2-layer BERT's float8 step took about 30 s, and the float8 driver rows could not be
rehearsed on the CPU (`bench/cuda_session.sh`, REHEARSE=1), while their bf16 rows could. A float8 value has at most
4 significant bits, so each product of two is exact in fp32; both GEMMs sum the same exact products in fp32 and
differ only in the order of the sums, i.e. by fp32 rounding (`tests/test_fp8_gemm.py` holds the two together).
The GPU path is torch's own, as before: cuBLASLt's float8 GEMM with the bias in its epilogue.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bert.model.cast import cast


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
              bias: Tensor | None = None) -> Tensor:
    """(a @ b) * scale_a * scale_b + bias in `out_dtype`, from float8 `a` (row-major) and `b` (column-major, as
    `torch._scaled_mm` takes it) and 0-dim fp32 scales (the inverse of each operand's cast scale)."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    out = (a.float() @ b.float()) * (scale_a * scale_b)
    if bias is not None:
        out = out + bias.float()
    return cast(out, out_dtype)  # not a no-op `.to`: the float8 Functions return this (bert.model.cast)
