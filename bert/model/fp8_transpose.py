"""Float8 tensors transposed by a kernel of their own (`bert::fp8_transpose`), for delayed float8's backward GEMMs.

Why: on Hopper `torch._scaled_mm` takes its second operand column-major, so the weight gradient needs x_q and g_q
with the tokens contiguous, and the input gradient w_q transposed (bert.model.fp8_delayed). Written as
`t.t().contiguous()`, inductor fuses each copy into the kernel that casts the tensor, which is a row-wise one
(LayerNorm, its backward, GELU's, the weight's amax): every thread then stores one byte T elements away from the
next, a 32-byte sector per byte. On an H200 (2026-11-27, `driver-fp8-delayed-layers-flat`) three such kernels took
40 ms of a 184 ms step (its fusions 88.5 ms, bf16's 32), while the float8 GEMMs saved 24 ms: float8 ran at 627
samples/s against bf16's 772.

An opaque custom op is a kernel inductor cannot fuse into: the cast stays in its row-wise kernel and writes the
row-major copy, coalesced, and this reads it back a tile at a time and writes the tile transposed, coalesced on
both sides (TransformerEngine's cast-transpose does both in one kernel: a pass of one byte more per element
here). On CUDA it is a Triton kernel of 64 x 64-byte tiles, on the CPU a transposed copy. The values are bytes
moved, so the result is exact whatever the float8 format (the test checks every byte against torch's transpose,
the Triton kernel in Triton's interpreter).

Each transpose is a custom op called from Python, launching its kernel from Python: about 290 a BERT-large step,
host time that hides behind the GPU's only while the step is GPU-bound (not measured yet; `torch.library.triton_op`
would let inductor launch the kernel from its own wrapper).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bert.model.compile_keys import key_on_source

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheel has no Triton: the CPU path needs none
    triton = None

TILE = 64  # bytes a side: a tile's rows and columns are each two full 32-byte sectors

if triton is not None:
    @triton.jit
    def _transpose_tiles(src, dst, rows, cols, TILE: tl.constexpr):
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src + r[:, None].to(tl.int64) * cols + c[None, :], mask=inside)
        tl.store(dst + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=tl.trans(inside))


def launch_transpose(src: Tensor, dst: Tensor) -> None:
    """The Triton kernel: `dst` (cols x rows, contiguous) = `src` (rows x cols, contiguous) transposed, as bytes.
    Row tiles on the grid's first axis, the one without a 65,535 limit (the token count's)."""
    rows, cols = src.shape
    _transpose_tiles[(triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))](src, dst, rows, cols, TILE=TILE)


# flexible_layout: inductor hands the op its input as the cast's kernel wrote it. Under torch's default for custom
# ops (exact strides) it realized the input apart, and each float8 cast stored its copy twice, one buffer for the
# scaled GEMM and one for this op: 8.5 GB of BERT-large's float8 step on the fake H100 (bench/gpu_compile.py). Any
# layout serves: the CUDA path makes its input contiguous, a no-op for the casts' row-major copies.
@torch.library.custom_op("bert::fp8_transpose", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fp8_transpose(t: Tensor) -> Tensor:
    """The 2-d `t` of 1-byte elements transposed into a new contiguous tensor of the same dtype."""
    if t.dim() != 2 or t.element_size() != 1:
        raise ValueError(f"fp8_transpose takes a 2-d tensor of 1-byte elements, not {tuple(t.shape)} {t.dtype}")
    if not t.is_cuda or triton is None:  # a copy, never a view (contiguous() is one where a side is 1)
        return t.t().clone(memory_format=torch.contiguous_format)
    out = t.new_empty((t.shape[1], t.shape[0]))
    if t.numel():
        with torch.cuda.device(t.device):  # Triton launches on the current device
            launch_transpose(t.contiguous().view(torch.uint8), out.view(torch.uint8))
    return out


@fp8_transpose.register_fake
def _(t: Tensor) -> Tensor:
    return t.new_empty((t.shape[1], t.shape[0]))


# called inside delayed float8's autograd Function, which is traced into cached graphs by the op's name: an edit
# here must miss them (bert.model.compile_keys)
key_on_source("bert::fp8_transpose", __file__)
