"""`bert::cudnn_varlen`, the custom op around cuDNN's ragged attention, traced and differentiated as torch.compile
does it. On the CPU a float64 reference stands in for the two aten calls (which need CUDA), returning what the op's
contract says cuDNN returns: the op's fake implementation, autograd registration and shape checks are what is under
test. On a GPU the real kernels run, compiled against eager."""

import re

import pytest
import torch
from test_attention import grads, reference_attention, reference_attention_backward

from bert.batch import SeqLayout
from bert.model import cudnn_varlen
from bert.model.attention import check_attention
from bert.model.cudnn_varlen import cudnn_varlen_op

LENGTHS = (5, 1, 130, 64, 12)


def reference_lse(q, k, lengths):
    """log sum_j exp(q_i . k_j / sqrt(d)) over token i's own sequence, as (T, H, 1)."""
    parts, start = [], 0
    for n in lengths:
        scores = torch.einsum("qhd,khd->qhk", q[start : start + n], k[start : start + n]) / q.shape[-1] ** 0.5
        parts.append(scores.logsumexp(-1, keepdim=True))
        start += n
    return torch.cat(parts)


SEED, OFFSET = 1234, 5678  # the philox state a forward with dropout "returns"


def float64_kernels(lengths, lse_layout="thd", replayed=None):
    """Stand-ins for `_aten_forward` / `_aten_backward`. They compute attention without dropout; with dropout they
    return the philox state (SEED, OFFSET) and the backward appends the state it is handed to `replayed`. At
    dropout 0 they return no state at all (None, the worst torch could hand back). lse_layout='ht' returns the
    log-sum-exp as (H, T), a layout the contract does not state."""

    def forward(q, k, v, cu, max_seqlen, dropout_p):
        assert max_seqlen == max(lengths) and cu.tolist()[-1] == sum(lengths)
        out = reference_attention(q, k, v, lengths).contiguous()
        lse = reference_lse(q, k, lengths)
        lse = lse.squeeze(-1).T.contiguous() if lse_layout == "ht" else lse
        if dropout_p == 0.0:
            return out, lse.float(), None, None
        return out, lse.float(), torch.tensor([SEED]), torch.tensor(OFFSET)

    def backward(grad, q, k, v, out, lse, seed, offset, cu, max_seqlen, dropout_p):
        assert grad.is_contiguous() and lse.shape == (q.shape[0], q.shape[1], 1) and seed.dim() == 0
        if replayed is not None:
            replayed.append((seed.item(), offset.item(), dropout_p))
        return reference_attention_backward(grad, q, k, v, lengths)

    return forward, backward


@pytest.fixture
def float64_cudnn(monkeypatch):
    forward, backward = float64_kernels(LENGTHS)
    monkeypatch.setattr(cudnn_varlen, "_aten_forward", forward)
    monkeypatch.setattr(cudnn_varlen, "_aten_backward", backward)


def fused_qkv(lengths, dtype=torch.float64, device="cpu"):
    """q, k, v as the model hands them over: views of one (T, 3, H, D) QKV output, rows 3 x H x D apart."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(lengths), 3, 2, 16, generator=gen).to(device, dtype).requires_grad_()
    return qkv, qkv.unbind(1)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_opcheck_fake_autograd_and_schema(float64_cudnn, dropout_p):
    """torch's own checker: the fake implementation's outputs match the real ones' metadata, the autograd
    registration is complete, and the op traces under AOT autograd with dynamic shapes."""
    _, (q, k, v) = fused_qkv(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    torch.library.opcheck(cudnn_varlen_op, (q, k, v, seq.cu_seqlens, seq.max_seqlen, dropout_p))


def compiles_in_one_graph_and_matches_the_reference(op, dropout_p: float) -> None:
    """`op` (a custom op around attention, its kernels the float64 stand-ins) under torch.compile: one graph, and the
    compiled forward and backward equal the float64 reference, gradients into the fused QKV tensor included."""
    from torch._dynamo.testing import CompileCounterWithBackend

    seq = SeqLayout.from_lengths(LENGTHS)
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def attend(qkv):
        q, k, v = qkv.unbind(1)
        return op(q, k, v, seq.cu_seqlens, seq.max_seqlen, dropout_p)[0] * 2.0

    torch._dynamo.reset()
    qkv, _ = fused_qkv(LENGTHS)
    got = attend(qkv)
    assert counter.frame_count == 1
    ref_qkv = qkv.detach().clone().requires_grad_()
    want = 2.0 * reference_attention(*ref_qkv.unbind(1), LENGTHS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (g,), (w,) = grads(got, (qkv,)), grads(want, (ref_qkv,))
    torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_compiles_in_one_graph_and_matches_the_reference(float64_cudnn):
    """The reason for the custom op: no graph break (the bare aten op cannot be traced)."""
    compiles_in_one_graph_and_matches_the_reference(cudnn_varlen_op, 0.0)


def test_the_backward_gets_the_forwards_philox_state(monkeypatch):
    """With dropout the backward must redraw the forward's mask: it is handed the seed and offset the forward
    returned (and the dropout probability), through the op's saved outputs."""
    replayed = []
    forward, backward = float64_kernels(LENGTHS, replayed=replayed)
    monkeypatch.setattr(cudnn_varlen, "_aten_forward", forward)
    monkeypatch.setattr(cudnn_varlen, "_aten_backward", backward)
    _, (q, k, v) = fused_qkv(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    out, _, rng = cudnn_varlen_op(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.1)
    assert rng.tolist() == [SEED, OFFSET] and rng.dtype == torch.int64
    grads(out, (q, k, v))
    assert replayed == [(SEED, OFFSET, 0.1)]


def test_a_layout_off_the_contract_fails_naming_the_setting(monkeypatch):
    forward, backward = float64_kernels(LENGTHS, lse_layout="ht")
    monkeypatch.setattr(cudnn_varlen, "_aten_forward", forward)
    _, (q, k, v) = fused_qkv(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    with pytest.raises(RuntimeError, match=r"ATTENTION=cudnn: .* logsumexp \(2, 212\) .* use ATTENTION=varlen"):
        cudnn_varlen_op(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.0)
    # with dropout the backward needs the philox state: none coming back is the same error, not an AttributeError
    forward, _ = float64_kernels(LENGTHS)
    monkeypatch.setattr(cudnn_varlen, "_aten_forward", lambda *args: (*forward(*args)[:2], None, None))
    with pytest.raises(RuntimeError, match=r"ATTENTION=cudnn: .* philox seed no tensor, .* use ATTENTION=varlen"):
        cudnn_varlen_op(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not cudnn_varlen.backward_is_fixed(), reason="cuDNN ragged backward of torch < 2.14 "
                    "(pytorch#186142): it would poison the process's CUDA context")
def test_cuda_compiled_equals_eager_without_graph_breaks():
    """The real kernels under inductor: one graph, forward and gradients as eager's (dropout 0, bf16)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    lengths = (5, 1, 130, 512, 300, 12)
    seq = SeqLayout.from_lengths(lengths, device="cuda")
    attend_eager = cudnn_varlen.cudnn_varlen(seq)
    counter = CompileCounterWithBackend("inductor")
    attend_compiled = torch.compile(lambda qkv: attend_eager(*qkv.unbind(1), 0.0), backend=counter, fullgraph=True)
    torch._dynamo.reset()
    qkv, _ = fused_qkv(lengths, torch.bfloat16, "cuda")
    got = attend_compiled(qkv)
    assert counter.frame_count == 1
    ref_qkv = qkv.detach().clone().requires_grad_()
    want = attend_eager(*ref_qkv.unbind(1), 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
    (g,), (w,) = grads(got, (qkv,)), grads(want, (ref_qkv,))
    torch.testing.assert_close(g, w, rtol=0, atol=2e-2)


@pytest.mark.parametrize("version, fixed", [("2.11.0+cu130", False), ("2.13.0+cpu", False), ("2.10.0a0+b4e4ee8", False),
                                            ("2.14.0", True), ("2.14.0a0+git5d2f", True), ("3.0.1", True)])
def test_a_torch_whose_cudnn_backward_is_broken_is_refused_in_one_line(monkeypatch, version, fixed):
    """torch 2.11 (the GPU machines') sized the ragged backward's dq accumulator by the head dimension
    (pytorch#186142): ATTENTION=cudnn is refused where the driver checks its device (`check_attention`, once, not by
    the per-batch planner), before anything runs; bench/model.py leaves the row out by `backward_is_fixed`."""
    monkeypatch.setattr(torch, "__version__", version)
    assert cudnn_varlen.backward_is_fixed() == fixed
    if fixed:
        check_attention("cudnn", torch.device("cuda"))
        return
    for check in (lambda: check_attention("cudnn", torch.device("cuda")), cudnn_varlen.check_torch):
        with pytest.raises(ValueError, match=rf"^ATTENTION=cudnn needs torch >= 2\.14: torch {re.escape(version)}'s "
                                             r"cuDNN ragged backward .*pytorch/pytorch#186142.*use ATTENTION=varlen$"):
            check()
    check_attention("varlen", torch.device("cuda"))  # flash is not concerned
