"""bert.model.triton_attention (`ATTENTION=triton`): attention of the tokens within their sequences, with dropout from
a Philox mask. References: a padded float64 attention through torch's softmax and autograd, given the op's mask; SDPA
per sequence without dropout; the mask's definition evaluated element by element; the binomial law; torch's
`gradcheck` and `opcheck`. The Triton kernels the GPU runs are checked against the torch path in Triton's interpreter
(fp32 and fp16: its bf16 `tl.dot` is wrong, found here), compiled for sm_90 (no register spills), and on a GPU."""


import pytest
import torch
import torch.nn.functional as F
from triton_checks import LOOP_BOUND_PATCH, needs_triton, refuse_torch_path_on_cuda, run_check

from bert.batch import SeqLayout
from bert.config import from_flat
from bert.model import triton_attention as ta
from bert.model.attention import check_attention, varlen_attention
from bert.model.compile_keys import configure_caches
from bert.model.philox import randint4x

OP = torch.ops.bert.triton_attention
SEED = torch.tensor(2**45 + 987)


def tokens(lengths, heads=2, dim=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, sum(lengths), heads, dim, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def packed(q, k, v):
    """The ops' (T, 3, H, D) input, from three (a copy; differentiable)."""
    return torch.stack((q, k, v), 1)


def cu_of(lengths):
    return SeqLayout.from_lengths(lengths).cu_seqlens


def reference(q, k, v, lengths, keep_of, p):
    """Padded float64 attention: (B, H, L, L) scores, padded keys filled with -inf, torch's softmax, then the mask
    `keep_of(b)` (H, n, n) for sequence b and 1 / (1 - p)."""
    batch, longest, (heads, dim) = len(lengths), max(lengths), q.shape[1:]
    padded = [torch.zeros(batch, longest, heads, dim, dtype=torch.float64) for _ in range(3)]
    start = 0
    for b, n in enumerate(lengths):
        for buf, t in zip(padded, (q, k, v)):
            buf[b, :n] = t[start:start + n].double()
        start += n
    qp, kp, vp = (t.transpose(1, 2) for t in padded)
    scores = qp @ kp.transpose(-1, -2) / dim**0.5
    real = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    probs = torch.softmax(scores.masked_fill(~real[:, None, None, :], float("-inf")), -1)
    if p > 0:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        for b, n in enumerate(lengths):
            keep[b, :, :n, :n] = keep_of(b)
        probs = probs * keep / (1 - p)
    out = (probs @ vp).transpose(1, 2)
    return torch.cat([out[b, :n] for b, n in enumerate(lengths)])


def op_mask(lengths, heads, p, seed=SEED):
    """The op's mask for sequence b, from `keep_mask`."""
    starts = [sum(lengths[:b]) for b in range(len(lengths))]
    groups = ta.groups_per_row(max(lengths))
    return lambda b: ta.keep_mask(seed, heads, sum(lengths), torch.arange(starts[b], starts[b] + lengths[b]),
                                  lengths[b], groups, p)


LENGTHS = [5, 1, 70, 33]


def test_the_mask_is_its_definition_element_by_element():
    """Counter (h * T + i) * G + j // 8, word (j mod 8) // 2 of Philox4x32-7 (FlashAttention-2's rounds), half j mod
    2, dropped below round(p * 2^16): evaluated one element at a time, at elements of every word and half."""
    assert ta.PHILOX_ROUNDS == 7
    heads, lengths, p = 3, [40, 77], 0.25
    keep = op_mask(lengths, heads, p)(1)  # the second sequence: its queries start at token 40
    groups, threshold, total = ta.groups_per_row(77), ta.drop_threshold(p), 117
    g = torch.Generator().manual_seed(1)
    for _ in range(64):
        h, i, j = (int(torch.randint(n, (), generator=g)) for n in (heads, 77, 77))
        counter = (h * total + 40 + i) * groups + j // 8
        word = randint4x(SEED, torch.tensor([counter]), 7)[(j % 8) // 2].item()
        assert keep[h, i, j].item() == ((word >> (16 * (j % 2))) & 0xFFFF >= threshold), (h, i, j)


def test_the_bits_hold_eight_elements_a_byte():
    keep = torch.rand(3, 5, 21) > 0.5
    bits = ta.pack_bits(keep, 3)
    assert bits.shape == (3, 5, 3) and torch.equal(ta.unpack_bits(bits, 21), keep)
    assert bits[0, 0, 0].item() == sum(int(keep[0, 0, s]) << s for s in range(8))
    assert (bits[..., 2] >> 5).eq(0).all()  # elements 21-23 do not exist: 0


def test_the_mask_drops_p_and_follows_the_seed():
    lengths, heads = [512, 300, 200], 4
    for p in (0.1, 0.5):
        drops = torch.cat([(~op_mask(lengths, heads, p)(b)).flatten() for b in range(3)]).double()
        n = drops.numel()
        assert abs(drops.mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert ta.drop_threshold(0.1) == 6554 and ta.drop_threshold(0.0) == 0
    a, b = op_mask(lengths, heads, 0.1)(0), op_mask(lengths, heads, 0.1, torch.tensor(5))(0)
    assert (a != b).double().mean().item() == pytest.approx(2 * 0.1 * 0.9, abs=0.01)  # independent masks
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ta.drop_threshold(1.0)


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_the_op_is_padded_attention_with_its_mask(p, dtype, tol):
    q, k, v = tokens(LENGTHS, dtype=dtype)
    out, lse, bits = OP(packed(q, k, v), cu_of(LENGTHS), max(LENGTHS), p, SEED if p else None)
    want = reference(q, k, v, LENGTHS, op_mask(LENGTHS, 2, p), p)
    assert bits.shape == ((2, sum(LENGTHS), 16) if p else (2, 0, 16)) and bits.dtype == torch.uint8
    start = 0
    for b, n in enumerate(LENGTHS):  # the bits the backward reads are the mask
        if p:
            assert torch.equal(ta.unpack_bits(bits[:, start:start + n], n), op_mask(LENGTHS, 2, p)(b))
        start += n
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    start, scores = 0, []
    for n in LENGTHS:  # the log-sum-exp in base 2, (H, T)
        s = torch.einsum("ihd,jhd->hij", q[start:start + n].double(), k[start:start + n].double()) / 4
        scores.append(torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64)))
        start += n
    torch.testing.assert_close(lse.double(), torch.cat(scores, 1), rtol=tol, atol=tol)


def test_without_dropout_it_is_sdpa_per_sequence_and_the_loop_backend():
    q, k, v = tokens(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    got = varlen_attention(q, k, v, seq, 0.0, "triton")
    start, parts = 0, []
    for n in LENGTHS:
        parts.append(F.scaled_dot_product_attention(*(t[start:start + n].transpose(0, 1) for t in (q, k, v)))
                     .transpose(0, 1))
        start += n
    torch.testing.assert_close(got, torch.cat(parts), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, varlen_attention(q, k, v, seq, 0.0, "loop"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_every_gradient_is_autograds_through_the_reference(p):
    q, k, v = (t.requires_grad_() for t in tokens(LENGTHS))
    grad = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(OP(packed(q, k, v), cu_of(LENGTHS), max(LENGTHS), p, SEED if p else None)[0], (q, k, v),
                              grad)
    want = torch.autograd.grad(reference(q, k, v, LENGTHS, op_mask(LENGTHS, 2, p), p), (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_and_opcheck():
    lengths = [3, 9, 1]
    qkv = packed(*tokens(lengths, dim=8)).requires_grad_()
    cu = cu_of(lengths)
    assert torch.autograd.gradcheck(lambda qkv: OP(qkv, cu, 9, 0.3, SEED)[0], (qkv,), fast_mode=True)
    torch.library.opcheck(OP, (qkv, cu, 9, 0.3, SEED))
    # without dropout (the bits' rows 0): the fake and the schema; AOT's dynamic-shape trace ran above (slow: ~10 s)
    torch.library.opcheck(OP, (qkv, cu, 9, 0.0, None),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_the_op_refuses_what_it_cannot_run():
    q, k, v = tokens(LENGTHS)
    with pytest.raises(ValueError, match="needs a seed"):
        OP(packed(q, k, v), cu_of(LENGTHS), 70, 0.1, None)
    for wrong in (q, torch.stack((q, k), 1)):  # three views, not two or none
        with pytest.raises(ValueError, match=r"\(T, 3, H, D\)"):
            OP(wrong, cu_of(LENGTHS), 70, 0.0, None)


def test_the_forward_kernel_refuses_counters_past_32_bits():
    """The kernel's counters c = (h T + i) G + j // 8 are 32-bit, rows up to 256 past the last token (a last query
    block's) included: a call whose counters would reach 2^31 is refused before anything is allocated (q a stride-0
    view: nothing of 2^25 + 1 tokens is made); one whose last is 2^31 - 1 is not."""
    ta.check_counters(16, 2**21 - 16, 64)
    with pytest.raises(ValueError, match="Philox counters below 2\\^31"):
        ta.check_counters(16, 2**21 - 15, 64)
    huge = torch.zeros(1, 1, 16, dtype=torch.bfloat16).expand(2**25 + 1, 1, 16)
    with pytest.raises(ValueError, match=r"1 heads x 33554433 tokens \(\+ 256\) x 64 mask bytes"):
        ta.launch_forward(huge, huge, huge, torch.tensor([0, 2**25 + 1], dtype=torch.int32), 512, 0.1, SEED)


def test_compiled_the_op_stays_one_node_each_way_and_matches_eager():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seq = SeqLayout.from_lengths(LENGTHS)
    q, k, v = (t.float().requires_grad_() for t in tokens(LENGTHS))
    seen = []

    def count(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if "triton_attention" in str(n.target))
        return make_boxed_func(gm.forward)

    def f(q, k, v):
        return varlen_attention(q, k, v, seq, 0.1, "triton")

    torch._dynamo.reset()
    torch.compile(f, backend=aot_autograd(fw_compiler=count, bw_compiler=count), fullgraph=True)(q, k, v).sum() \
        .backward()
    assert seen == ["bert.triton_attention.default", "bert.triton_attention_backward.default"]

    def grads(fn):  # the seed drawn by torch's generator as eager's (fallback_random): the same masks
        torch.manual_seed(5)
        return torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v))

    want = grads(f)
    torch._dynamo.reset()
    configure_caches()  # as the driver: the caches keyed on this module's source, so an edit misses them
    with torch._inductor.config.patch(fallback_random=True):
        got = grads(torch.compile(f))
    torch._dynamo.reset()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_model_on_it_is_the_model_on_the_loop_backend():
    """The layers hand the op their packed QKV (bert.model.attend) and take its packed gradient: without dropout, the
    loss and every gradient as on the loop backend (float64, the op's torch path)."""
    from bert.model import BertConfig, BertForPreTraining
    from bert.synthetic import random_batch

    cfg = BertConfig(vocab_size=1104, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    batch = random_batch((9, 30, 14), seed=4, vocab_size=1104)
    models = []
    for backend in ("triton", "loop"):
        torch.manual_seed(0)
        model = BertForPreTraining(cfg, attention=backend).double().eval()  # eval: no dropout
        model(batch).loss.backward()
        models.append(model)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_config_and_the_device_check_take_it(monkeypatch):
    assert from_flat(attention="triton").model.attention == "triton"
    check_attention("triton", torch.device("cpu"), "fp32")  # the torch path: any dtype on the CPU
    monkeypatch.setattr(ta, "triton", object())  # Triton present (the CPU wheel has none)
    check_attention("triton", torch.device("cuda"), "bf16")
    with pytest.raises(ValueError, match="ATTENTION=triton needs PRECISION=bf16"):
        check_attention("triton", torch.device("cuda"), "fp32")
    monkeypatch.setattr(ta, "triton", None)
    with pytest.raises(ValueError, match="ATTENTION=triton needs Triton on CUDA"):
        check_attention("triton", torch.device("cuda"), "bf16")


def test_build_model_refuses_a_head_dimension_its_kernels_lack(monkeypatch, tmp_path):
    """build_model's own check (the driver's, after run_and_time.sh's): on CUDA, with Triton, a model whose heads are
    48 wide stops before the model is made (no GPU here: the check comes first)."""
    import json

    from bert.config import ModelConfig
    from bert.train.build import build_model

    monkeypatch.setattr(ta, "triton", object())
    odd = tmp_path / "bert_config.json"
    odd.write_text(json.dumps({"vocab_size": 30528, "hidden_size": 96, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "intermediate_size": 384}))
    cfg = ModelConfig(bert_config_path=str(odd), attention="triton", precision="bf16")
    with pytest.raises(ValueError, match="ATTENTION=triton on CUDA takes a head dimension .* not 48"):
        build_model(cfg, torch.device("cuda"))


INTERPRETER = LOOP_BOUND_PATCH + """
import sys, torch
from bert.model import triton_attention as ta


def bits_differ(bits, want_bits, lengths):
    # the sequences whose own keys' bits differ, bit for bit (the rest is never read)
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    return [n for n, at in zip(lengths, starts)
            if not torch.equal(ta.unpack_bits(bits[:, at:at + n], n), ta.unpack_bits(want_bits[:, at:at + n], n))]


bad = []
# (lengths, heads, head dim, dtype, p, a shift of every score, max_seqlen above the longest by)
for lengths, heads, dim, dtype, p, shift, over in [([5, 70, 130], 2, 16, torch.float32, 0.1, 0, 0),
                                                   ([64, 1, 33], 3, 32, torch.float32, 0.3, 0, 0),
                                                   ([200, 129], 2, 64, torch.float16, 0.1, 0, 0),
                                                   ([20], 1, 16, torch.float16, 0.0, 0, 0),
                                                   ([40, 70], 1, 16, torch.float16, 0.1, 60, 0),
                                                   ([40, 70], 1, 16, torch.float32, 0.0, 100, 0),
                                                   ([3, 90, 17], 2, 16, torch.float32, 0.2, 0, 100)]:
    g = torch.Generator().manual_seed(len(lengths) + dim)
    qkv = torch.randn(sum(lengths), 3, heads, dim, generator=g)
    # a shift softmax does not see: every row's scores far below 0 (log-sum-exp near -86 or -144 in base 2), as a
    # padding sequence's may drift in training; a key past the end then has P = 2^-lse, unbounded
    qkv[:, 0, :, 0] += shift
    qkv[:, 1, :, 0] = -4.0 if shift else qkv[:, 1, :, 0]
    qkv = qkv.to(dtype)  # q, k, v as views of a fused QKV, as in the model
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    seed, longest = torch.tensor(123456789), max(lengths) + over
    out, lse, bits = ta.launch_forward(q, k, v, cu, longest, p, seed if p else None)
    want, want_lse, want_bits = ta.attention_torch(q, k, v, lengths, longest, p, seed)
    tol = (1e-5 if dtype == torch.float32 else 2e-3) * (1 + shift / 10)  # scores of -100 keep fewer bits
    case = (lengths, dim, str(dtype), p, shift, over)
    if not torch.allclose(out.float(), want.float(), rtol=tol, atol=tol):
        bad.append(case + ("out", (out.float() - want.float()).abs().max().item()))
    if not torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5):
        bad.append(case + ("lse",))
    if p:
        bad += [case + ("bits", n) for n in bits_differ(bits, want_bits, lengths)]
    # with dropout, key blocks whose mask is one 16-bit word a row, one, four and eight 32-bit words, some past the
    # row's bytes in a sequence's last block: the same output and bits
    for tile in [(16, 16, 4), (32, 32, 4), (16, 128, 4), (16, 256, 4)] if p and dim == 16 else []:
        out2, _, bits2 = ta.launch_forward(q, k, v, cu, longest, p, seed, tile)
        if not torch.allclose(out2.float(), want.float(), rtol=tol, atol=tol):
            bad.append(case + (tile, "out", (out2.float() - want.float()).abs().max().item()))
        bad += [case + (tile, "bits", n) for n in bits_differ(bits2, want_bits, lengths)]
    grad = torch.randn(q.shape, generator=g).to(dtype)
    wants = ta.backward_torch(grad, q, k, v, out, want_bits, lengths, p)
    # the backward's own tile, and with dropout tiles whose key blocks read the mask as 16 and 32 bits and two 64-bit
    # words a row, the second past the row's bytes in a sequence's last block
    for tile in [ta.BACKWARD_TILE] + ([(16, 16, 4), (32, 32, 4), (16, 128, 4)] if p and dim == 16 else []):
        got = ta.launch_backward(grad, q, k, v, out, lse, bits, cu, longest, p, tile, tile)
        if got.shape != qkv.shape:  # the packed gradient, written in place by both kernels
            bad.append(case + (tile, "packed", tuple(got.shape)))
        for name, a, b in zip(("dq", "dk", "dv"), got.unbind(1), wants):
            if not torch.isfinite(a.float()).all() or not torch.allclose(a.float(), b.float(), rtol=tol,
                                                                         atol=tol * (1 + b.float().abs().max().item())):
                bad.append(case + (tile, name, (a.float() - b.float()).abs().max().item()))
# bits the backward cannot read as aligned words (a byte off; a row of 9 bytes, the old G for 70 keys) are refused
for wrong in (torch.empty(bits.numel() + 1, dtype=torch.uint8)[1:].view(bits.shape), bits[..., :9]):
    try:
        ta.launch_backward(grad, q, k, v, out, lse, wrong, cu, longest, p)
        bad.append(("misread bits accepted", tuple(wrong.shape)))
    except ValueError as e:
        assert "8-byte boundary" in str(e), e
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_triton_kernels_match_the_torch_path_in_the_interpreter():
    """The three CUDA kernels in Triton's interpreter against the torch path with the same seed: sequences of 1 and of
    lengths cut inside a tile, several query and key blocks, q, k, v as strided views of one fused QKV, dropout on and
    off, head dimensions 16-64, max_seqlen above the longest sequence, every score shifted far below 0 (dQ came out NaN
    so: a key past the end, with P = 2^-lse, times its zero K row); fp32 and fp16 (the interpreter's bf16 products
    are wrong). Every gradient finite."""
    run_check(INTERPRETER, timeout=600, interpret=True)


SM90 = """
import sys
sys.path.insert(0, "bench")
import attention_sass
from bert.model import triton_attention as ta

bad, seen = [], []
for dtype in ("bf16", "fp16"):
    for kernel, tile, signature in attention_sass.signatures(ta, dtype):
        for dim in (64, 128):
            for dropout in (True, False):
                case = (kernel.fn.__name__, dtype, dim, dropout)
                try:
                    row = attention_sass.count(kernel, tile, signature, dropout, dim)
                except Exception as e:
                    bad.append(case + (repr(e)[:300],))
                    continue
                seen.append(case + (row["stack_bytes"], row["loop_local"], row["hgmma"]))
                # BERT's heads: nothing spilled in the loop, at most 8 bytes kept for after it; Hopper's MMA in every
                # kernel's loop
                if (dim == 64 and (row["loop_local"] or row["stack_bytes"] > 8)) or not row["hgmma"]:
                    bad.append(case + (row,))
print("seen", seen)
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@needs_triton
def test_the_kernels_compile_for_an_h100_without_spills():
    """The three kernels compiled for sm_90 with Triton's ptxas (no GPU needed), bf16 and fp16, head dimensions 64 and
    128, dropout on and off: each uses Hopper's warpgroup MMA, and at BERT's 64 none spills a register inside its loop
    and at most 8 bytes a thread in all (cuobjdump's resource usage; the forward with 4 warps spilled 240 bytes a
    thread, with 64-bit pointers a tile 1,328; dK dV with dropout keeps one value for its epilogue there, a store and
    a load a program)."""
    run_check(SM90, timeout=900)


TORCH_PATHS = (ta.attention_torch, ta.backward_torch)


@pytest.fixture
def kernels_only(monkeypatch):
    """The torch path refused on CUDA: a CUDA test that passes ran the Triton kernels."""
    refuse_torch_path_on_cuda(monkeypatch, ta, "attention_torch", "backward_torch")


def step_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Phase-2-like lengths (at most 512) summing to `tokens`."""
    g, lengths = torch.Generator().manual_seed(seed), []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(20, 513, (), generator=g)), tokens - sum(lengths)))
    return lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens_in_step,p", [(24576, 0.1), (3001, 0.0)])
def test_cuda_the_kernels_match_the_torch_path(tokens_in_step, p, kernels_only):
    """On the GPU, BERT-large's heads at a step's token count: bf16 outputs and gradients within bf16's rounding of the
    torch path's in fp32 with the same seed (so the same mask)."""
    lengths = step_lengths(tokens_in_step)
    q, k, v = (t.cuda() for t in tokens(lengths, heads=16, dim=64, dtype=torch.bfloat16))
    cu, longest, seed = cu_of(lengths).cuda(), max(lengths), SEED.cuda()
    out, lse, bits = OP(packed(q, k, v), cu, longest, p, seed if p else None)
    want, want_lse, want_bits = TORCH_PATHS[0](*(t.cpu().float() for t in (q, k, v)), lengths, longest, p, SEED)
    torch.testing.assert_close(out.cpu().float(), want, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-3, atol=1e-3)
    start = 0
    for n in lengths:  # the same mask, bit for bit
        assert not p or torch.equal(ta.unpack_bits(bits[:, start:start + n].cpu(), n),
                                    ta.unpack_bits(want_bits[:, start:start + n], n))
        start += n
    grad = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    got = torch.ops.bert.triton_attention_backward(grad, packed(q, k, v), out, lse, bits, cu, longest, p).unbind(1)
    wants = TORCH_PATHS[1](*(t.cpu().float() for t in (grad, q, k, v, out)), want_bits, lengths, p)
    for a, b in zip(got, wants):
        torch.testing.assert_close(a.cpu().float(), b, rtol=2**-6, atol=2**-6 * (1 + b.abs().max().item()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_without_dropout_it_is_flash_attention(kernels_only):
    """Against torch's FlashAttention-2 (the `varlen` backend) on views of a fused QKV, forward and gradients."""
    lengths = step_lengths(8192, seed=1)
    qkv = torch.randn(sum(lengths), 3, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seq = SeqLayout.from_lengths(lengths, device="cuda")
    outs = [varlen_attention(*qkv.unbind(1), seq, 0.0, name) for name in ("triton", "varlen")]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2**-7, atol=2**-7)
    grad = torch.randn_like(outs[0])
    got, want = (torch.autograd.grad(o, qkv, grad)[0].float() for o in outs)
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6 * (1 + want.abs().max().item()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_graph_replays_it_with_a_fresh_mask(kernels_only):
    """Captured in a CUDA graph with the seed drawn inside it (torch's generator is graph-safe), each replay draws a
    new mask."""
    lengths = [512, 300, 77]
    q, k, v = (t.cuda() for t in tokens(lengths, heads=16, dim=64, dtype=torch.bfloat16))
    attend = ta.triton_varlen(SeqLayout.from_lengths(lengths, device="cuda"))
    qkv = packed(q, k, v)
    attend(qkv, 0.1)  # warm: the kernel compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(qkv, 0.1)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out) and torch.isfinite(out.float()).all()
