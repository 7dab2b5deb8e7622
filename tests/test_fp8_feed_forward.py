"""bert.model.fp8_feed_forward (the float8 FFN as one autograd Function, its GELU kernel writing the second linear's
e4m3 input and its transpose). References: the two units it replaces (Float8BiasGELU then Float8ResidualOutput,
autograd between them), which it must equal bit for bit; the GELU=rational formula and torch's float8 cast for the
op; torch's `opcheck`. The Triton kernel is checked against the torch path in Triton's interpreter and compiled for
sm_90."""

import copy

import pytest
import torch
from test_fp8_bias_gelu import NARROWING_PATCH, compiled_ops
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model import fp8_feed_forward as fff
from bert.model import fp8_residual_norm as frn
from bert.model.bias_gelu import apply_bias_gelu
from bert.model.dropout_add_norm import apply_residual_norm
from bert.model.fp8 import convert_to_fp8
from bert.model.fp8_delayed import E4M3
from bert.model.gelu import rational_gelu_reference
from bert.synthetic import random_batch

OP = torch.ops.bert.gelu_fp8


def model_pair(dropout=0.1, seed=0):
    """(a float8 model with BIAS_GELU=fused and RESIDUAL_NORM=fused, its FFNs one Function each; the same with the
    two units apart), equal parameters."""
    def build(feed_forward: bool) -> BertForPreTraining:
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=1104, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64).with_dropout(dropout)
        model = BertForPreTraining(cfg, attention="padded")
        apply_bias_gelu(model, "fused")
        apply_residual_norm(model, "fused")
        if feed_forward:
            convert_to_fp8(model, recipe="delayed")
        else:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr("bert.model.fp8.apply_fp8_feed_forward", lambda model: [])
                convert_to_fp8(model, recipe="delayed")
        return model

    return build(True), build(False)


def train_step(model, batch, amax: float, last_layer_subset: bool = False):
    """A training step's loss and what it leaves: every gradient and every amax (set to `amax` first, so the
    casts scale as a calibrated run's)."""
    for name, buffer in model.named_buffers():
        if "amax" in name:
            buffer.fill_(amax)
    model.last_layer_subset = last_layer_subset
    torch.manual_seed(11)  # the dropout seeds: the same draws both sides
    loss = model(batch).loss
    loss.backward()
    return (loss.detach(), {n: p.grad for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers() if "amax" in n})


BATCH = dict(seed=3, vocab_size=1104)  # 32 tokens: float8's weight GEMMs take 16s


def assert_frozen_close_is_the_units(pair, close: str) -> None:
    """With each layer's `close` (a sublayer's closing unit) frozen in both models of `pair`, its linear's input
    gradient is still wanted by what comes before: every other gradient equal, bit for bit."""
    for m in pair:
        for layer in m.bert.encoder.layer:
            layer.get_submodule(close).dense.requires_grad_(False)
    batch = random_batch((9, 5, 18), **BATCH)
    (_, grads, _), (_, want, _) = (train_step(m, batch, 2.0) for m in pair)
    assert grads[f"bert.encoder.layer.0.{close}.dense.weight"] is None
    for name, grad in want.items():
        assert (grads[name] is None and grad is None) or torch.equal(grads[name], grad), name


def assert_eval_is_the_units(pair) -> None:
    """In eval (dropout off, no grad) the loss equals the units' and no amax is recorded."""
    model, reference = pair
    batch = random_batch((9, 5, 18), **BATCH)
    for m in pair:
        m.eval()
    with torch.no_grad():
        before = {n: b.clone() for n, b in model.named_buffers() if "amax" in n}
        assert torch.equal(model(batch).loss, reference(batch).loss)
        assert all(torch.equal(b, before[n]) for n, b in model.named_buffers() if "amax" in n)


@pytest.mark.parametrize("amax", [2.0, 1e-3])  # the second saturates the float8 copies
def test_the_float8_ffn_is_its_two_units_bit_for_bit(amax):
    """With dropout on: the loss, every parameter's gradient and every amax equal the two units' (the GELU output's
    amax, which the op now takes, among them)."""
    model, reference = model_pair()
    swapped = [type(layer.output) for layer in model.bert.encoder.layer]
    assert swapped == [fff.Float8FeedForwardOutput] * 2
    assert [type(layer.output) for layer in reference.bert.encoder.layer] == [frn.Float8ResidualOutput] * 2
    assert model.state_dict().keys() == reference.state_dict().keys()
    batch = random_batch((9, 5, 18), seed=3, vocab_size=1104)  # 32 tokens: float8's weight GEMMs take 16s
    (loss, grads, amaxes), (want_loss, want_grads, want_amaxes) = (train_step(m, batch, amax)
                                                                   for m in (model, reference))
    assert torch.equal(loss, want_loss)
    for name, grad in want_grads.items():
        assert torch.equal(grads[name], grad), name
    assert amaxes.keys() == want_amaxes.keys()
    for name, value in want_amaxes.items():
        assert torch.equal(amaxes[name], value), name
    # the GELU output's amax (the FFN close's input) was recorded, not left at its start
    assert float(amaxes["bert.encoder.layer.0.output.dense.amax_input"]) != amax


def test_with_the_ffn_close_frozen_the_gradient_still_reaches_what_comes_before():
    assert_frozen_close_is_the_units(model_pair(), "output")


def test_in_eval_it_records_nothing_and_is_the_units_eval():
    assert_eval_is_the_units(model_pair(dropout=0.5))


def compiled_layer_step(model, *needles: str) -> tuple[list[str], list, list]:
    """A step of `model`'s first layer compiled by AOT autograd: (the ops named by `needles` its graphs hold, its
    input's and parameters' gradients, those of an eager step from the same amaxes)."""
    layer = model.bert.encoder.layer[0]
    attend = model.plan_attention(random_batch((9, 5, 18), **BATCH).seq)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(5))

    def step(module):
        leaf = x.clone().requires_grad_()
        module(leaf, attend).x.square().sum().backward()
        return [leaf.grad] + [p.grad.clone() for p in module.parameters()]

    want = step(copy.deepcopy(layer))  # the amaxes as they start, for both
    seen, got = compiled_ops(layer, step, *needles)
    return seen, got, want


def test_the_op_is_the_gelu_cast_to_e4m3_with_its_transpose_and_amax():
    g = torch.Generator().manual_seed(2)
    h = (torch.randn(48, 80, generator=g) * 3).to(torch.bfloat16)
    scale = torch.tensor(30.0)
    q, q_t, amax = OP(h, scale)
    gelu = rational_gelu_reference(h)  # bf16, as the unfused FFN's output
    assert gelu.dtype == torch.bfloat16 and q.dtype == q_t.dtype == E4M3
    assert torch.equal(q.view(torch.uint8), (gelu.float() * 30).clamp(-448, 448).to(E4M3).view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert amax.dtype == torch.float32 and float(amax) == float(gelu.float().abs().max())
    assert OP(h, torch.tensor(1e6))[0].float().abs().max() == 448  # saturated, not NaN
    torch.library.opcheck(OP, (h, scale))
    h[3, 4] = float("nan")
    assert not torch.isfinite(OP(h, scale)[2])  # not kept: the old amax stays
    for wrong in ((h[:, :1].expand(48, 4), scale), (h, torch.ones(1))):
        with pytest.raises(ValueError, match="contiguous"):
            OP(*wrong)


def test_the_config_builds_it_with_all_three_and_the_delayed_recipe():
    from bert.train.build import build_model

    layers = BertConfig.load("tiny").num_hidden_layers
    for bias_gelu, residual_norm, expected in [("fused", "fused", layers), ("fused", "torch", 0),
                                               ("torch", "fused", 0)]:
        cfg = from_flat(bias_gelu=bias_gelu, residual_norm=residual_norm, precision="fp8", fp8_recipe="delayed",
                        static_tokens=512, attention="padded", bert_config_path="tiny").model
        model = build_model(cfg, torch.device("cpu"))
        assert sum(type(m) is fff.Float8FeedForwardOutput for m in model.modules()) == expected
    with pytest.raises(ValueError, match="Float8ResidualOutput"):
        fff.Float8FeedForwardOutput.from_module(model.bert.encoder.layer[0].output.dense)


def test_compiled_the_gelus_copy_is_not_transposed_again_and_the_step_matches_eager():
    """AOT autograd's graphs of one layer: the forward transposes the first linear's input and the two weights, the
    GELU's op writes the second input's transposed copy; the backward transposes neither of the FFN's gradients (the
    norm's and the GELU backward's kernels write them transposed too). Compiled by inductor, the step equals eager."""
    seen, got, want = compiled_layer_step(model_pair(dropout=0.0)[0], "fp8_transpose", "fp8_cast_transpose",
                                           "gelu_fp8", "gelu_backward_fp8")
    ffn = [name for name in seen if "gelu" in name]
    assert ffn == ["bert.gelu_fp8.default", "bert.gelu_backward_fp8.default"], seen
    # forward: the attention sublayer's two linears' inputs, the FFN's first input; backward: the QKV's gradient,
    # cast by inductor under padded attention (the out-projection's and the FFN's second come transposed from the
    # norms' backward kernels); the four weights are cast with their transposes
    assert seen.count("bert.fp8_transpose.default") == (2 + 1) + 1, seen
    assert seen.count("bert.fp8_cast_transpose.default") == 4, seen
    for a, b in zip(got, want):
        assert torch.equal(a, b)


INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model import fp8_feed_forward as fff

bad = []
# (tokens, width, dtype, tile, scale): rows and columns cut inside a tile, a program of several row blocks, a scale
# that saturates
for tokens, width, dtype, tile, scale in [(77, 300, torch.float32, (8, 64, 32, 4), 40.0),
                                          (70, 40, torch.bfloat16, (16, 32, 16, 2), 3e3),
                                          (33, 257, torch.float16, (16, 128, 64, 4), 1.0)]:
    g = torch.Generator().manual_seed(tokens + width)
    h = (torch.randn(tokens, width, generator=g) * 3).to(dtype)
    s = torch.tensor(scale)
    case = (tokens, width, str(dtype), tile, scale)
    (q, q_t, amax), (want_q, _, want_amax) = fff.launch_forward(h, s, tile), fff.gelu_fp8_torch(h, s)
    # the GELU in fp32 on both sides, libdevice's exp2 against torch's: a rounding of the dtype apart at most
    off = (q.float() != want_q.float()).float().mean().item()
    if off > 0.002:
        bad.append(case + ("q differs at", off))
    if not torch.equal(q_t.view(torch.uint8), q.t().view(torch.uint8)):  # the kernel's own copy, byte for byte
        bad.append(case + ("q_t is not q transposed",))
    if q.float().abs().max() > 448:
        bad.append(case + ("not saturated",))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    if not torch.allclose(amax, want_amax, rtol=tol, atol=0):
        bad.append(case + ("amax", amax.item(), want_amax.item()))
h[2, 3] = float("nan")
if torch.isfinite(fff.launch_forward(h, s, tile)[2]):
    bad.append("a NaN gave a finite amax")
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_triton_kernel_matches_the_torch_path_in_the_interpreter():
    run_check(INTERPRETER, timeout=600, interpret=True)


@needs_triton
def test_the_kernel_compiles_for_an_h100_without_spills():
    """At the default tile (bench/bias_gelu_sass.py): nothing on the stack, room for more than one block an SM."""
    import sys

    from script_modules import ROOT

    from bert.model.bias_gelu import TILE

    sys.path.insert(0, str(ROOT / "bench"))
    import bias_gelu_sass

    row = bias_gelu_sass.count_fp8(TILE)[1]
    assert row["kernel"] == "fp8 ffn _forward_kernel", row
    assert row["stack_bytes"] == 0 and row["blocks_per_sm"] >= 2, row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_kernel_matches_the_torch_path(monkeypatch):
    """BERT-large's FFN in bf16 (24,405 tokens: the H100 profile's batch), the kernel against the torch path."""
    g = torch.Generator(device="cuda").manual_seed(5)
    h = (torch.randn(24405, 4096, device="cuda", generator=g) * 3).to(torch.bfloat16)
    scale = torch.tensor(100.0, device="cuda")
    want = fff.gelu_fp8_torch(h, scale)
    refuse_torch_path_on_cuda(monkeypatch, fff, "gelu_fp8_torch")
    got = OP(h, scale)
    assert (got[0].float() != want[0].float()).float().mean() < 0.002
    assert torch.equal(got[1].view(torch.uint8), got[0].t().contiguous().view(torch.uint8))
    torch.testing.assert_close(got[2], want[2], rtol=1e-2, atol=0)
