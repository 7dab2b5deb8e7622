"""The close of every BERT sublayer, y = LayerNorm(dropout(h + b) + residual), as one kernel each way
(`bert::dropout_add_layer_norm`, selected by RESIDUAL_NORM=fused), as apex's and NVIDIA's submissions fuse it.

Why: inductor fuses the same chain, but the generated code the H200 brought back (2026-11-27, the compiled-layers
cache) spends more than it needs to. The forward draws each element's random number with `tl.rand`, a 10-round
Philox call that keeps one of its four words (66 SASS instructions an element, `bench/sass_count.py`), and ran at
2.0 TB/s, 42 % of the card's bandwidth; for one of a layer's two norms the backward first writes x_hat in fp32 from
the saved mask, h and residual, then reads it back with the two gradients and the mask, and it sums gamma's and
beta's gradients over the tokens in split reductions. Here:

- **forward**, one row per program: read h and the residual (and the dense layer's bias: its add, and its gradient's
  sum, come into these kernels instead of cuBLAS's epilogue and a reduction of their own), write y, the sum
  s = dropout(h + b) + residual in y's dtype, mean and rstd (fp32, one each a row), and the mask as bits, eight
  elements a byte. One Philox call gives four elements' words, and a thread draws the words of its own eight
  elements, no more (`_kept_byte`).
- **backward**, ROWS rows per program: read dy, s, the mask bits, mean and rstd; write the residual's gradient
  (LayerNorm's backward, d s) and h's (d s times the mask over 1 - p); gamma's, beta's and the bias's gradients are
  column sums each program keeps for its rows and writes once, summed over the programs after.
- **transposed float8 copies** (TRANSPOSE, bert.model.fp8_residual_norm's ops): the float8 output (the forward's e4m3
  y, the backward's e5m2 d h) is the next GEMM's operand, and its weight gradient's wants it transposed, tokens
  contiguous. A row's transpose is a byte every T bytes, a sector a byte; so the program takes ROWS rows (the
  forward too, then), and after a barrier reads its own block back (from L2, just written) ROWS x 128 at a time and
  stores it transposed, ROWS = 32 tokens a column: a full 32-byte sector. `bert::fp8_transpose` read the whole copy
  back from memory for it (one pass of a byte an element: 2.4 GB of BERT-large's float8 step on the fake H100).
- **the backward from the output** (`from_output`, RESIDUAL_NORM=fused-lean), as apex's memory-efficient LayerNorm
  (and Megatron's `--memory-efficient-layer-norm`): the forward writes no sum (SUM off) and the backward reads y,
  recovering x_hat = (y - beta) / gamma (FROM_Y). y is written anyway, for the next sublayer, so one (T, N) store
  a norm goes: 48 of BERT-large's step, 50 MB each at 24,576 tokens. Under float8 y becomes the saved tensor in
  the sum's place (the next linear saves its e4m3 copy, not y); in bf16 the next linear saves y already, so the sum's
  memory goes too. The price is y's rounding (bf16) carried into x_hat, times |beta / gamma| where that is large; a
  gamma of 0 loses x_hat (NaN gradients, which the driver's NaN check stops on). Opt-in, as in apex.

The mask is a pure function of the seed (a fresh 62-bit one each call, from torch's generator) and the element: element
j of row t is dropped iff word j % 4 of Philox4x32-10(counter 2 V t + j // 4, key seed) is below round(p * 2^32), V the
power of two at or above N / 8, the mask's bytes a row (so p is exact to 2^-32). A program holds a row as a (V, 8) tile,
eight consecutive elements a thread: the four words of both its counters are all it uses, and its byte of the mask is
its own. (Until the forty-third session the row was a (4, W) tile, element j word j // W of counter j % W: Triton laid a
counter's four elements across threads, which drew it about four times over, and the forward's loop with dropout
compiled for sm_90 to 1,021 instructions, more than its bytes take, where it now takes 516, `bench/norm_sass.py`.) The
CPU draws the same words in torch's arithmetic (bert.model.philox), so one seed gives one mask on every device, and the
Triton kernels (run in Triton's interpreter by the tests) are checked against the CPU bit for bit. The arithmetic is
fp32, as inductor's; float64 inputs take the torch path on every device, in float64 (gradcheck's).

Not measured on a GPU yet. Each call launches its Triton kernel from Python (one a sublayer each way: 96 a BERT-large
step, and the 48 sums of the backward's partials), host time hidden only while the step is GPU-bound;
`torch.library.triton_op` would let inductor launch them from its wrapper.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bert.model.compile_keys import key_on_source
from bert.model.layers import BertResidualOutput
from bert.model.philox import dropout_seed, randint4x
from bert.model.swap import swap_modules

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheel has no Triton: the CPU path needs none
    triton = None

# RESIDUAL_NORM: nn.Dropout + add + nn.LayerNorm (eager or compiled), or this, keeping the sum for the backward or
# (fused-lean) recovering x_hat from the output
RESIDUAL_NORMS = ("torch", "fused", "fused-lean")
ROWS = 32  # rows a backward program takes: its column sums are written once per ROWS rows


def bytes_per_row(n: int) -> int:
    """V: the mask's bytes a row of `n` elements, eight elements each (a power of two: a Triton block); the row draws
    2 V Philox counters, four elements' words each."""
    return 1 << max(0, (-(-n // 8) - 1).bit_length())


def drop_threshold(p: float) -> int:
    """Words below this are dropped: P = threshold / 2^32, p to 2^-32."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")
    return min(round(p * 2**32), 2**32 - 1)


def keep_mask(seed: Tensor, rows: int, n: int, p: float) -> Tensor:
    """(rows, n) bool: the elements the kernels keep for `seed` (module doc), drawn in torch's arithmetic."""
    v = bytes_per_row(n)
    counters = torch.arange(rows, device=seed.device)[:, None] * 2 * v + torch.arange(2 * v, device=seed.device)
    words = torch.stack(randint4x(seed, counters), -1).reshape(rows, 8 * v)  # element j = word j % 4, counter j // 4
    return words[:, :n] >= drop_threshold(p)


def pack_bits(keep: Tensor) -> Tensor:
    """(rows, n) bool -> (rows, V) uint8: bit k of byte v is element 8 v + k."""
    rows, n = keep.shape
    v = bytes_per_row(n)
    padded = torch.zeros(rows, 8 * v, dtype=torch.int32, device=keep.device)
    padded[:, :n] = keep.int()
    shifts = torch.arange(8, dtype=torch.int32, device=keep.device)
    return (padded.view(rows, v, 8) << shifts).sum(-1).to(torch.uint8)


def unpack_bits(bits: Tensor, n: int) -> Tensor:
    """`pack_bits` undone: (rows, n) bool."""
    shifts = torch.arange(8, dtype=torch.int32, device=bits.device)
    return ((bits.int()[:, :, None] >> shifts) & 1).flatten(1)[:, :n].bool()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(p: float, compute: torch.dtype) -> float:
    """1 / (1 - p) as the kernels have it: an fp32 number, unless the arithmetic is float64 (rounded on the host, with
    no tensor made: this runs at every call)."""
    return 1.0 / (1.0 - p) if compute == torch.float64 else float(np.float32(1.0 / (1.0 - p)))


if triton is not None:
    @triton.jit
    def _forward_rows(h, res, gamma, beta, dense_bias, seed, y, s, bits, mean_out, rstd_out, yq, cast_scale, amaxes,
                      y2, yqt, rows, n, threshold, scale, eps, V: tl.constexpr, ROWS: tl.constexpr,
                      DROPOUT: tl.constexpr, DENSE_BIAS: tl.constexpr, FLOAT8: tl.constexpr, TWICE: tl.constexpr,
                      TRANSPOSE: tl.constexpr, SUM: tl.constexpr):
        """ROWS rows a program, one at a time. FLOAT8: y also rounded to its dtype, times cast_scale, saturated and
        stored in e4m3 into yq, the next float8 linear's input, and the row's largest magnitude into amaxes[row]
        (infinity for a NaN: not kept), as bert.model.fp8_residual_norm's `dropout_add_layer_norm_fp8` hands it on.
        TWICE: y stored into y2 as well, a tensor apart for its second reader (bert.model.layers' Stream across a
        graph's edge). TRANSPOSE (with FLOAT8): the program's rows of yq then stored transposed into yqt
        (`_transpose_rows`). SUM: the sum stored into s, the backward's input; without it the backward reads y
        (FROM_Y)."""
        k = tl.arange(0, 8)[None, :]
        j = tl.arange(0, V)[:, None] * 8 + k  # the row as a (V, 8) tile, a thread's eight elements a mask byte
        inside = j < n
        w = tl.load(gamma + j, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(beta + j, mask=inside, other=0.0).to(tl.float32)
        for i in tl.range(0, ROWS, num_stages=2):  # the next row's loads in flight during this one's sums
            t = tl.program_id(0).to(tl.int64) * ROWS + i
            here = t < rows
            live = inside & here
            at = t * n + j
            x = tl.load(h + at, mask=live, other=0.0).to(tl.float32)
            if DENSE_BIAS:
                x += tl.load(dense_bias + j, mask=inside, other=0.0).to(tl.float32)
            if DROPOUT:
                byte = _kept_byte(tl.load(seed), t * 2 * V, tl.arange(0, V), n, threshold)
                tl.store(bits + t * V + tl.arange(0, V), byte.to(tl.uint8), mask=here)
                x = tl.where(_kept_in_tile(byte, k), x * scale, 0.0)
            x += tl.load(res + at, mask=live, other=0.0).to(tl.float32)
            mean = tl.sum(x) / n
            d = tl.where(inside, x - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(d * d) / n + eps)
            out = d * rstd * w + b
            tl.store(y + at, out.to(y.dtype.element_ty), mask=live)
            if TWICE:
                tl.store(y2 + at, out.to(y.dtype.element_ty), mask=live)
            if SUM:
                tl.store(s + at, x.to(s.dtype.element_ty), mask=live)
            if FLOAT8:
                r = tl.where(inside, out.to(y.dtype.element_ty).to(tl.float32), 0.0)
                tl.store(yq + at, tl.clamp(r * tl.load(cast_scale), -448.0, 448.0).to(tl.float8e4nv), mask=live)
                tl.store(amaxes + t, tl.max(tl.max(tl.where(r == r, tl.abs(r), float("inf")), 1), 0), mask=here)
            tl.store(mean_out + t, mean, mask=here)
            tl.store(rstd_out + t, rstd, mask=here)
        if TRANSPOSE:
            _transpose_rows(yq, yqt, tl.program_id(0).to(tl.int64) * ROWS, rows, n, ROWS, 128)

    @triton.jit
    def _kept_byte(seed, counter0, v, n, threshold):
        """Byte v of the row's mask (its counters from `counter0`): bit k is 1 where element 8 v + k (< n) is kept.
        Its two counters' words are drawn here, in the bytes' layout, one byte a thread, and the tile's mask is
        unpacked from it: selected into the (V, 8) tile first and summed over its columns, the words cost the
        forward's loop 1,521 instructions on sm_90 where this takes 516 (`bench/norm_sass.py`)."""
        first = counter0 + 2 * v
        a0, a1, a2, a3 = tl.randint4x(seed, first)
        b0, b1, b2, b3 = tl.randint4x(seed, first + 1)
        return _kept4(a0, a1, a2, a3, 8 * v, n, threshold) | (_kept4(b0, b1, b2, b3, 8 * v + 4, n, threshold) << 4)

    @triton.jit
    def _kept_in_tile(byte, k):
        """The (V, 8) tile's mask from its V bytes: element (v, k) is bit k of byte v."""
        return ((byte[:, None] >> k) & 1) != 0

    @triton.jit
    def _kept4(r0, r1, r2, r3, j, n, threshold):
        """Four bits: bit q is 1 where element j + q (< n), word q, is kept (zero-extended: the words are uint32)."""
        return (_kept(r0, j, n, threshold) | (_kept(r1, j + 1, n, threshold) << 1)
                | (_kept(r2, j + 2, n, threshold) << 2) | (_kept(r3, j + 3, n, threshold) << 3))

    @triton.jit
    def _kept(word, j, n, threshold):
        return ((word.to(tl.int64) >= threshold) & (j < n)).to(tl.int32)

    @triton.jit
    def _transpose_rows(src, dst, t0, rows, n, ROWS: tl.constexpr, COLS: tl.constexpr):
        """Rows t0 .. t0 + ROWS of `src` (n wide, row-major: float8, as this program just stored them) into `dst`
        (n x rows, row-major), transposed: ROWS tokens contiguous a column, a full 32-byte sector for ROWS = 32. The
        barrier first: the other threads of the program stored those rows, and read back through L2 they cost no
        pass over memory, where `bert::fp8_transpose` would read the whole copy again."""
        tl.debug_barrier()
        r = t0 + tl.arange(0, ROWS)
        for c0 in range(0, n, COLS):
            col = c0 + tl.arange(0, COLS)
            inside = (r[:, None] < rows) & (col[None, :] < n)
            tile = tl.load(src + r[:, None] * n + col[None, :], mask=inside)
            tl.store(dst + col[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=tl.trans(inside))

    @triton.jit
    def _backward_rows(dy, dy2, s, bits, mean_in, rstd_in, gamma, beta, dh, ds, sums, cast_scale, amaxes, dht, rows,
                       n, scale, V: tl.constexpr, ROWS: tl.constexpr, DROPOUT: tl.constexpr, FLOAT8: tl.constexpr,
                       ROUND: tl.constexpr, SECOND: tl.constexpr, TRANSPOSE: tl.constexpr, FROM_Y: tl.constexpr):
        """FLOAT8: dh is h's gradient rounded to ROUND, times cast_scale, saturated to e5m2, and amaxes[program]
        its rows' largest magnitude (infinity for a NaN: not kept), as bert.model.fp8_residual_norm's float8 dense
        takes it. SECOND: y's gradient is dy + dy2, rounded to dy's dtype as autograd's add rounds it
        (bert.model.fp8_residual_norm's paired output). TRANSPOSE (with FLOAT8): the program's rows of dh then stored
        transposed into dht, the dense layer's weight-gradient operand (`_transpose_rows`). FROM_Y: `s` is the
        forward's output y, and x_hat is (y - beta) / gamma (the forward stored no sum: its SUM off)."""
        program = tl.program_id(0)
        k = tl.arange(0, 8)[None, :]
        j = tl.arange(0, V)[:, None] * 8 + k  # the forward's (V, 8) tile
        inside = j < n
        w = tl.load(gamma + j, mask=inside, other=0.0).to(tl.float32)
        if FROM_Y:
            b = tl.load(beta + j, mask=inside, other=0.0).to(tl.float32)
            inv_w = tl.where(inside, 1.0 / w, 0.0)
        dgamma = tl.zeros((V, 8), dtype=tl.float32)
        dbeta = tl.zeros((V, 8), dtype=tl.float32)
        dbias = tl.zeros((V, 8), dtype=tl.float32)
        top = tl.zeros((V, 8), dtype=tl.float32)
        for i in tl.range(0, ROWS, num_stages=2):  # the next row's loads in flight during this one's sums
            t = program.to(tl.int64) * ROWS + i
            live = inside & (t < rows)
            at = t * n + j
            g = tl.load(dy + at, mask=live, other=0.0).to(tl.float32)
            if SECOND:
                g = (g + tl.load(dy2 + at, mask=live, other=0.0).to(tl.float32)).to(dy.dtype.element_ty)
                g = g.to(tl.float32)
            rstd = tl.load(rstd_in + t, mask=t < rows, other=0.0).to(tl.float32)
            if FROM_Y:
                xhat = (tl.load(s + at, mask=live, other=0.0).to(tl.float32) - b) * inv_w
            else:
                xhat = (tl.load(s + at, mask=live, other=0.0).to(tl.float32)
                        - tl.load(mean_in + t, mask=t < rows, other=0.0).to(tl.float32)) * rstd
            xhat = tl.where(live, xhat, 0.0)
            gx = g * w
            d_sum = rstd * (gx - tl.sum(gx) / n - xhat * (tl.sum(gx * xhat) / n))
            d_h = d_sum
            if DROPOUT:
                byte = tl.load(bits + t * V + tl.arange(0, V), mask=t < rows, other=0).to(tl.int32)
                d_h = tl.where(_kept_in_tile(byte, k), d_sum * scale, 0.0)
            tl.store(ds + at, d_sum.to(ds.dtype.element_ty), mask=live)
            if FLOAT8:
                r = tl.where(live, d_h.to(ROUND).to(tl.float32), 0.0)  # the gradient as the unfused path holds it
                scaled = tl.clamp(r * tl.load(cast_scale), -57344.0, 57344.0)  # e5m2's largest, as scaled_cast
                tl.store(dh + at, scaled.to(tl.float8e5), mask=live)
                top = tl.maximum(top, tl.where(r == r, tl.abs(r), float("inf")))
            else:
                tl.store(dh + at, d_h.to(dh.dtype.element_ty), mask=live)
            dgamma += g * xhat
            dbeta += g
            dbias += tl.where(live, d_h, 0.0)
        out = sums + program.to(tl.int64) * 3 * n + j
        tl.store(out, dgamma, mask=inside)
        tl.store(out + n, dbeta, mask=inside)
        tl.store(out + 2 * n, dbias, mask=inside)
        if FLOAT8:
            tl.store(amaxes + program, tl.max(tl.max(top, 1), 0))
        if TRANSPOSE:
            _transpose_rows(dh, dht, program.to(tl.int64) * ROWS, rows, n, ROWS, 128)


TRITON_DTYPES = {} if triton is None else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                                            torch.float16: tl.float16}


def _warps(v: int) -> int:
    return max(1, min(8, v // 32))  # a mask byte, 8 elements, a thread: 4 warps for BERT-large's 1,024


def _on_triton(t: Tensor, stats: Tensor) -> bool:
    """The kernels' path: CUDA with Triton, fp32 arithmetic (the statistics' dtype; float64's is the torch path's)."""
    return t.is_cuda and triton is not None and stats.dtype == torch.float32


def launch_forward(h: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, dense_bias: Tensor | None,
                   seed: Tensor | None, p: float, eps: float, out: tuple[Tensor, ...],
                   float8: tuple[Tensor, Tensor, Tensor] | None = None, y2: Tensor | None = None,
                   yqt: Tensor | None = None) -> None:
    """The forward's Triton kernel into `out` (y, s, bits, mean, rstd), one program a row; on the current device.
    With `float8` (y's e4m3 copy, the e4m3 scale, 0-dim fp32, and the rows' amaxes, fp32) y is also cast (FLOAT8);
    with `y2` (y's shape and dtype) y is also stored there (TWICE); with `yqt` (N x T, e4m3: with `float8`) the
    copy is stored transposed there too (TRANSPOSE), ROWS rows a program. An `s` of 0 rows is not written (SUM
    off: the backward works from y)."""
    y, s, bits, mean, rstd = out
    rows, n = h.shape
    keeps_sum = s.shape[0] == rows
    v = bytes_per_row(n)
    yq, cast_scale, amaxes = float8 or (y, y, y)  # unread without FLOAT8
    if yqt is not None and float8 is None:
        raise ValueError("the transposed e4m3 copy needs the e4m3 copy (float8)")
    per_program = 1 if yqt is None else ROWS  # a row's transpose is a byte a sector: ROWS rows' is a sector
    # a flag off leaves its pointer unread: y stands in (an empty tensor's pointer may be null)
    _forward_rows[(triton.cdiv(rows, per_program),)](
        h.contiguous(), residual.contiguous(), weight, bias, y if dense_bias is None else dense_bias,
        y if seed is None else seed, y, s if keeps_sum else y, bits if p > 0 else y, mean, rstd, yq, cast_scale, amaxes,
        y if y2 is None else y2, y if yqt is None else yqt, rows, n, drop_threshold(p), _scale(p, torch.float32), eps,
        V=v, ROWS=per_program, DROPOUT=p > 0, DENSE_BIAS=dense_bias is not None, FLOAT8=float8 is not None,
        TWICE=y2 is not None, TRANSPOSE=yqt is not None, SUM=keeps_sum, num_warps=_warps(v))


def launch_backward(dy: Tensor, s: Tensor, bits: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, p: float,
                    out: tuple[Tensor, ...], float8: tuple[Tensor, torch.dtype] | None = None,
                    dy2: Tensor | None = None, dht: Tensor | None = None, beta: Tensor | None = None
                    ) -> Tensor | None:
    """The backward's Triton kernel into `out` (d h, d s, sums), ROWS rows a program, their column sums added after.
    With `float8` (the e5m2 scale, 0-dim fp32, and the dtype h's gradient is rounded to) d h is e5m2 (`out[0]`'s
    dtype) and its amax is returned (the kernel's FLOAT8). With `dy2` (dy's shape and dtype), y's gradient is
    dy + dy2 (SECOND). With `dht` (N x T, e5m2: with `float8`) d h is stored transposed there too (TRANSPOSE).
    With `beta` (the norm's), `s` is the output y, x_hat recovered from it (FROM_Y)."""
    dh, ds, sums = out
    rows, n = s.shape
    v = bytes_per_row(n)
    if dht is not None and float8 is None:
        raise ValueError("the transposed e5m2 gradient needs the e5m2 gradient (float8)")
    programs = triton.cdiv(rows, ROWS)
    partial = sums.new_empty((programs, 3, n))
    amaxes = sums.new_empty(programs if float8 else 0)
    cast_scale, round_to = float8 or (sums, torch.float32)  # unread without FLOAT8
    dy = dy.contiguous()
    second = dy if dy2 is None else dy2.contiguous()  # unread without SECOND
    _backward_rows[(programs,)](dy, second, s, bits if p > 0 else s, mean, rstd, weight,
                                weight if beta is None else beta, dh, ds, partial, cast_scale,
                                amaxes if float8 else sums, dh if dht is None else dht, rows, n,
                                _scale(p, torch.float32), V=v, ROWS=ROWS, DROPOUT=p > 0, FLOAT8=float8 is not None,
                                ROUND=TRITON_DTYPES[round_to], SECOND=dy2 is not None, TRANSPOSE=dht is not None,
                                FROM_Y=beta is not None, num_warps=_warps(v))
    torch.sum(partial, 0, out=sums)  # one launch
    return amaxes.amax() if float8 else None


def x_hat_from_output(y: Tensor, gamma: Tensor, beta: Tensor, compute: torch.dtype) -> Tensor:
    """LayerNorm's x_hat from its output, (y - beta) * (1 / gamma), as apex's memory-efficient LayerNorm recovers
    it (the kernels' FROM_Y): y's rounding, amplified where |beta / gamma| is large; a zero gamma gives a NaN."""
    return (y.to(compute) - beta.to(compute)) * (1 / gamma.to(compute))


def forward_torch(h: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, dense_bias: Tensor | None,
                  seed: Tensor | None, p: float, eps: float, out: tuple[Tensor, ...]) -> None:
    """The forward in torch's ops, into `out` as `launch_forward`'s: the same mask, any device."""
    y, s, bits, mean, rstd = out
    compute = mean.dtype
    x = h.to(compute)
    if dense_bias is not None:
        x = x + dense_bias.to(compute)
    if p > 0:
        keep = keep_mask(seed, *h.shape, p)
        x = torch.where(keep, x * _scale(p, compute), 0.0)
        bits.copy_(pack_bits(keep))
    x = x + residual.to(compute)
    mean.copy_(x.mean(-1))
    rstd.copy_(torch.rsqrt((x - mean[:, None]).square().mean(-1) + eps))
    y.copy_((x - mean[:, None]) * rstd[:, None] * weight.to(compute) + bias.to(compute))
    if s.shape == x.shape:  # else 0 rows: the backward works from y
        s.copy_(x)


def backward_torch(dy: Tensor, s: Tensor, bits: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, p: float,
                   out: tuple[Tensor, ...], beta: Tensor | None = None) -> None:
    """The backward in torch's ops, into `out` as `launch_backward`'s (with `beta`, `s` is y)."""
    dh, ds, sums = out
    compute = mean.dtype
    xhat = (s.to(compute) - mean[:, None]) * rstd[:, None] if beta is None else x_hat_from_output(s, weight, beta,
                                                                                                compute)
    g = dy.to(compute)
    gx = g * weight.to(compute)
    d_sum = rstd[:, None] * (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True))
    d_h = torch.where(unpack_bits(bits, s.shape[1]), d_sum * _scale(p, compute), 0.0) if p > 0 else d_sum
    dh.copy_(d_h)
    ds.copy_(d_sum)
    sums.copy_(torch.stack([(g * xhat).sum(0), g.sum(0), d_h.sum(0)]))


@torch.library.custom_op("bert::dropout_add_layer_norm", mutates_args=())
def dropout_add_layer_norm_op(h: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, dense_bias: Tensor | None,
                              seed: Tensor | None, p: float, eps: float, from_output: bool = False
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(T, N) `h` and `residual` -> y, s, the mask's bits (T x V uint8; 0 rows when p = 0), mean, rstd (module doc);
    with `from_output` s has 0 rows (unwritten): the backward recovers x_hat from y (RESIDUAL_NORM=fused-lean)."""
    check_forward(h, residual, p, seed)
    out = _outputs(h, residual, p, from_output)
    if not _on_triton(h, out[3]):
        forward_torch(h, residual, weight, bias, dense_bias, seed, p, eps, out)
    elif h.shape[0]:
        with torch.cuda.device(h.device):  # Triton launches on the current device
            launch_forward(h, residual, weight, bias, dense_bias, seed, p, eps, out)
    return out


def check_forward(h: Tensor, residual: Tensor, p: float, seed: Tensor | None) -> None:
    """A ValueError for the forward's inputs: h and the residual one (T, N) shape, p in [0, 1), a seed for p > 0."""
    if h.dim() != 2 or h.shape != residual.shape:
        raise ValueError(f"h {tuple(h.shape)} and residual {tuple(residual.shape)} must be the same (T, N)")
    drop_threshold(p)  # p in [0, 1)
    if p > 0 and seed is None:
        raise ValueError("dropout needs a seed")


def _outputs(h: Tensor, residual: Tensor, p: float, from_output: bool = False
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, n = h.shape
    dtype = torch.promote_types(h.dtype, residual.dtype)
    stats = dict(dtype=_compute_dtype(dtype), device=h.device)
    return (h.new_empty((rows, n), dtype=dtype), h.new_empty((0 if from_output else rows, n), dtype=dtype),
            h.new_empty((rows if p > 0 else 0, bytes_per_row(n)), dtype=torch.uint8),
            torch.empty(rows, **stats), torch.empty(rows, **stats))


@dropout_add_layer_norm_op.register_fake
def _(h, residual, weight, bias, dense_bias, seed, p, eps, from_output=False):
    return _outputs(h, residual, p, from_output)


@torch.library.custom_op("bert::dropout_add_layer_norm_backward", mutates_args=())
def dropout_add_layer_norm_backward(dy: Tensor, s: Tensor, bits: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor,
                                    p: float, h_dtype: torch.dtype, beta: Tensor | None = None
                                    ) -> tuple[Tensor, Tensor, Tensor]:
    """d h (`h_dtype`), d s (s's dtype: the residual's gradient), and the column sums (3, N) of dy * x_hat, dy and
    d h (gamma's, beta's and the dense bias's gradients) in the statistics' dtype. With `beta` (the norm's), `s` is
    the forward's output y, x_hat recovered from it (`x_hat_from_output`)."""
    out = _grads(dy, s, mean, h_dtype)
    if not _on_triton(s, mean):
        backward_torch(dy, s, bits, mean, rstd, weight, p, out, beta)
    elif s.shape[0]:
        with torch.cuda.device(s.device):
            launch_backward(dy, s, bits, mean, rstd, weight, p, out, beta=beta)
    else:
        out[2].zero_()
    return out


def _grads(dy: Tensor, s: Tensor, mean: Tensor, h_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(s, dtype=h_dtype), torch.empty_like(s),
            torch.empty((3, s.shape[1]), dtype=mean.dtype, device=s.device))


@dropout_add_layer_norm_backward.register_fake
def _(dy, s, bits, mean, rstd, weight, p, h_dtype, beta=None):
    return _grads(dy, s, mean, h_dtype)


def _setup_context(ctx, inputs, output) -> None:
    h, _residual, weight, beta, dense_bias, _seed, p, _eps, from_output = inputs
    y, s, bits, mean, rstd = output
    ctx.save_for_backward(*saved_norm(y, s, beta, from_output), bits, mean, rstd, weight)
    ctx.mark_non_differentiable(s, bits, mean, rstd)
    ctx.set_materialize_grads(False)  # else eager autograd fills a zero gradient for s, bits, mean and rstd each call
    ctx.p, ctx.h_dtype, ctx.dense_bias = p, h.dtype, dense_bias is not None


def _backward(ctx, dy, *_aux):
    """Autograd casts each gradient to its input's dtype where they differ (the residual's, under autocast, and the
    fp32 column sums for bf16 parameters); d h comes in h's dtype from the kernel."""
    if dy is None:  # y unused
        return (None,) * 9
    s, beta, bits, mean, rstd, weight = ctx.saved_tensors
    dh, ds, sums = torch.ops.bert.dropout_add_layer_norm_backward(dy, s, bits, mean, rstd, weight, ctx.p, ctx.h_dtype,
                                                                  beta)
    return dh, ds, sums[0], sums[1], sums[2] if ctx.dense_bias else None, None, None, None, None


dropout_add_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def saved_norm(y: Tensor, s: Tensor, beta: Tensor, from_output: bool) -> tuple[Tensor, Tensor | None]:
    """What the backward reads x_hat from: (y, beta) with `from_output`, else (s, None)."""
    return (y, beta) if from_output else (s, None)


def dropout_add_layer_norm(h: Tensor, residual: Tensor, norm: nn.LayerNorm, p: float,
                           dense_bias: Tensor | None = None, from_output: bool = False) -> Tensor:
    """`norm`(dropout(h + dense_bias, p) + residual) over the last axis, any leading shape; a fresh seed per call
    from torch's generator on h's device (so a rank's masks follow its seed, as nn.Dropout's do). `from_output`: the
    backward from y, no sum kept."""
    n = residual.shape[-1]
    y = torch.ops.bert.dropout_add_layer_norm(h.reshape(-1, n), residual.reshape(-1, n), norm.weight, norm.bias,
                                              dense_bias, dropout_seed(p, h.device), p, norm.eps, from_output)[0]
    return y.view(residual.shape)


class FusedResidualOutput(BertResidualOutput):
    """BertResidualOutput through `bert::dropout_add_layer_norm`, with the same submodules (names, checkpoints and
    optimizer groups unchanged). A plain nn.Linear's bias is added in the kernel, its gradient summed there; a float8
    linear (bert.model.fp8) keeps its bias in its own GEMM. `from_output` (RESIDUAL_NORM=fused-lean): the backward
    recovers x_hat from y, and the forward keeps no sum."""

    from_output = False

    @classmethod
    def from_module(cls, module: BertResidualOutput) -> FusedResidualOutput:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.dense, new.LayerNorm, new.dropout = module.dense, module.LayerNorm, module.dropout
        new.from_output = getattr(module, "from_output", False)
        return new.train(module.training)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        p = self.dropout.p if self.training else 0.0
        if type(self.dense) is nn.Linear:
            return dropout_add_layer_norm(F.linear(h, self.dense.weight), residual, self.LayerNorm, p, self.dense.bias,
                                          self.from_output)
        return dropout_add_layer_norm(self.dense(h), residual, self.LayerNorm, p, None, self.from_output)


def check_residual_norm(kind: str, device: torch.device) -> None:
    """A ValueError for a RESIDUAL_NORM that cannot run as asked on `device` (the fused one's GPU kernels are
    Triton's)."""
    _known(kind)
    if kind != "torch" and device.type == "cuda" and triton is None:
        raise ValueError(f"RESIDUAL_NORM={kind} needs Triton on CUDA (it ships with torch's CUDA wheels); it is not "
                         "installed here")


def _known(kind: str) -> str:
    if kind not in RESIDUAL_NORMS:
        raise ValueError(f"RESIDUAL_NORM={kind!r} is not one of {', '.join(RESIDUAL_NORMS)}")
    return kind


def apply_residual_norm(model: nn.Module, kind: str) -> list[str]:
    """RESIDUAL_NORM: with `fused` (or `fused-lean`, whose backward works from the output), swap every
    BertResidualOutput of `model` for a FusedResidualOutput, in place; the names swapped (none for `torch`)."""
    if _known(kind) == "torch":
        return []

    def fused(module: BertResidualOutput) -> FusedResidualOutput:
        new = FusedResidualOutput.from_module(module)
        new.from_output = kind == "fused-lean"
        return new

    return swap_modules(model, lambda module, _: type(module) is BertResidualOutput, fused)


# traced into compiled graphs by the ops' names, with this module's fakes and backward: an edit here must miss them
# (bert.model.compile_keys; the hash is the module's, so the backward op's name needs no key of its own)
key_on_source("bert::dropout_add_layer_norm", __file__)
