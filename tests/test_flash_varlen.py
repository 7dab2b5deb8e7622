"""`bert::flash_varlen`, the custom op around torch's flash kernels with dropout (ATTENTION=varlen's training path),
traced, differentiated and cached as torch.compile does it. On the CPU a float64 reference stands in for the two aten
calls (which need CUDA), returning what the op's contract says flash returns: the op's fake implementation, autograd
registration, shape checks and AOT autograd's cache are what is under test. On a GPU the real kernels run."""

import pytest
import torch
import torch._functorch.config
from test_attention import grads, reference_attention, reference_attention_backward
from test_cudnn_varlen import LENGTHS, compiles_in_one_graph_and_matches_the_reference, fused_qkv, reference_lse

from bert.batch import SeqLayout
from bert.model import cuda_varlen
from bert.model.cuda_varlen import flash_varlen_op

STATE = (1234, 5678)  # the philox seed and offset a forward "returns"


def float64_kernels(lengths, lse_layout="ht", replayed=None):
    """Stand-ins for `_aten_forward` / `_aten_backward`: attention without dropout, the log-sum-exp as (H, T) (flash's
    unpadded layout; 'thd' returns (T, H, 1), which the contract does not state), the philox state as a (2,) uint64
    and the unused () uint64 flash returns. The backward appends the state it is handed to `replayed`."""

    def forward(q, k, v, cu, max_seqlen, dropout_p):
        assert max_seqlen == max(lengths) and cu.tolist()[-1] == sum(lengths)
        lse = reference_lse(q, k, lengths)
        lse = lse.squeeze(-1).T.contiguous() if lse_layout == "ht" else lse
        return (reference_attention(q, k, v, lengths).contiguous(), lse.float(),
                torch.tensor(STATE, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64))

    def backward(grad, q, k, v, out, lse, cu, max_seqlen, dropout_p, rng_state, unused):
        assert grad.is_contiguous() and lse.shape == (q.shape[1], q.shape[0]) and rng_state.dtype == torch.uint64
        if replayed is not None:
            replayed.append((tuple(rng_state.tolist()), dropout_p))
        return reference_attention_backward(grad, q, k, v, lengths)

    return forward, backward


def stand_in(monkeypatch, **kwargs):
    forward, backward = float64_kernels(LENGTHS, **kwargs)
    monkeypatch.setattr(cuda_varlen, "_aten_forward", forward)
    monkeypatch.setattr(cuda_varlen, "_aten_backward", backward)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_opcheck_fake_autograd_and_schema(monkeypatch, dropout_p):
    """torch's own checker: the fake implementation's outputs match the real ones' metadata, the autograd
    registration is complete, and the op traces under AOT autograd with dynamic shapes."""
    stand_in(monkeypatch)
    _, (q, k, v) = fused_qkv(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    torch.library.opcheck(flash_varlen_op, (q, k, v, seq.cu_seqlens, seq.max_seqlen, dropout_p))


def test_compiles_in_one_graph_and_matches_the_reference(monkeypatch):
    """Compiled too, the backward is handed the forward's philox state (through the graph as int64) and dropout."""
    replayed = []
    stand_in(monkeypatch, replayed=replayed)
    compiles_in_one_graph_and_matches_the_reference(flash_varlen_op, 0.1)
    assert replayed == [(STATE, 0.1)]


def test_the_backward_gets_the_forwards_philox_state(monkeypatch):
    """With dropout the backward must redraw the forward's mask: it is handed the state the forward returned (and
    the dropout probability), through the op's saved outputs."""
    replayed = []
    stand_in(monkeypatch, replayed=replayed)
    _, (q, k, v) = fused_qkv(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    out, _, rng_state, _ = flash_varlen_op(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.1)
    assert rng_state.dtype == torch.int64 and rng_state.view(torch.uint64).tolist() == list(STATE)
    grads(out, (q, k, v))
    assert replayed == [(STATE, 0.1)]


def test_a_layout_off_the_contract_fails_naming_the_setting(monkeypatch):
    stand_in(monkeypatch, lse_layout="thd")
    _, (q, k, v) = fused_qkv(LENGTHS)
    seq = SeqLayout.from_lengths(LENGTHS)
    with pytest.raises(RuntimeError, match=r"^ATTENTION=varlen: this torch build's flash attention returned "
                                           r"logsumexp \(212, 2, 1\) .* use ATTENTION=padded$"):
        flash_varlen_op(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.1)
    forward, _ = float64_kernels(LENGTHS)
    # an older torch's state: two int64 scalars (the forward's seed and offset), not the (2,) uint64 stated
    monkeypatch.setattr(cuda_varlen, "_aten_forward", lambda *args: (*forward(*args)[:2], torch.tensor(1),
                                                                     torch.tensor(2)))
    with pytest.raises(RuntimeError, match=r"ATTENTION=varlen: .* philox state \(\) torch.int64 on cpu, not what"):
        flash_varlen_op(q, k, v, seq.cu_seqlens, seq.max_seqlen, 0.1)


class AsFunction(torch.autograd.Function):
    """The op's former form: an autograd Function around the flash kernels (here the op and its backward op, over
    the stand-ins), which AOT autograd does not cache. Opaque calls, as the aten kernels were: the float64 reference
    traced into the graph instead made inductor compile its every einsum, four fifths of this test's time."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, dropout_p):
        out, lse, rng_state, unused = flash_varlen_op(q, k, v, cu, max_seqlen, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, cu)
        ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, rng_state, unused, cu = ctx.saved_tensors
        return (*cuda_varlen.flash_varlen_backward(grad, q, k, v, out, lse, rng_state, unused, cu, ctx.max_seqlen,
                                                   ctx.dropout_p), None, None, None)


def compiles(step, inputs, edits, before=lambda: None) -> list[dict]:
    """For each of `edits` (None: as it is), `step` compiled anew after the edit and `before()`, and run forward and
    backward on fresh copies of `inputs`, all under one fresh inductor cache: each compile's counters and input
    gradients."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_inductor_cache

    seen = []
    with fresh_inductor_cache():
        for edit in edits:
            if edit is not None:
                edit()
            before()
            counters.clear()
            torch._dynamo.reset()
            args = [x.detach().clone().requires_grad_() for x in inputs]
            torch.compile(step, backend="inductor")(*args).backward()
            seen.append({"aot": {k.removeprefix("autograd_cache_"): v for k, v in counters["aot_autograd"].items()
                                 if k in ("autograd_cache_hit", "autograd_cache_bypass", "autograd_cache_saved")},
                         "inductor": {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items()
                                      if k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
                         "grads": [x.grad for x in args]})
    torch._dynamo.reset()
    return seen


def test_aot_autograd_caches_a_graph_holding_the_op_and_not_one_holding_an_autograd_function(monkeypatch):
    """The reason for the custom op: a driver that loads its graphs from a compile cache took inductor's from it but
    re-traced AOT autograd's, because the model's graph held an autograd Function (which torch does not cache by
    default); with the op the second compile takes AOT autograd's graph from the cache too."""
    stand_in(monkeypatch)
    seq = SeqLayout.from_lengths(LENGTHS)

    def step(attend):
        return lambda qkv: (attend(*qkv.unbind(1), seq.cu_seqlens, seq.max_seqlen, 0.1) * 2).sum()

    qkv = fused_qkv(LENGTHS)[0]
    first, second = compiles(step(lambda *args: flash_varlen_op(*args)[0]), [qkv], [None, None])
    assert first["aot"] == {"saved": 1} and second["aot"] == {"hit": 1}
    with torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=False):  # torch's default,
        as_function = compiles(step(AsFunction.apply), [qkv], [None, None])  # which the driver changes (compile_keys)
    assert all(c["aot"].get("bypass") and not c["aot"].get("hit") for c in as_function)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_cuda_the_real_kernels_keep_the_contract(dropout_p):
    """torch's checker on the real flash kernels: what they return is what the fake implementation states, and the
    autograd registration is complete. Not its eager-against-compiled comparison of values: the unused output (and
    the philox state at dropout 0) is memory the kernel never writes (tests/test_attention.py compares the values)."""
    seq = SeqLayout.from_lengths((5, 1, 130, 512, 300, 12), device="cuda")
    _, (q, k, v) = fused_qkv(seq.lengths, torch.bfloat16, "cuda")
    torch.library.opcheck(flash_varlen_op, (q, k, v, seq.cu_seqlens, seq.max_seqlen, dropout_p),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
