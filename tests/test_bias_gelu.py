"""bert.model.bias_gelu (`BIAS_GELU=fused`): GELU(h + b) and its gradients, the bias's summed in the backward's pass.
References: torch's exact F.gelu and autograd through it in float64 (the rational erfc is within 6e-8 |x|), the
unswapped model, torch's `opcheck`. The Triton kernels the GPU runs are checked against the torch path in Triton's
interpreter (tiles cut at both edges, several row blocks a program) and on a GPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model import bias_gelu as bg
from bert.model.layers import BertIntermediate
from bert.synthetic import random_batch

OP = torch.ops.bert.bias_gelu


def inputs(tokens=37, width=24, dtype=torch.float64, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, width, generator=g, dtype=torch.float64) * scale).to(dtype)
    b = torch.randn(width, generator=g, dtype=torch.float64).to(dtype)
    return h, b


def test_the_op_is_gelu_of_h_plus_b_and_its_gradients_autograds():
    h, b = (t.requires_grad_() for t in inputs())
    grad = torch.randn(h.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = OP(h, b)
    exact = F.gelu(h + b)
    x = (h + b).detach()
    assert ((y - exact).abs() <= 6e-8 * x.abs() + 1e-15).all()
    got, want = torch.autograd.grad(y, (h, b), grad), torch.autograd.grad(exact, (h, b), grad)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=3e-7)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=3e-7 * h.shape[0])  # the sum of the column's dh
    torch.testing.assert_close(got[1], got[0].sum(0), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_computed_in_fp32_from_h_plus_b_unrounded(dtype):
    h, b = inputs(dtype=dtype)
    y = OP(h, b)
    assert y.dtype == dtype
    want = F.gelu(h.double() + b.double()).to(dtype)  # h + b not rounded to the half dtype first
    torch.testing.assert_close(y, want, rtol=torch.finfo(dtype).eps, atol=1e-6)
    # the same rounding but where the rational erfc's 6e-8 tips one over (h + b rounded first: a fifth and more)
    assert (y != want).double().mean() < 0.01
    dh, db = torch.ops.bert.bias_gelu_backward(torch.ones_like(h), h, b)
    assert (dh.dtype, db.dtype) == (dtype, dtype)
    slope = torch.func.grad(lambda x: F.gelu(x).sum())(h.double() + b.double())
    torch.testing.assert_close(db.double(), slope.sum(0).to(dtype).double(), rtol=2 * torch.finfo(dtype).eps,
                               atol=1e-3)


def test_opcheck_and_gradcheck():
    h, b = (t.requires_grad_() for t in inputs(tokens=5, width=3))
    assert torch.autograd.gradcheck(OP, (h, b))
    torch.library.opcheck(OP, (h, b))
    torch.library.opcheck(torch.ops.bert.bias_gelu_backward, (torch.randn(5, 3, dtype=torch.float64), *inputs(5, 3)))


def test_the_op_refuses_what_it_cannot_run():
    h, b = inputs()
    with pytest.raises(ValueError, match=r"contiguous \(T, N\)"):
        OP(h.t(), b)
    with pytest.raises(ValueError, match=r"\(N,\) bias"):
        OP(h, b[:3])


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=1104, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                     max_position_embeddings=32)
    return BertForPreTraining(cfg, attention="loop").double()


def test_the_swapped_model_is_the_model_with_the_same_parameters():
    """Every FFN swapped (not the MLM head's GELU), parameters the same objects and names; the loss and every
    gradient as the unswapped model's within the rational erfc's error."""
    model, reference = tiny_model(), tiny_model()
    params = dict(model.named_parameters())
    swapped = bg.apply_bias_gelu(model, "fused")
    assert swapped == ["bert.encoder.layer.0.intermediate", "bert.encoder.layer.1.intermediate"]
    assert all(type(m) is bg.FusedBiasGELU for m in (model.bert.encoder.layer[i].intermediate for i in range(2)))
    assert dict(model.named_parameters()) == params and model.state_dict().keys() == reference.state_dict().keys()
    batch = random_batch((9, 5, 14), seed=3, vocab_size=1104)
    for m in (model, reference):
        m.eval()  # no dropout: the same arithmetic
    losses = [m(batch).loss for m in (model, reference)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-9, atol=0)
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=name)
    assert bg.apply_bias_gelu(tiny_model(), "torch") == []


def test_a_dense_that_is_not_a_plain_linear_keeps_its_bias_and_the_activation():
    class OtherLinear(nn.Linear):  # as a float8 linear: its own GEMM, its own bias
        def forward(self, x):
            return super().forward(x) * 2.0

    ffn = BertIntermediate(BertConfig(vocab_size=8, hidden_size=4, num_hidden_layers=1, num_attention_heads=1,
                                      intermediate_size=6)).double()
    fused = bg.FusedBiasGELU.from_module(ffn)
    other = OtherLinear(4, 6).double()
    fused.dense = other
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(fused(x), F.gelu(other(x)))


def test_the_config_and_the_driver_build_take_it():
    from bert.train.build import build_model

    cfg = from_flat(bias_gelu="fused", attention="loop", bert_config_path="tiny").model
    model = build_model(cfg, torch.device("cpu"))
    assert sum(type(m) is bg.FusedBiasGELU for m in model.modules()) == BertConfig.load("tiny").num_hidden_layers
    with pytest.raises(ValueError, match="BIAS_GELU='fusd' is not one of torch, fused"):
        bg.check_bias_gelu("fusd", torch.device("cpu"))
    with pytest.raises(ValueError, match="BIAS_GELU='fusd' is not one of torch, fused"):
        bg.apply_bias_gelu(tiny_model(), "fusd")


def test_without_triton_a_cuda_run_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(bg, "triton", None)  # as torch's CPU wheel: no Triton
    with pytest.raises(ValueError, match="BIAS_GELU=fused needs Triton on CUDA"):
        bg.check_bias_gelu("fused", torch.device("cuda"))
    assert bg.check_bias_gelu("fused", torch.device("cpu")) == "fused"  # the torch path needs none


def test_compiled_the_op_stays_one_node_each_way_and_matches_eager():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def count(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if "bias_gelu" in str(n.target))
        return make_boxed_func(gm.forward)

    h, b = (t.float().requires_grad_() for t in inputs())
    torch._dynamo.reset()
    compiled = torch.compile(OP, backend=aot_autograd(fw_compiler=count, bw_compiler=count), fullgraph=True)
    got = torch.autograd.grad(compiled(h, b).square().sum(), (h, b))
    torch._dynamo.reset()
    assert seen == ["bert.bias_gelu.default", "bert.bias_gelu_backward.default"]
    want = torch.autograd.grad(OP(h, b).square().sum(), (h, b))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=0, atol=0)


INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
from bert.model import bias_gelu as bg

bad = []
# (tokens, width, dtype, tile): rows and columns cut inside a tile, a backward program of several row blocks
for tokens, width, dtype, tile in [(77, 300, torch.float32, (8, 64, 32, 4)), (5, 64, torch.float32, bg.TILE),
                                   (70, 40, torch.float16, (16, 32, 16, 2)),
                                   (33, 257, torch.float32, (16, 128, 64, 4))]:
    g = torch.Generator().manual_seed(tokens + width)
    h = (torch.randn(tokens, width, generator=g) * 3).to(dtype)
    b = torch.randn(width, generator=g).to(dtype)
    grad = torch.randn(tokens, width, generator=g).to(dtype)
    case = (tokens, width, str(dtype), tile)
    y, want = bg.launch_forward(h, b, tile), bg.bias_gelu_torch(h, b)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    if not torch.allclose(y.float(), want.float(), rtol=tol, atol=tol):
        bad.append(case + ("y", (y.float() - want.float()).abs().max().item()))
    (dh, db), (want_dh, want_db) = bg.launch_backward(grad, h, b, tile), bg.bias_gelu_backward_torch(grad, h, b)
    if not torch.allclose(dh.float(), want_dh.float(), rtol=tol, atol=tol):
        bad.append(case + ("dh", (dh.float() - want_dh.float()).abs().max().item()))
    if not torch.allclose(db.float(), want_db.float(), rtol=tol, atol=tol * tokens):
        bad.append(case + ("db", (db.float() - want_db.float()).abs().max().item()))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_triton_kernels_match_the_torch_path_in_the_interpreter():
    """Both kernels in Triton's interpreter against the torch path: rows and columns cut inside a tile (the masks),
    a backward program summing several row blocks and a last program with fewer, fp32 and fp16."""
    run_check(INTERPRETER, timeout=600, interpret=True)


@needs_triton
def test_the_kernels_compile_for_an_h100_without_spills():
    """Both kernels compiled for sm_90 at the default tile (bench/bias_gelu_sass.py): nothing on the stack, and the
    backward's registers leave an SM room for more than one block (at 32 rows at a time it held one)."""
    import sys

    from script_modules import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import bias_gelu_sass

    forward, backward = bias_gelu_sass.count(bg.TILE)
    assert forward["stack_bytes"] == backward["stack_bytes"] == 0
    assert backward["blocks_per_sm"] >= 2 and backward["per_element"] < 40, backward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [24405, 511])
def test_cuda_the_kernels_match_the_torch_path(monkeypatch, tokens):
    """BERT-large's FFN in bf16 (24,405 tokens: the H100 profile's batch), the kernels against the torch path."""
    h, b = (t.cuda() for t in inputs(tokens, 4096, torch.bfloat16, seed=7))
    grad = torch.randn(h.shape, device="cuda").to(torch.bfloat16)
    want_y = bg.bias_gelu_torch(h, b)
    want_dh, want_db = bg.bias_gelu_backward_torch(grad, h, b)
    refuse_torch_path_on_cuda(monkeypatch, bg, "bias_gelu_torch", "bias_gelu_backward_torch")
    y = OP(h, b)
    dh, db = torch.ops.bert.bias_gelu_backward(grad, h, b)
    torch.testing.assert_close(y, want_y, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dh, want_dh, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(db.float(), want_db.float(), rtol=1e-2, atol=5e-2)
