"""bert.model.fp8_gemm: the CPU's float8 GEMM against torch's own `_scaled_mm` and a float64 sum of the products."""

import pytest
import torch

from bert.model.fp8_gemm import scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def operands(rows: int, inner: int, cols: int, a_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(rows, inner, generator=g) * 40).to(a_dtype)
    b = (torch.randn(cols, inner, generator=g) * 3).to(E4M3).t()  # column-major, as the weight's copy is handed
    return a, b, torch.tensor(0.37), torch.tensor(1.9), torch.randn(cols, generator=g) * 50


@pytest.mark.parametrize("a_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_it_is_torchs_scaled_mm_up_to_the_order_of_the_sums(a_dtype, out_dtype, with_bias):
    """Against a float64 sum of the same products (exact in fp32 and float64 alike), scaled and biased in float64:
    within fp32's rounding of the sums in fp32 out, one rounding to bf16 in bf16 out; torch's reference loop
    (`torch._scaled_mm` on the CPU) within the same bounds, and the two within each other's."""
    a, b, sa, sb, bias = operands(48, 160, 32, a_dtype, seed=3)
    bias = bias.to(out_dtype) if with_bias else None
    exact = (a.double() @ b.double()) * (sa.double() * sb.double())
    if bias is not None:
        exact = exact + bias.double()
    ours = scaled_mm(a, b, sa, sb, out_dtype, bias)
    torchs = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (48, 32)
    # the bound: fp32's epsilon over the sum of |products| (160 terms), or bf16's half-ulp of the value
    mass = (a.double().abs() @ b.double().abs()) * float(sa * sb)
    bound = mass * 160 * 2.0**-24 if out_dtype == torch.float32 else exact.abs() * 2.0**-8 + mass * 160 * 2.0**-24
    for got in (ours, torchs):
        assert ((got.double() - exact).abs() <= bound + 1e-30).all()
    assert not torch.equal(exact.to(out_dtype), torch.zeros_like(ours))


def test_each_scale_and_the_bias_count_once():
    """A scale doubled doubles the result (exactly: a power of two), and the bias moves it by the bias alone."""
    a, b, sa, sb, bias = operands(16, 64, 16, E4M3, seed=5)
    plain = scaled_mm(a, b, sa, sb, torch.float32)
    assert torch.equal(scaled_mm(a, b, sa * 2, sb, torch.float32), plain * 2)
    assert torch.equal(scaled_mm(a, b, sa, sb * 2, torch.float32), plain * 2)
    torch.testing.assert_close(scaled_mm(a, b, sa, sb, torch.float32, bias) - plain, bias.expand_as(plain),
                               rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 GEMMs need a CUDA GPU of compute capability 8.9 or newer")
def test_cuda_it_is_torchs_scaled_mm():
    """On the GPU it is cuBLASLt's float8 GEMM, bit for bit, bias in the epilogue."""
    a, b, sa, sb, bias = (t.cuda() for t in operands(64, 128, 32, E4M3, seed=7))
    bias = bias.to(torch.bfloat16)
    assert torch.equal(scaled_mm(a, b, sa, sb, torch.bfloat16, bias),
                       torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16))
