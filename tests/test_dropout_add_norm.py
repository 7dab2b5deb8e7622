"""bert.model.dropout_add_norm: `bert::dropout_add_layer_norm` is LayerNorm(dropout(h + b) + residual) and its
gradients, with the mask Philox draws. References: the same chain in float64 through torch's modules and autograd,
given the op's mask; torch's `gradcheck` and `opcheck`; the binomial law for the mask; the unfused model
(RESIDUAL_NORM=torch) for the swapped one. The Triton kernels the GPU runs are checked against the CPU path in
Triton's interpreter (bit for bit on the mask) and, where there is one, on a GPU."""


import pytest
import torch
from torch import nn
from triton_checks import needs_triton, refuse_torch_path_on_cuda, run_check

from bert.config import from_flat
from bert.model import BertConfig, BertForPreTraining
from bert.model import dropout_add_norm as dan
from bert.model.compile_keys import configure_caches
from bert.model.dropout_add_norm import (
    FusedResidualOutput,
    apply_residual_norm,
    bytes_per_row,
    check_residual_norm,
    drop_threshold,
    dropout_add_layer_norm,
    keep_mask,
    pack_bits,
    unpack_bits,
)
from bert.model.layers import BertResidualOutput
from bert.model.philox import philox4x32
from bert.synthetic import random_batch
from bert.train.build import build_model

OP = torch.ops.bert.dropout_add_layer_norm


def inputs(rows: int, n: int, dtype=torch.float64, residual_dtype=None, seed: int = 0):
    """h, residual, gamma (not 1), beta, dense bias: every term matters."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, n, generator=g, dtype=torch.float64).to(dtype)
    residual = torch.randn(rows, n, generator=g, dtype=torch.float64).to(residual_dtype or dtype)
    gamma = (1 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    beta, bias = (0.3 * torch.randn(2, n, generator=g, dtype=torch.float64)).to(dtype)
    return h, residual, gamma, beta, bias


def reference(h, residual, gamma, beta, bias, keep, p, eps=1e-12):
    """The chain in float64 through torch's own LayerNorm, the op's mask given."""
    x = h.double() + (0 if bias is None else bias.double())
    x = torch.where(keep, x / (1 - p), 0.0) if p else x
    return nn.functional.layer_norm(x + residual.double(), (h.shape[-1],), gamma.double(), beta.double(), eps)


SEED = torch.tensor(2**40 + 321)


@pytest.mark.parametrize("dtype,residual_dtype,tol", [(torch.float64, None, 1e-12), (torch.float32, None, 2e-6),
                                                      (torch.bfloat16, None, 3e-2),
                                                      (torch.bfloat16, torch.float32, 2e-6)])
@pytest.mark.parametrize("p,with_bias", [(0.1, True), (0.0, True), (0.5, False)])
def test_the_forward_is_the_chain_with_the_ops_mask(dtype, residual_dtype, tol, p, with_bias):
    h, residual, gamma, beta, bias = inputs(45, 96, dtype, residual_dtype)
    bias = bias if with_bias else None
    y, s, bits, mean, rstd = OP(h, residual, gamma, beta, bias, SEED if p else None, p, 1e-12)
    keep = keep_mask(SEED, 45, 96, p) if p else torch.ones(45, 96, dtype=torch.bool)
    assert y.dtype == s.dtype == torch.promote_types(dtype, residual_dtype or dtype)
    assert bits.shape == ((45 if p else 0), bytes_per_row(96)) and bits.dtype == torch.uint8
    if p:
        assert torch.equal(unpack_bits(bits, 96), keep)
    torch.testing.assert_close(y.double(), reference(h, residual, gamma, beta, bias, keep, p), rtol=0, atol=tol)
    x = torch.where(keep, (h.double() + (0 if bias is None else bias.double())) / (1 - p), 0.0) + residual.double()
    torch.testing.assert_close(s.double(), x, rtol=tol, atol=tol)  # the saved sum, in y's dtype
    torch.testing.assert_close(mean.double(), x.mean(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(rstd.double(), x.var(-1, unbiased=False).add(1e-12).rsqrt(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("p,with_bias", [(0.1, True), (0.0, False), (0.3, False)])
def test_every_gradient_is_autograds_through_the_chain(p, with_bias):
    h, residual, gamma, beta, bias = (t.requires_grad_() for t in inputs(37, 64))
    bias = bias if with_bias else None
    y = OP(h, residual, gamma, beta, bias, SEED if p else None, p, 1e-12)[0]
    keep = keep_mask(SEED, 37, 64, p) if p else torch.ones(37, 64, dtype=torch.bool)
    want = reference(h, residual, gamma, beta, bias, keep, p)
    dy = torch.randn(37, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = [t for t in (h, residual, gamma, beta, bias) if t is not None]
    got_grads = torch.autograd.grad(y, leaves, dy)
    want_grads = torch.autograd.grad(want, leaves, dy)
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_each_gradient_has_its_inputs_dtype():
    """Under autocast h is bf16 and the residual fp32; with master weights the LayerNorm's parameters are bf16 and
    the kernel's column sums fp32."""
    h, residual, gamma, beta, bias = inputs(8, 16, torch.bfloat16, torch.float32)
    leaves = [t.requires_grad_() for t in (h, residual, gamma, beta, bias.float())]
    y = OP(*leaves, SEED, 0.1, 1e-12)[0]
    assert y.dtype == torch.float32
    assert [g.dtype for g in torch.autograd.grad(y.sum(), leaves)] == [t.dtype for t in leaves]


def test_gradcheck_and_opcheck():
    h, residual, gamma, beta, bias = inputs(9, 24)
    torch.autograd.gradcheck(lambda *t: OP(*t, SEED, 0.2, 1e-5)[0],
                             tuple(t.clone().requires_grad_() for t in (h, residual, gamma, beta, bias)))
    for args in [(h, residual, gamma, beta, bias, SEED, 0.2, 1e-5), (h, residual, gamma, beta, None, None, 0.0, 1e-5),
                 tuple(t.float() if t.is_floating_point() else t for t in (h, residual, gamma, beta, bias, SEED))
                 + (0.1, 1e-12)]:
        torch.library.opcheck(OP.default, args)
    y, s, bits, mean, rstd = OP(h, residual, gamma, beta, bias, SEED, 0.2, 1e-5)
    torch.library.opcheck(torch.ops.bert.dropout_add_layer_norm_backward.default,
                          (torch.randn_like(y), s, bits, mean, rstd, gamma, 0.2, torch.float32))


def test_the_mask_drops_p_of_the_elements_and_follows_the_seed():
    rows, n, p = 300, 1024, 0.1
    keep = keep_mask(SEED, rows, n, p)
    dropped = (~keep).sum().item()
    sd = (rows * n * p * (1 - p)) ** 0.5
    assert abs(dropped - rows * n * p) < 5 * sd  # binomial, 5 standard deviations
    assert torch.equal(keep, keep_mask(SEED.clone(), rows, n, p))
    other = keep_mask(SEED + 1, rows, n, p)
    assert abs((keep != other).float().mean().item() - 2 * p * (1 - p)) < 0.01  # independent masks differ so often
    for column in (0, 1, 2, 3, 1023):  # each of the four words of a counter drops about p of its column
        assert abs((~keep[:, column]).float().mean().item() - p) < 5 * (p * (1 - p) / rows) ** 0.5
    assert drop_threshold(0.1) == 429496730 and drop_threshold(0.0) == 0
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="not in"):
            drop_threshold(bad)


def test_the_mask_is_its_definition():
    """The module doc's words, one element at a time: element j of row t is kept iff word j % 4 of Philox4x32-10
    at counter 2 V t + j // 4 is at or above the threshold."""
    rows, n, p = 3, 100, 0.3
    keep, v, threshold = keep_mask(SEED, rows, n, p), bytes_per_row(n), drop_threshold(p)
    key = (SEED & 0xFFFFFFFF, SEED >> 32)
    for t in range(rows):
        for j in range(n):
            counter = torch.tensor(2 * v * t + j // 4)
            words = philox4x32((counter, torch.tensor(0), torch.tensor(0), torch.tensor(0)), key)
            assert bool(keep[t, j]) == (int(words[j % 4]) >= threshold), (t, j)


def test_the_bits_hold_eight_elements_a_byte():
    assert [bytes_per_row(n) for n in (1, 8, 9, 96, 128, 384, 1024)] == [1, 1, 2, 16, 16, 64, 128]
    keep = torch.rand(7, 100, generator=torch.Generator().manual_seed(3)) > 0.5
    bits = pack_bits(keep)
    assert bits.shape == (7, 16) and torch.equal(unpack_bits(bits, 100), keep)
    assert bits[0, 0].item() == sum(int(keep[0, k]) << k for k in range(8))
    assert bits[0, 12].item() == sum(int(keep[0, 96 + k]) << k for k in range(4))  # the row's last four elements


def test_dropout_needs_a_seed_and_one_shape():
    h, residual, gamma, beta, bias = inputs(4, 8)
    with pytest.raises(ValueError, match="needs a seed"):
        OP(h, residual, gamma, beta, bias, None, 0.1, 1e-12)
    with pytest.raises(ValueError, match="must be the same"):
        OP(h, residual[:3], gamma, beta, bias, SEED, 0.1, 1e-12)


def model_pair(dropout: float) -> tuple[BertForPreTraining, BertForPreTraining]:
    cfg = BertConfig(vocab_size=1064, real_vocab_size=1061, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=80).with_dropout(dropout)
    torch.manual_seed(0)
    plain = BertForPreTraining(cfg, attention="loop").double()
    fused = BertForPreTraining(cfg, attention="loop").double()
    fused.load_state_dict(plain.state_dict())
    assert len(apply_residual_norm(fused, "fused")) == 4  # two a layer
    return plain, fused


def test_the_swapped_model_keeps_its_names_and_trains_as_the_unfused_one():
    """Dropout 0 (the masks are the op's own, tested above): loss and every gradient equal the unfused model's,
    padded forward included."""
    plain, fused = model_pair(0.0)
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert isinstance(fused.bert.encoder.layer[1].attention.output, FusedResidualOutput)
    batch = random_batch((5, 17, 30), seed=4, vocab_size=1061)
    for forward in ("forward", "forward_padded"):
        losses = [getattr(m, forward)(batch).loss for m in (plain, fused)]
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-12)
        grads = [torch.autograd.grad(loss, list(m.parameters())) for loss, m in zip(losses, (plain, fused))]
        for (name, _), a, b in zip(plain.named_parameters(), *grads):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=name)


def test_the_swapped_model_drops_in_training_only():
    _, fused = model_pair(0.1)
    batch = random_batch((5, 17, 30), seed=4, vocab_size=1061)
    fused.eval()
    assert torch.equal(fused(batch).loss, fused(batch).loss)
    fused.train()
    torch.manual_seed(1)
    first = fused(batch).loss
    torch.manual_seed(1)
    assert torch.equal(first, fused(batch).loss)  # the seed is torch's generator's: a rank's seed fixes its masks
    assert not torch.equal(first, fused(batch).loss)


def test_a_float8_dense_keeps_its_bias_and_the_kernel_adds_none():
    from bert.model.fp8_delayed import DelayedFloat8Linear

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64).with_dropout(0.0)
    plain = BertResidualOutput(cfg, 64)
    fused = FusedResidualOutput.from_module(BertResidualOutput(cfg, 64))
    fused.load_state_dict(plain.state_dict())
    h, residual = torch.randn(16, 64), torch.randn(16, 32)
    want = plain(h, residual)
    fused.dense = DelayedFloat8Linear.from_linear(fused.dense)
    plain.dense = DelayedFloat8Linear.from_linear(plain.dense)
    torch.testing.assert_close(fused(h, residual), plain(h, residual), rtol=0, atol=1e-6)
    assert not torch.allclose(fused(h, residual), want)  # float8 did change it: the path was taken


def test_the_config_selects_it():
    """(A typo is refused with the other selectors', tests/test_config.py.)"""
    model_cfg = lambda **kw: from_flat(bert_config_path="tiny", **kw).model  # noqa: E731
    assert model_cfg().residual_norm == "torch"
    model = build_model(model_cfg(residual_norm="fused"), torch.device("cpu"))
    assert sum(isinstance(m, FusedResidualOutput) for m in model.modules()) == 4
    assert not any(isinstance(m, FusedResidualOutput) for m in build_model(model_cfg(), torch.device("cpu")).modules())


def test_fused_on_a_gpu_without_triton_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(dan, "triton", None)
    with pytest.raises(ValueError, match="RESIDUAL_NORM=fused needs Triton"):
        check_residual_norm("fused", torch.device("cuda"))
    check_residual_norm("fused", torch.device("cpu"))
    check_residual_norm("torch", torch.device("cuda"))


def test_compiled_the_op_stays_one_node_each_way_and_matches_eager():
    """Dynamo and AOT autograd trace it as an opaque node, forward and backward (inductor cannot re-fuse it), with
    no graph break; compiled by inductor with dropout on, every gradient equals eager's for the same generator state
    (the seed is the one random number, drawn in the graph)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64).with_dropout(0.1)
    layer = FusedResidualOutput.from_module(BertResidualOutput(cfg, 64))
    h, residual = torch.randn(16, 64, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    seen = []

    def count(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if "dropout_add_layer_norm" in str(n.target))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=count, bw_compiler=count), fullgraph=True)
    compiled(h, residual).sum().backward()
    assert seen == ["bert.dropout_add_layer_norm.default", "bert.dropout_add_layer_norm_backward.default"]
    # inductor, dropout on: its seed drawn by torch's generator as eager's (fallback_random), so the masks match
    def grads(fn):
        torch.manual_seed(5)
        return torch.autograd.grad(fn(h, residual).square().sum(), (h, residual, *layer.parameters()))

    want = grads(layer)
    torch._dynamo.reset()
    configure_caches()  # as the driver: the caches keyed on the op's source, so an edit of its module misses them
    with torch._inductor.config.patch(fallback_random=True):
        got = grads(torch.compile(layer))
    torch._dynamo.reset()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.manual_seed(6)  # another seed, another mask: the equality above is the masks', not dropout's absence
    assert not torch.equal(torch.autograd.grad(layer(h, residual).square().sum(), h)[0], want[0])


KERNELS = """
import sys, torch
import triton, triton.language as tl
from bert.model import dropout_add_norm as dan
from bert.model.philox import randint4x

@triton.jit
def words(seed, out, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    a, b, c, d = tl.randint4x(tl.load(seed), i.to(tl.int64) + (1 << 33))
    for k, w in enumerate((a, b, c, d)):
        tl.store(out + k * BLOCK + i, w.to(tl.int64))

seed = torch.tensor(2**61 + 12345)
out = torch.zeros(256, dtype=torch.int64)
words[(1,)](seed, out, BLOCK=64)
bad = [] if torch.equal(out, torch.cat(randint4x(seed, torch.arange(64) + (1 << 33)))) else ["philox"]
ulp = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}  # an output's rounding, and the fp32 sums' order
for rows, n, dtype, residual_dtype, p, with_bias in [(45, 96, torch.float32, torch.float32, 0.1, True),
                                                      (33, 128, torch.bfloat16, torch.bfloat16, 0.3, True),
                                                      (40, 100, torch.bfloat16, torch.float32, 0.0, False),
                                                      (21, 99, torch.float32, torch.float32, 0.2, False),
                                                      (70, 1024, torch.bfloat16, torch.bfloat16, 0.1, True)]:
    g = torch.Generator().manual_seed(rows)
    h, r = torch.randn(rows, n, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(residual_dtype)
    gamma, beta = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype), (0.3 * torch.randn(n, generator=g)).to(dtype)
    bias = (0.3 * torch.randn(n, generator=g)).to(dtype) if with_bias else None
    seed = torch.tensor(987654321) if p else None
    kernel, torch_ops = dan._outputs(h, r, p), dan._outputs(h, r, p)
    dan.launch_forward(h, r, gamma, beta, bias, seed, p, 1e-12, kernel)
    dan.forward_torch(h, r, gamma, beta, bias, seed, p, 1e-12, torch_ops)
    case = (rows, n, str(dtype), p)
    if not torch.equal(kernel[2], torch_ops[2]):
        bad.append(case + ("bits",))
    for name, a, b in zip(("y", "s", "mean", "rstd"), (kernel[0], kernel[1], *kernel[3:]),
                          (torch_ops[0], torch_ops[1], *torch_ops[3:])):
        if not torch.allclose(a.double(), b.double(), rtol=ulp[a.dtype], atol=ulp[a.dtype]):
            bad.append(case + (name,))
    dy = torch.randn(rows, n, generator=g).to(kernel[0].dtype)
    grads = [dan._grads(dy, kernel[1], kernel[3], h.dtype) for _ in range(2)]
    dan.launch_backward(dy, kernel[1], kernel[2], kernel[3], kernel[4], gamma, p, grads[0])
    dan.backward_torch(dy, kernel[1], kernel[2], kernel[3], kernel[4], gamma, p, grads[1])
    for name, a, b in zip(("dh", "ds", "sums"), *grads):
        if not torch.allclose(a.double(), b.double(), rtol=2 * ulp[a.dtype], atol=2 * ulp[a.dtype]):
            bad.append(case + (name, (a.double() - b.double()).abs().max().item()))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_triton_kernels_match_the_cpu_path_in_the_interpreter():
    """The CUDA path's two kernels, run by Triton's interpreter: Triton's own Philox words equal bert.model.philox's,
    the mask's bits equal the CPU path's bit for bit (a row not a multiple of eight, its last byte cut, p = 0, mixed
    dtypes, BERT-large's width) and every output is within a rounding of the output dtype (the backward's in several
    programs of ROWS rows, the last one cut)."""
    run_check(KERNELS, timeout=300, interpret=True)


SM90 = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bert.model import dropout_add_norm as dan

def compile(kernel, signature, constants, v):
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=dan._warps(v)))

bad = []
for dtype, residual_dtype in [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp16")]:
    out = "fp32" if "fp32" in (dtype, residual_dtype) else dtype
    for v in (1, 16, 128):
        for dropout, dense_bias, threshold in [(True, True, "i32"), (True, False, "i64"), (False, False, "i32")]:
            float8 = dropout and not dense_bias  # bert.model.fp8_residual_norm's float8 output: its bias in the GEMM
            signature = dict(h=f"*{dtype}", res=f"*{residual_dtype}", gamma=f"*{dtype}", beta=f"*{dtype}",
                             dense_bias=f"*{dtype}", seed="*i64", y=f"*{out}", s=f"*{out}", bits="*u8",
                             mean_out="*fp32", rstd_out="*fp32", yq="*fp8e4nv" if float8 else f"*{out}",
                             cast_scale="*fp32", amaxes="*fp32", y2=f"*{out}",
                             yqt="*fp8e4nv" if float8 else f"*{out}", rows="i32", n="i32", threshold=threshold,
                             scale="fp32", eps="fp32", V="constexpr", ROWS="constexpr", DROPOUT="constexpr",
                             DENSE_BIAS="constexpr", FLOAT8="constexpr", TWICE="constexpr", TRANSPOSE="constexpr",
                             SUM="constexpr")
            # TWICE and TRANSPOSE with FLOAT8: the float8 FFN's close, which writes the layer's output twice and its
            # e4m3 copy transposed, ROWS rows a program
            handing = float8 and v == 128
            try:
                compile(dan._forward_rows, signature, dict(V=v, ROWS=dan.ROWS if handing else 1, DROPOUT=dropout,
                                                           DENSE_BIAS=dense_bias, FLOAT8=float8, TWICE=handing,
                                                           TRANSPOSE=handing, SUM=v != 16), v)
            except Exception as e:
                bad.append(("forward", dtype, residual_dtype, v, dropout, repr(e)[:300]))
        for dropout in (True, False):
            signature = dict(dy=f"*{out}", dy2=f"*{out}", s=f"*{out}", bits="*u8", mean_in="*fp32",
                             rstd_in="*fp32", gamma=f"*{dtype}", beta=f"*{dtype}", dh=f"*{dtype}", ds=f"*{out}",
                             sums="*fp32", cast_scale="*fp32", amaxes="*fp32", dht=f"*{dtype}", rows="i32", n="i32",
                             scale="fp32", V="constexpr", ROWS="constexpr", DROPOUT="constexpr", FLOAT8="constexpr",
                             ROUND="constexpr", SECOND="constexpr", TRANSPOSE="constexpr", FROM_Y="constexpr")
            try:  # x_hat from y (RESIDUAL_NORM=fused-lean) with dropout, from s without
                compile(dan._backward_rows, signature, dict(V=v, ROWS=dan.ROWS, DROPOUT=dropout, FLOAT8=False,
                                                            ROUND=dan.TRITON_DTYPES[torch.float32], SECOND=False,
                                                            TRANSPOSE=False, FROM_Y=dropout), v)
            except Exception as e:
                bad.append(("backward", dtype, residual_dtype, v, dropout, repr(e)[:300]))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_kernels_compile_for_an_h100():
    """The interpreter runs what a GPU compile may refuse (a loop-carried sum changing dtype, found so in review):
    both kernels compiled for sm_90 with Triton's own ptxas, no GPU needed, for each dtype mix the driver meets
    (bf16 masters, fp32, autocast's bf16 h with an fp32 residual, fp16), a threshold typed i32 or i64 (p above 1/2),
    and rows of 4, 128 and 1,024 elements."""
    run_check(SM90, timeout=600)


@pytest.fixture
def kernels_only(monkeypatch):
    """The torch path refused on CUDA: a CUDA test that passes ran the Triton kernels."""
    refuse_torch_path_on_cuda(monkeypatch, dan, "forward_torch", "backward_torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,n", [(24576, 1024), (3001, 1024), (77, 384)])
def test_cuda_the_kernels_match_the_cpu_path(rows, n, kernels_only):
    """On the GPU at the step's shape (a batch's tokens by BERT-large's width) and at cut ones: the same mask as the
    CPU's for the same seed, bit for bit; outputs and gradients within bf16's rounding."""
    h, residual, gamma, beta, bias = inputs(rows, n, torch.bfloat16)
    args = (h, residual, gamma, beta, bias)
    cuda = [t.cuda().requires_grad_() for t in args]
    cpu = [t.clone().requires_grad_() for t in args]
    outs = [OP(*ts, SEED.to(ts[0].device), 0.1, 1e-12) for ts in (cuda, cpu)]
    assert torch.equal(outs[0][2].cpu(), outs[1][2])
    torch.testing.assert_close(outs[0][0].cpu().float(), outs[1][0].float(), rtol=0, atol=2**-6)
    dy = torch.randn(rows, n, dtype=torch.bfloat16)
    for got, want in zip(torch.autograd.grad(outs[0][0], cuda, dy.cuda()), torch.autograd.grad(outs[1][0], cpu, dy)):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=2**-5 * (1 + want.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_graph_replays_it_with_a_fresh_mask(kernels_only):
    """Captured in a CUDA graph with the seed drawn inside it (torch's generator is graph-safe), each replay draws a
    new mask."""
    h, residual, gamma, beta, bias = (t.cuda() for t in inputs(256, 1024, torch.bfloat16))
    norm = nn.LayerNorm(1024, eps=1e-12).cuda().to(torch.bfloat16)
    dropout_add_layer_norm(h, residual, norm, 0.1, bias)  # warm: the kernel compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = dropout_add_layer_norm(h, residual, norm, 0.1, bias)
    graph.replay()
    first = y.clone()
    graph.replay()
    assert not torch.equal(first, y) and torch.isfinite(y.float()).all()
