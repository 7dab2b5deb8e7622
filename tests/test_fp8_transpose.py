"""bert.model.fp8_transpose: `bert::fp8_transpose` gives torch's transpose byte for byte, on the CPU and through the
Triton kernel the GPU runs (in Triton's interpreter here), and stays a node of its own in the graphs delayed float8
compiles into (the point of it: inductor cannot fuse the copy into the cast's row-wise kernel). The reference is
`t.t().contiguous()`."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from script_modules import ROOT
from test_fp8_bias_gelu import NARROWING_PATCH
from torch import nn

from bert.model.fp8_delayed import E4M3, E5M2, DelayedFloat8Linear, saturated_cast
from bert.model.fp8_transpose import fp8_cast_transpose, fp8_transpose


def float8(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every byte pattern likely (NaN's and inf's included): random bytes seen as `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_op_is_torchs_transpose_byte_for_byte(dtype):
    t = float8((70, 130), dtype)
    out = fp8_transpose(t)
    assert same_bytes(out, t.t().contiguous()) and out.is_contiguous()
    wide = t[:, ::2]  # a strided input is made contiguous first
    assert same_bytes(fp8_transpose(wide), wide.t().contiguous())


@pytest.mark.parametrize("shape", [(1, 5), (5, 1), (0, 4), (1, 1)])
def test_a_side_of_one_or_none_still_gives_a_new_tensor(shape):
    """t().contiguous() of such a tensor is a view of it, which a custom op may not return."""
    t = float8(shape, E4M3)
    out = fp8_transpose(t)
    assert same_bytes(out, t.t().contiguous()) and not out._is_view()
    assert not t.numel() or out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_anything_but_a_matrix_of_bytes_is_refused():
    for bad in (torch.zeros(4, 4), torch.zeros(2, 2, 2, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="a 2-d tensor of 1-byte elements"):
            fp8_transpose(bad)


def test_its_fake_gives_the_transposed_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.bert.fp8_transpose(torch.empty(24576, 1024, dtype=E4M3))
    assert out.shape == (1024, 24576) and out.dtype == E4M3 and out.is_contiguous()


KERNEL = """
import sys, torch
from bert.model.fp8_transpose import launch_transpose
bad = []
for rows, cols in [(64, 64), (130, 70), (1, 200), (200, 1), (512, 1024)]:
    src = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    dst = torch.full((cols, rows), 7, dtype=torch.uint8)
    launch_transpose(src, dst)
    if not torch.equal(dst, src.t().contiguous()):
        bad.append((rows, cols))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton (torch's CUDA build) not installed")
def test_the_triton_kernel_transposes_every_byte_in_the_interpreter():
    """The CUDA path's kernel, run by Triton's interpreter on the CPU: tiles cut at both edges, a single row and a
    single column, and a full BERT-width block; every byte of the output written, none outside."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "bad []" in done.stdout


def test_compiled_delayed_float8_keeps_the_transposes_as_their_own_kernels():
    """The forward saves x_q's transpose and the backward makes g_q's, each through the op, and the weight is cast
    with its transpose by `bert::fp8_cast_transpose` (dynamo's graphs of the layer's forward and backward hold the
    three), and the compiled gradients are eager's."""
    torch.manual_seed(0)
    layer = DelayedFloat8Linear.from_linear(nn.Linear(64, 128))
    x = torch.randn(32, 64, requires_grad=True)
    calls = []

    def count(gm, example_inputs):
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "transpose" in str(n.target)
                     and str(n.target).startswith("bert."))
        return make_boxed_func(gm.forward)

    def grads(fn):
        layer._start_amaxes(x.device)
        x.grad = layer.weight.grad = None
        fn(x).square().sum().backward()
        return x.grad.clone(), layer.weight.grad.clone()

    eager = grads(layer)
    torch._dynamo.reset()
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    compiled = grads(torch.compile(layer, backend=aot_autograd(fw_compiler=count, bw_compiler=count)))
    torch._dynamo.reset()
    assert calls == ["bert.fp8_cast_transpose.default", "bert.fp8_transpose.default", "bert.fp8_transpose.default"]
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_cast_op_is_the_saturated_cast_and_its_transpose(dtype):
    """`bert::fp8_cast_transpose` against scaled e4m3 in float64 arithmetic: each element the nearest e4m3 of w x s
    (ties to even, as torch rounds), saturated at 448; the second output the first's bytes transposed."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(70, 130, generator=g, dtype=torch.float64) * 3).to(dtype)
    scale = torch.tensor(90.0)
    q, q_t = fp8_cast_transpose(w, scale)
    assert q.dtype == q_t.dtype == E4M3 and q.is_contiguous() and q_t.is_contiguous()
    want = (w.double() * 90).clamp(-448, 448).to(E4M3)  # float64's product, then one rounding
    assert same_bytes(q, want) and same_bytes(q_t, want.t().contiguous())
    assert q.float().abs().max() == 448  # saturated, not NaN
    assert same_bytes(q, saturated_cast(w, scale, E4M3))
    torch.library.opcheck(torch.ops.bert.fp8_cast_transpose.default, (w, scale))
    for bad in ((w[0], scale), (w, torch.ones(1))):
        with pytest.raises(ValueError, match="2-d tensor and a 0-dim scale"):
            fp8_cast_transpose(*bad)


CAST_KERNEL = """
import sys, torch
""" + NARROWING_PATCH + """
from bert.model.fp8_delayed import E4M3, saturated_cast
from bert.model.fp8_transpose import launch_cast_transpose
bad = []
for rows, cols, dtype, scale in [(64, 64, torch.bfloat16, 100.0), (130, 70, torch.float32, 3e3),
                                 (1, 200, torch.float16, 1.0), (200, 1, torch.bfloat16, 50.0),
                                 (256, 1024, torch.bfloat16, 448.0)]:
    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    q, q_t = torch.full((rows, cols), 7.0).to(E4M3), torch.full((cols, rows), 7.0).to(E4M3)
    launch_cast_transpose(w, torch.tensor(scale), q, q_t)
    want = saturated_cast(w, torch.tensor(scale), E4M3).view(torch.uint8)
    q, q_t = q.view(torch.uint8), q_t.view(torch.uint8)
    if not (torch.equal(q, want) and torch.equal(q_t, want.t().contiguous())):
        bad.append((rows, cols, str(dtype), (q != want).float().mean().item()))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton (torch's CUDA build) not installed")
def test_the_triton_cast_kernel_is_the_saturated_cast_in_the_interpreter():
    """The cast op's kernel in Triton's interpreter (its float narrowing torch's: the interpreter's own rounds
    wrong, test_fp8_bias_gelu's NARROWING_PATCH): every byte saturated_cast's, both copies, tiles cut at both edges,
    each dtype a weight has, a scale that saturates."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", CAST_KERNEL], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "bad []" in done.stdout


SM90 = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bert.model import fp8_transpose as ft
bad = []
for dtype in ("bf16", "fp16", "fp32"):
    signature = dict(src=f"*{dtype}", scale="*fp32", dst="*fp8e4nv", dst_t="*fp8e4nv", rows="i32", cols="i32",
                     TILE="constexpr")
    try:
        triton.compile(ASTSource(ft._cast_transpose_tiles, signature, dict(TILE=ft.TILE)),
                       target=GPUTarget("cuda", 90, 32))
    except Exception as e:
        bad.append((dtype, repr(e)[:300]))
print("bad", bad)
sys.exit(1 if bad else 0)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton (torch's CUDA build) not installed")
def test_the_cast_kernel_compiles_for_an_h100():
    done = subprocess.run([sys.executable, "-c", SM90], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and "bad []" in done.stdout, (done.stdout + done.stderr)[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(3072, 1024), (1024, 4096), (4096, 1024), (77, 5)])
def test_cuda_the_cast_kernel_is_the_saturated_cast(shape):
    """On the GPU, BERT-large's weight shapes and one that cuts the tiles, against the torch cast on the GPU."""
    w = torch.randn(shape, device="cuda").to(torch.bfloat16)
    scale = 448 / w.float().abs().amax()
    q, q_t = fp8_cast_transpose(w, scale)
    want = saturated_cast(w, scale, E4M3)
    assert same_bytes(q, want) and same_bytes(q_t, want.t().contiguous()) and q.device == w.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(24576, 1024), (24576, 4096), (4096, 1024), (1000, 3072), (77, 5)])
def test_cuda_the_kernel_is_torchs_transpose_byte_for_byte(shape):
    """On the GPU, the op's Triton kernel at the step's shapes (a batch's tokens by BERT-large's widths: the grid's
    first axis is the long one) and at shapes that cut the tiles."""
    t = float8(shape, E4M3).cuda()
    out = fp8_transpose(t)
    assert same_bytes(out, t.t().contiguous()) and out.is_contiguous() and out.device == t.device
