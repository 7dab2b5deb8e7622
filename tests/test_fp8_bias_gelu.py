"""bert.model.fp8_bias_gelu (`BIAS_GELU=fused` under delayed float8): the FFN's first float8 linear and its GELU,
the gradient's float8 cast, amax and bias sums in one backward pass. References: the unfused path it replaces (a
DelayedFloat8Linear, then GELU=rational, autograd between them), which it must equal bit for bit but for the bias
gradient's sum; the exact GELU's derivative in float64; torch's `opcheck`. The Triton kernel is checked against the
torch path in Triton's interpreter and compiled for sm_90."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_config import parse
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.config import ConfigError, from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model import fp8_bias_gelu as fbg
from bert.model.bias_gelu import FusedBiasGELU, apply_bias_gelu
from bert.model.fp8 import convert_to_fp8
from bert.model.fp8_delayed import E5M2, DelayedFloat8Linear
from bert.model.gelu import RationalGELU
from bert.model.layers import BertIntermediate
from bert.synthetic import random_batch

OP = torch.ops.bert.gelu_backward_fp8


def ffn_pair(dtype, amax_input, amax_grad, seed=0):
    """(the unfused float8 FFN: DelayedFloat8Linear then GELU=rational, the same as a Float8BiasGELU), equal
    parameters and amaxes."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=8, hidden_size=64, num_hidden_layers=1, num_attention_heads=1, intermediate_size=128)
    ref = BertIntermediate(cfg).to(dtype)
    ref.activation = RationalGELU()
    ref.dense = DelayedFloat8Linear.from_linear(ref.dense)
    ours = fbg.Float8BiasGELU.from_module(FusedBiasGELU.from_module(copy.deepcopy(ref)))
    for m in (ref, ours):
        m.dense.amax_input.fill_(amax_input)
        m.dense.amax_grad.fill_(amax_grad)
    return ref, ours


def step(module, x, grad):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(grad)
    d = module.dense
    return {"y": y, "dx": x.grad, "dw": d.weight.grad, "db": d.bias.grad, "amax_grad": d.amax_grad.clone(),
            "amax_input": d.amax_input.clone()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amax_grad", [0.5, 1e-3])  # the second saturates the gradient's float8 copy
def test_it_is_the_unfused_float8_linear_and_gelu_but_for_the_bias_sums_rounding(dtype, amax_grad):
    ref, ours = ffn_pair(dtype, 3.0, amax_grad)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 64, generator=g).to(dtype)
    grad = torch.randn(48, 128, generator=g).to(dtype)
    assert_unfused_but_bias_sums(step(ours, x, grad), step(ref, x, grad), dtype, amax_grad)


def assert_unfused_but_bias_sums(got: dict, want: dict, dtype: torch.dtype, amax_grad: float, rows: int = 48) -> None:
    """Every output of a fused float8 step equals the unfused path's bit for bit, in its dtype, but the dense bias's
    gradient: summed in fp32 before its rounding to the dtype (the unfused path: after), within `rows` roundings."""
    for name in set(want) - {"db"}:
        assert got[name].dtype == want[name].dtype, name
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert float(want["amax_grad"]) != amax_grad  # recorded for the next step
    tol = 0 if dtype == torch.float32 else rows * 2.0 ** -8
    torch.testing.assert_close(got["db"].float(), want["db"].float(), rtol=0, atol=tol)
    if dtype == torch.bfloat16:
        assert (got["db"] != want["db"]).any()  # the reference does differ, so the test can tell


def test_a_non_finite_gradient_keeps_the_old_amax_as_the_unfused_path_does():
    ref, ours = ffn_pair(torch.float32, 3.0, 0.5)
    x = torch.randn(16, 64)
    grad = torch.randn(16, 128)
    grad[3, 5] = float("nan")
    for module in (ref, ours):
        assert float(step(module, x, grad)["amax_grad"]) == 0.5


def test_the_op_in_float64_is_the_exact_gelus_gradient_scaled_and_rounded_to_e5m2():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(40, 24, generator=g, dtype=torch.float64) * 3
    grad = torch.randn(40, 24, generator=g, dtype=torch.float64)
    scale = torch.tensor(64.0)
    q, q_t, db, amax = OP(grad, h, scale)
    assert (q.dtype, db.dtype, amax.dtype) == (E5M2, torch.float64, torch.float32)
    assert q_t.is_contiguous() and torch.equal(q_t.view(torch.uint8), q.t().view(torch.uint8))
    exact = torch.func.vjp(F.gelu, h)[1](grad)[0]
    torch.testing.assert_close(db, exact.sum(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(amax.double(), exact.abs().max(), rtol=1e-6, atol=0)
    # e5m2 keeps 2 mantissa bits: within half its spacing (2^-3 relative) of the scaled gradient, or its subnormals'
    err = (q.double() - exact * 64).abs()
    assert (err <= 2.0 ** -3 * (exact * 64).abs() + 2.0 ** -17).all()
    # saturated, not inf: the largest e5m2
    q = OP(grad, h, torch.tensor(1e6))[0]
    assert q.float().abs().max() == torch.finfo(E5M2).max and torch.isfinite(q.float()).all()


def test_opcheck_and_the_refusals():
    g = torch.Generator().manual_seed(3)
    h, grad = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    torch.library.opcheck(OP, (grad, h, torch.tensor(8.0)))
    with pytest.raises(ValueError, match="0-dim scale"):
        OP(grad, h, torch.ones(1))
    with pytest.raises(ValueError, match="contiguous h"):
        OP(grad.t(), h.t(), torch.tensor(1.0))


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=1104, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64).with_dropout(0.0)
    return BertForPreTraining(cfg, attention="padded")


def test_the_float8_model_swaps_each_ffn_and_trains_as_the_unfused_one():
    """BIAS_GELU=fused then delayed float8: every FFN a Float8BiasGELU, parameters and checkpoint keys unchanged;
    the loss and every gradient as the unfused float8 model's (GELU=rational), the FFN biases' within their sums'
    rounding."""
    model, reference = tiny_model(), tiny_model()
    params = dict(model.named_parameters())
    apply_bias_gelu(model, "fused")
    convert_to_fp8(model, recipe="delayed")
    for layer in reference.bert.encoder.layer:  # the FFNs' GELU only: the MLM head's stays exact in both
        layer.intermediate.activation = RationalGELU()
    convert_to_fp8(reference, recipe="delayed")
    assert [type(layer.intermediate) for layer in model.bert.encoder.layer] == [fbg.Float8BiasGELU] * 2
    assert dict(model.named_parameters()) == params and model.state_dict().keys() == reference.state_dict().keys()
    batch = random_batch((9, 5, 18), seed=3, vocab_size=1104)  # 32 tokens: float8's weight GEMMs take 16s
    losses = [m(batch).loss for m in (model, reference)]
    assert float(losses[0].detach()) == float(losses[1].detach())
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        exact = not name.endswith("intermediate.dense.bias")
        torch.testing.assert_close(p.grad, q.grad, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6, msg=name)
    amaxes = [[b for n, b in m.named_buffers() if "amax" in n] for m in (model, reference)]
    assert amaxes[0] == amaxes[1]


def test_the_config_takes_it_with_the_delayed_recipe_only():
    from bert.train.build import build_model

    cfg = from_flat(bias_gelu="fused", precision="fp8", fp8_recipe="delayed", static_tokens=512, attention="padded",
                    bert_config_path="tiny").model
    model = build_model(cfg, torch.device("cpu"))
    assert sum(type(m) is fbg.Float8BiasGELU for m in model.modules()) == BertConfig.load("tiny").num_hidden_layers
    with pytest.raises(ConfigError, match="FP8_RECIPE=tensorwise"):
        parse(BIAS_GELU="fused", PRECISION="fp8", STATIC_TOKENS="512")
    assert parse(BIAS_GELU="fused", PRECISION="fp8", FP8_RECIPE="delayed", STATIC_TOKENS="512").model.bias_gelu == \
        "fused"
    # FP8_LINEARS=ffn keeps the FFN in float8; a FusedBiasGELU over a plain linear stays itself
    model = tiny_model()
    apply_bias_gelu(model, "fused")
    assert fbg.apply_fp8_bias_gelu(model) == []
    with pytest.raises(ValueError, match="DelayedFloat8Linear"):
        fbg.Float8BiasGELU.from_module(model.bert.encoder.layer[0].intermediate)


def compiled_ops(module, run, *needles: str) -> tuple[list[str], object]:
    """(the ops whose names hold one of `needles` in the forward and backward graphs AOT autograd traces of
    `module`, in order; `run`'s result on the compiled module)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def count(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes
                    if n.op == "call_function" and any(needle in str(n.target) for needle in needles))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    try:
        return seen, run(torch.compile(module, backend=aot_autograd(fw_compiler=count, bw_compiler=count)))
    finally:
        torch._dynamo.reset()


def test_compiled_the_op_is_one_node_of_the_backward_and_the_step_matches_eager():
    _, eager = ffn_pair(torch.float32, 3.0, 0.5)
    compiled_module = copy.deepcopy(eager)  # before the eager step: the same amaxes
    g = torch.Generator().manual_seed(4)
    x, grad = torch.randn(32, 64, generator=g), torch.randn(32, 128, generator=g)
    want = step(eager, x, grad)
    seen, got = compiled_ops(compiled_module, lambda m: step(m, x, grad), "gelu_backward_fp8", "fp8_transpose",
                             "fp8_cast_transpose")
    # the forward casts w with its transpose and transposes x_q; the backward's g_q comes transposed from the op, so
    # none there
    assert seen == ["bert.fp8_cast_transpose.default", "bert.fp8_transpose.default",
                    "bert.gelu_backward_fp8.default"], seen
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)


# Triton 3.6's interpreter rounds fp32 to a narrower float by adding the cut-off bit to the mantissa without its
# carry (and without ties to even): 1943 became 1024 in e5m2, and bf16 rounds wrong the same way. The GPU's
# conversions are the hardware's; in the interpreter this puts torch's in their place, so the check is of the
# kernel's own arithmetic
NARROWING_PATCH = """
import numpy as np
import triton.runtime.interpreter as interpreter
convert = interpreter._convert_float
NARROW = {"fp8e5": torch.float8_e5m2, "fp8e4nv": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}
def by_torch(input, input_dtype, output_dtype, rounding_mode):
    if input_dtype.name == "fp32" and output_dtype.name in NARROW:
        t = torch.from_numpy(np.frombuffer(input.tobytes(), dtype=np.float32).copy())
        bits = torch.uint8 if output_dtype.primitive_bitwidth == 8 else torch.int16
        return t.to(NARROW[output_dtype.name]).view(bits).numpy().reshape(input.shape)
    return convert(input, input_dtype, output_dtype, rounding_mode)
interpreter._convert_float = by_torch
"""

INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model import fp8_bias_gelu as fbg

bad = []
# (tokens, width, dtype, tile, scale): rows and columns cut inside a tile, a program of several row blocks, a scale
# that saturates
for tokens, width, dtype, tile, scale in [(77, 300, torch.float32, (8, 64, 32, 4), 40.0),
                                          (70, 40, torch.bfloat16, (16, 32, 16, 2), 3e4),
                                          (33, 257, torch.float16, (16, 128, 64, 4), 1.0)]:
    g = torch.Generator().manual_seed(tokens + width)
    h = (torch.randn(tokens, width, generator=g) * 3).to(dtype)
    grad = torch.randn(tokens, width, generator=g).to(dtype)
    s = torch.tensor(scale)
    case = (tokens, width, str(dtype), tile, scale)
    (q, q_t, db, amax), (want_q, _, want_db, want_amax) = fbg.launch_backward(grad, h, s, tile), \\
        fbg.gelu_backward_fp8_torch(grad, h, s)
    # the slope in fp32 on both sides, libdevice's exp2 against torch's: a rounding of the dtype apart at most
    off = (q.float() != want_q.float()).float().mean().item()
    if off > 0.002:
        bad.append(case + ("q differs at", off))
    if not torch.equal(q_t.view(torch.uint8), q.t().view(torch.uint8)):  # the kernel's own copy, byte for byte
        bad.append(case + ("q_t is not q transposed",))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    if not torch.allclose(db, want_db, rtol=1e-5, atol=1e-5 * tokens):
        bad.append(case + ("db", (db - want_db).abs().max().item()))
    if not torch.allclose(amax, want_amax, rtol=tol, atol=0):
        bad.append(case + ("amax", amax.item(), want_amax.item()))
grad[2, 3] = float("nan")
if torch.isfinite(fbg.launch_backward(grad, h, s, tile)[3]):
    bad.append("a NaN gradient gave a finite amax")
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_triton_kernel_matches_the_torch_path_in_the_interpreter():
    run_check(INTERPRETER, timeout=600, interpret=True)


@needs_triton
def test_the_kernel_compiles_for_an_h100_without_spills():
    """The kernel compiled for sm_90 at the default tile (bench/bias_gelu_sass.py): nothing on the stack, room for
    more than one block an SM."""
    import sys

    from script_modules import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import bias_gelu_sass

    row = bias_gelu_sass.count_fp8(fbg.TILE)[0]  # the backward's
    assert row["stack_bytes"] == 0 and row["blocks_per_sm"] >= 2 and row["per_element"] < 45, row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_kernel_matches_the_torch_path(monkeypatch):
    """BERT-large's FFN in bf16 (24,405 tokens: the H100 profile's batch), the kernel against the torch path."""
    g = torch.Generator(device="cuda").manual_seed(5)
    h = (torch.randn(24405, 4096, device="cuda", generator=g) * 3).to(torch.bfloat16)
    grad = torch.randn(h.shape, device="cuda", generator=g).to(torch.bfloat16)
    scale = torch.tensor(1e4, device="cuda")
    want = fbg.gelu_backward_fp8_torch(grad, h, scale)
    refuse_torch_path_on_cuda(monkeypatch, fbg, "gelu_backward_fp8_torch")
    q, q_t, db, amax = OP(grad, h, scale)
    assert (q.float() != want[0].float()).float().mean() < 0.01
    assert torch.equal(q_t.view(torch.uint8), q.t().view(torch.uint8))
    torch.testing.assert_close(db, want[2], rtol=1e-3, atol=1e-1)
    torch.testing.assert_close(amax, want[3], rtol=1e-2, atol=0)
