"""`FP8_RECIPE=delayed`: our float8 linear with delayed per-tensor scaling, TransformerEngine's default recipe.

Why: torchao's dynamic scaling (FP8_RECIPE=tensorwise) needs a tensor's amax before its cast, so every cast is a
pass over the tensor after a reduction over it. Compiled, that ran BERT-large at 0.71x of bf16 on an H100
(2026-11-26). With delayed scaling the input's and the output gradient's scales come from the previous step's
amax: the cast needs nothing computed from the tensor itself, so inductor can fuse it into the kernel that makes
the tensor (LayerNorm, GELU, the attention output), with this step's amax, the next step's scale, as a reduction
in the same pass. The weights, small, are scaled by their current amax (a reduction of inductor's, then one
pass of ours that writes the e4m3 copy and its transpose, `bert::fp8_cast_transpose`).

    forward   y  = (x_q @ w_q^T) / (s_x s_w) + b        x_q = e4m3(x s_x), w_q = e4m3(w s_w)
    backward  dx = (g_q @ w_q) / (s_g s_w)              g_q = e5m2(g s_g)
              dw = (g_q^T @ x_q) / (s_g s_x)
    scales    s = max / amax: e4m3's max 448, e5m2's 57,344; a value beyond saturates (clamped, not inf)

`torch._scaled_mm` takes its first operand row-major and its second column-major, so the backward's GEMMs read
x_q, w_q and g_q transposed. The forward saves x_q's and w_q's transposed copies (only the ones a gradient needs),
the backward makes g_q's. Where our own kernel made the float8 tensor (the fused norms, GELU and attention of
bert.model.fp8_*), it wrote the transpose too, a tile at a time; else it is made by `bert::fp8_transpose`
(bert.model.fp8_transpose), a kernel inductor cannot fuse into the cast's: fused there, as `t().contiguous()` was,
the row-wise kernels stored the copy a byte per 32-byte sector, and float8 ran slower than bf16 on an H200 (627
against 772 samples/s, 2026-11-27).

The amax history is one step long and lives in two 0-dim buffers per layer (`amax_input`, `amax_grad`). They start
at each format's max (scale 1, as TransformerEngine starts); the untimed compile warm-up's forward and backward on
its synthetic batch (bert.train.warmup), or under COMPILE=off one such pass for them alone (`calibrate_float8`), set
them before the first timed step (a resumed run's are put back after it, or kept). Only a training forward (train
mode, grad enabled) records the input's; a non-finite amax is not recorded. Each rank keeps its own: DDP does not
broadcast buffers (bert.dist.ddp; TransformerEngine reduces them across the ranks, here the gradients are averaged
after the GEMMs anyway). So they are not in the model's state_dict (the weights file and its exports stay
nn.Linear's) but in each rank's own checkpoint file (`AmaxState`, bert.train.checkpoint): a resumed run scales its
first step as the run it continues would have.
Under autocast the input is cast to autocast's dtype first, as nn.Linear's is, so the output has that dtype.

Parameters and names are nn.Linear's, so checkpoints, weight-decay groups, master weights and DDP are unchanged.
No torchao: this needs only `torch._scaled_mm` (CUDA of compute capability >= 8.9). On the CPU the GEMMs are fp32
GEMMs of the same exact products (bert.model.fp8_gemm), which is how the tests check the recipe against a float64
reference of the same scaling and the driver rows rehearse.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bert.model.fp8_gemm import scaled_mm
from bert.model.fp8_transpose import fp8_cast_transpose, fp8_transpose
from bert.model.swap import swap_modules

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The amaxes a layer starts from: each format's max, i.e. scale 1, as TransformerEngine starts (1 would clip the
# first step's activations to +-1; a run compiled first calibrates them in its warm-up)
START = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}
AMAXES = {"amax_input": E4M3, "amax_grad": E5M2}  # each layer's amax buffers, by the format they scale for


def scaled_cast(t: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`t` scaled so that `amax` maps to `dtype`'s largest value, saturated, cast; and 1 / scale (fp32). An amax of
    0 (an all-zero tensor) counts as 1e-12, so the cast is zeros, not NaN. (Written with literals: a module-level
    float read here becomes a symbolic input under `dynamic=True`, which dynamo cannot lift into an
    autograd.Function's graph, torch 2.13: "lift_tracked_freevar_to_input should not be called on root".)"""
    scale = cast_scale(amax, dtype)
    return saturated_cast(t, scale, dtype), scale.reciprocal()


def saturated_cast(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` times `scale` in fp32, clamped to `dtype`'s range (a value beyond saturates, not inf), cast."""
    limit = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-limit, limit).to(dtype)


def cast_scale(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """The fp32 scale that maps `amax` to `dtype`'s largest value (an amax of 0 counting as 1e-12)."""
    return torch.finfo(dtype).max / amax.float().clamp(min=1e-12)


def record_amax(history: Tensor, t: Tensor) -> None:
    """`t`'s amax into `history` (the next step's scale), unless it is not finite: one overflowed gradient would
    otherwise give the next step a scale of 0 and NaN everywhere; the old amax is kept instead.

    Each row's first, then theirs: the same value, but a reduction over rows has the iteration space of the cast
    beside it (and of a LayerNorm before it), so inductor makes the two one kernel, one read of `t`. A reduction of
    the whole tensor at once is split into partial sums of another shape and stays a kernel of its own, a second
    read: compiled for an H100 (bench/gpu_compile.py, `fp8-delayed-layers-step`) the BERT-large step moved 109.4 GB
    that way and 89.8 GB this way, at 24,576 tokens. (Columns first, beside the bias gradients' sums, moved 94.2.)"""
    keep_amax(history, amax_of(t.detach()))


def amax_of(t: Tensor) -> Tensor:
    """max |t| in fp32, by rows first (`record_amax`); NaN if any element is."""
    return t.abs().amax(dim=-1).amax().float()


def keep_amax(history: Tensor, amax: Tensor) -> None:
    """`amax` into `history` if it is finite (`record_amax`)."""
    history.copy_(torch.where(torch.isfinite(amax), amax, history))


def float8_matmul_forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None, amax_input: Tensor, amax_grad: Tensor
                          ) -> tuple[Tensor, list[Tensor | None]]:
    """x @ w^T + b in float8 (the bias in the GEMM's epilogue), and what the backward's GEMMs read, for the caller
    to save (`float8_input_and_weight_grads` takes them as the first four saved): the forward of `_Float8Matmul` and
    of those built on it (bert.model.fp8_bias_gelu)."""
    x_q, inv_x = scaled_cast(x, amax_input, E4M3)
    ctx.amax_grad = amax_grad  # not saved: written in backward
    ctx.dtypes = linear_dtypes(x, w, bias)
    return float8_linear(x_q, inv_x, w, bias, ctx.needs_input_grad[:2], x.dtype)


def linear_dtypes(x: Tensor, w: Tensor, bias: Tensor | None) -> tuple[torch.dtype, torch.dtype, torch.dtype | None]:
    """(the input's, the weight's, the bias's dtype): what a float8 linear's gradients are cast back to."""
    return x.dtype, w.dtype, None if bias is None else bias.dtype


def float8_linear(x_q: Tensor, inv_x: Tensor, w: Tensor, bias: Tensor | None, needs: tuple[bool, bool],
                  dtype: torch.dtype, x_qt: Tensor | None = None) -> tuple[Tensor, list[Tensor | None]]:
    """x @ w^T + b in `dtype` from the input already in e4m3 (x_q, and 1 / its scale), and the backward's four
    operands (`float8_grads`) for `needs` (whether dx, dw are wanted); `x_qt`, x_q transposed (contiguous), where
    the kernel that made x_q wrote it too, else made here."""
    # the backward's operands in its GEMMs' layouts (module doc): x_q^T for dw and w_q^T for dx, row-major;
    # neither in an eval or no-grad forward
    needs_dx, needs_dw = needs
    scale_w = cast_scale(w.detach().abs().amax(), E4M3)
    w_q, w_qt = fp8_cast_transpose(w, scale_w) if needs_dx else (saturated_cast(w, scale_w, E4M3), None)
    inv_w = scale_w.reciprocal()
    if needs_dw and x_qt is None:
        x_qt = fp8_transpose(x_q)
    saved = [x_qt if needs_dw else None, w_qt, inv_x, inv_w]
    return scaled_mm(x_q, w_q.t(), inv_x, inv_w, dtype, None if bias is None else bias.to(dtype)), saved


class _Float8Matmul(torch.autograd.Function):
    """x @ w^T + b in float8, the output gradient's amax recorded for the next step (module doc). The bias is added
    in the GEMM's epilogue, as cuBLAS adds nn.Linear's: added after it, it was a kernel of its own wherever the
    output's consumer could not take it (the QKV's, read by flash attention: a read and a write of T x 3072 a layer,
    7.2 GB of BERT-large's step on the fake H100, bench/gpu_compile.py)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None, amax_input: Tensor, amax_grad: Tensor) -> Tensor:
        y, saved = float8_matmul_forward(ctx, x, w, bias, amax_input, amax_grad)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        g_q, inv_g = scaled_cast(grad, ctx.amax_grad, E5M2)
        record_amax(ctx.amax_grad, grad)  # the next step's scale
        dx, dw = float8_input_and_weight_grads(ctx, g_q, inv_g, grad.dtype)
        db = grad.sum(0).to(ctx.dtypes[2]) if ctx.needs_input_grad[2] else None  # from the gradient as it came
        return dx, dw, db, None, None


def float8_input_and_weight_grads(ctx, g_q: Tensor, inv_g: Tensor, dtype: torch.dtype, g_qt: Tensor | None = None
                                  ) -> tuple[Tensor | None, Tensor | None]:
    """(dx, dw) of a `_Float8Matmul`'s forward (saved in `ctx`) from its output gradient in float8, g_q, and 1 / its
    scale (`float8_grads`)."""
    return float8_grads(ctx.saved_tensors[:4], ctx.dtypes, g_q, inv_g, dtype, g_qt)


def float8_grads(saved, dtypes, g_q: Tensor, inv_g: Tensor, dtype: torch.dtype, g_qt: Tensor | None = None
                 ) -> tuple[Tensor | None, Tensor | None]:
    """(dx, dw) of a float8 linear from the four tensors its forward saved (`float8_linear`) and its dtypes
    (`linear_dtypes`), given its output gradient in float8, g_q, and 1 / its scale; the GEMMs' outputs in `dtype`,
    then the input's and the weight's dtypes; None for one not needed. `g_qt`, g_q transposed (contiguous), where
    the kernel that made g_q wrote it too; else it is made here."""
    x_qt, w_qt, inv_x, inv_w = saved
    # x_q and w_q column-major: their saved transposes, seen transposed (no copy)
    x_dtype, w_dtype, _ = dtypes
    dx = dw = None
    # the transpose before dx's GEMM: inductor then writes g_q once, where after it the cast's kernel wrote a
    # second copy for the transpose (bench/gpu_compile.py on the fake H100)
    if x_qt is not None and g_qt is None:
        g_qt = fp8_transpose(g_q)
    if w_qt is not None:
        dx = scaled_mm(g_q, w_qt.t(), inv_g, inv_w, dtype).to(x_dtype)
    if x_qt is not None:
        dw = scaled_mm(g_qt, x_qt.t(), inv_g, inv_x, dtype).to(w_dtype)
    return dx, dw


class DelayedFloat8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in float8 with delayed scaling (module doc); built from a linear by `from_linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._start_amaxes(device)

    def _start_amaxes(self, device) -> None:
        """The input's and the gradient's amax history, at their start (START), fp32 on `device`."""
        for name, dtype in AMAXES.items():
            self.register_buffer(name, torch.full((), START[dtype], device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> DelayedFloat8Linear:
        """The same Parameter objects (names, optimizer groups and hooks keep them), float8 GEMMs."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        new._start_amaxes(linear.weight.device)
        return new

    def _apply(self, fn, recurse: bool = True):
        """`.to(dtype)` and the like leave the amaxes fp32 (a bf16 amax, rounded down, would saturate)."""
        super()._apply(fn, recurse)
        for name in AMAXES:
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, getattr(self, name).float())
        return self

    def forward(self, x: Tensor) -> Tensor:
        return self.through(_Float8Matmul, x)

    def through(self, function: type[torch.autograd.Function], x: Tensor, *rest) -> Tensor:
        """`function` (`_Float8Matmul` or one built on it) of this layer's input, weight, bias and amaxes (and `rest`,
        that function's further inputs), with the input's amax recorded: the layer's forward."""
        flat = self.flat_input(x)
        weight, bias = without_grad(self.weight, self.bias)
        y = function.apply(flat, weight, bias, self.amax_input, self.amax_grad, *rest)
        if self.records():
            with torch.no_grad():
                record_amax(self.amax_input, flat)
        if isinstance(y, tuple):  # a function of several outputs (bert.model.fp8_residual_norm's) shapes them itself
            return y
        return y.reshape(*x.shape[:-1], -1)  # out_features wide, or what `function` makes of them

    def flat_input(self, x: Tensor) -> Tensor:
        """`x` as the GEMM takes it: (rows, in_features) row-major (_scaled_mm's first operand), and as nn.Linear
        under autocast in autocast's dtype."""
        flat = x.reshape(-1, self.in_features).contiguous()
        if autocast_on(flat):
            flat = flat.to(torch.get_autocast_dtype(flat.device.type))
        return flat

    def records(self) -> bool:
        """Whether this forward records its input's amax: a training step's, not the eval's nor the no-grad's."""
        return self.training and torch.is_grad_enabled()


def without_grad(*params: Tensor | None) -> tuple[Tensor | None, ...]:
    """`params` as a float8 Function's inputs: detached where no gradient is recorded (no_grad: the evaluation), as
    they are. Autograd fills a Function's `ctx.needs_input_grad` from its inputs' requires_grad alone, grad mode or
    not, so without this an eval forward made the backward's operands as a training one does: every weight's
    transposed e4m3 copy, and the input's where no kernel had written it."""
    if torch.is_grad_enabled():
        return params
    return tuple(None if p is None else p.detach() for p in params)


def autocast_on(x: Tensor) -> bool:
    """Whether autocast is on for x's device (torch 2.11 raises for a device autocast lacks: meta). A float8 close
    then hands nothing on in e4m3: the next linear casts autocast's copy of its input, not the close's output."""
    return x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)


def wants_transpose(linear: DelayedFloat8Linear | None) -> bool:
    """Whether a close handing `linear` its input in e4m3 writes the copy transposed too, that linear's
    weight-gradient operand: where its weight's gradient will be wanted (a training forward, the weight not
    frozen), as `float8_linear` saves it."""
    return linear is not None and torch.is_grad_enabled() and linear.weight.requires_grad


def handed_on(handed, transposed: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
    """A Stream's float8 from what a close's Function handed on (the e4m3 copy, 1 / its scale, its amax, its
    transpose): the transpose None where the close was not asked for it (`transposed`: 0 rows then); None where
    nothing was handed."""
    if not handed:
        return None
    y_q, inv, amax, y_qt = handed
    return y_q, inv, amax, y_qt if transposed else None


class AmaxState:
    """Every DelayedFloat8Linear's amaxes in `model`, as a checkpoint part of each rank's own (module doc). Loading
    copies those both sides have, by module name (a compiled wrapper's `_orig_mod.` dropped): a checkpoint of a run
    without them (bf16, another FP8_LINEARS, one written before they were saved) leaves the rest at their start."""

    missing_ok = True  # bert.train.checkpoint: a checkpoint may predate this part

    def __init__(self, model: nn.Module):
        self.model = model

    def _buffers(self) -> dict[str, Tensor]:
        return {f"{name}.{key}".replace("_orig_mod.", ""): getattr(module, key)
                for name, module in self.model.named_modules() if isinstance(module, DelayedFloat8Linear)
                for key in AMAXES}

    def state_dict(self) -> dict[str, Tensor]:
        return {name: amax.detach().to("cpu", copy=True) for name, amax in self._buffers().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, amax in self._buffers().items():
                if name in state:
                    amax.copy_(state[name])


def convert_to_delayed_fp8(model: nn.Module, keep) -> list[str]:
    """Swap every `nn.Linear` that `keep(module, name)` accepts for a DelayedFloat8Linear, in place; the names."""
    return swap_modules(model, keep, DelayedFloat8Linear.from_linear)
