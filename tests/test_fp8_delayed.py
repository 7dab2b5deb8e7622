"""FP8_RECIPE=delayed (bert.model.fp8_delayed): our float8 linear with delayed per-tensor scaling.

The reference is float64 arithmetic on operands rounded to float8 by the recipe's own rule (scale = max / amax,
saturate, round to nearest), with the input's and the gradient's amax taken from the layer's buffers (the previous
step's) and the weight's from the weight: the layer's output and both gradients must match it. The CPU runs
`torch._scaled_mm` itself, so these are the real float8 roundings, not an emulation.
"""

import sys

import pytest
import torch
from test_fp8 import ENCODER_LINEARS, tiny_model
from torch import nn

from bert.model.fp8 import FP8_RECIPES, check_fp8, convert_to_fp8
from bert.model.fp8_delayed import DelayedFloat8Linear
from bert.synthetic import random_batch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def rounded(x: torch.Tensor, amax: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the recipe rounds it, in float64: scaled so `amax` maps to the format's max (the scale in fp32),
    saturated, rounded, unscaled."""
    limit = torch.finfo(dtype).max
    scale = torch.tensor(limit / max(amax, 1e-12), dtype=torch.float32).double()
    return (x.double() * scale).clamp(-limit, limit).to(dtype).double() / scale


def layer(fin: int = 64, fout: int = 128) -> DelayedFloat8Linear:
    torch.manual_seed(0)
    return DelayedFloat8Linear.from_linear(nn.Linear(fin, fout))


@pytest.mark.parametrize("amax_input, amax_grad", [(3.0, 0.5), (1.5, 2e-3)])  # the second saturates x and g
def test_forward_and_backward_match_a_float64_reference_of_delayed_scaling(amax_input, amax_grad):
    lin = layer()
    lin.amax_input.fill_(amax_input)
    lin.amax_grad.fill_(amax_grad)
    x = torch.randn(48, 64, requires_grad=True)
    y = lin(x)
    grad = torch.randn_like(y) * 1e-3
    y.backward(grad)
    w, b = lin.weight.detach(), lin.bias.detach().double()
    x_q, w_q = rounded(x.detach(), amax_input, E4M3), rounded(w, float(w.abs().max()), E4M3)
    g_q = rounded(grad, amax_grad, E5M2)
    torch.testing.assert_close(y.double(), x_q @ w_q.T + b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), g_q @ w_q, rtol=1e-5, atol=1e-8)  # fp32 sums of ~1e-3
    torch.testing.assert_close(lin.weight.grad.double(), g_q.T @ x_q, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(lin.bias.grad, grad.sum(0))
    # the next step's scales: this step's amax
    assert float(lin.amax_input) == float(x.abs().max()) and float(lin.amax_grad) == float(grad.abs().max())
    exact = x.detach().double() @ w.double().T + b
    assert (y.double() - exact).abs().max() > 1e-3  # it did round to float8


def test_a_zero_input_gives_zeros_not_nan():
    lin = layer(16, 16)
    lin.amax_input.zero_()
    x = torch.zeros(16, 16, requires_grad=True)
    y = lin(x)
    y.backward(torch.zeros_like(y))
    assert torch.equal(y, lin.bias.detach().expand(16, 16)) and torch.equal(x.grad, torch.zeros(16, 16))


def test_conversion_swaps_the_encoder_linears_and_keeps_parameters_and_checkpoint_keys():
    model = tiny_model()
    params = dict(model.named_parameters())
    keys = set(model.state_dict())
    swapped = convert_to_fp8(model, recipe="delayed")
    assert sorted(swapped) == sorted(f"bert.encoder.layer.{i}.{n}" for i in range(2) for n in ENCODER_LINEARS)
    assert all(isinstance(model.get_submodule(n), DelayedFloat8Linear) for n in swapped)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert set(model.state_dict()) == keys  # the amax buffers are not saved


def test_delayed_needs_no_torchao(monkeypatch):
    assert "delayed" in FP8_RECIPES
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    check_fp8("fp8", torch.device("cuda"), "delayed")
    with pytest.raises(ValueError, match="needs torchao"):
        check_fp8("fp8", torch.device("cuda"), "tensorwise")


def test_a_bf16_model_trains_close_to_bf16_and_compiles():
    """Master-weight style bf16 weights: the float8 model's loss within 3 % of the bf16 one's, finite gradients;
    compiled (aot_eager: dynamo and AOT autograd capture it, the amax buffer writes of forward and backward
    included) the same loss and the same next-step amaxes as eager."""
    batch = random_batch([100, 37, 64, 200], seed=0, vocab_size=1998)
    losses, amaxes = [], []
    for variant in ("bf16", "fp8", "fp8-compiled"):
        torch._dynamo.reset()
        model = tiny_model().to(torch.bfloat16)
        if variant != "bf16":
            convert_to_fp8(model, recipe="delayed")
        run = torch.compile(model, backend="aot_eager", dynamic=True) if variant.endswith("compiled") else model
        loss = run(batch).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses.append(float(loss))
        amaxes.append([float(b) for n, b in model.named_buffers() if "amax" in n])
    assert abs(losses[1] - losses[0]) < 0.03 * losses[0]
    assert losses[2] == losses[1] and amaxes[2] == amaxes[1] and all(a != 1.0 for a in amaxes[1])
