"""Peak dense matmul FLOP/s of one accelerator, the denominator of MFU.

Figures are NVIDIA's datasheet peaks without structured sparsity, per GPU [NVIDIA-DGX] (the datasheets
print the sparse figure, twice these). fp32 training runs its matmuls as TF32 on tensor cores only when
torch is told so (`torch.set_float32_matmul_precision` 'high' or 'medium'); otherwise it runs on the CUDA
cores, at the plain FP32 peak. PRECISION=fp8 is charged at the FP8 tensor-core peak (H100 SXM / H200:
3,958 TFLOP/s sparse, 1,979 dense; H100 PCIe 3,026 / 1,513; NVL 3,341 / 1,670.5), although only the encoder
linears run in float8 and attention and the heads stay bf16: its MFU is against the fastest the chip can
do. A100 has no FP8 (`peak_flops` gives None); the FLOP count does not depend on the precision.
"""

from __future__ import annotations

import torch

# (substrings the device name must all contain, upper-case) -> peak FLOP/s by math mode; first match wins.
PEAKS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("NVL",), {"fp8": 1670.5e12, "bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),  # H100 NVL, H200 NVL
    (("H100", "PCIE"), {"fp8": 1513e12, "bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    (("H100",), {"fp8": 1979e12, "bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM5
    (("H200",), {"fp8": 1979e12, "bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # H200 SXM, GH200: H100 SXM die
    (("A100",), {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),  # SXM4 and PCIe
)


def math_mode(precision: str) -> str:
    """The tensor-core mode a run's matmuls use: 'fp8', 'bf16' (bf16 and fp16 peak the same), 'tf32' or 'fp32'."""
    if precision == "fp8":
        return "fp8"
    if precision in ("bf16", "fp16"):
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of the device called `device_name` (torch.cuda.get_device_name) at `precision`
    (fp32, bf16, fp16, fp8); None for a device not in the table (a CPU, an unknown GPU) or a mode it lacks
    (fp8 on an A100)."""
    name = device_name.upper()
    for needles, peaks in PEAKS:
        if all(n in name for n in needles):
            return peaks.get(math_mode(precision))
    return None


def device_peak_flops(device: torch.device, precision: str, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of the run's `device`: `override_tflops` x 1e12 if set, else from the table."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), precision)
