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

Most float8 tensors now come transposed from the kernel that made them (the norms', the GELU's, the attention's);
what is left here is the first layer's input and the last layer's on its kept rows, 4 calls a BERT-large step. A
weight is cast and transposed in one pass (`bert::fp8_cast_transpose`, 96 calls a step: its e4m3 copy, the forward
GEMM's, and the copy transposed, the input gradient's), a 64 x 64 tile at a time as the plain transpose. Each is a
custom op launching its kernel from Python, host time that hides behind the GPU's only while the step is
GPU-bound (not measured yet; `torch.library.triton_op` would let inductor launch the kernel from its own wrapper).
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


    @triton.jit
    def _cast_transpose_tiles(src, scale, dst, dst_t, rows, cols, TILE: tl.constexpr):
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        at = r[:, None].to(tl.int64) * cols + c[None, :]
        x = tl.load(src + at, mask=inside, other=0.0).to(tl.float32)
        # saturated_cast's arithmetic: fp32 product, clamped to e4m3's largest, rounded to nearest even
        q = tl.clamp(x * tl.load(scale), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(dst + at, q, mask=inside)
        tl.store(dst_t + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(q), mask=tl.trans(inside))


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


def launch_cast_transpose(src: Tensor, scale: Tensor, dst: Tensor, dst_t: Tensor) -> None:
    """The Triton kernel: `dst` (rows x cols) = e4m3(`src` x `scale`, saturated) and `dst_t` (cols x rows) the same
    transposed, both contiguous e4m3; `src` contiguous, `scale` 0-dim fp32."""
    rows, cols = src.shape
    _cast_transpose_tiles[(triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))](src, scale, dst, dst_t, rows, cols,
                                                                               TILE=TILE)


@torch.library.custom_op("bert::fp8_cast_transpose", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fp8_cast_transpose(t: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The 2-d `t` times `scale` (0-dim fp32), saturated and cast to e4m3 (bert.model.fp8_delayed's
    `saturated_cast`), and that copy transposed, both contiguous, in one pass: a weight's two float8 copies, the
    forward GEMM's and the input gradient's. Inductor cast the weight in a kernel of its own and this op's plain
    transpose read the copy back (0.7 GB of BERT-large's float8 step on the fake H100, 96 launches each)."""
    from bert.model.fp8_delayed import E4M3, saturated_cast  # that module imports this one

    if t.dim() != 2 or scale.shape != ():
        raise ValueError(f"fp8_cast_transpose takes a 2-d tensor and a 0-dim scale, got {tuple(t.shape)} and "
                         f"{tuple(scale.shape)}")
    if not (t.is_cuda and triton is not None and t.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        q = saturated_cast(t, scale, E4M3)
        return q, q.t().clone(memory_format=torch.contiguous_format)
    q, q_t = t.new_empty(t.shape, dtype=E4M3), t.new_empty((t.shape[1], t.shape[0]), dtype=E4M3)
    if t.numel():
        with torch.cuda.device(t.device):  # Triton launches on the current device
            launch_cast_transpose(t.contiguous(), scale.float(), q, q_t)
    return q, q_t


@fp8_cast_transpose.register_fake
def _(t: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    e4m3 = torch.float8_e4m3fn
    return t.new_empty(t.shape, dtype=e4m3), t.new_empty((t.shape[1], t.shape[0]), dtype=e4m3)


# called inside delayed float8's autograd Function, which is traced into cached graphs by the op's name: an edit
# here must miss them (bert.model.compile_keys)
key_on_source("bert::fp8_transpose", __file__)
key_on_source("bert::fp8_cast_transpose", __file__)
