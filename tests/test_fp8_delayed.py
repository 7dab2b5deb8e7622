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
from bert.model.fp8_delayed import START, AmaxState, DelayedFloat8Linear
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
    assert float(lin.amax_input) == float(x.detach().abs().max()) and float(lin.amax_grad) == float(grad.abs().max())
    exact = x.detach().double() @ w.double().T + b
    assert (y.double() - exact).abs().max() > 1e-3  # it did round to float8


def test_the_forward_saves_the_backwards_float8_operands_already_transposed():
    """The backward's GEMMs take x_q and w_q column-major: the forward saves x_q^T and w_q^T row-major, made beside
    its casts (where compiled they can share the cast's pass), so the backward copies no saved tensor. The
    values are the casts' own: the float64 test above checks the gradients made from them."""
    lin = layer(fin=32, fout=48)
    lin.amax_input.fill_(2.0)
    x = torch.randn(16, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lin(x)
    eight = [t for t in saved if t.dtype == E4M3]
    assert [(tuple(t.shape), t.is_contiguous()) for t in eight] == [((32, 16), True), ((32, 48), True)]
    torch.testing.assert_close(eight[0].t().float(), (x.detach() * (448 / 2.0)).clamp(-448, 448).to(E4M3).float())
    # only what a gradient needs: x^T for the weight's, w^T for the input's
    for x_grad, w_grad, shapes in ((False, True, [(32, 16)]), (True, False, [(32, 48)])):
        lin.weight.requires_grad_(w_grad)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = lin(x.detach().requires_grad_(x_grad))
        assert [tuple(t.shape) for t in saved if t.dtype == E4M3] == shapes
        y.sum().backward()
    lin.weight.requires_grad_(True)


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
    included) the same loss and the same next-step amaxes as eager. Padded attention: the linears are the point,
    and its one SDPA per layer traces faster than `loop`'s one per sequence."""
    batch = random_batch([100, 37, 64, 200], seed=0, vocab_size=1998)
    losses, amaxes = [], []
    for variant in ("bf16", "fp8", "fp8-compiled"):
        torch._dynamo.reset()
        model = tiny_model(attention="padded").to(torch.bfloat16)
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


@pytest.mark.parametrize("build", [
    {}, {"optimizer_layout": "flat", "compile_optimizer": True, "compile": "debug", "compile_scope": "layers"},
    {"attention": "triton", "residual_norm": "fused-lean", "bias_gelu": "fused", "compile": "debug"},
], ids=["eager", "layers-flat", "candidate"])
def test_the_driver_trains_it_with_master_weights_on_the_cpu(world_of_one, synthetic_data, tmp_path, build):
    """`build_run` as the driver builds PRECISION=fp8 FP8_RECIPE=delayed MASTER_WEIGHTS=1 (allowed on the CPU, whose
    `torch._scaled_mm` is real float8): the encoder's linears swapped, bf16 weights, fp32 masters; three steps
    with finite losses that move the weights, and the amax buffers set by them. Eager, and as the GPU session's
    candidate fastest run builds it (bench/cuda_session.sh fp8-delayed-layers-flat): per-layer graphs and the
    compiled flat update (COMPILE=debug here: dynamo's capture, not inductor's code); and as the float8 candidate
    (bench/cuda_session.sh fp8-delayed-lean-norm-triton-biasgelu...): our Triton attention, the lean fused norm and
    the fused bias + GELU, every linear inside one of our float8 Functions (on their torch paths here)."""
    from test_loop import make_run

    from bert.optim.master import MasterWeights
    from bert.train.loop import train_step

    torch._dynamo.reset()
    run = make_run(synthetic_data, tmp_path, precision="fp8", fp8_recipe="delayed", master_weights=True,
                   static_tokens=128, **{"attention": "padded", **build})  # the CPU run, on a GPU's machine too
    model = run.ddp.module
    swapped = [m for m in model.modules() if isinstance(m, DelayedFloat8Linear)]
    assert len(swapped) == 4 * model.config.num_hidden_layers and isinstance(run.optimizer, MasterWeights)
    if "residual_norm" in build:  # each sublayer one Function of ours: the candidate's GPU step, on the CPU
        from bert.model.fp8_attention_block import Float8AttentionOutput
        from bert.model.fp8_feed_forward import Float8FeedForwardOutput

        layers = model.bert.encoder.layer
        assert all(type(layer.attention.output) is Float8AttentionOutput for layer in layers)
        assert all(type(layer.output) is Float8FeedForwardOutput for layer in layers)
    assert (run.optimizer.layout is not None) == ("optimizer_layout" in build)
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
    run.checkpoint()  # each rank's file holds its amaxes (resume is exact: test_a_resumed_run_continues_...)
    saved = torch.load(next(tmp_path.glob("**/checkpoints/step_*/rank_00000.pt")), weights_only=False)["fp8_amaxes"]
    assert len(saved) == 2 * len(swapped) and torch.equal(saved["bert.encoder.layer.0.output.dense.amax_grad"],
                                                          model.bert.encoder.layer[0].output.dense.amax_grad)


def two_layers() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    for i in (0, 2):
        model[i] = DelayedFloat8Linear.from_linear(model[i])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(16, 32, generator=g) * (1 + 2 * torch.rand(1, generator=g))).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_resumed_run_continues_with_the_amaxes_its_rank_recorded(tmp_path):
    """Resume is exact under FP8_RECIPE=delayed: the amaxes (each rank's own, not in the model's state_dict) go in
    the rank's checkpoint file, so 2 steps, a checkpoint and 2 more equal the 2 more run from the checkpoint, bit
    for bit. Loaded without them (restarted at scale 1) the next steps differ: what the part saves matters."""
    from bert.train.checkpoint import load_checkpoint, save_checkpoint

    model, opt = two_layers()
    train_steps(model, opt, 2, seed=1)
    where = save_checkpoint(tmp_path, 2, model, {"optimizer": opt}, 0, {"fp8_amaxes": AmaxState(model)})
    saved = torch.load(where / "rank_00000.pt", weights_only=False)["fp8_amaxes"]
    assert sorted(saved) == ["0.amax_grad", "0.amax_input", "2.amax_grad", "2.amax_input"]
    assert not set(map(float, saved.values())) & set(START.values())
    whole = train_steps(model, opt, 2, seed=2)
    resumed, opt2 = two_layers()
    load_checkpoint(where, resumed, {"optimizer": opt2}, 0, {"fp8_amaxes": AmaxState(resumed)})
    assert all(torch.equal(a, b) for a, b in zip(train_steps(resumed, opt2, 2, seed=2), whole, strict=True))
    restarted, opt3 = two_layers()
    load_checkpoint(where, restarted, {"optimizer": opt3}, 0, {})
    assert not all(torch.equal(a, b) for a, b in zip(train_steps(restarted, opt3, 2, seed=2), whole, strict=True))


def test_the_amaxes_load_by_module_name_and_a_checkpoint_without_them_leaves_their_start(tmp_path):
    """A compiled model's names (`_orig_mod.`) load into the plain one; a model without float8 layers (a bf16 run
    resuming an fp8 checkpoint) takes nothing; a checkpoint written before the amaxes were saved leaves them at
    their start, while a missing loader position is still an error."""
    from bert.train.checkpoint import load_checkpoint, save_checkpoint

    model, _ = two_layers()
    for i, amax in enumerate(b for n, b in model.named_buffers() if "amax" in n):
        amax.fill_(i + 1.5)
    state = AmaxState(torch.compile(model)).state_dict()
    assert sorted(state) == ["0.amax_grad", "0.amax_input", "2.amax_grad", "2.amax_input"]
    plain, _ = two_layers()
    AmaxState(plain).load_state_dict(state)
    assert [float(b) for n, b in plain.named_buffers() if "amax" in n] == [1.5, 2.5, 3.5, 4.5]
    AmaxState(nn.Linear(2, 2)).load_state_dict(state)

    class Position:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    where = save_checkpoint(tmp_path, 1, plain, {}, 0, {"loader": Position()})  # no fp8_amaxes in the file
    fresh, _ = two_layers()
    load_checkpoint(where, fresh, {}, 0, {"loader": Position(), "fp8_amaxes": AmaxState(fresh)})
    assert {float(b) for n, b in fresh.named_buffers() if "amax" in n} == set(START.values())
    with pytest.raises(KeyError, match="other"):
        load_checkpoint(where, fresh, {}, 0, {"other": Position()})


@pytest.mark.parametrize("resumed", [False, True])
def test_the_compile_warm_up_calibrates_a_new_runs_amaxes_and_keeps_a_resumed_ones(world_of_one, synthetic_data,
                                                                                  tmp_path, monkeypatch, resumed):
    """The driver's compile warm-up runs a training forward and backward on a synthetic batch, which records amaxes
    (test_a_bf16_model_trains_close_to_bf16_and_compiles: compiled as eager): a new run keeps them (its first step
    is not scaled by the start values), a resumed run gets the ones its checkpoint restored back (a review found
    the warm-up overwriting them after `resume`). The warm-up itself is stood in for by one that records 7.0
    everywhere: compiling the model on the CPU takes a minute."""
    from test_loop import make_run

    import bert.train.warmup as warmup
    from bert.train.mlperf_log import MLPerfLog

    def records(model, batch, autocast) -> float:
        for name, amax in model.named_buffers():
            if "amax" in name:
                amax.fill_(7.0)
        return 0.0

    monkeypatch.setattr(warmup, "warm_up", records)
    run = make_run(synthetic_data, tmp_path, precision="fp8", fp8_recipe="delayed", master_weights=True,
                   static_tokens=128, attention="loop", compile="debug", resume=resumed)
    try:
        amaxes = AmaxState(run.ddp.module)
        restored = {name: torch.tensor(0.25 + i) for i, name in enumerate(amaxes.state_dict())}
        amaxes.load_state_dict(restored)
        warmup.compile_before_run(run, MLPerfLog("", enabled=False), torch.device("cpu"))
    finally:
        run.loader.close()
    after = amaxes.state_dict()
    assert len(after) == 8 * run.ddp.module.config.num_hidden_layers
    assert all(torch.equal(after[name], restored[name] if resumed else torch.tensor(7.0)) for name in restored)


class Float8Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """How often each of our float8 ops ran."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "bert":
            name = func.__name__.split(".")[0]
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ours", [{}, dict(attention="triton", residual_norm="fused-lean", bias_gelu="fused")],
                         ids=["linears", "every-function-of-ours"])
def test_an_evaluation_makes_none_of_the_backwards_operands(ours):
    """The driver's float8 model (delayed scaling, alone or with every Function of ours) in an eval forward without
    grad: no weight's transposed e4m3 copy, no input's, nothing for a backward that never runs (autograd says a
    Function's inputs need gradients by their requires_grad alone, under no_grad too: fp8_delayed.without_grad),
    and the same output as a training-mode forward without dropout computes."""
    from bert.config import from_flat
    from bert.train.build import build_model

    cfg = from_flat(bert_config_path="tiny", precision="fp8", fp8_recipe="delayed", static_tokens=512, **ours)
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"))
    batch = random_batch((200, 180, 132), seed=1, vocab_size=30522)
    model.eval()
    with torch.no_grad(), Float8Ops() as ops:
        loss = model(batch).loss
    assert not {"fp8_transpose", "fp8_cast_transpose"} & set(ops.calls), ops.calls
    with Float8Ops() as trained:
        want = model(batch).loss  # eval mode (no dropout), grad on: the training forward's operands
    assert trained.calls.get("fp8_cast_transpose", 0) > 0, trained.calls  # the mode sees them where they run
    torch.testing.assert_close(loss, want, rtol=0, atol=0)


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resumed"])
def test_without_compile_a_new_run_calibrates_its_amaxes_before_run_start(world_of_one, synthetic_data, tmp_path,
                                                                          resume):
    """COMPILE=off has no compile warm-up, so `compile_before_run` runs one forward and backward on the synthetic
    batch for the amaxes alone: every one leaves its start (scale 1, which flushes small e5m2 gradients), the
    weights, their gradients and the RNG as they were. A resumed run keeps what its checkpoint restored."""
    from test_loop import make_run

    from bert.train.mlperf_log import MLPerfLog
    from bert.train.warmup import compile_before_run

    torch._dynamo.reset()
    run = make_run(synthetic_data, tmp_path, precision="fp8", fp8_recipe="delayed", master_weights=True,
                   static_tokens=128, resume=resume)
    try:
        model = run.ddp.module
        swapped = [m for m in model.modules() if isinstance(m, DelayedFloat8Linear)]
        weights = [p.detach().clone() for p in model.parameters()]
        rng = torch.get_rng_state()
        assert compile_before_run(run, MLPerfLog(str(tmp_path / "log.txt"), True), torch.device("cpu")) is None
        amaxes = [(float(m.amax_input), float(m.amax_grad)) for m in swapped]
        if resume:
            assert amaxes == [(START[E4M3], START[E5M2])] * len(swapped)
        else:
            assert all(a != START[E4M3] and g != START[E5M2] and 0 < g < a for a, g in amaxes)
        assert all(torch.equal(w, p) and p.grad is None for w, p in zip(weights, model.parameters()))
        assert torch.equal(rng, torch.get_rng_state())
    finally:
        run.loader.close()
