"""Every attention backend against a float64 softmax reference with a block-diagonal mask."""

import math

import pytest
import torch

from bert.batch import SeqLayout
from bert.model.attention import BACKENDS, length_groups, resolve_backend, varlen_attention
from bert.model.cudnn_varlen import backward_is_fixed

LENGTHS = (5, 1, 130, 512, 300, 12, 257, 128)  # every length group, both extremes
CPU_BACKENDS = ("loop", "grouped", "padded")
# torch before 2.14: cuDNN's ragged backward writes past its buffers (bert.model.cudnn_varlen.MIN_TORCH); on a GPU it
# would poison the process's CUDA context for every later test
CUDNN = pytest.param("cudnn", marks=pytest.mark.skipif(not backward_is_fixed(), reason="cuDNN ragged backward of torch "
                                                        "< 2.14 (pytorch#186142)"))


def reference_attention(q, k, v, lengths):
    """softmax(q k^T / sqrt(d)) v over all T tokens, with cross-sequence scores masked out (the mask is
    built on q's device: masked_fill wants both on one)."""
    seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                     torch.tensor(lengths, device=q.device), output_size=sum(lengths))
    same = seq_id[:, None] == seq_id[None, :]  # (T, T)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~same, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def random_qkv(lengths, heads=2, head_dim=8, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    shape = (sum(lengths), heads, head_dim)
    return [torch.randn(shape, generator=gen, dtype=dtype).to(device).requires_grad_() for _ in range(3)]


def grads(out, inputs, seed=1):
    # drawn in float64 whatever out's dtype: torch's CPU sampler draws other numbers for bf16 than for float64,
    # and a bf16 output must get the same cotangent as its float64 reference
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    weight = weight.to(out.device, out.dtype)
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_matches_reference_forward_and_grads(backend):
    q, k, v = random_qkv(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    want = reference_attention(q, k, v, LENGTHS)
    got = varlen_attention(q, k, v, seq, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_dropout_is_applied(backend):
    lengths = (40, 7, 200)
    q, k, v = random_qkv(lengths)
    seq = SeqLayout.from_lengths(lengths)
    exact = varlen_attention(q, k, v, seq, dropout_p=0.0, backend=backend)
    dropped = varlen_attention(q, k, v, seq, dropout_p=0.5, backend=backend)
    changed = (dropped - exact).abs().amax(dim=(1, 2)) > 1e-6
    assert changed.float().mean() > 0.9  # nearly every token sees some dropped probabilities


def test_length_groups_follow_the_paper_edges():
    lengths = [128, 129, 256, 257, 384, 385, 512, 1, 600]
    assert length_groups(lengths) == [[0, 7], [1, 2], [3, 4], [5, 6, 8]]
    assert length_groups([300, 310]) == [[0, 1]]  # empty groups are skipped


def test_backend_names():
    assert resolve_backend("auto", "cpu") == "loop"
    assert resolve_backend("auto", "cuda") == "varlen"
    with pytest.raises(ValueError, match="nope"):
        resolve_backend("nope")
    for cuda_only in ("varlen", "cudnn"):
        with pytest.raises(ValueError, match=f"'{cuda_only}' needs the batch on a CUDA device"):
            BACKENDS[cuda_only](SeqLayout.from_lengths([3, 4]))


def test_reference_runs_on_the_device_of_its_inputs():
    """On the CPU, the meta device stands in for CUDA: a mask left on the CPU fails here as it did on a GPU
    ("expected self and mask to be on the same device")."""
    q = torch.empty(sum(LENGTHS), 2, 8, device="meta")
    assert reference_attention(q, q, q, LENGTHS).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ("varlen", CUDNN, "grouped"))
def test_cuda_backends_match_reference_in_bf16(backend):
    q, k, v = random_qkv(LENGTHS, heads=4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    seq = SeqLayout.from_lengths(LENGTHS, device="cuda")
    want = reference_attention(*(t.double() for t in (q, k, v)), LENGTHS)
    got = varlen_attention(q, k, v, seq, backend=backend)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)
    for g, w in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        torch.testing.assert_close(g.double(), w.double(), rtol=0, atol=5e-2)
    dropped = varlen_attention(q, k, v, seq, dropout_p=0.5, backend=backend)
    assert (dropped - got).abs().max() > 1e-2
    grads(dropped, (q, k, v))  # the dropout path has a backward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_path_takes_strided_views_of_the_fused_qkv():
    """The training path (FlashVarlenDropout, the aten flash kernels with a dropout argument) on q, k, v as the
    model hands them over: views of one (T, 3, H, D) QKV output, rows 3 x H x D apart. At dropout 0 it must equal
    the reference, gradients into the fused tensor included."""
    from bert.model.cuda_varlen import FlashVarlenDropout

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(LENGTHS), 3, 4, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous() and q.stride(-1) == 1
    seq = SeqLayout.from_lengths(LENGTHS, device="cuda")
    got = FlashVarlenDropout.apply(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.0)
    ref_qkv = qkv.detach().double().requires_grad_()
    want = reference_attention(*ref_qkv.unbind(1), LENGTHS)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)
    (g,), (w,) = grads(got, (qkv,)), grads(want, (ref_qkv,))
    torch.testing.assert_close(g.double(), w, rtol=0, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not backward_is_fixed(), reason="cuDNN ragged backward of torch < 2.14 (pytorch#186142)")
def test_cuda_cudnn_takes_strided_views_of_the_fused_qkv():
    """cuDNN's ragged attention on q, k, v as the model hands them over (views of one (T, 3, H, D) QKV output)
    equals the reference at dropout 0, gradients into the fused tensor included."""
    from bert.model.cudnn_varlen import cudnn_varlen

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(LENGTHS), 3, 4, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    got = cudnn_varlen(SeqLayout.from_lengths(LENGTHS, device="cuda"))(*qkv.unbind(1), 0.0)
    ref_qkv = qkv.detach().double().requires_grad_()
    want = reference_attention(*ref_qkv.unbind(1), LENGTHS)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)
    (g,), (w,) = grads(got, (qkv,)), grads(want, (ref_qkv,))
    torch.testing.assert_close(g.double(), w, rtol=0, atol=5e-2)


def check_dropout_backward_replays_the_forwards_mask(backend: str, device: str, dtype: torch.dtype) -> None:
    """out = P v with P the dropped-out attention probabilities. With v's rows one-hot (sequences no longer than
    the head dimension), out's rows are P's rows; the gradient with respect to v of sum(out * w) is P^T w, which
    the backward must compute with the same P: a mask drawn afresh would miss by the size of P's entries."""
    lengths = (48, 40, 64)
    seq = SeqLayout.from_lengths(lengths, device=device)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(sum(lengths), 2, 64, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.cat([torch.eye(n, 64).expand(2, n, 64).transpose(0, 1) for n in lengths]).to(device, dtype)
    v.requires_grad_()
    out = BACKENDS[backend](seq)(q, k, v, 0.3)
    w = torch.randn(out.shape, generator=gen).to(device, dtype)
    (got,) = torch.autograd.grad(out, v, w)
    want, dropped = torch.zeros_like(got, dtype=torch.float64), []
    for start, n in zip(seq.cu_seqlens.tolist(), lengths):
        p = out[start : start + n, :, :n].double()  # (i, h, j) = P_h[i, j]
        want[start : start + n] = torch.einsum("ihj,ihd->jhd", p, w[start : start + n].double())
        dropped.append((p == 0).double().mean().item())
    assert min(dropped) > 0.2  # dropout 0.3 did drop entries of every sequence's P
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=3e-2)


def test_dropout_backward_replays_the_forwards_mask():
    """The check itself, on the CPU's per-sequence SDPA (autograd keeps its mask), in float64."""
    check_dropout_backward_replays_the_forwards_mask("loop", "cpu", torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ("varlen", CUDNN))
def test_cuda_dropout_backward_replays_the_forwards_mask(backend):
    """The flash and cuDNN kernels redraw the mask in the backward from the forward's philox state."""
    check_dropout_backward_replays_the_forwards_mask(backend, "cuda", torch.bfloat16)
