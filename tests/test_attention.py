"""Every attention backend against a float64 softmax reference with a block-diagonal mask."""

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bert.batch import SeqLayout
from bert.model import attention
from bert.model.attention import BACKENDS, check_attention, length_groups, resolve_backend, varlen_attention
from bert.model.cudnn_varlen import backward_is_fixed
from bert.model.padding import GroupedLayout, host_tensor, pad_groups, unpad_groups
from bert.static_shapes import pad_to_buckets
from bert.synthetic import random_batch

LENGTHS = (5, 1, 130, 512, 300, 12, 257, 128)  # every length group, both extremes
CPU_BACKENDS = ("loop", "grouped", "padded")
# torch before 2.14: cuDNN's ragged backward writes past its buffers (bert.model.cudnn_varlen.MIN_TORCH); on a GPU it
# would poison the process's CUDA context for every later test
CUDNN = pytest.param("cudnn", marks=pytest.mark.skipif(not backward_is_fixed(), reason="cuDNN ragged backward of torch "
                                                        "< 2.14 (pytorch#186142)"))


# The batches grouped attention must handle: all four groups; groups 2 and 3 empty; one group; one token; a batch
# as STATIC_TOKENS=1024 pads it (three padding sequences, bert.static_shapes)
LENGTH_SETS = {
    "all-groups": LENGTHS,
    "empty-groups": (3, 400, 7, 390, 512),
    "one-group": (300, 310, 257),
    "one-token": (1,),
    "static-tokens": pad_to_buckets(random_batch((200, 35, 130, 477, 90)), 1024, 64).seq.lengths,
}


def reference_attention(q, k, v, lengths):
    """softmax(q k^T / sqrt(d)) v over all T tokens, with cross-sequence scores masked out (the mask is
    built on q's device: masked_fill wants both on one)."""
    seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                     torch.tensor(lengths, device=q.device), output_size=sum(lengths))
    same = seq_id[:, None] == seq_id[None, :]  # (T, T)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~same, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference_attention_backward(grad, q, k, v, lengths):
    """dq, dk, dv of `reference_attention` by hand, sequence by sequence: a custom op's kernel runs below autograd, so
    a stand-in for one cannot differentiate the reference."""
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype) for t in (q, k, v))
    scale, start = q.shape[-1] ** -0.5, 0
    for n in lengths:
        rows = slice(start, start + n)
        p = (torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * scale).softmax(-1)
        do = grad[rows]
        dv[rows] = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, v[rows])
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, k[rows]) * scale
        dk[rows] = torch.einsum("hqk,qhd->khd", ds, q[rows]) * scale
        start += n
    return dq, dk, dv


def packed(q, k, v):
    """The (T, 3, H, D) tensor a layer hands its Attend (bert.model.attend), from three: a copy, differentiable."""
    return torch.stack((q, k, v), 1)


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


@pytest.mark.parametrize("lengths", LENGTH_SETS.values(), ids=LENGTH_SETS)
def test_grouped_equals_loop_and_padded_with_gradients(lengths):
    """Forward and q, k, v gradients of the three CPU backends in float64, each against the reference and grouped
    against the other two, on batches with empty length groups and with STATIC_TOKENS's padding sequences."""
    q, k, v = random_qkv(lengths)
    seq = SeqLayout.from_lengths(lengths)
    want = reference_attention(q, k, v, lengths)
    got = {name: BACKENDS[name](seq)(packed(q, k, v), 0.0) for name in CPU_BACKENDS}
    got_grads = {name: grads(out, (q, k, v)) for name, out in got.items()}
    want_grads = grads(want, (q, k, v))
    for name, out in got.items():
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        for g, w in zip(got_grads[name], want_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        for g, w in zip(got_grads["grouped"], got_grads[name]):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


class Ops(TorchDispatchMode):
    """The aten ops run under it, each with the shapes of the tensors it returns (views left out)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.ops.append((func._schema.name, [t.shape for t in outs if isinstance(t, torch.Tensor)]))
        return out

    def writing(self, shape):
        return [name for name, shapes in self.ops for s in shapes if s == shape]


def test_grouped_backward_writes_one_gradient_per_input():
    """q, k and v each reach the groups through one scatter into a buffer of blocks: the backward writes one (T, H, D)
    gradient per tensor (padding each group from q, k, v wrote a zero-filled one per group and tensor, then summed)."""
    q, k, v = random_qkv(LENGTHS)
    qkv = packed(q, k, v).detach().requires_grad_()  # the layer's packed QKV, a leaf: its gradient is one stack
    out = BACKENDS["grouped"](SeqLayout.from_lengths(LENGTHS))(qkv, 0.0)
    cotangent = torch.ones_like(out)
    with Ops() as ops:
        out.backward(cotangent)
    assert ops.writing(q.shape) == ["aten::index_select"] * 3, ops.writing(q.shape)


def test_loop_runs_the_fused_kernel_on_the_cpu():
    """4-D (1, H, L, D) inputs get the CPU's flash kernel (faster than the math kernel that 3-D inputs always get;
    on CUDA the fused kernels need 4-D too)."""
    q, k, v = random_qkv((40, 7), dtype=torch.float32)
    with Ops() as ops, torch.no_grad():
        BACKENDS["loop"](SeqLayout.from_lengths((40, 7)))(packed(q, k, v), 0.0)
    names = {name for name, _ in ops.ops}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names and "aten::bmm" not in names


def test_grouped_compiled_equals_eager():
    """Under torch.compile the groups run on the current stream (`side_streams_wanted`); dynamo's capture
    (aot_eager: no code generation) leaves the forward and the gradients unchanged."""
    lengths = LENGTH_SETS["empty-groups"]
    seq = SeqLayout.from_lengths(lengths)
    q, k, v = random_qkv(lengths)
    attend = BACKENDS["grouped"](seq)
    want = attend(packed(q, k, v), 0.0)
    torch._dynamo.reset()
    got = torch.compile(attend, backend="aot_eager", fullgraph=True)(packed(q, k, v), 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_side_streams_only_eagerly():
    """Dynamo does not trace stream switches and record_stream reliably: a compiled graph takes the current stream."""
    cuda = torch.device("cuda")  # only its type is read

    def probe(x):
        return x + attention.side_streams_wanted(cuda)

    torch._dynamo.reset()
    assert probe(torch.zeros(1)).item() == 1
    assert torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(1)).item() == 0
    assert not attention.side_streams_wanted(torch.device("cpu"))


def test_grouped_layout_scatters_every_token_once():
    lengths = (5, 1, 130, 512, 300)
    seq = SeqLayout.from_lengths(lengths)
    layout = GroupedLayout.build(seq, length_groups(lengths))
    assert layout.shapes == ((2, 5), (1, 130), (1, 300), (1, 512))
    assert sorted(layout.slots.tolist()) == sorted(set(layout.slots.tolist()))  # no two tokens share a slot
    assert [m.sum().item() for m in layout.key_masks] == [6, 130, 300, 512]
    x = torch.arange(sum(lengths), dtype=torch.float64)[:, None].expand(-1, 3)
    blocks = pad_groups(x, layout)
    assert [tuple(b.shape) for b in blocks] == [(2, 5, 3), (1, 130, 3), (1, 300, 3), (1, 512, 3)]
    assert blocks[0][:, :, 0].tolist() == [[0, 1, 2, 3, 4], [5, 0, 0, 0, 0]]  # sequences 0 and 1, zero-padded
    for block, mask in zip(blocks, layout.key_masks):
        assert (block[~mask] == 0).all()
    assert torch.equal(unpad_groups(blocks, layout), x)


@pytest.mark.parametrize("groups, problem", [([[0, 1], [1, 2]], "in an earlier group"), ([[0], [2]], "leave out")])
def test_grouped_layout_wants_every_sequence_once(groups, problem):
    with pytest.raises(ValueError, match=problem):
        GroupedLayout.build(SeqLayout.from_lengths((3, 4, 5)), groups)


def test_host_tensors_are_pinned_for_cuda_only():
    """A non_blocking copy from pageable memory may make the host wait: CUDA targets get pinned host tensors; the CPU
    keeps the array's own memory (no copy)."""
    a = np.arange(6)
    host = host_tensor(a, torch.device("cpu"))
    assert not host.is_pinned() and host.data_ptr() == a.ctypes.data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_tensors_are_pinned():
    assert host_tensor(np.arange(6), torch.device("cuda")).is_pinned()


def test_a_half_precision_backend_under_fp32_is_refused_before_the_run():
    """varlen's and cuDNN's kernels take fp16/bf16 only: PRECISION=fp32 (the default) with them, or with `auto` on
    CUDA, is one line naming both settings at the device check, not a failure at the first forward."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for name, which in (("varlen", "varlen"), ("auto", "auto (varlen on cuda)")):
        with pytest.raises(ValueError) as e:
            check_attention(name, cuda, "fp32")
        assert str(e.value) == f"ATTENTION={which} needs PRECISION=bf16, fp16 or fp8 (its kernels take half " \
            "precision only), not PRECISION=fp32: set PRECISION=bf16, or ATTENTION=padded for fp32"
        for precision in ("bf16", "fp16", "fp8", None):  # None: the caller did not say
            check_attention(name, cuda, precision)
    for name in ("auto", "loop", "grouped", "padded"):
        check_attention(name, cpu, "fp32")
    check_attention("grouped", cuda, "fp32")


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
def test_cuda_grouped_side_streams_hold_what_they_read(monkeypatch):
    """Each side stream records itself on every tensor it reads that the main stream allocated (q, k, v blocks and
    the key mask), so the caching allocator does not hand that memory to the main stream while the side stream
    still reads it; the outputs record the main stream. And the result stays exact."""
    recorded = []
    real = torch.Tensor.record_stream
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: (recorded.append((t, s)), real(t, s))[1])
    lengths = LENGTH_SETS["empty-groups"]
    q, k, v = random_qkv(lengths, heads=4, head_dim=64, dtype=torch.float32, device="cuda")
    seq = SeqLayout.from_lengths(lengths, device="cuda")
    out = BACKENDS["grouped"](seq)(packed(q, k, v), 0.0)
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    side = [(t, s) for t, s in recorded if s != main]
    assert len(side) == 2 * 4 and len({s for _, s in side}) == 2  # two groups, q, k, v and key mask each
    assert sum(t.dtype == torch.bool for t, _ in side) == 2
    assert sum(s == main for _, s in recorded) == 2
    torch.testing.assert_close(out, reference_attention(q, k, v, lengths), rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_path_takes_strided_views_of_the_fused_qkv():
    """The training path (`bert::flash_varlen`, the aten flash kernels with a dropout argument) on q, k, v as the
    model hands them over: views of one (T, 3, H, D) QKV output, rows 3 x H x D apart. At dropout 0 it must equal
    the reference, gradients into the fused tensor included."""
    from bert.model.cuda_varlen import flash_varlen_op

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(LENGTHS), 3, 4, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous() and q.stride(-1) == 1
    seq = SeqLayout.from_lengths(LENGTHS, device="cuda")
    got = flash_varlen_op(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.0)[0]
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
    out = BACKENDS[backend](seq)(packed(q, k, v), 0.3)
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
