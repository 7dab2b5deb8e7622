"""PRECISION's compute dtype: what autocast casts to over fp32 weights, and what the weights themselves are cast
to under MASTER_WEIGHTS=1 (bert.optim.master). fp8 computes everything but the float8 GEMMs in bf16
(bert.model.fp8); fp32 has no entry (no autocast). Its own module so that benchmarks can take the driver's
mapping without importing the driver (and its mlperf-logging dependency)."""

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
