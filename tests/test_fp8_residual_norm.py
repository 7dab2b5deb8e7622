"""bert.model.fp8_residual_norm (`RESIDUAL_NORM=fused` under delayed float8): a sublayer's closing float8 linear and
its dropout + residual + LayerNorm, the dense output gradient's float8 cast, amax and bias sums in the norm
backward's pass. References: the unfused path it replaces (a FusedResidualOutput over a DelayedFloat8Linear,
autograd between them), which it must equal bit for bit but for the bias gradient's sum; LayerNorm's gradient in
float64 through torch's own modules; torch's `opcheck`. The Triton kernel's float8 branch is checked against the
torch path in Triton's interpreter and compiled for sm_90."""

import copy

import pytest
import torch
from test_fp8_bias_gelu import NARROWING_PATCH, assert_unfused_but_bias_sums, compiled_ops, tiny_model
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.config import from_flat
from bert.model import BertConfig
from bert.model import fp8_residual_norm as frn
from bert.model.dropout_add_norm import FusedResidualOutput, apply_residual_norm, keep_mask
from bert.model.fp8 import convert_to_fp8, is_fp8_linear
from bert.model.fp8_delayed import E5M2, DelayedFloat8Linear, convert_to_delayed_fp8
from bert.model.layers import BertResidualOutput
from bert.synthetic import random_batch

OP = torch.ops.bert.dropout_add_layer_norm_backward_fp8


def sublayer_pair(dtype, amax_grad, p=0.1, seed=0):
    """(the unfused float8 sublayer close: a FusedResidualOutput over a DelayedFloat8Linear, the same as a
    Float8ResidualOutput), equal parameters and amaxes; gamma and beta not 1 and 0."""
    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64).with_dropout(p)
    ref = FusedResidualOutput.from_module(BertResidualOutput(cfg, 64)).to(dtype)
    with torch.no_grad():
        ref.LayerNorm.weight.add_(0.3 * torch.randn(32).to(dtype))
        ref.LayerNorm.bias.add_(0.3 * torch.randn(32).to(dtype))
    ref.dense = DelayedFloat8Linear.from_linear(ref.dense)
    ours = frn.Float8ResidualOutput.from_module(copy.deepcopy(ref))
    for m in (ref, ours):
        m.dense.amax_input.fill_(3.0)
        m.dense.amax_grad.fill_(amax_grad)
    return ref, ours


def step(module, x, residual, grad, run=None):
    """Forward and backward, `grad` y's gradient (or `run` does both, returning y); what each made."""
    x, residual = x.detach().clone().requires_grad_(), residual.detach().clone().requires_grad_()
    torch.manual_seed(7)  # the dropout seed: the same mask both sides
    if run is None:
        y = module(x, residual)
        y.backward(grad)
    else:
        y = run(x, residual)
    d, norm = module.dense, module.LayerNorm
    return {"y": y, "dx": x.grad, "dresidual": residual.grad, "dw": d.weight.grad, "db": d.bias.grad,
            "dgamma": norm.weight.grad, "dbeta": norm.bias.grad, "amax_grad": d.amax_grad.clone(),
            "amax_input": d.amax_input.clone()}


def data(dtype, residual_dtype=None, rows=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    return x, *(torch.randn(rows, 32, generator=g).to(residual_dtype or dtype) for _ in range(2))


@pytest.mark.parametrize("dtype,residual_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                  (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("amax_grad", [0.5, 1e-3])  # the second saturates the gradient's float8 copy
def test_it_is_the_unfused_float8_linear_and_norm_but_for_the_bias_sums_rounding(dtype, residual_dtype, amax_grad):
    ref, ours = sublayer_pair(dtype, amax_grad)
    x, residual, grad = data(dtype, residual_dtype)
    assert_unfused_but_bias_sums(step(ours, x, residual, grad), step(ref, x, residual, grad), dtype, amax_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paired_its_two_gradients_are_the_unfused_paths_one_summed(dtype):
    """Float8ResidualOutput.paired: y twice (one storage), each with its own gradient, added in the op (`Stream`):
    everything the unfused path gives for their sum as autograd adds it, but for the bias sums' rounding."""
    ref, ours = sublayer_pair(dtype, 0.5)
    x, residual, grad = data(dtype)
    part = torch.randn(grad.shape, generator=torch.Generator().manual_seed(4)).to(dtype)

    def paired(x, residual):
        pair = ours.paired(x, residual)
        assert pair.x.data_ptr() == pair.residual.data_ptr()
        torch.autograd.backward((pair.x, pair.residual), (grad - part, part))
        return pair.x

    got = step(ours, x, residual, None, run=paired)
    assert_unfused_but_bias_sums(got, step(ref, x, residual, (grad - part) + part), dtype, 0.5)


def test_in_eval_it_drops_nothing_and_is_the_unfused_eval():
    ref, ours = sublayer_pair(torch.float32, 0.5, p=0.5)
    x, residual, _ = data(torch.float32, rows=16)
    for m in (ref, ours):
        m.eval()
    with torch.no_grad():
        y = ours(x, residual)
        assert torch.equal(y, ours(x, residual)) and torch.equal(y, ref(x, residual))


def test_a_non_finite_gradient_keeps_the_old_amax_as_the_unfused_path_does():
    ref, ours = sublayer_pair(torch.float32, 0.5)
    x, residual, grad = data(torch.float32, rows=16)
    grad[3, 5] = float("nan")
    for module in (ref, ours):
        assert float(step(module, x, residual, grad)["amax_grad"]) == 0.5


def test_the_op_in_float64_is_layer_norms_gradient_scaled_and_rounded_to_e5m2():
    """The op's d h against LayerNorm(dropout(h) + residual)'s gradient through torch's own modules in float64, the
    op's mask given; d s, the sums and the amax exact to float64's rounding."""
    g = torch.Generator().manual_seed(2)
    rows, n, p = 40, 24, 0.2
    h, residual, dy = (torch.randn(rows, n, generator=g, dtype=torch.float64) for _ in range(3))
    gamma = 1 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    beta = 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    seed = torch.tensor(2**40 + 5)
    _, s, bits, mean, rstd = torch.ops.bert.dropout_add_layer_norm(h, residual, gamma, beta, None, seed, p, 1e-12)
    keep = keep_mask(seed, rows, n, p)
    leaves = [t.clone().requires_grad_() for t in (h, residual, gamma, beta)]
    x = torch.where(keep, leaves[0] / (1 - p), 0.0) + leaves[1]
    y = torch.nn.functional.layer_norm(x, (n,), leaves[2], leaves[3], 1e-12)
    exact = torch.autograd.grad(y, leaves, dy)
    scale = torch.tensor(64.0)
    q, ds, sums, amax, q_t = OP(dy, s, bits, mean, rstd, gamma, p, torch.float64, scale)
    assert (q.dtype, ds.dtype, sums.dtype, amax.dtype) == (E5M2, torch.float64, torch.float64, torch.float32)
    assert q_t.shape == (0, rows)  # no transpose unless asked
    q_t = OP(dy, s, bits, mean, rstd, gamma, p, torch.float64, scale, None, True)[4]
    assert q_t.shape == (n, rows) and q_t.is_contiguous()
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
    torch.testing.assert_close(ds, exact[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(sums, torch.stack([exact[2], exact[3], exact[0].sum(0)]), rtol=0, atol=1e-11)
    torch.testing.assert_close(amax.double(), exact[0].abs().max(), rtol=1e-6, atol=0)
    # e5m2 keeps 2 mantissa bits: within half its spacing (2^-3 relative) of the scaled gradient, or its subnormals'
    err = (q.double() - exact[0] * 64).abs()
    assert (err <= 2.0 ** -3 * (exact[0] * 64).abs() + 2.0 ** -17).all()
    # saturated, not inf: the largest e5m2
    q = OP(dy, s, bits, mean, rstd, gamma, p, torch.float64, torch.tensor(1e6))[0]
    assert q.float().abs().max() == torch.finfo(E5M2).max and torch.isfinite(q.float()).all()


def test_opcheck_and_the_refusal():
    g = torch.Generator().manual_seed(3)
    h, residual, dy = (torch.randn(16, 32, generator=g) for _ in range(3))
    gamma, beta = torch.ones(32), torch.zeros(32)
    _, s, bits, mean, rstd = torch.ops.bert.dropout_add_layer_norm(h, residual, gamma, beta, None,
                                                                   torch.tensor(11), 0.1, 1e-12)
    torch.library.opcheck(OP, (dy, s, bits, mean, rstd, gamma, 0.1, torch.bfloat16, torch.tensor(8.0)))
    torch.library.opcheck(OP, (dy, s, bits, mean, rstd, gamma, 0.1, torch.bfloat16, torch.tensor(8.0), h))
    torch.library.opcheck(OP, (dy, s, bits, mean, rstd, gamma, 0.1, torch.bfloat16, torch.tensor(8.0), h, True))
    with pytest.raises(ValueError, match="0-dim"):
        OP(dy, s, bits, mean, rstd, gamma, 0.1, torch.bfloat16, torch.ones(1))
    for wrong in (h[1:], h.double()):
        with pytest.raises(ValueError, match="second gradient"):
            OP(dy, s, bits, mean, rstd, gamma, 0.1, torch.bfloat16, torch.tensor(8.0), wrong)


def test_in_a_float8_layer_the_attention_outputs_two_gradients_reach_its_norm_apart():
    """One float8 layer (COMPILE_SCOPE=layers' unit) traced by AOT autograd: the attention's norm takes the FFN's
    and the residual's gradients in two parts, so no add comes before it; the FFN's norm, whose output leaves the
    graph, one. The layer's gradients are eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    model = tiny_model()
    apply_residual_norm(model, "fused")
    convert_to_fp8(model, recipe="delayed")
    layer = model.bert.encoder.layer[0]
    attend = model.plan_attention(random_batch((9, 5, 18), seed=3, vocab_size=1104).seq)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(5))
    parts = []

    def record(gm, example_inputs):
        parts.extend(second_gradient(n) for n in gm.graph.nodes
                     if n.op == "call_function" and "dropout_add_layer_norm_backward_fp8" in str(n.target))
        return make_boxed_func(gm.forward)

    def grads(module):
        leaf = x.clone().requires_grad_()
        module(leaf, attend).x.square().sum().backward()
        return [leaf.grad] + [p.grad.clone() for p in module.parameters()]

    want = grads(copy.deepcopy(layer))  # the amaxes as they start, for both
    layer.zero_grad()
    torch._dynamo.reset()
    try:
        got = grads(torch.compile(layer, backend=aot_autograd(fw_compiler=record, bw_compiler=record)))
    finally:
        torch._dynamo.reset()
    assert parts == [False, True], parts  # backward order: the FFN's norm first
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def second_gradient(node) -> bool:
    """Whether a call of the float8 norm backward takes y's gradient in two parts (its `dy2`, the tenth argument)."""
    return node.kwargs.get("dy2") is not None or (len(node.args) > 9 and node.args[9] is not None)


def test_the_float8_model_swaps_each_sublayer_close_and_trains_as_the_unfused_one():
    """RESIDUAL_NORM=fused then delayed float8: every sublayer's close a Float8ResidualOutput, parameters and
    checkpoint keys unchanged; the loss and every gradient as the unfused float8 model's (RESIDUAL_NORM=fused over
    DelayedFloat8Linear), the closing dense layers' biases within their sums' rounding."""
    model, reference = tiny_model(), tiny_model()
    params = dict(model.named_parameters())
    for m in (model, reference):
        apply_residual_norm(m, "fused")
    convert_to_fp8(model, recipe="delayed")
    # the unfused float8 path: the linears swapped, the closes kept
    convert_to_delayed_fp8(reference, lambda module, name: is_fp8_linear(module, name))
    closes = [m for m in model.modules() if isinstance(m, FusedResidualOutput)]
    assert len(closes) == 4 and all(isinstance(m, frn.Float8ResidualOutput) for m in closes)
    assert not any(type(m) is frn.Float8ResidualOutput for m in reference.modules())
    assert dict(model.named_parameters()) == params and model.state_dict().keys() == reference.state_dict().keys()
    batch = random_batch((9, 5, 18), seed=3, vocab_size=1104)  # 32 tokens: float8's weight GEMMs take 16s
    losses = [m(batch).loss for m in (model, reference)]
    assert float(losses[0].detach()) == float(losses[1].detach())
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        exact = not (name.endswith("output.dense.bias") and "layer." in name)
        torch.testing.assert_close(p.grad, q.grad, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6, msg=name)
    amaxes = [[b for n, b in m.named_buffers() if "amax" in n] for m in (model, reference)]
    assert amaxes[0] == amaxes[1]


def test_the_config_builds_it_with_the_delayed_recipe_only():
    from bert.train.build import build_model

    layers = BertConfig.load("tiny").num_hidden_layers
    cfg = from_flat(residual_norm="fused", precision="fp8", fp8_recipe="delayed", static_tokens=512,
                    attention="padded", bert_config_path="tiny").model
    model = build_model(cfg, torch.device("cpu"))
    assert sum(isinstance(m, frn.Float8ResidualOutput) for m in model.modules()) == 2 * layers
    # FP8_LINEARS=ffn keeps the attention's output dense in bf16: its close stays the bf16 kernel's
    cfg = from_flat(residual_norm="fused", precision="fp8", fp8_recipe="delayed", fp8_linears="ffn",
                    static_tokens=512, attention="padded", bert_config_path="tiny").model
    model = build_model(cfg, torch.device("cpu"))
    assert sum(isinstance(m, frn.Float8ResidualOutput) for m in model.modules()) == layers
    assert sum(type(m) is FusedResidualOutput for m in model.modules()) == layers
    with pytest.raises(ValueError, match="DelayedFloat8Linear"):
        frn.Float8ResidualOutput.from_module(FusedResidualOutput.from_module(
            tiny_model().bert.encoder.layer[0].output))


def test_compiled_the_op_is_one_node_of_the_backward_and_the_step_matches_eager():
    _, eager = sublayer_pair(torch.float32, 0.5)
    compiled_module = copy.deepcopy(eager)  # before the eager step: the same amaxes
    x, residual, grad = data(torch.float32, rows=32, seed=4)
    want = step(eager, x, residual, grad)
    seen, got = compiled_ops(compiled_module, lambda m: step(m, x, residual, grad), "dropout_add_layer_norm")
    assert seen == ["bert.dropout_add_layer_norm.default", "bert.dropout_add_layer_norm_backward_fp8.default"]
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)


INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model import dropout_add_norm as dan
from bert.model import fp8_residual_norm as frn
from bert.model.fp8_delayed import E5M2

bad = []
# (rows, n, dtype, residual dtype, p, scale): a last program cut, a row not a power of two, autocast's fp32
# residual, a scale that saturates, a row wider than a transposed tile
for rows, n, dtype, residual_dtype, p, scale in [(45, 96, torch.float32, torch.float32, 0.1, 40.0),
                                                 (70, 100, torch.bfloat16, torch.bfloat16, 0.3, 3e4),
                                                 (33, 128, torch.bfloat16, torch.float32, 0.0, 1.0),
                                                 (40, 64, torch.float16, torch.float16, 0.1, 500.0),
                                                 (36, 300, torch.bfloat16, torch.bfloat16, 0.1, 1e3)]:
    g = torch.Generator().manual_seed(rows)
    h, r = torch.randn(rows, n, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(residual_dtype)
    gamma, beta = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype), (0.3 * torch.randn(n, generator=g)).to(dtype)
    seed = torch.tensor(987654321) if p else None
    y, s, bits, mean, rstd = dan._outputs(h, r, p)
    dan.forward_torch(h, r, gamma, beta, None, seed, p, 1e-12, (y, s, bits, mean, rstd))
    dy = torch.randn(rows, n, generator=g).to(y.dtype)
    sc = torch.tensor(scale)
    case = (rows, n, str(dtype), str(residual_dtype), p, scale)
    kernel = frn._grads(dy, s, mean)
    dht = torch.full((n, rows), 3.0).to(E5M2)
    amax = dan.launch_backward(dy, s, bits, mean, rstd, gamma, p, kernel, (sc, dtype), None, dht)
    want = frn.dropout_add_layer_norm_backward_fp8(dy, s, bits, mean, rstd, gamma, p, dtype, sc)
    if not torch.equal(dht.view(torch.uint8), kernel[0].view(torch.uint8).t()):  # TRANSPOSE: the kernel's own bytes
        bad.append(case + ("dh transposed",))
    # fp32 sums in another order on each side: a rounding of the dtype apart at most
    off = (kernel[0].float() != want[0].float()).float().mean().item()
    if off > 0.01:
        bad.append(case + ("q differs at", off))
    if kernel[0].dtype != E5M2:
        bad.append(case + ("q's dtype", str(kernel[0].dtype)))
    tol = 2e-6 if dtype == torch.float32 else 2 ** -6
    if not torch.allclose(kernel[1].double(), want[1].double(), rtol=tol, atol=tol):
        bad.append(case + ("ds",))
    if not torch.allclose(kernel[2], want[2], rtol=1e-4, atol=1e-4 * rows):
        bad.append(case + ("sums", (kernel[2] - want[2]).abs().max().item()))
    if not torch.allclose(amax, want[3], rtol=tol, atol=0):
        bad.append(case + ("amax", amax.item(), want[3].item()))
    # y's gradient in two parts (SECOND): the kernel's sum is autograd's add, so every output is the one-part kernel's
    part = torch.randn(rows, n, generator=g).to(y.dtype)
    twice = frn._grads(dy, s, mean)
    amax2 = dan.launch_backward(dy - part, s, bits, mean, rstd, gamma, p, twice, (sc, dtype), part)
    once = frn._grads(dy, s, mean)
    amax1 = dan.launch_backward((dy - part) + part, s, bits, mean, rstd, gamma, p, once, (sc, dtype))
    if not all(torch.equal(a.view(torch.uint8) if a.dtype == E5M2 else a, b.view(torch.uint8) if b.dtype == E5M2
                           else b) for a, b in zip((*twice, amax2), (*once, amax1))):
        bad.append(case + ("two parts",))
dy[2, 3] = float("nan")
if torch.isfinite(dan.launch_backward(dy, s, bits, mean, rstd, gamma, p, frn._grads(dy, s, mean), (sc, dtype))):
    bad.append("a NaN gradient gave a finite amax")
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_kernels_float8_branch_matches_the_torch_path_in_the_interpreter():
    run_check(INTERPRETER, timeout=600, interpret=True)


FORWARD_INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model import dropout_add_norm as dan
from bert.model.fp8_delayed import E4M3

bad = []
# (rows, n, dtype, residual dtype, p, scale): a row not a power of two, autocast's fp32 residual, a scale that
# saturates, a row wider than a transposed tile
for rows, n, dtype, residual_dtype, p, scale in [(45, 96, torch.float32, torch.float32, 0.1, 40.0),
                                                 (30, 100, torch.bfloat16, torch.bfloat16, 0.3, 3e3),
                                                 (33, 128, torch.bfloat16, torch.float32, 0.0, 1.0),
                                                 (40, 300, torch.bfloat16, torch.bfloat16, 0.1, 20.0)]:
    g = torch.Generator().manual_seed(rows)
    h, r = torch.randn(rows, n, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(residual_dtype)
    gamma, beta = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype), (0.3 * torch.randn(n, generator=g)).to(dtype)
    seed = torch.tensor(987654321) if p else None
    out, plain = dan._outputs(h, r, p), dan._outputs(h, r, p)
    y_q, amaxes, y2 = torch.empty_like(out[0], dtype=E4M3), torch.empty(rows), torch.full_like(out[0], 7.0)
    dan.launch_forward(h, r, gamma, beta, None, seed, p, 1e-12, out, (y_q, torch.tensor(scale), amaxes), y2)
    dan.launch_forward(h, r, gamma, beta, None, seed, p, 1e-12, plain)
    # TRANSPOSE: ROWS rows a program (the last one cut), every other output as one row a program's
    rowwise, y_qt = dan._outputs(h, r, p), torch.full((n, rows), 5.0).to(E4M3)
    y_q2, amaxes2 = torch.empty_like(y_q), torch.empty(rows)
    dan.launch_forward(h, r, gamma, beta, None, seed, p, 1e-12, rowwise, (y_q2, torch.tensor(scale), amaxes2), None,
                       y_qt)
    if not all(torch.equal(a, b) for a, b in zip(rowwise + (y_q2.view(torch.uint8), amaxes2),
                                                 out + (y_q.view(torch.uint8), amaxes))):
        bad.append(case + ("ROWS rows a program changed an output",))
    if not torch.equal(y_qt.view(torch.uint8), y_q.view(torch.uint8).t()):
        bad.append(case + ("y_q transposed",))
    case = (rows, n, str(dtype), str(residual_dtype), p, scale)
    if not all(torch.equal(a, b) for a, b in zip(out[:2] + out[3:], plain[:2] + plain[3:])):
        bad.append(case + ("the float8 store changed the norm",))
    if not torch.equal(y2, plain[0]):  # TWICE: y again, every element
        bad.append(case + ("y2",))
    want = (out[0].float() * scale).clamp(-448, 448).to(E4M3)  # the kernel's own y, cast as scaled_cast casts
    if not torch.equal(y_q.view(torch.uint8), want.view(torch.uint8)):
        bad.append(case + ("y_q", (y_q.float() != want.float()).float().mean().item()))
    if float(amaxes.max()) != float(out[0].float().abs().max()):
        bad.append(case + ("amax",))
h[2, 3] = float("nan")
dan.launch_forward(h, r, gamma, beta, None, seed, p, 1e-12, dan._outputs(h, r, p), (y_q, torch.tensor(1.0), amaxes))
if torch.isfinite(amaxes.max()):
    bad.append("a NaN gave a finite amax")
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_forward_kernels_float8_store_matches_the_torch_cast_in_the_interpreter():
    """`bert::dropout_add_layer_norm_fp8`'s kernel path: the e4m3 copy is the kernel's own y cast as scaled_cast
    casts, byte for byte, the amax its y's, y's second copy (`twice`) y, and the norm's outputs unchanged by them."""
    run_check(FORWARD_INTERPRETER, timeout=600, interpret=True)


SM90 = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bert.model import dropout_add_norm as dan

bad = []
for dtype, out in [("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp32", "fp32")]:
    round_to = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    for v in (16, 128):
        signature = dict(dy=f"*{out}", dy2=f"*{out}", s=f"*{out}", bits="*u8", mean_in="*fp32", rstd_in="*fp32",
                         gamma=f"*{dtype}", beta=f"*{dtype}", dh="*fp8e5", ds=f"*{out}", sums="*fp32",
                         cast_scale="*fp32", amaxes="*fp32", dht="*fp8e5", rows="i32", n="i32", scale="fp32",
                         V="constexpr", ROWS="constexpr", DROPOUT="constexpr", FLOAT8="constexpr", ROUND="constexpr",
                         SECOND="constexpr", TRANSPOSE="constexpr", FROM_Y="constexpr")
        # the model's at BERT-large's width: y's two gradients added in the kernel, d h stored transposed too; x_hat
        # from y (RESIDUAL_NORM=fused-lean) for bf16 there, for the other dtypes at the narrow width
        constants = dict(V=v, ROWS=dan.ROWS, DROPOUT=True, FLOAT8=True, ROUND=dan.TRITON_DTYPES[round_to],
                         SECOND=v == 128, TRANSPOSE=v == 128, FROM_Y=(v == 128) == (dtype == "bf16"))
        try:
            triton.compile(ASTSource(dan._backward_rows, signature, constants), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=dan._warps(v)))
        except Exception as e:
            bad.append((dtype, out, v, repr(e)[:300]))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_float8_kernel_compiles_for_an_h100():
    """The float8 branch compiled for sm_90 with Triton's own ptxas, for the dtype mixes the driver meets (bf16
    masters, autocast's bf16 h with an fp32 residual, fp16, fp32) and BERT-large's width."""
    run_check(SM90, timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_kernel_matches_the_torch_path(monkeypatch):
    """BERT-large's width in bf16 (24,405 tokens: the H100 profile's batch), the kernel against the torch path."""
    g = torch.Generator(device="cuda").manual_seed(5)
    rows, n, p = 24405, 1024, 0.1
    h, r, dy = (torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    gamma = (1 + 0.3 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    beta = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    _, s, bits, mean, rstd = torch.ops.bert.dropout_add_layer_norm(h, r, gamma, beta, None,
                                                                   torch.tensor(3, device="cuda"), p, 1e-12)
    scale = torch.tensor(1e3, device="cuda")
    want = [t.cpu() for t in OP(dy.cpu(), s.cpu(), bits.cpu(), mean.cpu(), rstd.cpu(), gamma.cpu(), p,
                                torch.bfloat16, scale.cpu())]
    refuse_torch_path_on_cuda(monkeypatch, frn, "backward_torch")
    got = [t.cpu() for t in OP(dy, s, bits, mean, rstd, gamma, p, torch.bfloat16, scale)]
    assert (got[0].float() != want[0].float()).float().mean() < 0.01
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2**-7, atol=2**-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-3, atol=1e-1)
    torch.testing.assert_close(got[3], want[3], rtol=1e-2, atol=0)
    # TRANSPOSE: d h's bytes transposed, every other output the kernel's without it (the same programs' order)
    transposed = OP(dy, s, bits, mean, rstd, gamma, p, torch.bfloat16, scale, None, True)
    plain = OP(dy, s, bits, mean, rstd, gamma, p, torch.bfloat16, scale)
    assert torch.equal(transposed[4].view(torch.uint8), transposed[0].view(torch.uint8).t())
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(transposed[:4], plain[:4]))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's bytes (torch.equal compares them, not float8 values, which it cannot), else the tensor."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_forward_kernel_rows_a_program_and_its_transpose():
    """`bert::dropout_add_layer_norm_fp8` at BERT-large's width in bf16 (24,405 tokens, the last program's rows cut):
    with `transposed` (ROWS rows a program, each block read back after the barrier) every output is the one-row
    kernel's bit for bit, and the transposed copy is the e4m3 copy's bytes transposed: a missing barrier shows here."""
    g = torch.Generator(device="cuda").manual_seed(6)
    rows, n = 24405, 1024
    h, r = (torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    gamma = (1 + 0.3 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    beta = 0.3 * torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    args = (h, r, gamma, beta, torch.tensor(3, device="cuda"), 0.1, 1e-12, torch.tensor(50.0, device="cuda"), True)
    plain, transposed = torch.ops.bert.dropout_add_layer_norm_fp8(*args), torch.ops.bert.dropout_add_layer_norm_fp8(
        *args, True)
    assert plain[8].shape == (0, rows) and transposed[8].shape == (n, rows)
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(plain[:8], transposed[:8]))
    assert torch.equal(transposed[8].view(torch.uint8), transposed[5].view(torch.uint8).t())


def test_a_transposed_copy_without_the_float8_copy_is_refused():
    """The kernels' TRANSPOSE transposes their own float8 output: asked for without FLOAT8 there is nothing to
    transpose, and the launchers refuse before any kernel starts."""
    from bert.model import dropout_add_norm as dan

    h = torch.randn(4, 8)
    out = dan._outputs(h, h, 0.0)
    with pytest.raises(ValueError, match="needs the e4m3 copy"):
        dan.launch_forward(h, h, torch.ones(8), torch.zeros(8), None, None, 0.0, 1e-12, out, yqt=torch.empty(8, 4))
    with pytest.raises(ValueError, match="needs the e5m2 gradient"):
        dan.launch_backward(h, out[1], out[2], out[3], out[4], torch.ones(8), 0.0, frn._grads(h, out[1], out[3]),
                            dht=torch.empty(8, 4))
