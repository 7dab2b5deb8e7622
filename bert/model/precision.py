"""PRECISION's compute dtype: what autocast casts to over fp32 weights, and what the weights themselves are cast
to under MASTER_WEIGHTS=1 (bert.optim.master). fp8 computes everything but the float8 GEMMs in bf16
(bert.model.fp8); fp32 has no entry (no autocast). Its own module so that benchmarks can take the driver's
rules without importing the driver (and its mlperf-logging dependency)."""

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the model computes in (fp32 for PRECISION=fp32)."""
    return AUTOCAST_DTYPES.get(precision, torch.float32)


def autocast_dtype(precision: str, master_weights: bool = False) -> torch.dtype | None:
    """What autocast casts to, or None for no autocast: under fp32, and under master weights, whose model
    already holds its weights in the compute dtype (autocast would only cast LayerNorm, softmax and the like
    up to fp32 and back down: the casts master weights exist to remove)."""
    return None if master_weights else AUTOCAST_DTYPES.get(precision)
