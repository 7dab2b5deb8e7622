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
from bert.model.fp8_delayed import START, DelayedFloat8Linear
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


def test_amaxes_start_at_scale_one_and_only_a_training_step_records_them():
    """TransformerEngine's start (each format's max: scale 1); an eval or no-grad forward leaves the input's amax;
    a non-finite gradient leaves the gradient's (its scale would be 0, the next step NaN)."""
    lin = layer(16, 16)
    assert (float(lin.amax_input), float(lin.amax_grad)) == (448.0, 57344.0)
    x = torch.randn(16, 16) * 5
    with torch.no_grad():
        lin(x)
    lin.eval()
    lin(x)
    assert float(lin.amax_input) == 448.0
    lin.train()
    y = lin(x.requires_grad_())
    assert float(lin.amax_input) == float(x.abs().max())
    grad = torch.ones_like(y)
    grad[0, 0] = float("inf")
    y.backward(grad)
    assert float(lin.amax_grad) == 57344.0
    lin(x).backward(torch.full((16, 16), 0.25))
    assert float(lin.amax_grad) == 0.25


def test_under_autocast_it_computes_in_autocasts_dtype_as_a_linear_does():
    lin, plain = layer(16, 32), nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, expected = lin(x), plain(x)
    assert y.dtype == expected.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


def test_the_amaxes_stay_fp32_when_the_model_is_cast():
    lin = layer(16, 16).to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and lin.amax_input.dtype == lin.amax_grad.dtype == torch.float32


def test_ddp_leaves_each_ranks_amaxes_alone(world_of_one):
    from bert.config import DistConfig
    from bert.dist.ddp import apply_ddp

    assert apply_ddp(tiny_model(), DistConfig()).broadcast_buffers is False


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
    assert losses[2] == losses[1] and amaxes[2] == amaxes[1] and not set(amaxes[1]) & set(START.values())


def test_the_driver_trains_it_with_master_weights_on_the_cpu(world_of_one, synthetic_data, tmp_path):
    """`build_run` as the driver builds PRECISION=fp8 FP8_RECIPE=delayed MASTER_WEIGHTS=1 (allowed on the CPU, whose
    `torch._scaled_mm` is real float8): the encoder's linears swapped, bf16 weights, fp32 masters; three steps
    with finite losses that move the weights, and the amax buffers set by them."""
    from test_loop import make_run

    from bert.optim.master import MasterWeights
    from bert.train.loop import train_step

    run = make_run(synthetic_data, tmp_path, precision="fp8", fp8_recipe="delayed", master_weights=True,
                   static_tokens=128, attention="varlen" if torch.cuda.is_available() else "loop")
    model = run.ddp.module
    swapped = [m for m in model.modules() if isinstance(m, DelayedFloat8Linear)]
    assert len(swapped) == 4 * model.config.num_hidden_layers and isinstance(run.optimizer, MasterWeights)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    batches = iter(run.loader)
    try:
        losses = [float(train_step(run, batches)) for _ in range(3)]
    finally:
        run.loader.close()
    assert all(loss == loss and 0 < loss < 20 for loss in losses)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()) if p.requires_grad)
    assert all(float(m.amax_grad) != 1.0 and float(m.amax_input) != 1.0 for m in swapped)
