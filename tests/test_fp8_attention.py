"""bert.model.fp8_attention (`ATTENTION=triton` under delayed float8): the float8 QKV linear and our flash attention,
the QKV gradient's float8 cast, amax and bias sums in the attention's backward kernels. References: the unfused path
it replaces (a DelayedFloat8Linear QKV, then ATTENTION=triton, autograd between them), which it must equal bit for
bit; the attention's torch-path gradient (itself checked against float64 autograd in test_triton_attention);
torch's `opcheck`. The kernels' float8 branch is checked against the torch path in Triton's interpreter and compiled
for sm_90."""

import copy

import pytest
import torch
from test_fp8_bias_gelu import NARROWING_PATCH, compiled_ops
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.batch import SeqLayout
from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model import fp8_attention as fa
from bert.model import triton_attention as ta
from bert.model.fp8 import convert_to_fp8, is_fp8_linear
from bert.model.fp8_delayed import E4M3, E5M2, DelayedFloat8Linear, convert_to_delayed_fp8, saturated_cast
from bert.model.layers import BertSelfAttention
from bert.synthetic import random_batch

OP = torch.ops.bert.triton_attention_backward_fp8
LENGTHS = [5, 17, 10]
TOKENS = sum(LENGTHS)


def attention_pair(dtype, amax_grad, p=0.1, seed=0):
    """(the unfused float8 QKV and attention: BertSelfAttention over a DelayedFloat8Linear, the same as a
    Float8SelfAttention), equal parameters and amaxes."""
    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64).with_dropout(p)
    ref = BertSelfAttention(cfg).to(dtype)
    ref.qkv = DelayedFloat8Linear.from_linear(ref.qkv)
    ours = fa.Float8SelfAttention.from_module(copy.deepcopy(ref))
    for m in (ref, ours):
        m.qkv.amax_input.fill_(3.0)
        m.qkv.amax_grad.fill_(amax_grad)
    return ref, ours


def step(module, attend, x, grad):
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(7)  # the dropout seed: the same mask both sides
    y = module(x, attend)
    y.backward(grad)
    d = module.qkv
    return {"y": y, "dx": x.grad, "dw": d.weight.grad, "db": d.bias.grad, "amax_grad": d.amax_grad.clone(),
            "amax_input": d.amax_input.clone()}


def data(dtype, tokens=TOKENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 32, generator=g).to(dtype), torch.randn(tokens, 32, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amax_grad", [0.5, 1e-3])  # the second saturates the gradient's float8 copy
def test_it_is_the_unfused_float8_qkv_and_attention(dtype, amax_grad):
    """Bit for bit, the bias gradient too: the torch path sums the rounded gradient, as the unfused path does (the
    kernels sum it unrounded, checked in the interpreter below)."""
    ref, ours = attention_pair(dtype, amax_grad)
    attend = ta.triton_varlen(SeqLayout.from_lengths(LENGTHS))
    x, grad = data(dtype)
    want, got = step(ref, attend, x, grad), step(ours, attend, x, grad)
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)
    assert float(want["amax_grad"]) != amax_grad  # recorded for the next step


def test_in_eval_it_drops_nothing_and_is_the_unfused_eval():
    ref, ours = attention_pair(torch.float32, 0.5, p=0.5)
    attend = ta.triton_varlen(SeqLayout.from_lengths(LENGTHS))
    x, _ = data(torch.float32)
    for m in (ref, ours):
        m.eval()
    with torch.no_grad():
        y = ours(x, attend)
        assert torch.equal(y, ours(x, attend)) and torch.equal(y, ref(x, attend))


def test_a_non_finite_gradient_keeps_the_old_amax_as_the_unfused_path_does():
    ref, ours = attention_pair(torch.float32, 0.5)
    attend = ta.triton_varlen(SeqLayout.from_lengths(LENGTHS))
    x, grad = data(torch.float32)
    grad[3, 5] = float("nan")
    for module in (ref, ours):
        assert float(step(module, attend, x, grad)["amax_grad"]) == 0.5


def test_another_backend_takes_self_attentions_own_forward():
    from bert.model.attention import BACKENDS

    ref, ours = attention_pair(torch.float32, 0.5, p=0.0)
    attend = BACKENDS["loop"](SeqLayout.from_lengths(LENGTHS))
    x, grad = data(torch.float32)
    want, got = step(ref, attend, x, grad), step(ours, attend, x, grad)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)


def inputs(dtype=torch.float64, lengths=(6, 11), heads=2, dim=8, p=0.2, seed=2):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, dim, generator=g, dtype=torch.float64).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, lse, bits = torch.ops.bert.triton_attention(qkv, cu, max(lengths), p, torch.tensor(99))
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    return grad, qkv, out, lse, bits, cu, max(lengths), p


def test_the_op_in_float64_is_the_attentions_gradient_scaled_and_rounded_to_e5m2():
    args = inputs()
    exact = torch.ops.bert.triton_attention_backward(*args)
    q, q_t, sums, amax = OP(*args, torch.tensor(64.0))
    assert (q.dtype, q.shape, sums.dtype, sums.shape, amax.dtype) == (E5M2, exact.shape, torch.float64,
                                                                      exact.shape[1:], torch.float32)
    assert q_t.is_contiguous() and torch.equal(q_t.view(torch.uint8), q.flatten(1).t().view(torch.uint8))
    torch.testing.assert_close(sums, exact.sum(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(amax.double(), exact.abs().max(), rtol=1e-6, atol=0)
    # e5m2 keeps 2 mantissa bits: within half its spacing (2^-3 relative) of the scaled gradient, or its subnormals'
    err = (q.double() - exact * 64).abs()
    assert (err <= 2.0 ** -3 * (exact * 64).abs() + 2.0 ** -17).all()
    q = OP(*args, torch.tensor(1e6))[0]  # saturated, not inf: the largest e5m2
    assert q.float().abs().max() == torch.finfo(E5M2).max and torch.isfinite(q.float()).all()


def test_with_the_outputs_e4m3_copy_delta_reads_the_copy():
    """With the output in e4m3 and 1 / its scale (the float8 attention block's), the gradient is float64's
    attention gradient with the copy's values as O in delta = rowsum(dO * O), and not the one from O itself."""
    grad, qkv, out, *rest = inputs()
    o_q = saturated_cast(out, torch.tensor(32.0), E4M3)
    copy_values = o_q.double() / 32  # exact, as the op's product with 1 / 32
    want = torch.ops.bert.triton_attention_backward(grad, qkv, copy_values, *rest)
    exact = torch.ops.bert.triton_attention_backward(grad, qkv, out, *rest)
    got = OP(grad, qkv, o_q, *rest, torch.tensor(1.0), torch.tensor(1 / 32))
    torch.testing.assert_close(got[2], want.sum(0), rtol=0, atol=1e-12)  # the unrounded sums
    assert not torch.allclose(got[2], exact.sum(0), rtol=0, atol=1e-9)


def test_opcheck_and_the_refusal():
    args = inputs(torch.float32)
    torch.library.opcheck(OP, (*args, torch.tensor(8.0)))
    o_q = saturated_cast(args[2], torch.tensor(30.0), E4M3)
    # not test_schema: it compares the inputs before and after with allclose, which the CPU lacks for float8
    torch.library.opcheck(OP, (args[0], args[1], o_q, *args[3:], torch.tensor(8.0), torch.tensor(1 / 30)),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="0-dim"):
        OP(*args, torch.ones(1))
    with pytest.raises(ValueError, match="0-dim"):
        OP(args[0], args[1], o_q, *args[3:], torch.tensor(8.0), torch.ones(1))
    for out, inv in [(o_q, None), (args[2], torch.tensor(1.0))]:  # each without the other
        with pytest.raises(ValueError, match="e4m3 output comes with 1 / its scale"):
            OP(args[0], args[1], out, *args[3:], torch.tensor(8.0), inv)


def tiny_model(attention="triton", seed=0):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=1104, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)  # dropout on: the masks are drawn alike
    return BertForPreTraining(cfg, attention=attention)


def test_the_float8_model_swaps_each_self_attention_and_trains_as_the_unfused_one():
    """Delayed float8 on a model with ATTENTION=triton: every self-attention a Float8SelfAttention, parameters and
    checkpoint keys unchanged; the loss, every gradient and every amax as the unfused float8 model's."""
    model, reference = tiny_model(), tiny_model()
    params = dict(model.named_parameters())
    convert_to_fp8(model, recipe="delayed")
    convert_to_delayed_fp8(reference, lambda module, name: is_fp8_linear(module, name))  # the unfused float8 path
    assert [type(layer.attention.self) for layer in model.bert.encoder.layer] == [fa.Float8SelfAttention] * 2
    assert dict(model.named_parameters()) == params and model.state_dict().keys() == reference.state_dict().keys()
    batch = random_batch((9, 5, 18), seed=3, vocab_size=1104)  # 32 tokens: float8's weight GEMMs take 16s
    losses = []
    for m in (model, reference):
        torch.manual_seed(11)
        losses.append(m(batch).loss)
    assert float(losses[0].detach()) == float(losses[1].detach())
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    amaxes = [[b for n, b in m.named_buffers() if "amax" in n] for m in (model, reference)]
    assert amaxes[0] == amaxes[1]


def test_the_config_builds_it_under_delayed_float8():
    from bert.train.build import build_model

    layers = BertConfig.load("tiny").num_hidden_layers
    cfg = from_flat(precision="fp8", fp8_recipe="delayed", static_tokens=512, attention="triton",
                    bert_config_path="tiny").model
    assert sum(type(m) is fa.Float8SelfAttention for m in build_model(cfg, torch.device("cpu")).modules()) == layers
    # FP8_LINEARS=ffn keeps the QKV in bf16: BertSelfAttention stays itself
    cfg = from_flat(precision="fp8", fp8_recipe="delayed", fp8_linears="ffn", static_tokens=512, attention="triton",
                    bert_config_path="tiny").model
    assert not any(type(m) is fa.Float8SelfAttention for m in build_model(cfg, torch.device("cpu")).modules())
    with pytest.raises(ValueError, match="DelayedFloat8Linear"):
        fa.Float8SelfAttention.from_module(tiny_model().bert.encoder.layer[0].attention.self)


def test_compiled_the_op_is_one_node_of_the_backward_and_the_step_matches_eager():
    _, eager = attention_pair(torch.float32, 0.5)
    compiled_module = copy.deepcopy(eager)  # before the eager step: the same amaxes
    attend = ta.triton_varlen(SeqLayout.from_lengths(LENGTHS))
    x, grad = data(torch.float32, seed=4)
    want = step(eager, attend, x, grad)
    seen, got = compiled_ops(compiled_module, lambda m: step(m, attend, x, grad), "triton_attention", "fp8_transpose",
                             "fp8_cast_transpose")
    # the forward casts w with its transpose and transposes x_q; the backward's gradient comes transposed from the
    # op, so none there
    assert seen == ["bert.fp8_cast_transpose.default", "bert.fp8_transpose.default", "bert.triton_attention.default",
                    "bert.triton_attention_backward_fp8.default"], seen
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)


INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model import triton_attention as ta
from bert.model import fp8_attention as fa
from bert.model.fp8_delayed import E4M3, E5M2, saturated_cast

bad = []
# (lengths, heads, head dim, dtype, p, scale): key and query blocks cut, several of each, a sequence of one, fp32 and
# fp16 (the interpreter's bf16 products are wrong), a scale that saturates
for lengths, heads, dim, dtype, p, scale in [([5, 70, 130], 2, 16, torch.float32, 0.1, 40.0),
                                             ([64, 1, 33], 3, 32, torch.float16, 0.3, 3e4),
                                             ([20], 1, 16, torch.float16, 0.0, 1.0)]:
    g = torch.Generator().manual_seed(len(lengths) + dim)
    qkv = torch.randn(sum(lengths), 3, heads, dim, generator=g).to(dtype)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    longest = max(lengths)
    out, lse, bits = ta.attention_torch(q, k, v, lengths, longest, p, torch.tensor(123456789))
    grad = torch.randn(q.shape, generator=g).to(dtype)
    s = torch.tensor(scale)
    # the output as it is, then its e4m3 copy (the float8 attention block's), which delta reads then
    for o_scale in (None, 50.0):
        case = (lengths, dim, str(dtype), p, scale, o_scale)
        o, inv = out, None
        if o_scale is not None:
            o, inv = saturated_cast(out, torch.tensor(o_scale), E4M3), torch.tensor(1 / o_scale)
        got_q, got_qt, got_sums, got_amax = ta.launch_backward(grad, q, k, v, o, lse, bits, cu, longest, p, scale=s,
                                                               out_inv=inv)
        want_q, _, want_sums, want_amax = fa.triton_attention_backward_fp8(grad, qkv, o, lse, bits, cu, longest, p, s,
                                                                           inv)
        if got_q.dtype != E5M2 or got_q.shape != qkv.shape:
            bad.append(case + ("q", str(got_q.dtype), tuple(got_q.shape)))
        # the kernels' own transposed copy, byte for byte (every token is in a sequence: all of it written)
        if not torch.equal(got_qt.view(torch.uint8), got_q.flatten(1).t().view(torch.uint8)):
            bad.append(case + ("q_t is not q transposed",))
        # fp32 sums in another order on each side: a rounding of the dtype apart at most, in a few elements
        off = (got_q.float() != want_q.float()).float().mean().item()
        if off > 0.02:
            bad.append(case + ("q differs at", off))
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(got_sums, want_sums.float(), rtol=tol, atol=tol * len(lengths)):
            bad.append(case + ("sums", (got_sums - want_sums.float()).abs().max().item()))
        if not torch.allclose(got_amax, want_amax, rtol=tol, atol=0):
            bad.append(case + ("amax", got_amax.item(), want_amax.item()))
grad[2, 0, 3] = float("nan")
if torch.isfinite(ta.launch_backward(grad, q, k, v, out, lse, bits, cu, longest, p, scale=s)[3]):
    bad.append("a NaN gradient gave a finite amax")
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_kernels_float8_branch_matches_the_torch_path_in_the_interpreter():
    run_check(INTERPRETER, timeout=900, interpret=True)


SM90 = """
import sys
sys.path.insert(0, "bench")
import attention_sass
from bert.model import triton_attention as ta

bad = []
for dtype in ("bf16", "fp16"):
    for kernel, tile, signature in attention_sass.signatures(ta, dtype, float8=True)[1:]:
        for dropout in (True, False):
            case = (kernel.fn.__name__, dtype, dropout)
            try:
                row = attention_sass.count(kernel, tile, signature, dropout, 64)
            except Exception as e:
                bad.append(case + (repr(e)[:300],))
                continue
            if row["stack_bytes"] or not row["hgmma"]:  # BERT's heads: nothing spilled, Hopper's MMA in the loop
                bad.append(case + (row,))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_float8_backward_kernels_compile_for_an_h100_without_spills():
    run_check(SM90, timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("e4m3_out", [False, True])
def test_cuda_the_kernels_match_the_torch_path(monkeypatch, e4m3_out):
    """BERT-large's heads in bf16 at phase-2-like lengths, the kernels against the torch path; with `e4m3_out`,
    delta read from the output's e4m3 copy (the float8 attention block's)."""
    lengths = [512, 300, 129, 64, 17]
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(sum(lengths), 3, 16, 64, device="cuda", generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out, lse, bits = torch.ops.bert.triton_attention(qkv, cu, 512, 0.1, torch.tensor(3, device="cuda"))
    grad = torch.randn(out.shape, device="cuda", generator=g).to(torch.bfloat16)
    scale, inv = torch.tensor(1e3, device="cuda"), None
    if e4m3_out:
        out, inv = saturated_cast(out, torch.tensor(100.0, device="cuda"), E4M3), torch.tensor(0.01, device="cuda")
    want = [t.cpu() for t in OP(*(t.cpu() for t in (grad, qkv, out, lse, bits, cu)), 512, 0.1, scale.cpu(),
                                None if inv is None else inv.cpu())]
    refuse_torch_path_on_cuda(monkeypatch, fa, "backward_torch")
    got = [t.cpu() for t in OP(grad, qkv, out, lse, bits, cu, 512, 0.1, scale, inv)]
    assert (got[0].float() != want[0].float()).float().mean() < 0.02
    assert torch.equal(got[1].view(torch.uint8), got[0].flatten(1).t().view(torch.uint8))
    torch.testing.assert_close(got[2], want[2], rtol=1e-2, atol=1e-1)
    torch.testing.assert_close(got[3], want[3], rtol=1e-2, atol=0)
