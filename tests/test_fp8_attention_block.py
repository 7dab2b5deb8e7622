"""bert.model.fp8_attention_block (the float8 attention sublayer as one autograd Function, the attention's forward
kernel writing the projection's e4m3 input and its transpose, and no bf16 output). References: the two units it
replaces (Float8SelfAttention then Float8ResidualOutput, autograd between them), which it must equal bit for bit
once their attention's backward reads its delta from the projection's e4m3 input as the block's does; the same
model in float64, to which its gradients are as close as the units'; torch's float8 cast for the op; torch's
`opcheck`. The kernel's float8 epilogue is checked against the torch path in Triton's interpreter and compiled for
sm_90."""

import contextlib
import copy

import pytest
import torch
from test_fp8_bias_gelu import NARROWING_PATCH
from test_fp8_feed_forward import (
    assert_eval_is_the_units,
    assert_frozen_close_is_the_units,
    compiled_layer_step,
    train_step,
)
from test_fp8_residual_norm import second_gradient
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model import fp8_attention as fa
from bert.model import fp8_attention_block as fab
from bert.model import fp8_residual_norm as frn
from bert.model.bias_gelu import apply_bias_gelu
from bert.model.dropout_add_norm import apply_residual_norm
from bert.model.fp8 import convert_to_fp8
from bert.model.fp8_delayed import E4M3, cast_scale, saturated_cast
from bert.model.layers import Stream
from bert.synthetic import random_batch

OP = torch.ops.bert.triton_attention_fp8


def model_pair(dropout=0.1, seed=0, attention="triton", bias_gelu=False):
    """(a float8 model with ATTENTION=triton and RESIDUAL_NORM=fused, its attention sublayers one Function each;
    the same with the two units apart), equal parameters. `bias_gelu`: BIAS_GELU=fused too, so each FFN is one
    Function (bert.model.fp8_feed_forward) and the first model's attention closes hand it its input in e4m3."""
    def build(block: bool) -> BertForPreTraining:
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=1104, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64).with_dropout(dropout)
        model = BertForPreTraining(cfg, attention=attention)
        if bias_gelu:
            apply_bias_gelu(model, "fused")
        apply_residual_norm(model, "fused")
        with pytest.MonkeyPatch.context() as patch:
            if not block:
                patch.setattr("bert.model.fp8.apply_fp8_attention_block", lambda model: [])
            convert_to_fp8(model, recipe="delayed")
        return model

    return build(True), build(False)


@contextlib.contextmanager
def delta_from_e4m3(amax: float):
    """The two units' attention backward (bert.model.fp8_attention's) reading, for its delta = rowsum(dO * O), the
    e4m3 copy of O that the projection's delayed scale makes (the scale of `amax`, what `train_step` sets every
    amax to), as the block's does: the reference the block equals bit for bit."""
    real = fa.linear_attention_backward

    def from_copy(grad, saved, *args, out_inv=None):
        assert out_inv is None  # only the units' path comes here
        qkv, out, lse, bits, cu = saved
        scale = cast_scale(torch.tensor(amax), E4M3)
        return real(grad, (qkv, saturated_cast(out, scale, E4M3), lse, bits, cu), *args, out_inv=scale.reciprocal())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fa, "linear_attention_backward", from_copy)
        yield


@pytest.mark.parametrize("amax,last_layer_subset,bias_gelu", [(2.0, False, False), (1e-3, False, False),
                                                             (2.0, True, False), (2.0, False, True),
                                                             (1e-3, False, True), (2.0, True, True)])
def test_the_float8_attention_sublayer_is_its_two_units_bit_for_bit(amax, last_layer_subset, bias_gelu):
    """With dropout on, and a scale that saturates: the loss, every gradient and every amax equal the two units'
    (the attention output's amax, which the op now takes, among them), their attention's delta read from the
    projection's e4m3 input (`delta_from_e4m3`, in both models: with the last layer's kept rows its sublayer runs
    as the two units). With the FFN one Function too, the close hands it its input in e4m3, cast by
    the norm's kernel with the FFN's first linear's delayed scale, and that linear's amax kept there; and the first
    layer's FFN hands the second layer its output, twice apart and in e4m3 for its QKV (which, on the last layer's
    kept rows, casts its own)."""
    model, reference = model_pair(bias_gelu=bias_gelu)
    closes = [layer.attention.output for layer in model.bert.encoder.layer]
    assert [type(m) for m in closes] == [fab.Float8AttentionOutput] * 2
    assert [m.hands_on for m in closes] == [bias_gelu] * 2
    if bias_gelu:  # the last layer's FFN has no layer to hand to
        assert [layer.output.hands_on for layer in model.bert.encoder.layer] == [True, False]
    assert [type(layer.attention.output) for layer in reference.bert.encoder.layer] == [frn.Float8ResidualOutput] * 2
    assert model.state_dict().keys() == reference.state_dict().keys()
    batch = random_batch((9, 5, 18), seed=3, vocab_size=1104)  # 32 tokens: float8's weight GEMMs take 16s
    with delta_from_e4m3(amax):
        (loss, grads, amaxes), (want_loss, want_grads, want_amaxes) = (train_step(m, batch, amax, last_layer_subset)
                                                                       for m in (model, reference))
    assert torch.equal(loss, want_loss)
    for name, grad in want_grads.items():
        assert torch.equal(grads[name], grad), name
    for name, value in want_amaxes.items():
        assert torch.equal(amaxes[name], value), name
    assert float(amaxes["bert.encoder.layer.0.attention.output.dense.amax_input"]) != amax  # recorded


def test_under_autocast_nothing_is_handed_on_and_it_is_the_units():
    """Under autocast each float8 linear casts autocast's copy of its input, not the close's output, so no close
    hands one on: the loss and every gradient as the units'."""
    model, reference = model_pair(bias_gelu=True)
    batch = random_batch((9, 5, 18), seed=3, vocab_size=1104)
    with torch.autocast("cpu", dtype=torch.bfloat16), delta_from_e4m3(2.0):
        (loss, grads, _), (want_loss, want_grads, _) = (train_step(m, batch, 2.0) for m in (model, reference))
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], g) for n, g in want_grads.items())


def test_with_another_attention_backend_it_is_the_two_units():
    model, reference = model_pair(attention="padded")
    batch = random_batch((9, 5, 18), seed=3, vocab_size=1104)
    (loss, grads, _), (want_loss, want_grads, _) = (train_step(m, batch, 2.0) for m in (model, reference))
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], g) for n, g in want_grads.items())


def test_with_the_projection_frozen_the_gradient_still_reaches_the_qkv():
    with delta_from_e4m3(2.0):
        assert_frozen_close_is_the_units(model_pair(), "attention.output")


def float64_model(dropout: float = 0.1, seed: int = 0) -> BertForPreTraining:
    """`model_pair`'s model without float8, in float64: our attention's and norm's torch paths draw the same
    dropout masks from the same seeds."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=1104, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64).with_dropout(dropout)
    model = BertForPreTraining(cfg, attention="triton")
    apply_residual_norm(model, "fused")
    return model.double()


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_the_delta_from_the_e4m3_copy_moves_the_gradients_far_less_than_float8_does(seed):
    """Against the same model in float64, the block's encoder gradients (its attention's delta from the e4m3
    output) are as close as the two units' (delta from the bf16 output): float8's rounding is a few per cent of
    them, the copy's change under 1 % of that (0.14 % here), and not nothing (the block does read the copy)."""
    model, units = model_pair()
    batch = random_batch((9, 5, 18), seed=seed, vocab_size=1104)
    grads = [train_step(m, batch, 2.0)[1] for m in (float64_model(), units, model)]
    names = [n for n, g in grads[0].items() if n.startswith("bert.encoder.") and g is not None]
    want, got_units, got = (torch.cat([g[n].double().flatten() for n in names]) for g in grads)
    error_units, error = (float((g - want).norm() / want.norm()) for g in (got_units, got))
    moved = float((got - got_units).norm() / got_units.norm())
    assert 0.005 < error_units < 0.1
    assert 0 < moved < 1e-2 * error_units and abs(error - error_units) < 1e-2 * error_units


def test_in_eval_it_records_nothing_and_is_the_units_eval():
    assert_eval_is_the_units(model_pair(dropout=0.5))


def test_the_op_is_the_attention_with_its_output_cast_to_e4m3():
    g = torch.Generator().manual_seed(2)
    lengths, heads, dim = (6, 11), 2, 8
    qkv = torch.randn(sum(lengths), 3, heads, dim, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, 6, 17], dtype=torch.int32)
    seed, scale = torch.tensor(5), torch.tensor(300.0)
    lse, bits, o_q, o_qt, amax = OP(qkv, cu, 11, 0.2, seed, scale)
    out, *want = torch.ops.bert.triton_attention(qkv, cu, 11, 0.2, seed)
    assert all(torch.equal(a, b) for a, b in zip((lse, bits), want))
    assert o_q.dtype == o_qt.dtype == E4M3 and o_q.shape == out.shape
    assert torch.equal(o_q.view(torch.uint8), (out.float() * 300).clamp(-448, 448).to(E4M3).view(torch.uint8))
    assert torch.equal(o_qt.view(torch.uint8), o_q.flatten(1).t().contiguous().view(torch.uint8))
    assert float(amax) == float(out.float().abs().max())
    torch.library.opcheck(OP, (qkv, cu, 11, 0.2, seed, scale))
    with pytest.raises(ValueError, match="0-dim"):
        OP(qkv, cu, 11, 0.2, seed, torch.ones(1))


def test_the_config_builds_it_with_both_and_the_delayed_recipe():
    from bert.train.build import build_model

    layers = BertConfig.load("tiny").num_hidden_layers
    # another backend swaps too (Float8SelfAttention's own swap does) and runs the two units at each call
    for attention, residual_norm, expected in [("triton", "fused", layers), ("triton", "torch", 0),
                                               ("padded", "fused", layers)]:
        cfg = from_flat(attention=attention, residual_norm=residual_norm, precision="fp8", fp8_recipe="delayed",
                        static_tokens=512, bert_config_path="tiny").model
        model = build_model(cfg, torch.device("cpu"))
        assert sum(type(m) is fab.Float8AttentionOutput for m in model.modules()) == expected
    with pytest.raises(ValueError, match="Float8ResidualOutput"):
        fab.Float8AttentionOutput.from_module(model.bert.encoder.layer[0].attention.self)


def test_compiled_the_outputs_copy_is_not_transposed_again_and_the_step_matches_eager():
    """AOT autograd's graphs of one layer: the attention's op writes the projection's transposed input, so the
    forward transposes only the QKV's input and the four weights and the FFN's two inputs. Compiled by inductor,
    the step equals eager."""
    seen, got, want = compiled_layer_step(model_pair(dropout=0.0)[0], "fp8_transpose", "fp8_cast_transpose",
                                           "triton_attention")
    attention = [name for name in seen if "attention" in name]
    assert attention == ["bert.triton_attention_fp8.default", "bert.triton_attention_backward_fp8.default"], seen
    # forward: the QKV's input and the FFN's two inputs; backward: the FFN's first e5m2 gradient (the QKV's comes
    # transposed from its op, the projection's and the FFN's second from the norms' backward kernels); the four
    # weights are cast with their transposes
    assert seen.count("bert.fp8_transpose.default") == 3 + 1, seen
    assert seen.count("bert.fp8_cast_transpose.default") == 4, seen
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_compiled_with_the_ffn_one_function_the_norm_hands_it_its_input_cast():
    """With BIAS_GELU=fused too: the attention's close is the float8 norm op (`bert::dropout_add_layer_norm_fp8`),
    and the step compiled by inductor equals eager."""
    seen, got, want = compiled_layer_step(model_pair(dropout=0.0, bias_gelu=True)[0], "dropout_add_layer_norm")
    assert seen[:2] == ["bert.dropout_add_layer_norm_fp8.default", "bert.dropout_add_layer_norm.default"], seen
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_compiled_apart_two_layers_hand_over_two_gradients_apart_and_the_input_in_e4m3():
    """Two float8 layers compiled apart (COMPILE_SCOPE=layers) and traced by AOT autograd: the first layer's FFN
    norm takes the second layer's two gradients in two parts (no add before it, in either graph), the second
    layer's forward casts no input of its own (its QKV's came in e4m3), and both layers' gradients are eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    model = model_pair(dropout=0.1, bias_gelu=True)[0]
    attend = model.plan_attention(random_batch((9, 5, 18), seed=3, vocab_size=1104).seq)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(5))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    def step(first, second):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(7)  # the dropout seeds
        second(first(Stream(leaf, leaf), attend, into=second.attention), attend).x.square().sum().backward()
        return [leaf.grad] + [p.grad.clone() for p in (*first.parameters(), *second.parameters())]

    want = step(*copy.deepcopy(list(model.bert.encoder.layer)))  # the amaxes as they start, for both
    torch._dynamo.reset()
    try:
        got = step(*(torch.compile(layer, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
                     for layer in model.bert.encoder.layer))
    finally:
        torch._dynamo.reset()
    forward_first, forward_second, backward_second, backward_first = graphs
    # in backward order, each layer's: the FFN's norm, then the attention's; the last layer's FFN norm gets one
    assert two_parts(backward_second) == [False, True] and two_parts(backward_first) == [True, True]
    # and the second layer's two input gradients leave its graph apart, not added there; the first layer's input,
    # one tensor twice (the embeddings'), has its two added
    assert [added(g) for g in (backward_second, backward_first)] == [0, 1]

    def e4m3_casts(graph):
        return sum(n.op == "call_function" and n.kwargs.get("dtype") == E4M3 for n in graph.nodes)

    # only the first layer casts an input, its QKV's (the four weights are cast by their op, with their transposes)
    assert (e4m3_casts(forward_first), e4m3_casts(forward_second)) == (1, 0)
    assert [ops(g, "fp8_cast_transpose") for g in graphs] == [4, 4, 0, 0]
    # and transposes nothing else (but the first layer its QKV's input): every input's and every gradient's
    # transposed copy comes from the kernel that made it, the norms' (TRANSPOSE) among them
    assert [ops(g, "fp8_transpose") for g in graphs] == [1, 0, 0, 0]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def ops(graph, name: str) -> int:
    """How many calls of our op `name` (`bert::<name>`) `graph` holds."""
    return sum(n.op == "call_function" and str(n.target) == f"bert.{name}.default" for n in graph.nodes)


def added(graph) -> int:
    """How many adds of `graph` make a (tokens, hidden) tensor (32 x 32 here): two gradients of the stream summed."""
    return sum(n.op == "call_function" and n.target is torch.ops.aten.add.Tensor
               and tuple(n.meta["val"].shape) == (32, 32) for n in graph.nodes)


def two_parts(graph) -> list[bool]:
    """For each float8 norm backward of `graph`, in order, whether it takes y's gradient in two parts."""
    return [second_gradient(n) for n in graph.nodes
            if n.op == "call_function" and "dropout_add_layer_norm_backward_fp8" in str(n.target)]



def test_the_norm_op_casts_its_output_as_scaled_cast_does():
    g = torch.Generator().manual_seed(4)
    h, residual = (torch.randn(24, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    gamma, beta = torch.ones(32, dtype=torch.bfloat16), torch.zeros(32, dtype=torch.bfloat16)
    seed, scale = torch.tensor(9), torch.tensor(200.0)
    *out, y_q, amax, y2, y_qt = torch.ops.bert.dropout_add_layer_norm_fp8(h, residual, gamma, beta, seed, 0.1, 1e-12,
                                                                          scale)
    want = torch.ops.bert.dropout_add_layer_norm(h, residual, gamma, beta, None, seed, 0.1, 1e-12)
    assert all(torch.equal(a, b) for a, b in zip(out, want)) and y2.shape == (0, 32) and y_qt.shape == (0, 24)
    twice = torch.ops.bert.dropout_add_layer_norm_fp8(h, residual, gamma, beta, seed, 0.1, 1e-12, scale, True)
    assert torch.equal(twice[7], want[0]) and twice[7].data_ptr() != twice[0].data_ptr()  # y again, apart
    assert torch.equal(y_q.view(torch.uint8), (want[0].float() * 200).clamp(-448, 448).to(E4M3).view(torch.uint8))
    assert float(amax) == float(want[0].float().abs().max())
    transposed = torch.ops.bert.dropout_add_layer_norm_fp8(h, residual, gamma, beta, seed, 0.1, 1e-12, scale, False,
                                                           True)[-1]
    assert transposed.shape == (32, 24) and transposed.is_contiguous() and transposed.dtype == E4M3
    assert torch.equal(transposed.view(torch.uint8), y_q.view(torch.uint8).t())  # the same bytes, transposed
    for twice, transposed in [(False, False), (True, False), (True, True)]:
        torch.library.opcheck(torch.ops.bert.dropout_add_layer_norm_fp8.default,
                              (h, residual, gamma, beta, seed, 0.1, 1e-12, scale, twice, transposed))
    op = torch.ops.bert.dropout_add_layer_norm_fp8
    for args, message in [((h, residual[:3], gamma, beta, seed, 0.1, 1e-12, scale), "must be the same"),
                          ((h, residual, gamma, beta, None, 0.1, 1e-12, scale), "needs a seed"),
                          ((h, residual, gamma, beta, seed, 0.1, 1e-12, torch.ones(1)), "0-dim")]:
        with pytest.raises(ValueError, match=message):
            op(*args)


INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model import triton_attention as ta
from bert.model.fp8_delayed import E4M3
from bert.model.layers import Stream

bad = []
# (lengths, dtype, p, scale): a sequence cut inside a tile, several tiles, dropout, a scale that saturates
for lengths, dtype, p, scale in [((5, 40, 17), torch.bfloat16, 0.1, 30.0), ((33, 70), torch.float16, 0.0, 3e3),
                                 ((9,), torch.float32, 0.2, 1.0)]:
    g = torch.Generator().manual_seed(sum(lengths))
    heads, dim = 2, 16
    qkv = torch.randn(sum(lengths), 3, heads, dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = qkv.unbind(1)
    seed, s = torch.tensor(7), torch.tensor(scale)
    case = (lengths, str(dtype), p, scale)
    lse, bits, o_q, o_qt, amax = ta.launch_forward(q, k, v, cu, max(lengths), p, seed, (16, 16, 4), scale=s)
    out, *plain = ta.launch_forward(q, k, v, cu, max(lengths), p, seed, (16, 16, 4))
    if not torch.equal(lse, plain[0]):
        bad.append(case + ("the float8 epilogue changed the log-sum-exp",))
    # (the bits' bytes past a sequence's keys are unwritten)
    if p > 0 and not all(torch.equal(ta.unpack_bits(a[:, s0:s1], s1 - s0), ta.unpack_bits(b[:, s0:s1], s1 - s0))
                         for a, b in [(bits, plain[1])] for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist())):
        bad.append(case + ("the float8 epilogue changed the mask",))
    want = (out.float() * scale).clamp(-448, 448).to(E4M3)
    if not torch.equal(o_q.view(torch.uint8), want.view(torch.uint8)):
        bad.append(case + ("o_q", (o_q.float() != want.float()).float().mean().item()))
    if not torch.equal(o_qt.view(torch.uint8), o_q.flatten(1).t().contiguous().view(torch.uint8)):
        bad.append(case + ("o_qt is not o_q transposed",))
    if float(amax) != float(out.float().abs().max()):
        bad.append(case + ("amax", amax.item(), out.float().abs().max().item()))
qkv[3, 0, 1, 2] = float("nan")
q, k, v = qkv.unbind(1)
if torch.isfinite(ta.launch_forward(q, k, v, cu, max(lengths), p, seed, (16, 16, 4), scale=s)[4]):
    bad.append("a NaN gave a finite amax")
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_kernels_float8_epilogue_matches_the_torch_cast_in_the_interpreter():
    """The output's e4m3 copy, written in its place, is the plain kernel's output (rounded to its dtype) cast as
    scaled_cast casts, byte for byte; its transpose byte for byte; the amax the output's; the log-sum-exp and the
    mask unchanged by it."""
    run_check(INTERPRETER, timeout=900, interpret=True)


SM90 = """
import sys
sys.path.insert(0, "bench")
import attention_sass
from bert.model import triton_attention as ta

bad = []
for dtype in ("bf16", "fp16"):
    kernel, tile, signature = attention_sass.signatures(ta, dtype, float8=True)[0]
    for dropout in (True, False):
        try:
            row = attention_sass.count(kernel, tile, signature, dropout, 64)
        except Exception as e:
            bad.append((dtype, dropout, repr(e)[:300]))
            continue
        if row["stack_bytes"] or not row["hgmma"]:  # BERT's heads: nothing spilled, Hopper's MMA in the loop
            bad.append((dtype, dropout, row))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_float8_forward_kernel_compiles_for_an_h100_without_spills():
    run_check(SM90, timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_kernel_matches_the_torch_path(monkeypatch):
    """BERT-large's heads in bf16 on the H100 profile's batch shape, the kernel's copy against the torch cast of
    its own output."""
    g = torch.Generator(device="cuda").manual_seed(5)
    lengths = [128, 512, 77, 300] * 8
    qkv = torch.randn(sum(lengths), 3, 16, 64, device="cuda", generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale = torch.tensor(100.0, device="cuda")
    refuse_torch_path_on_cuda(monkeypatch, fab, "attention_torch")
    _, _, o_q, o_qt, amax = OP(qkv, cu, 512, 0.1, torch.tensor(3, device="cuda"), scale)
    out = torch.ops.bert.triton_attention(qkv, cu, 512, 0.1, torch.tensor(3, device="cuda"))[0]
    want = (out.float() * 100).clamp(-448, 448).to(E4M3)
    assert torch.equal(o_q.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(o_qt.view(torch.uint8), o_q.flatten(1).t().contiguous().view(torch.uint8))
    assert float(amax) == float(out.float().abs().max())
