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
from torch import nn

from bert.model.fp8_delayed import E4M3, E5M2, DelayedFloat8Linear
from bert.model.fp8_transpose import fp8_transpose


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
    """The forward saves x_q's and w_q's transposes and the backward makes g_q's, each through the op (dynamo's
    graph of the layer's forward and backward holds three), and the compiled gradients are eager's."""
    torch.manual_seed(0)
    layer = DelayedFloat8Linear.from_linear(nn.Linear(64, 128))
    x = torch.randn(32, 64, requires_grad=True)
    calls = []

    def count(gm, example_inputs):
        calls.extend(n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.bert.fp8_transpose.default))
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
    assert len(calls) == 3
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(24576, 1024), (24576, 4096), (4096, 1024), (1000, 3072), (77, 5)])
def test_cuda_the_kernel_is_torchs_transpose_byte_for_byte(shape):
    """On the GPU, the op's Triton kernel at the step's shapes (a batch's tokens by BERT-large's widths: the grid's
    first axis is the long one) and at shapes that cut the tiles."""
    t = float8(shape, E4M3).cuda()
    out = fp8_transpose(t)
    assert same_bytes(out, t.t().contiguous()) and out.is_contiguous() and out.device == t.device
