"""`PRECISION=fp8`: the encoder's linear layers run their GEMMs in float8 (torchao), the rest in bf16.

The rest is bf16 as for PRECISION=bf16: autocast over fp32 weights, or with MASTER_WEIGHTS=1 bf16 weights
(the float8 layers' too: torchao scales and casts whatever dtype the weight has) with fp32 masters in the
optimizer (bert.optim.master), which is how the submissions hold a float8 model ([NVIDIA-BERT] v3.0: bf16/fp16
parameters, fp32 masters in DistributedFusedLAMB) and saves autocast's per-step weight casts.

Which layers: in every encoder layer the fused QKV projection (`attention.self.qkv`), the attention output
(`attention.output.dense`) and the FFN (`intermediate.dense`, `output.dense`), which carry nearly all of the step's
FLOPs. `FP8_LINEARS` narrows that (`FP8_LINEAR_SETS`): dynamic scaling pays an amax pass and a cast of each operand
(input, weight, output gradient, and their transposes), so a GEMM's float8 gain per byte cast grows with its sizes
(a cast is T x K, the GEMM T x K x N), and the smallest, the 1024 x 1024 attention output, gains least and may lose:
`ffn-qkv` keeps it in bf16, `ffn` QKV too (`bench/fp8_linear.py` times each). The pooler, the NSP classifier, the
MLM transform and the decoder tied to the word embeddings stay in bf16, as in NVIDIA's H100 submissions
[NVIDIA-BERT] (v3.0, `--use_transformer_engine2`): there TransformerEngine's `fp8_autocast` wraps the encoder layers
only (`FP8_MHA`'s QKV and projection GEMMs and `LayerNormMLP`'s two), and the heads run outside it. The heads see
few rows (the pooler one per sequence, the MLM head only the masked ones), so float8 would gain little there, and
the decoder shares its weight with the embedding lookup (it is `F.linear` on that weight, not an `nn.Linear` torchao
could swap).

How: torchao's float8 training (`convert_to_float8_training` with a module filter) swaps those `nn.Linear`s for
`Float8Linear`s with the same parameters (same names: checkpoints, weight decay groups and DDP are unchanged).
`FP8_RECIPE` picks the scaling (`FP8_RECIPES`):
    tensorwise     (the default) dynamic, one scale per tensor; activations and weights e4m3, gradients e5m2 (the
                   "hybrid" format of NVIDIA's recipe); cuBLAS's float8 GEMMs; torchao's fastest
    rowwise        torchao's "rowwise": one scale per row of each operand (each row gets e4m3's whole range,
                   2^-9 to 448, however large another row's values are), power-of-2 scales, e4m3 everywhere;
                   the forward GEMM CUTLASS's rowwise-scaled one (fast accumulation), the two backward GEMMs
                   cuBLAS's tensorwise one at unit scales, the row scales applied to its output (torchao's
                   float8_ops: CUTLASS's is slow without fast accumulation)
    rowwise-gw-hp  torchao's "rowwise_with_gw_hp": rowwise, but the weight-gradient GEMM in bf16, so the two
                   casts it needs (the input, T x K, and the output gradient, T x N, each scaled along the token
                   axis) are not made; its most accurate recipe. For BERT-large's K = 1024 those casts may cost
                   what the GEMM saves (`bench/fp8_linear.py` times tensorwise and rowwise per linear).
    delayed        ours (bert.model.fp8_delayed), no torchao: per-tensor scales from the previous step's amax
                   (TransformerEngine's default recipe), so a cast needs no reduction over its own tensor first
                   and can fuse into the kernel that makes it; e4m3 activations and weights, e5m2 gradients
torchao's float8 is meant to be compiled (the casts and amax reductions fuse into a few kernels), so it composes
with COMPILE; eager works but is slower than bf16.

Shapes: `torch._scaled_mm` needs the inner dimension and the weight's dimensions to be multiples of 16. The
weight-gradient GEMM's inner dimension is the token count, so training batches must be padded to a multiple
of 16 tokens: `bert.config` requires STATIC_TOKENS to be one (NVIDIA pads to 256 for the same reason). The
eval's forward has no such constraint.

Rules: the closed division pre-approves fp8 among the numerical formats, with scaling ("per-tensor or
per-block" is a listed numerically safe technique), since [MLPerf-rules] commit da1fa63 (2022-04, "Add FP8 to
the accepted datatypes"; section "Numerical formats" at d73e20f179). So PRECISION=fp8 is allowed in both
divisions; reference convergence points are fp32 or bf16, so an fp8 run must still converge within the RCP.
The rowwise recipes' scales are per row, which we read as blocks of one row (the rules do not name rows).

Nothing falls back silently: no CUDA device (FP8_RECIPE=delayed excepted: the CPU runs its float8 casts, and its
GEMMs as fp32 GEMMs of the same exact products, bert.model.fp8_gemm: how the CPU tests check it), compute
capability below 8.9 (float8 tensor cores: Ada, Hopper, Blackwell), or torchao not installed (FP8_RECIPE=delayed
excepted) is a one-line `ValueError` naming PRECISION=fp8, raised before any work
(`bert.train.build.build_model`, and `python -m bert.train.config --check-env --check-device` in
`run_and_time.sh`). torchao is not in the default (CPU) install; the Dockerfile installs it: 0.18.0 for torch
>= 2.11, 0.16.0 for 2.10 (0.17 and 0.18 skip their C++ extensions below 2.11), each run under the CPU suite
(`scripts/test_torch.sh`). `TORCHAO` below is the one place that pairing is written: the Dockerfile and
`scripts/test_torch.sh` install what `torchao_release()` names for the torch they run. TransformerEngine (in
NVIDIA's PyTorch container) is the other float8 library; this harness does not use it.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from bert.model.fp8_attention import apply_fp8_attention
from bert.model.fp8_attention_block import apply_fp8_attention_block
from bert.model.fp8_bias_gelu import apply_fp8_bias_gelu
from bert.model.fp8_delayed import convert_to_delayed_fp8
from bert.model.fp8_feed_forward import apply_fp8_feed_forward
from bert.model.fp8_residual_norm import apply_fp8_residual_norm
from bert.release import major_minor

TORCHAO = {(2, 10): "0.16.0", (2, 11): "0.18.0"}  # torch (major, minor) -> the torchao release built for it
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x)
ALIGN = 16  # torch._scaled_mm: inner dimension and both weight dimensions
FP8_RECIPES: dict[str, str | None] = {  # FP8_RECIPE -> torchao's recipe name (None: ours, tensorwise hybrid)
    "tensorwise": None,
    "rowwise": "rowwise",
    "rowwise-gw-hp": "rowwise_with_gw_hp",
    "delayed": None,  # ours, without torchao (bert.model.fp8_delayed)
}
FP8_LINEAR_SETS: dict[str, tuple[str, ...]] = {  # FP8_LINEARS -> the linears of each encoder layer in float8
    "all": ("attention.self.qkv", "attention.output.dense", "intermediate.dense", "output.dense"),
    "ffn": ("intermediate.dense", "output.dense"),
    "ffn-qkv": ("attention.self.qkv", "intermediate.dense", "output.dense"),
}


def fp8_pattern(linears: str = "all") -> re.Pattern:
    """Module names of the float8 linears of set `linears` (`FP8_LINEAR_SETS`), in any encoder layer."""
    names = "|".join(re.escape(name) for name in FP8_LINEAR_SETS[linears])
    return re.compile(rf"(^|\.)encoder\.layer\.\d+\.({names})$")



def check_fp8(precision: str, device: torch.device, recipe: str = "tensorwise") -> None:
    """Raise a one-line ValueError naming PRECISION=fp8 when float8 training cannot run on `device` (with FP8_RECIPE
    `recipe`: all but `delayed` need torchao)."""
    if precision != "fp8":
        return
    if device.type != "cuda" and recipe == "delayed":
        return  # float8 values and scales on the CPU too, their GEMMs in fp32 (bert.model.fp8_gemm): tests, rehearsals
    if device.type != "cuda":
        raise ValueError(f"PRECISION=fp8 needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}."
                         f"{MIN_CAPABILITY[1]} or newer (float8 tensor cores); this run's device is {device.type}: "
                         "use PRECISION=bf16")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ValueError(f"PRECISION=fp8 needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
                         f"(float8 tensor cores); {torch.cuda.get_device_name(device)} is {capability[0]}."
                         f"{capability[1]}: use PRECISION=bf16")
    if recipe == "delayed":
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ValueError(f"PRECISION=fp8 needs torchao's float8 training, which is not installed ({e}): "
                         f"pip install torchao=={torchao_release()}") from None


def torchao_release(torch_version: str | None = None) -> str:
    """The torchao release for `torch_version` (as torch writes it; default: the running torch's): TORCHAO's entry,
    the newest for a newer torch."""
    release = major_minor(torch_version or torch.__version__) or min(TORCHAO)
    return TORCHAO[max([k for k in TORCHAO if k <= release] or [min(TORCHAO)])]


def is_fp8_linear(module: nn.Module, name: str, linears: str = "all") -> bool:
    """The module filter: the encoder linears of set `linears`; a ValueError if one cannot be float8."""
    if not (isinstance(module, nn.Linear) and fp8_pattern(linears).search(name)):
        return False
    if any(d % ALIGN for d in module.weight.shape):
        raise ValueError(f"PRECISION=fp8: {name} has weight shape {tuple(module.weight.shape)}; float8 GEMMs need "
                         f"both dimensions to be multiples of {ALIGN}")
    return True


def float8_config(emulate: bool = False, recipe: str = "tensorwise"):
    """torchao's config for `recipe` (FP8_RECIPE; tensorwise: dynamic per-tensor scaling, e4m3 activations and
    weights, e5m2 gradients). `emulate` runs the GEMMs in fp32 on the float8-rounded operands (any device: how
    the CPU tests run it)."""
    from torchao.float8 import CastConfig, Float8LinearConfig

    if FP8_RECIPES[recipe] is not None:
        return dataclasses.replace(Float8LinearConfig.from_recipe_name(FP8_RECIPES[recipe]), emulate=emulate)
    e4m3, e5m2 = CastConfig(target_dtype=torch.float8_e4m3fn), CastConfig(target_dtype=torch.float8_e5m2)
    return Float8LinearConfig(cast_config_input=e4m3, cast_config_weight=e4m3, cast_config_grad_output=e5m2,
                              emulate=emulate)


def convert_to_fp8(model: nn.Module, emulate: bool = False, linears: str = "all", recipe: str = "tensorwise"
                   ) -> list[str]:
    """Swap the encoder's linear layers of set `linears` (FP8_LINEARS) for torchao `Float8Linear`s scaled by
    `recipe` (FP8_RECIPE), or ours for `delayed` (bert.model.fp8_delayed), in place (after `check_fp8`, before
    compiling and DDP); returns the names swapped."""
    swapped: list[str] = []
    if recipe == "delayed":
        swapped = convert_to_delayed_fp8(model, lambda module, name: is_fp8_linear(module, name, linears))
        if not swapped:
            raise ValueError("PRECISION=fp8: the model has no encoder linear layers to run in float8")
        apply_fp8_bias_gelu(model)  # BIAS_GELU=fused's FFNs whose first linear is now float8
        apply_fp8_residual_norm(model)  # RESIDUAL_NORM=fused's sublayers whose dense is now float8
        apply_fp8_attention(model)  # each float8 QKV, for ATTENTION=triton's planner
        apply_fp8_feed_forward(model)  # each FFN both of whose units are now float8 ones of ours
        apply_fp8_attention_block(model)  # each attention sublayer the same
        return swapped
    from torchao.float8 import convert_to_float8_training

    def keep(module: nn.Module, name: str) -> bool:
        if is_fp8_linear(module, name, linears):
            swapped.append(name)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=keep, config=float8_config(emulate, recipe))
    if not swapped:
        raise ValueError("PRECISION=fp8: the model has no encoder linear layers to run in float8")
    return swapped


def apply_precision(model: nn.Module, precision: str, device: torch.device, fp8_linears: str = "all",
                    fp8_recipe: str = "tensorwise") -> nn.Module:
    """PRECISION's change to the model itself: fp8 swaps the encoder linears (those of FP8_LINEARS, scaled by
    FP8_RECIPE); the others change nothing here (autocast does their work)."""
    check_fp8(precision, device, fp8_recipe)
    if precision == "fp8":
        convert_to_fp8(model, linears=fp8_linears, recipe=fp8_recipe)
    return model
