"""RESIDUAL_NORM=fused-lean (bert.model.dropout_add_norm's `from_output`): the fused norm's forward keeps no sum, and
its backward recovers x_hat from the output, (y - beta) / gamma, as apex's memory-efficient LayerNorm does.
References: LayerNorm's gradient in float64 through torch's own modules; the sum-keeping fused norm
(RESIDUAL_NORM=fused) for the outputs, the rounding in bf16 and the models' training steps; torch's `gradcheck` and
`opcheck`. The kernels' FROM_Y (and the forward's SUM off) are checked against the torch path in Triton's
interpreter, and on a GPU where there is one."""

import pytest
import torch
from test_dropout_add_norm import SEED, inputs, reference
from test_fp8_bias_gelu import NARROWING_PATCH
from torch.utils._python_dispatch import TorchDispatchMode
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.config import ConfigError, from_env_and_args, from_flat
from bert.model import dropout_add_norm as dan
from bert.model import fp8_residual_norm as frn
from bert.model.dropout_add_norm import FusedResidualOutput, keep_mask
from bert.model.fp8_delayed import E4M3
from bert.synthetic import random_batch
from bert.train.build import build_model

OP = torch.ops.bert.dropout_add_layer_norm
FP8_FORWARD = torch.ops.bert.dropout_add_layer_norm_fp8
FP8_BACKWARD = torch.ops.bert.dropout_add_layer_norm_backward_fp8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_forward_keeps_no_sum_and_the_rest_unchanged(dtype):
    h, residual, gamma, beta, bias = inputs(45, 96, dtype)
    full = OP(h, residual, gamma, beta, bias, SEED, 0.1, 1e-12)
    lean = OP(h, residual, gamma, beta, bias, SEED, 0.1, 1e-12, True)
    assert lean[1].shape == (0, 96) and full[1].shape == (45, 96)
    for name, a, b in zip(("y", "bits", "mean", "rstd"), (full[0], *full[2:]), (lean[0], *lean[2:])):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("p,with_bias", [(0.1, True), (0.0, False), (0.3, False)])
def test_every_gradient_is_autograds_through_the_chain(p, with_bias):
    """In float64 the gradients from y are LayerNorm's own, as the sum's are."""
    h, residual, gamma, beta, bias = (t.requires_grad_() for t in inputs(37, 64))
    bias = bias if with_bias else None
    y = OP(h, residual, gamma, beta, bias, SEED if p else None, p, 1e-12, True)[0]
    keep = keep_mask(SEED, 37, 64, p) if p else torch.ones(37, 64, dtype=torch.bool)
    want = reference(h, residual, gamma, beta, bias, keep, p)
    dy = torch.randn(37, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = [t for t in (h, residual, gamma, beta, bias) if t is not None]
    for got, expected in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_gradcheck_and_opcheck():
    h, residual, gamma, beta, bias = inputs(9, 24)
    torch.autograd.gradcheck(lambda *t: OP(*t, SEED, 0.2, 1e-5, True)[0],
                             tuple(t.clone().requires_grad_() for t in (h, residual, gamma, beta, bias)))
    torch.library.opcheck(OP.default, (h, residual, gamma, beta, bias, SEED, 0.2, 1e-5, True))
    y, _, bits, mean, rstd = OP(h, residual, gamma, beta, bias, SEED, 0.2, 1e-5, True)
    torch.library.opcheck(torch.ops.bert.dropout_add_layer_norm_backward.default,
                          (torch.randn_like(y), y, bits, mean, rstd, gamma, 0.2, torch.float64, beta))
    scale = torch.tensor(3.0)
    torch.library.opcheck(FP8_FORWARD.default, (h, residual, gamma, beta, SEED, 0.2, 1e-5, scale, True, True, True))
    torch.library.opcheck(FP8_BACKWARD.default, (torch.randn_like(y), y, bits, mean, rstd, gamma, 0.2, torch.float64,
                                                 scale, None, True, beta))


@pytest.mark.parametrize("seed", range(3))
def test_in_bf16_its_gradients_round_as_the_sums_do(seed):
    """bf16 throughout (the masters' model weights): y carries its rounding into x_hat, the sum its own; each gradient
    is as far from float64's as the sum-keeping norm's, within twice that and a bf16 rounding of the largest."""
    h, residual, gamma, beta, bias = inputs(256, 384, torch.bfloat16, seed=seed)
    keep = keep_mask(SEED, 256, 384, 0.1)
    dy = torch.randn(256, 384, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    exact = [t.double().requires_grad_() for t in (h, residual, gamma, beta, bias)]
    want = torch.autograd.grad(reference(*exact, keep, 0.1), exact, dy.double())
    errors = {}
    for lean in (False, True):
        leaves = [t.clone().requires_grad_() for t in (h, residual, gamma, beta, bias)]
        got = torch.autograd.grad(OP(*leaves, SEED, 0.1, 1e-12, lean)[0], leaves, dy)
        errors[lean] = [((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]
    for name, full, lean in zip(("h", "residual", "gamma", "beta", "bias"), errors[False], errors[True]):
        assert lean <= 2 * full and lean < 2**-7, (name, full, lean)


def test_a_zero_gamma_gives_nan_gradients_not_wrong_ones():
    """x_hat is lost where gamma is 0 (y is beta there): the gradients are NaN, which the driver's NaN check stops
    on, rather than finite and wrong."""
    h, residual, gamma, beta, bias = (t.requires_grad_() for t in inputs(8, 16))
    with torch.no_grad():
        gamma[3] = 0.0
    y = OP(h, residual, gamma, beta, bias, None, 0.0, 1e-12, True)[0]  # no element dropped: each one's gradient
    dh, dgamma = torch.autograd.grad(y, (h, gamma), torch.ones_like(y))
    assert dgamma[3].isnan() and dh.isnan().all()


@pytest.mark.parametrize("twice,transposed", [(False, False), (True, True)])
def test_the_float8_ops_from_the_output_are_the_sums(twice, transposed):
    """The float8 forward keeps no sum and makes every other output as before; in float64 the float8 backward from
    y gives the sum's e5m2 bytes, amax and transpose, and its residual gradient and column sums within float64's
    rounding."""
    h, residual, gamma, beta, _ = inputs(40, 64)
    scale = torch.tensor(5.0)
    full = FP8_FORWARD(h, residual, gamma, beta, SEED, 0.1, 1e-12, scale, twice, transposed)
    lean = FP8_FORWARD(h, residual, gamma, beta, SEED, 0.1, 1e-12, scale, twice, transposed, True)
    assert lean[1].shape == (0, 64)
    for i, (a, b) in enumerate(zip(full, lean)):
        if i != 1:
            assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                               b.view(torch.uint8) if b.dtype == E4M3 else b), i
    y, s, bits, mean, rstd = full[:5]
    dy, dy2 = torch.randn(2, 40, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = [FP8_BACKWARD(dy, x, bits, mean, rstd, gamma, 0.1, torch.float64, scale, dy2 if twice else None,
                          transposed, b) for x, b in ((s, None), (y, beta))]
    for i, (a, b) in enumerate(zip(*grads)):
        if a.dtype == frn.E5M2:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=str(i))


class NormCalls(TorchDispatchMode):
    """Each call of a norm op of ours: whether it worked from the output (a forward's `from_output`, a backward's
    `beta` given), by the op's schema."""

    def __init__(self):
        super().__init__()
        self.lean: dict[str, list[bool]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace == "bert" and "layer_norm" in name:
            given = {a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                     for i, a in enumerate(func._schema.arguments)}
            lean = given["beta"] is not None if "backward" in name else given["from_output"]
            self.lean.setdefault(name, []).append(lean)
        return func(*args, **kwargs)


def train_step(residual_norm: str, **settings):
    """One training step of the tiny model built by the driver's own code: the loss, every parameter's gradient,
    the fused closes, and the norm ops' calls (`NormCalls`)."""
    torch.manual_seed(0)
    model = build_model(from_flat(residual_norm=residual_norm, bert_config_path="tiny", **settings).model,
                        torch.device("cpu"))
    torch.manual_seed(5)  # the dropout masks: the same both sides
    with NormCalls() as calls:
        loss = model(random_batch((9, 5, 18), seed=3, vocab_size=30522)).loss
        loss.backward()
    closes = [m for m in model.modules() if isinstance(m, FusedResidualOutput)]
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, closes, calls.lean


@pytest.mark.parametrize("settings", [{}, dict(precision="fp8", fp8_recipe="delayed", static_tokens=512,
                                               attention="triton", bias_gelu="fused")],
                         ids=["fp32", "fp8-delayed-one-function-a-sublayer"])
def test_the_config_builds_it_and_it_trains_as_the_sum_keeping_norm(settings):
    """Every sublayer's close (the float8 attention and FFN Functions' too) works from its output; the same loss, and
    every gradient within fp32's rounding of the RESIDUAL_NORM=fused model's."""
    loss, grads, closes, calls = train_step("fused-lean", **settings)
    want_loss, want_grads, want_closes, want_calls = train_step("fused", **settings)
    assert len(closes) == len(want_closes) == 4
    assert all(c.from_output for c in closes) and not any(c.from_output for c in want_closes)
    # each of the 4 norms once each way, through whichever op its Function calls, all from the output or none
    assert sum(len(v) for v in calls.values()) == sum(len(v) for v in want_calls.values()) == 8, calls
    assert all(all(v) for v in calls.values()) and not any(any(v) for v in want_calls.values()), (calls, want_calls)
    assert [type(c) for c in closes] == [type(c) for c in want_closes]
    assert torch.equal(loss, want_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_environment_selects_it_and_a_typo_fails_when_parsed():
    from test_config import BASE

    assert from_env_and_args([], {**BASE, "RESIDUAL_NORM": "fused-lean"}).model.residual_norm == "fused-lean"
    with pytest.raises(ConfigError, match=r"\$RESIDUAL_NORM.*fused-lean"):
        from_env_and_args([], {**BASE, "RESIDUAL_NORM": "fused-lena"})


INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model import dropout_add_norm as dan
from bert.model import fp8_residual_norm as frn

bad = []
# (rows, n, dtype, residual dtype, p): a last program cut, a row not a power of two, autocast's fp32 residual
for rows, n, dtype, residual_dtype, p in [(45, 96, torch.float32, torch.float32, 0.1),
                                          (70, 100, torch.bfloat16, torch.bfloat16, 0.3),
                                          (33, 128, torch.bfloat16, torch.float32, 0.0)]:
    g = torch.Generator().manual_seed(rows)
    h, r = torch.randn(rows, n, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(residual_dtype)
    gamma, beta = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype), (0.3 * torch.randn(n, generator=g)).to(dtype)
    seed = torch.tensor(987654321) if p else None
    case = (rows, n, str(dtype), str(residual_dtype), p)
    full, lean = dan._outputs(h, r, p), dan._outputs(h, r, p, True)
    lean[1].fill_(7.0)  # 0 rows: nothing to write
    dan.launch_forward(h, r, gamma, beta, None, seed, p, 1e-12, full)
    dan.launch_forward(h, r, gamma, beta, None, seed, p, 1e-12, lean)  # SUM off
    same = all(torch.equal(a, b) for a, b in zip((full[0], *full[2:]), (lean[0], *lean[2:])))
    if lean[1].shape != (0, n) or not same:
        bad.append(case + ("forward",))
    y, s, bits, mean, rstd = full
    dy = torch.randn(rows, n, generator=g).to(y.dtype)
    kernel, want = dan._grads(dy, y, mean, dtype), dan._grads(dy, y, mean, dtype)
    dan.launch_backward(dy, y, bits, mean, rstd, gamma, p, kernel, beta=beta)  # FROM_Y
    dan.backward_torch(dy, y, bits, mean, rstd, gamma, p, want, beta)
    tol = 2e-6 if dtype == torch.float32 else 2 ** -6
    for name, a, b in zip(("dh", "ds"), kernel, want):
        if not torch.allclose(a.double(), b.double(), rtol=tol, atol=tol):
            bad.append(case + (name, (a.double() - b.double()).abs().max().item()))
    if not torch.allclose(kernel[2], want[2], rtol=1e-4, atol=1e-4 * rows):
        bad.append(case + ("sums", (kernel[2] - want[2]).abs().max().item()))
    # the float8 backward from y: the torch path's e5m2 bytes but where the fp32 sums' order rounds apart
    sc = torch.tensor(40.0)
    q = frn._grads(dy, y, mean)
    amax = dan.launch_backward(dy, y, bits, mean, rstd, gamma, p, q, (sc, dtype), beta=beta)
    want_q = frn.dropout_add_layer_norm_backward_fp8(dy, y, bits, mean, rstd, gamma, p, dtype, sc, beta=beta)
    if (q[0].float() != want_q[0].float()).float().mean().item() > 0.01:
        bad.append(case + ("e5m2",))
    if not torch.allclose(amax, want_q[3], rtol=tol, atol=0):
        bad.append(case + ("amax", amax.item(), want_q[3].item()))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_kernels_from_the_output_match_the_torch_path_in_the_interpreter():
    """The forward with SUM off writes every other output as with it; the backward's FROM_Y (bf16 and float8) gives
    the torch path's gradients within a rounding of their dtype."""
    run_check(INTERPRETER, timeout=300, interpret=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_kernels_from_the_output_match_the_cpu_path(monkeypatch):
    """At the step's shape (a batch's tokens by BERT-large's width) in bf16: the GPU's gradients from y within bf16's
    rounding of the CPU's."""
    refuse_torch_path_on_cuda(monkeypatch, dan, "forward_torch", "backward_torch")
    h, residual, gamma, beta, bias = inputs(24576, 1024, torch.bfloat16)
    cuda = [t.cuda().requires_grad_() for t in (h, residual, gamma, beta, bias)]
    cpu = [t.clone().requires_grad_() for t in (h, residual, gamma, beta, bias)]
    outs = [OP(*ts, SEED.to(ts[0].device), 0.1, 1e-12, True) for ts in (cuda, cpu)]
    assert outs[0][1].shape == (0, 1024) and torch.equal(outs[0][2].cpu(), outs[1][2])
    dy = torch.randn(24576, 1024, dtype=torch.bfloat16)
    for got, want in zip(torch.autograd.grad(outs[0][0], cuda, dy.cuda()), torch.autograd.grad(outs[1][0], cpu, dy)):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=2**-5 * (1 + want.abs().max()))


def test_the_bench_sees_a_gamma_near_zero_beside_a_beta(tmp_path):
    """bench/norm_from_output.py on a checkpoint whose one norm has a feature of |beta / gamma| = 1000: there the
    lean norm's gamma gradient is far off float64's (y's bf16 rounding times 1000), the sum-keeping one's is not; the
    other norms' are as close as each other."""
    from safetensors.torch import save_file
    from script_modules import load_script

    from bert.model import BertConfig, BertForPreTraining

    bench = load_script("bench/norm_from_output.py")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.load("tiny"), attention="padded")
    norm = model.bert.encoder.layer[1].attention.output.LayerNorm
    with torch.no_grad():
        norm.weight[7], norm.bias[7] = 1e-3, 1.0
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "ckpt.safetensors")
    batches = [random_batch((40, 30, 20), seed=1, vocab_size=30522)]
    rows = {r["norm"]: r for r in bench.measure("tiny", str(tmp_path / "ckpt.safetensors"), batches)["norms"]}
    bad = rows["bert.encoder.layer.1.attention.output"]
    assert bad["max_beta_over_gamma"] == pytest.approx(1000, rel=1e-3)
    assert bad["worst_feature_error_fused-lean"] > 0.1 > 10 * bad["worst_feature_error_fused"], bad
    for name, row in rows.items():
        if row is not bad:
            assert row["dgamma_error_fused-lean"] < 2 * row["dgamma_error_fused"] + 1e-3, (name, row)


def test_traced_by_aot_autograd_the_backward_reads_the_output_and_matches_eager():
    """Dynamo and AOT autograd keep the op one node each way with no break, the forward told `from_output` and the
    backward given beta (the output its saved tensor); every gradient equals eager's bit for bit."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from bert.model import BertConfig
    from bert.model.layers import BertResidualOutput

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64).with_dropout(0.1)
    layer = FusedResidualOutput.from_module(BertResidualOutput(cfg, 64))
    layer.from_output = True
    h, residual = torch.randn(16, 64, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    calls = []

    def keep(gm, example_inputs):
        calls.extend(n for n in gm.graph.nodes if "dropout_add_layer_norm" in str(n.target))
        return make_boxed_func(gm.forward)

    def grads(fn):
        torch.manual_seed(5)
        return torch.autograd.grad(fn(h, residual).square().sum(), (h, residual, *layer.parameters()))

    want = grads(layer)
    torch._dynamo.reset()
    got = grads(torch.compile(layer, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True))
    torch._dynamo.reset()
    forward, backward = calls
    assert str(forward.target) == "bert.dropout_add_layer_norm.default" and forward.args[-1] is True
    assert str(backward.target) == "bert.dropout_add_layer_norm_backward.default"
    assert backward.args[-1] is not None  # beta: x_hat from y
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
