"""Flash attention with dropout on the unpadded tokens in Triton (`ATTENTION=triton`): our kernels for Hopper in
place of torch's FlashAttention-2.

Why: on the H100 (2026-11-26, `driver-compiled-opt`) torch's FlashAttention-2 took 23.8 ms of the 135.5 ms step,
about 130 TFLOP/s forward and backward, at phase 2's lengths (at most 512, half of them on average) with dropout 0.1.
FA2 was written for the A100: its matrix products are the A100's `mma` instructions, its tiles 128 x 128. Triton
compiles `tl.dot` on sm_90 to Hopper's warpgroup MMA, and the tiles here are smaller (64 keys), so a short sequence
wastes less of its last tile. Not measured on a GPU yet: whether it beats FA2 is the question the bench answers
(`bench/model.py --variants unpadded/varlen unpadded/triton`).

The kernels follow FlashAttention-2's algorithm [Dao-FlashAttention-2] on the concatenated tokens (`cu_seqlens`):

- **forward**, a program per (query block of BM, sequence, head): the keys of its own sequence in blocks of BN, an
  online softmax in base 2, the kept probabilities times V; it writes the output and the log-sum-exp (base 2).
- **backward**, two kernels, as Triton's fused-attention tutorial: one per key block (dK, dV, over the query blocks)
  and one per query block (dQ, over the key blocks), so no atomics; each recomputes the probabilities from the
  log-sum-exp, and reads the mask from the bits the forward wrote: (H, T, G) bytes, a bit an element (25 MB a
  BERT-large layer at 24,576 tokens), where drawing it again cost each backward kernel more instructions than all the
  rest of its work (SASS counted: 36 and 24 an element). Each row's bytes are read as 64-bit words, in the
  products' own layout (`_kept`). The dQ kernel, launched first, also computes delta = rowsum(dO * O), times
  1 - p, for the dK/dV kernel, in its one pass over dO; dS is computed times 1 - p, its 1 / (1 - p) applied at the
  stores (`_probabilities`).
- **packed**: the ops take q, k and v as one (T, 3, H, D) tensor, the QKV GEMM's output (bert.model.attend), and
  the backward's kernels write dq, dk and dv into one such gradient, where autograd's stack of three had copied
  them (7.2 GB of BERT-large's step on the fake H100, bench/gpu_compile.py).
- **float8** (FLOAT8, under delayed float8: bert.model.fp8_attention): the backward's kernels store that gradient
  in e5m2 for the float8 QKV's GEMMs, each tile with its amax and column sums, where inductor read the bf16 one back
  to cast it. The forward's FLOAT8 (bert.model.fp8_attention_block) writes the output in e4m3 only, the output
  projection's input, and the dQ kernel's delta then reads that copy (OUT_E4M3).

**The mask** is a pure function of the seed (a fresh 62-bit one per call from torch's generator, on the device, so CUDA
graphs replay fresh masks) and the element: for head h, query token i (its place in the T tokens) and key j (its place
in the sequence), counter c = (h * T + i) * G + j // 8 (G = 8 ceil(max_seqlen / 64), a row's bytes whole 64-bit words);
Philox4x32-7(c, key seed) gives four 32-bit words, of which element j takes word (j mod 8) // 2, half j mod 2, as a
16-bit number u; the element is dropped iff u < round(p * 2^16) (p to 2^-16; FA2's 8-bit threshold drops 0.1016 for
0.1). One Philox call serves eight elements. Seven rounds (`PHILOX_ROUNDS`) are FlashAttention-2's (its philox.cuh: six
rounds and a last one), so also those of torch's attention dropout on CUDA, the kernel this one replaces. Ten,
Random123's and C++26's default, keeps a margin above the fewest rounds that pass the known statistical tests; none is
known to fail at seven. Compiled for sm_90 the forward's loop with dropout runs 974 instructions where ten rounds ran
1,055 (bench/attention_sass.py), 8 % of the kernel's work; 680 since the forty-fifth session, the tile made from each
row's 32-bit words (`_draw`); the backward reads the bits and draws nothing. The kernel computes the counters in 32
bits, so a call's must stay below 2^31 (`check_counters`). The CPU draws the same numbers in
torch's arithmetic (`bert.model.philox`), so the kernels (run in Triton's interpreter by the tests) equal the torch
path's mask bit for bit. The bits of keys past a sequence's end, and of rows past it, are read by the backward but never
change a gradient (`_probabilities`); no byte past a row's G is read.

The torch path (the CPU, float64 anywhere) computes the same attention per sequence in torch's ops, and its backward
by the kernels' formulas (checked against autograd through a float64 reference by the tests).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bert.batch import SeqLayout
from bert.model.attend import Attend
from bert.model.compile_keys import key_on_source
from bert.model.fp8_delayed import E4M3, E5M2
from bert.model.philox import dropout_seed, randint4x

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheel has no Triton: the CPU path needs none
    triton = None

LOG2E = 1.4426950408889634  # log2(e): the kernels' softmax is base 2
PHILOX_ROUNDS = 7  # the mask's Philox4x32 rounds (module doc)
# (BM queries, BN keys, warps) a program takes: chosen by what sm_90's compile gives (bench/attention_sass.py), not
# timed on a GPU. The forward with 4 warps spilled 240 bytes a thread to the stack; the backward with 8 warps and 64
# queries ran twice the instructions an element (22 and 15 with 4).
FORWARD_TILE = (128, 64, 8)
BACKWARD_TILE = (64, 64, 4)
HEAD_DIMS = (16, 32, 64, 128)  # tl.dot's operands: a power of two, at least 16


def drop_threshold(p: float) -> int:
    """16-bit numbers below this are dropped: P = threshold / 2^16."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention dropout probability {p} is not in [0, 1)")
    return min(round(p * 2**16), 2**16 - 1)


def groups_per_row(max_seqlen: int) -> int:
    """G: a query row's Philox counters (eight keys each) and mask bytes, a multiple of 8 so that the backward
    reads a row's bytes as aligned 64-bit words (`_kept`)."""
    return -(-max_seqlen // 64) * 8


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch path's arithmetic: fp32, float64 for float64 (gradcheck's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def keep_mask(seed: Tensor, heads: int, tokens: int, rows: Tensor, length: int, groups: int, p: float) -> Tensor:
    """(heads, len(rows), length) bool: the elements kept for query tokens `rows` (their places in the T = `tokens`)
    and keys 0..length-1 of their sequence (module doc), in torch's arithmetic."""
    h = torch.arange(heads, device=rows.device)[:, None, None]
    g = torch.arange(-(-length // 8), device=rows.device)
    counters = (h * tokens + rows.to(torch.int64)[None, :, None]) * groups + g
    words = torch.stack(randint4x(seed, counters, PHILOX_ROUNDS), -1)  # (heads, rows, groups, 4)
    halves = torch.stack([words & 0xFFFF, words >> 16], -1)  # element 8g + 2w + half
    return halves.flatten(2)[..., :length] >= drop_threshold(p)


def pack_bits(keep: Tensor, groups: int) -> Tensor:
    """(..., n) bool -> (..., groups) uint8: bit s of byte g is element 8g + s (elements past n: 0)."""
    padded = torch.zeros(*keep.shape[:-1], groups * 8, dtype=torch.int32, device=keep.device)
    padded[..., :keep.shape[-1]] = keep.int()
    shifts = torch.arange(8, dtype=torch.int32, device=keep.device)
    return (padded.unflatten(-1, (groups, 8)) << shifts).sum(-1).to(torch.uint8)


def unpack_bits(bits: Tensor, n: int) -> Tensor:
    """`pack_bits` undone: (..., n) bool."""
    shifts = torch.arange(8, dtype=torch.int32, device=bits.device)
    return ((bits.int()[..., None] >> shifts) & 1).flatten(-2)[..., :n].bool()


def attention_torch(q: Tensor, k: Tensor, v: Tensor, lengths: list[int], max_seqlen: int, p: float,
                    seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(out (T, H, D) in q's dtype, log-sum-exp base 2 (H, T) in the compute dtype, the mask's bits (H, T, G) uint8,
    none when p = 0): the kernels' attention and mask, per sequence in torch's ops (fp32 arithmetic, float64 for
    float64)."""
    compute = _compute_dtype(q.dtype)
    tokens, heads, dim = q.shape
    scale, groups = 1.0 / math.sqrt(dim), groups_per_row(max_seqlen)
    bits = torch.zeros((heads, tokens if p > 0 else 0, groups), dtype=torch.uint8, device=q.device)
    outs, lses, start = [], [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].to(compute).transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        scores = qs @ ks.transpose(1, 2) * scale
        probs = torch.softmax(scores, -1)
        if p > 0:
            keep = keep_mask(seed, heads, tokens, torch.arange(start, start + n, device=q.device), n, groups, p)
            bits[:, start:start + n] = pack_bits(keep, groups)
            probs = torch.where(keep, probs / (1.0 - p), 0.0)
        outs.append((probs @ vs).transpose(0, 1))
        lses.append(torch.logsumexp(scores, -1) * LOG2E)
        start += n
    return torch.cat(outs).to(q.dtype), torch.cat(lses, 1), bits


def backward_torch(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, bits: Tensor, lengths: list[int],
                   p: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `attention_torch`, by the kernels' formulas per sequence, the mask from the forward's bits: P
    again from the scores, dV = P~^T dO, dP = (dO V^T) with the mask and scale, dS = P * (dP - rowsum(dO * O)),
    dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D) (P~: P with the mask and scale)."""
    compute = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    grads, start = [[], [], []], 0
    for n in lengths:
        qs, ks, vs, dos, outs = (t[start:start + n].to(compute).transpose(0, 1) for t in (q, k, v, grad, out))
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, -1)
        dprobs = dos @ vs.transpose(1, 2)
        kept = probs
        if p > 0:
            keep = unpack_bits(bits[:, start:start + n], n)
            kept = torch.where(keep, probs / (1.0 - p), 0.0)
            dprobs = torch.where(keep, dprobs / (1.0 - p), 0.0)
        ds = probs * (dprobs - (dos * outs).sum(-1, keepdim=True))
        for got, g in zip(grads, (ds @ ks * scale, ds.transpose(1, 2) @ qs * scale, kept.transpose(1, 2) @ dos)):
            got.append(g.transpose(0, 1))
        start += n
    return tuple(torch.cat(g).to(q.dtype).contiguous() for g in grads)


if triton is not None:
    _ROUNDS = tl.constexpr(PHILOX_ROUNDS)  # a kernel reads a global only as a constexpr

    @triton.jit
    def _draw(seed, head, rows, n0, tokens, groups, threshold, BM: tl.constexpr, BN: tl.constexpr):
        """The mask of query tokens `rows` (their places in the T tokens) against keys n0..n0+BN-1 of their
        sequence: (kept (BM, BN) bool, its 32-bit words (BM, ceil(BN / 32)) int32, bit s of word w being key
        n0 + 32w + s; 16 bits for a BN of 16). Key n0 + 8g + s is kept iff half s % 2 of word s // 2 of Philox call
        g is at or above `threshold`. `seed`: the key, loaded once a program (in the loop the pipeliner copied it
        through shared memory each block). Counters in 32 bits: `check_counters`.

        The tile comes from each row's words, not from the calls' (BM, BN // 8) bytes: a (BM,) tensor a word, which
        the products' layout reads as `_kept` reads its loads. Unpacked from the bytes by joins and a reshape, the
        tile was laid out as the calls and converted to the products' layout through shared memory (the forward's
        sm_90 loop 881 instructions with dropout, bench/attention_sass.py). A row's bytes are summed into its
        words (their bits are apart, so the sum is their OR), and the words are what the kernel stores."""
        W: tl.constexpr = (BN + 31) // 32
        part = tl.arange(0, BN // 8)  # a row's Philox calls in the block, BN // 8 // W to a word
        counter = ((head * tokens + rows).to(tl.int32) * groups)[:, None] + (part + n0 // 8).to(tl.int32)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, counter, _ROUNDS)
        byte = (_two_bits(r0, threshold) | (_two_bits(r1, threshold) << 2) | (_two_bits(r2, threshold) << 4)
                | (_two_bits(r3, threshold) << 6))
        words = tl.sum(tl.reshape(byte << (8 * (part % (BN // 8 // W)))[None, :], (BM, W, BN // 8 // W)), 2)
        cols = tl.arange(0, BN)[None, :]
        return _word_bits(_word_tile(words, cols, BM, BN), cols), words

    @triton.jit
    def _word_tile(words, cols, BM: tl.constexpr, BN: tl.constexpr):
        """(BM, BN) int32: each element's word of its row, (BM, ceil(BN / 32)) `words`, taken apart by splits (by a
        sum over a one-hot column the forward's loop ran 845 instructions where this runs 678)."""
        W: tl.constexpr = (BN + 31) // 32
        if W == 1:
            word = tl.broadcast_to(words, (BM, BN))
        elif W == 2:
            w0, w1 = tl.split(words)
            word = tl.where(cols < 32, w0[:, None], w1[:, None])
        elif W == 4:
            w0, w1, w2, w3 = _four(words, BM)
            word = _pick4(cols, w0, w1, w2, w3)
        else:  # 8: BN 256
            even, odd = tl.split(tl.reshape(words, (BM, 4, 2)))
            w0, w2, w4, w6 = _four(even, BM)
            w1, w3, w5, w7 = _four(odd, BM)
            word = tl.where(cols < 128, _pick4(cols, w0, w1, w2, w3), _pick4(cols - 128, w4, w5, w6, w7))
        return word

    @triton.jit
    def _pick4(cols, a, b, c, d):
        """(BM, BN): a, b, c or d ((BM,) each) by cols // 32, for cols below 128."""
        return tl.where(cols < 64, tl.where(cols < 32, a[:, None], b[:, None]),
                        tl.where(cols < 96, c[:, None], d[:, None]))

    @triton.jit
    def _four(x, BM: tl.constexpr):
        """The four columns of a (BM, 4) tensor."""
        even, odd = tl.split(tl.reshape(x, (BM, 2, 2)))
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3

    @triton.jit
    def _two_bits(word, threshold):
        """Bit 0: the word's low 16 bits are kept; bit 1: its high 16 bits. Both compared as 32 bits, unsigned, with
        the threshold in the high half: the high half needs no shift (the loop's 694 instructions: 678)."""
        high = threshold.to(tl.uint32) << 16
        return ((word << 16) >= high).to(tl.int32) | ((word >= high).to(tl.int32) << 1)

    @triton.jit
    def _kept(BITS, head, tokens, groups, start, rows, row_in, n0, BM: tl.constexpr, BN: tl.constexpr):
        """(BM, BN) bool: the mask of query tokens start + rows (local `rows`, `row_in` inside the sequence) against
        keys n0..n0+BN-1, each row's bytes read as 64-bit words, a (BM,) load each (G is a multiple of 8, so the
        block's first word is inside the row; a later one may not be: 32 or 16 bits for a smaller BN).

        Why: unpacked from the tile's (BM, BN // 8) bytes by joins, the mask was laid out a byte a thread, where the
        products' tile (Hopper's MMA layout) holds two bits of each byte a thread: the conversion took dK dV's sm_90
        loop 261 instructions (bench/attention_sass.py). A (BM,) load is read from shared memory in the products'
        own layout, each thread its rows' words. There an element is key 8j + 2l + c of its row, l from the
        thread's lane and j, c from its register: shifted by cols & 6 once a word (the lane's), each element's bit
        is at a constant place, cols & 25, which the compiler moves into predicates two at a time."""
        cols = tl.arange(0, BN)[None, :]
        first = (head * tokens + start + rows) * groups + n0 // 8  # the row's byte of key n0
        if BN >= 64:
            word = tl.zeros((BM, BN), tl.int32)
            for i in tl.static_range(BN // 64):  # `cols // 32 == ...` folds: each register's word is known
                inside = row_in if i == 0 else row_in & (n0 // 8 + 8 * i < groups)
                w = tl.load((BITS + first + 8 * i).to(tl.pointer_type(tl.int64)), mask=inside, other=0)
                word = tl.where(cols // 32 == 2 * i, w.to(tl.int32)[:, None], word)
                word = tl.where(cols // 32 == 2 * i + 1, (w >> 32).to(tl.int32)[:, None], word)
        elif BN == 32:  # bench/attention_tiles.py's candidates
            w = tl.load((BITS + first).to(tl.pointer_type(tl.int32)), mask=row_in, other=0)
            word = tl.broadcast_to(w[:, None], (BM, BN))
        else:  # 16, the interpreter's small tiles: the high half (sign bits) is never read
            w = tl.load((BITS + first).to(tl.pointer_type(tl.int16)), mask=row_in, other=0)
            word = tl.broadcast_to(w.to(tl.int32)[:, None], (BM, BN))
        return _word_bits(word, cols)

    @triton.jit
    def _word_bits(word, cols):
        """Bit cols % 32 of each element's word, as two shifts: cols & 6 is the same for all of a thread's elements
        in the products' layout (its lane's), cols & 25 a constant of its register (`_kept`)."""
        return ((word >> (cols & 6)) >> (cols & 25)) & 1 != 0

    @triton.jit
    def _sequence(cu):
        """(start, length) of program_id(1)'s sequence: a reduction of its two bounds, so both are scalars."""
        bounds = tl.load(cu + tl.program_id(1) + tl.arange(0, 2)).to(tl.int64)
        start = tl.min(bounds, 0)
        return start, tl.max(bounds, 0) - start

    @triton.jit
    def _rows_of(X, start, length, stride, head, head_stride, first, B: tl.constexpr, D: tl.constexpr):
        """A block pointer to rows first..first+B-1 of one head of the sequence's (length, D) slice of X: 32-bit
        offsets from one base, and loads padded with zeros past the sequence's end (a tensor of 64-bit pointers,
        one an element, spilled registers: found compiling for sm_90)."""
        return tl.make_block_ptr(X + start * stride + head * head_stride, shape=(length, D), strides=(stride, 1),
                                 offsets=(first, 0), block_shape=(B, D), order=(1, 0))

    @triton.jit
    def _words_at(BITS, head, tokens, groups, start, rows, n0, BN: tl.constexpr):
        """Pointers to the mask's 32-bit words (16-bit for a BN of 16) of query tokens start + rows (local `rows`)
        and keys n0..n0+BN-1, and which of them exist ((1, ceil(BN / 32)): a row has G bytes, a multiple of 8)."""
        W: tl.constexpr = (BN + 31) // 32
        g = n0 // 8 + BN // 8 // W * tl.arange(0, W)  # each word's first byte
        at = BITS + ((head * tokens + start + rows) * groups)[:, None] + g[None, :]
        return at.to(tl.pointer_type(tl.int32 if BN >= 32 else tl.int16)), g[None, :] < groups

    @triton.jit
    def _forward_tile(q, k_at, v_at, m_i, l_i, acc, n0, length, seed, BITS, head, start, rows, tokens, groups,
                      threshold, qk_scale, BM: tl.constexpr, BN: tl.constexpr, DROPOUT: tl.constexpr,
                      MASKED: tl.constexpr):
        """One key block of the online softmax; MASKED: the sequence's last, cut one (bounds checked, keys past the
        end at -inf), else a full block with no per-element test. With dropout it draws the block's mask and writes
        its bits for the backward."""
        if MASKED:
            k = tl.load(k_at, boundary_check=(0,), padding_option="zero")
            v = tl.load(v_at, boundary_check=(0,), padding_option="zero")
            s = tl.where((n0 + tl.arange(0, BN) < length)[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        else:
            k = tl.load(k_at)
            v = tl.load(v_at)
            s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        prob = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FFMA an element
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(prob, 1)
        if DROPOUT:
            kept, words = _draw(seed, head, start + rows, n0, tokens, groups, threshold, BM, BN)
            at, inside = _words_at(BITS, head, tokens, groups, start, rows, n0, BN)
            tl.store(at, words.to(at.dtype.element_ty), mask=inside & (rows < length)[:, None])
            # a zero the compiler cannot fold (qk_scale is finite): against a constant it moved the select past the
            # bf16 conversion below, selecting halves of registers (the loop's 819 instructions against 792)
            prob = tl.where(kept, prob, qk_scale * 0.0)
        return m_new, l_i, acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)

    @triton.jit
    def _forward(Q, K, V, OUT, LSE, BITS, cu, seed, tokens, groups, threshold, qk_scale, drop_scale,
                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, OQ, OQT, SCALE, AMAXES,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DROPOUT: tl.constexpr,
                 FLOAT8: tl.constexpr):
        """FLOAT8: the output rounded to q's dtype, times SCALE, saturated and stored in e4m3 only, into OQ ((T, H,
        D), strides so_t, so_h) and transposed into OQT ((H D, T), `_columns_of`), the next float8 linear's input and
        its weight gradient's operand (bert.model.fp8_attention_block), the tile's largest magnitude into
        AMAXES[program] (infinity for a NaN: not kept); OUT is not written (the backward's delta reads OQ)."""
        head = tl.program_id(2)
        start, length = _sequence(cu)
        m0 = tl.program_id(0) * BM
        if m0 < length:
            rows = m0 + tl.arange(0, BM)
            q = tl.load(_rows_of(Q, start, length, sq_t, head, sq_h, m0, BM, D), boundary_check=(0,),
                        padding_option="zero")
            k_at = _rows_of(K, start, length, sk_t, head, sk_h, 0, BN, D)
            v_at = _rows_of(V, start, length, sv_t, head, sv_h, 0, BN, D)
            m_i = tl.full((BM,), float("-inf"), tl.float32)
            l_i = tl.zeros((BM,), tl.float32)
            acc = tl.zeros((BM, D), tl.float32)
            key = tl.load(seed) if DROPOUT else 0
            full = length // BN * BN
            for n0 in tl.range(0, full, BN, num_stages=2):
                m_i, l_i, acc = _forward_tile(q, k_at, v_at, m_i, l_i, acc, n0, length, key, BITS, head, start, rows,
                                              tokens, groups, threshold, qk_scale, BM, BN, DROPOUT, False)
                k_at = tl.advance(k_at, (BN, 0))
                v_at = tl.advance(v_at, (BN, 0))
            if full < length:
                m_i, l_i, acc = _forward_tile(q, k_at, v_at, m_i, l_i, acc, full, length, key, BITS, head, start,
                                              rows, tokens, groups, threshold, qk_scale, BM, BN, DROPOUT, True)
            out = (acc * (drop_scale / l_i)[:, None]).to(Q.dtype.element_ty)
            if not FLOAT8:
                tl.store(_rows_of(OUT, start, length, so_t, head, so_h, m0, BM, D), out, boundary_check=(0,))
            tl.store(LSE + head * tokens + start + rows, m_i + tl.math.log2(l_i), mask=rows < length)
            if FLOAT8:
                r = tl.where((rows < length)[:, None], out.to(tl.float32), 0.0)
                e4m3 = tl.clamp(r * tl.load(SCALE), -448.0, 448.0).to(tl.float8e4nv)  # e4m3's largest: saturated
                tl.store(_rows_of(OQ, start, length, so_t, head, so_h, m0, BM, D), e4m3, boundary_check=(0,))
                tl.store(_columns_of(OQT, start, length, tokens, 0, head, m0, BM, D), tl.trans(e4m3),
                         boundary_check=(1,))
                slot = (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * tl.num_programs(2) + head
                tl.store(AMAXES + slot, tl.max(tl.max(tl.where(r == r, tl.abs(r), float("inf")), 1), 0))

    @triton.jit
    def _probabilities(q, k, do, v, lse, delta, BITS, head, tokens, groups, start, rows, row_in, n0, qk_scale,
                       BM: tl.constexpr, BN: tl.constexpr, DROPOUT: tl.constexpr):
        """(P~, dS (1 - p)) of a (BM, BN) tile, P~ being P with the mask and `delta` rowsum(dO * O) (1 - p): the
        backward kernels' shared part. The 1 / (1 - p) of dV and dS are applied once, at the gradients' stores.

        With dropout dS (1 - p) = P~ dP - P delta (1 - p): one select an element, P~'s, for dV's operand and dS both.
        As P (dP with the mask / (1 - p) - delta) it took a second one, and the compiler moved P~'s past dV's
        conversion to bf16, selecting halves of registers (sm_90, dK dV's loop: 632 instructions against 553).

        No bounds test an element: past the sequence's end q, k, v and dO are loaded as zeros and the log-sum-exp and
        delta as zeros, so a query row past it gives P = 1 and dS = 0 (dO = 0), whatever its mask. A key past it
        scores 0, so its P is 2^-lse, unbounded (a row's scores may all sit far below 0: softmax does not see a
        shift): in dK and dV that is a row never stored, but dQ's product with its zero K row would turn an inf
        into NaN, so `_backward_q` zeroes dS past the end in the sequence's last key block."""
        prob = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        dprob = tl.dot(do, tl.trans(v))
        if DROPOUT:
            dropped = tl.where(_kept(BITS, head, tokens, groups, start, rows, row_in, n0, BM, BN), prob, 0.0)
            return dropped, dropped * dprob - prob * delta[:, None]
        return prob, prob * (dprob - delta[:, None])

    @triton.jit
    def _columns_of(XT, start, length, tokens, part, head, first, B: tl.constexpr, D: tl.constexpr):
        """A block pointer to the transposed (3 H D, T) gradient: head `head`'s D rows of q, k or v (`part`), the
        sequence's tokens first..first+B-1 (contiguous: B bytes a row), none past its end."""
        row = (part * tl.num_programs(2) + head).to(tl.int64) * D
        return tl.make_block_ptr(XT + row * tokens + start, shape=(D, length), strides=(tokens, 1), offsets=(0, first),
                                 block_shape=(D, B), order=(1, 0))

    @triton.jit
    def _float8_store(at, t_at, value, live, ROUND: tl.constexpr, SCALE, AMAXES, PARTS, slot, D: tl.constexpr):
        """A gradient tile of a float8 QKV (FLOAT8, bert.model.fp8_attention): rounded to ROUND (q's dtype, as the
        unfused path holds it), scaled by SCALE, saturated and stored in e5m2 at block pointer `at`, and transposed
        at `t_at` (`_columns_of`: the weight gradient's operand); of its rows inside the sequence (`live`), the
        largest magnitude into AMAXES[slot] (infinity for a NaN: not kept) and the column sums, unrounded, into
        PARTS[slot] (the QKV bias's gradient, summed over the slots after)."""
        r = tl.where(live[:, None], value.to(ROUND).to(tl.float32), 0.0)
        e5m2 = tl.clamp(r * tl.load(SCALE), -57344.0, 57344.0).to(tl.float8e5)
        tl.store(at, e5m2, boundary_check=(0,))
        tl.store(t_at, tl.trans(e5m2), boundary_check=(1,))
        tl.store(AMAXES + slot, tl.max(tl.max(tl.where(r == r, tl.abs(r), float("inf")), 1), 0))
        tl.store(PARTS + slot * D + tl.arange(0, D), tl.sum(tl.where(live[:, None], value, 0.0), 0))

    @triton.jit
    def _backward_kv(Q, K, V, DO, LSE, DELTA, BITS, DK, DV, cu, tokens, groups, qk_scale, sm_scale, drop_scale,
                     sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sdo_t, sdo_h, sd_t, SCALE, AMAXES, PARTS, GRAD_T,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DROPOUT: tl.constexpr,
                     FLOAT8: tl.constexpr):
        head = tl.program_id(2)
        start, length = _sequence(cu)
        n0 = tl.program_id(0) * BN
        if n0 < length:
            k = tl.load(_rows_of(K, start, length, sk_t, head, sk_h, n0, BN, D), boundary_check=(0,),
                        padding_option="zero")
            v = tl.load(_rows_of(V, start, length, sv_t, head, sv_h, n0, BN, D), boundary_check=(0,),
                        padding_option="zero")
            q_at = _rows_of(Q, start, length, sq_t, head, sq_h, 0, BM, D)
            do_at = _rows_of(DO, start, length, sdo_t, head, sdo_h, 0, BM, D)
            dk = tl.zeros((BN, D), tl.float32)
            dv = tl.zeros((BN, D), tl.float32)
            for m0 in tl.range(0, length, BM, num_stages=2):
                rows = m0 + tl.arange(0, BM)
                row_in = rows < length
                q = tl.load(q_at, boundary_check=(0,), padding_option="zero")
                do = tl.load(do_at, boundary_check=(0,), padding_option="zero")
                lse = tl.load(LSE + head * tokens + start + rows, mask=row_in, other=0.0)
                delta = tl.load(DELTA + head * tokens + start + rows, mask=row_in, other=0.0)
                dropped, ds = _probabilities(q, k, do, v, lse, delta, BITS, head, tokens, groups, start, rows, row_in,
                                             n0, qk_scale, BM, BN, DROPOUT)
                dv += tl.dot(tl.trans(dropped.to(do.dtype)), do)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
                q_at = tl.advance(q_at, (BM, 0))
                do_at = tl.advance(do_at, (BM, 0))
            ds_scale = sm_scale * drop_scale  # dS's 1 / (1 - p) too
            # dk and dv: views of the packed (T, 3, H, D) gradient, rows sd_t apart
            dk_at = _rows_of(DK, start, length, sd_t, head, D, n0, BN, D)
            dv_at = _rows_of(DV, start, length, sd_t, head, D, n0, BN, D)
            if FLOAT8:
                live = n0 + tl.arange(0, BN) < length
                slot = ((tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + head) * 2
                _float8_store(dk_at, _columns_of(GRAD_T, start, length, tokens, 1, head, n0, BN, D), dk * ds_scale,
                              live, Q.dtype.element_ty, SCALE, AMAXES, PARTS, slot, D)
                _float8_store(dv_at, _columns_of(GRAD_T, start, length, tokens, 2, head, n0, BN, D), dv * drop_scale,
                              live, Q.dtype.element_ty, SCALE, AMAXES, PARTS, slot + 1, D)
            else:
                tl.store(dk_at, (dk * ds_scale).to(DK.dtype.element_ty), boundary_check=(0,))
                tl.store(dv_at, (dv * drop_scale).to(DV.dtype.element_ty), boundary_check=(0,))

    @triton.jit
    def _dq_tile(q, do, lse, delta, k_at, v_at, dq, BITS, head, tokens, groups, start, rows, row_in, n0, length,
                 qk_scale, BM: tl.constexpr, BN: tl.constexpr, DROPOUT: tl.constexpr,
                 MASKED: tl.constexpr):
        """dQ's sum over one key block; MASKED: the sequence's last, cut one, its dS zeroed past the end."""
        if MASKED:
            k = tl.load(k_at, boundary_check=(0,), padding_option="zero")
            v = tl.load(v_at, boundary_check=(0,), padding_option="zero")
        else:
            k = tl.load(k_at)
            v = tl.load(v_at)
        _, ds = _probabilities(q, k, do, v, lse, delta, BITS, head, tokens, groups, start, rows, row_in, n0, qk_scale,
                               BM, BN, DROPOUT)
        if MASKED:
            ds = tl.where((n0 + tl.arange(0, BN) < length)[None, :], ds, 0.0)
        return dq + tl.dot(ds.to(k.dtype), k)

    @triton.jit
    def _backward_q(Q, K, V, DO, OUT, LSE, DELTA, BITS, DQ, cu, tokens, groups, qk_scale, sm_scale, drop_scale,
                    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sdo_t, sdo_h, so_t, so_h, sd_t, SCALE, AMAXES, PARTS, GRAD_T,
                    OUT_INV, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DROPOUT: tl.constexpr,
                    FLOAT8: tl.constexpr, OUT_E4M3: tl.constexpr):
        """dQ of a query block, and first its rows' delta = rowsum(dO * O) (1 - p) in fp32, stored for `_backward_kv`
        (launched after it): each (row, head) has one program here, and O is read once, in the one pass over dO.
        OUT_E4M3: O is the forward's e4m3 copy (FLOAT8's), each element times OUT_INV (1 / its scale) before the
        product."""
        head = tl.program_id(2)
        start, length = _sequence(cu)
        m0 = tl.program_id(0) * BM
        if m0 < length:
            rows = m0 + tl.arange(0, BM)
            row_in = rows < length
            q = tl.load(_rows_of(Q, start, length, sq_t, head, sq_h, m0, BM, D), boundary_check=(0,),
                        padding_option="zero")
            do = tl.load(_rows_of(DO, start, length, sdo_t, head, sdo_h, m0, BM, D), boundary_check=(0,),
                         padding_option="zero")
            o = tl.load(_rows_of(OUT, start, length, so_t, head, so_h, m0, BM, D), boundary_check=(0,),
                        padding_option="zero")
            o = o.to(tl.float32)
            if OUT_E4M3:
                o = o * tl.load(OUT_INV)
            delta = tl.sum(do.to(tl.float32) * o, 1)  # 0 past the end (dO and O loaded as 0)
            delta = delta * (1.0 / drop_scale)  # times 1 - p, as `_probabilities` takes it
            tl.store(DELTA + head * tokens + start + rows, delta, mask=row_in)
            lse = tl.load(LSE + head * tokens + start + rows, mask=row_in, other=0.0)
            k_at = _rows_of(K, start, length, sk_t, head, sk_h, 0, BN, D)
            v_at = _rows_of(V, start, length, sv_t, head, sv_h, 0, BN, D)
            dq = tl.zeros((BM, D), tl.float32)
            full = length // BN * BN
            for n0 in tl.range(0, full, BN, num_stages=2):
                dq = _dq_tile(q, do, lse, delta, k_at, v_at, dq, BITS, head, tokens, groups, start, rows, row_in, n0,
                              length, qk_scale, BM, BN, DROPOUT, False)
                k_at = tl.advance(k_at, (BN, 0))
                v_at = tl.advance(v_at, (BN, 0))
            if full < length:
                dq = _dq_tile(q, do, lse, delta, k_at, v_at, dq, BITS, head, tokens, groups, start, rows, row_in, full,
                              length, qk_scale, BM, BN, DROPOUT, True)
            dq_at = _rows_of(DQ, start, length, sd_t, head, D, m0, BM, D)
            ds_scale = sm_scale * drop_scale  # dS's 1 / (1 - p) too
            if FLOAT8:
                slot = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + head
                _float8_store(dq_at, _columns_of(GRAD_T, start, length, tokens, 0, head, m0, BM, D), dq * ds_scale,
                              row_in, Q.dtype.element_ty, SCALE, AMAXES, PARTS, slot, D)
            else:
                tl.store(dq_at, (dq * ds_scale).to(DQ.dtype.element_ty), boundary_check=(0,))


def check_tile(tile: tuple[int, int, int]) -> tuple[int, int, int]:
    """(BM, BN, warps) the kernels take: blocks of 16 to 256 rows in powers of two (tl.dot's operands; BN a whole
    number of mask bytes), 1 to 8 warps in powers of two."""
    bm, bn, warps = tile
    if not all(16 <= b <= 256 and b & (b - 1) == 0 for b in (bm, bn)) or warps not in (1, 2, 4, 8):
        raise ValueError(f"a tile is (BM, BN, warps) with BM and BN powers of two in 16..256 and 1, 2, 4 or 8 warps, "
                         f"not {tile}")
    return bm, bn, warps


def check_counters(heads: int, tokens: int, groups: int) -> None:
    """The forward kernel computes the mask's Philox counters, c = (h T + i) G + j // 8, in 32 bits (64-bit ones took
    its sm_90 loop 18 instructions more): every c it computes is below (H T + 256) G (a last query block's rows run up
    to 256 past the last token, unstored), which must be at most 2^31: 2 million tokens a call at 16 heads and 512
    keys. There they equal the 64-bit ones the torch path computes, so the mask is the same."""
    if (heads * tokens + 256) * groups > 2**31:
        raise ValueError(f"ATTENTION=triton's dropout mask takes Philox counters below 2^31: {heads} heads x "
                         f"{tokens} tokens (+ 256) x {groups} mask bytes a row is {(heads * tokens + 256) * groups}")


def _strides(*tensors: Tensor) -> list[int]:
    return [s for t in tensors for s in (t.stride(0), t.stride(1))]


def _common(q: Tensor, max_seqlen: int, p: float) -> tuple[int, float, float, float, int]:
    """(G, softmax scale, its base-2 form, 1 / (1 - p), threshold)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return groups_per_row(max_seqlen), scale, scale * LOG2E, 1.0 / (1.0 - p), drop_threshold(p)


def launch_forward(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, p: float, seed: Tensor | None,
                   tile: tuple[int, int, int] = FORWARD_TILE, scale: Tensor | None = None
                   ) -> tuple[Tensor, ...]:
    """The forward kernel: (out (T, H, D) contiguous, log-sum-exp base 2 (H, T) fp32, the mask's bits (H, T, G)
    uint8, none when p = 0); on q's device. `tile`: (BM, BN, warps), other than the default for
    bench/attention_tiles.py. With `scale` (0-dim fp32, e4m3's: bert.model.fp8_attention_block) out in e4m3 in its
    place, the same transposed ((H D, T) contiguous) and its amax (the kernel's FLOAT8): (lse, bits, o_q, o_qt,
    amax)."""
    tokens, heads, dim = q.shape
    groups, _, qk_scale, drop_scale, threshold = _common(q, max_seqlen, p)
    if p > 0:  # before anything is allocated
        check_counters(heads, tokens, groups)
    float8 = scale is not None
    lse = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)
    # bytes past a sequence's groups are never written nor read (a sequence shorter than max_seqlen)
    bits = torch.empty((heads, tokens if p > 0 else 0, groups), dtype=torch.uint8, device=q.device)
    bm, bn, warps = check_tile(tile)
    grid = (triton.cdiv(max_seqlen, bm), cu.shape[0] - 1, heads)
    o_q = torch.empty((tokens, heads, dim) if float8 else 0, dtype=E4M3, device=q.device)
    o_qt = torch.empty((heads * dim, tokens) if float8 else 0, dtype=E4M3, device=q.device)
    out = o_q if float8 else q.new_empty((tokens, heads, dim))  # the output the kernel writes, row-major
    programs = grid[0] * grid[1] * grid[2]
    amaxes = torch.zeros(max(1, programs) if float8 else 0, dtype=torch.float32, device=q.device)  # 0: none ran
    # a flag off leaves its pointer unread: out stands in (an empty tensor's pointer may be null), and under float8,
    # which writes no bf16 out, q (its dtype: the same kernel)
    stand_in = q if float8 else out
    _forward[grid](q, k, v, stand_in, lse, bits if p > 0 else stand_in, cu, stand_in if seed is None else seed,
                   tokens, groups, threshold, qk_scale, drop_scale, *_strides(q, k, v, out),
                   *((o_q, o_qt, scale, amaxes) if float8 else (out,) * 4),
                   D=dim, BM=bm, BN=bn, DROPOUT=p > 0, FLOAT8=float8, num_warps=warps)
    return (lse, bits, o_q, o_qt, amaxes.amax()) if float8 else (out, lse, bits)


def launch_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bits: Tensor,
                    cu: Tensor, max_seqlen: int, p: float, q_tile: tuple[int, int, int] = BACKWARD_TILE,
                    kv_tile: tuple[int, int, int] = BACKWARD_TILE, scale: Tensor | None = None,
                    out_inv: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward kernels: the gradient of the packed QKV, (T, 3, H, D) contiguous in q's dtype, each kernel
    writing its part in place (bert.model.attend: no copy stacks dq, dk and dv). `q_tile`, `kv_tile`: the dQ and
    the dK/dV kernel's (BM, BN, warps). With `scale` (0-dim fp32: a float8 QKV's, bert.model.fp8_attention) the
    gradient is stored in e5m2, rounded to q's dtype and scaled first, and with it come the same transposed
    ((3 H D, T) contiguous: the weight gradient's operand), its column sums (3, H, D) fp32 (the QKV bias's gradient)
    and its amax. With `out_inv` (0-dim fp32, 1 / out's scale) `out` is the forward's e4m3 copy (FLOAT8's,
    bert.model.fp8_attention_block), which delta reads in its place."""
    tokens, heads, dim = q.shape
    delta = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)  # rowsum(dO * O), by the dQ kernel
    float8 = scale is not None
    dqkv = torch.empty((tokens, 3, heads, dim), dtype=E5M2 if float8 else q.dtype, device=q.device)
    dq, dk, dv = dqkv.unbind(1)
    groups, sm_scale, qk_scale, drop_scale, _ = _common(q, max_seqlen, p)
    if p > 0 and (bits.shape[-1] != groups or bits.data_ptr() % 8):  # `_kept` reads aligned 64-bit words
        raise ValueError(f"the mask's bits are (H, T, {groups}) bytes from an 8-byte boundary, not {tuple(bits.shape)} "
                         f"at {bits.data_ptr() % 8} past one")
    bits = bits if p > 0 else dqkv
    strides = _strides(q, k, v, grad)
    sequences = cu.shape[0] - 1
    bm, bn, warps = check_tile(q_tile)
    kv_bm, kv_bn, kv_warps = check_tile(kv_tile)
    q_grid = (triton.cdiv(max_seqlen, bm), sequences, heads)
    kv_grid = (triton.cdiv(max_seqlen, kv_bn), sequences, heads)
    # float8's slots, a program's (and part's) amax and column sums: a program past its sequence's end writes none,
    # so they start at 0
    q_slots, kv_slots = (math.prod(q_grid), 2 * math.prod(kv_grid)) if float8 else (0, 0)
    zeros = dict(dtype=torch.float32, device=q.device)
    q_parts, kv_parts, amaxes = (torch.zeros((q_slots, dim), **zeros), torch.zeros((kv_slots, dim), **zeros),
                                 torch.zeros(q_slots + kv_slots, **zeros))
    q_amaxes, kv_amaxes = amaxes[:q_slots], amaxes[q_slots:]
    # unread without float8: delta stands in (an empty tensor's pointer may be null)
    dqkv_t = torch.empty((3 * heads * dim if float8 else 0, tokens), dtype=E5M2, device=q.device)
    flags = (scale, q_amaxes, q_parts, dqkv_t) if float8 else (delta,) * 4
    _backward_q[q_grid](  # first: it writes delta
        q, k, v, grad, out, lse, delta, bits, dq, cu, tokens, groups, qk_scale, sm_scale, drop_scale, *strides,
        *_strides(out), dqkv.stride(0), *flags, delta if out_inv is None else out_inv, D=dim, BM=bm, BN=bn,
        DROPOUT=p > 0, FLOAT8=float8, OUT_E4M3=out_inv is not None, num_warps=warps)
    flags = (scale, kv_amaxes, kv_parts, dqkv_t) if float8 else (delta,) * 4
    _backward_kv[kv_grid](
        q, k, v, grad, lse, delta, bits, dk, dv, cu, tokens, groups, qk_scale, sm_scale, drop_scale, *strides,
        dqkv.stride(0), *flags, D=dim, BM=kv_bm, BN=kv_bn, DROPOUT=p > 0, FLOAT8=float8, num_warps=kv_warps)
    if not float8:
        return dqkv
    # slots: q's by (block, sequence, head); k's and v's by (block, sequence, head, part)
    sums = torch.cat([q_parts.view(-1, 1, heads, dim).sum(0), kv_parts.view(-1, heads, 2, dim).sum(0).transpose(0, 1)])
    return dqkv, dqkv_t, sums, amaxes.amax()


def _on_triton(q: Tensor) -> bool:
    """The kernels' path: CUDA with Triton, half precision, a head dimension tl.dot takes."""
    return q.is_cuda and triton is not None and q.dtype in (torch.float16, torch.bfloat16) \
        and q.shape[-1] in HEAD_DIMS


def _check(q: Tensor, k: Tensor, v: Tensor, p: float, seed: Tensor | None = None, forward: bool = True) -> None:
    """One (T, H, D) shape with unit last strides (the kernels' block pointers), p in [0, 1), a seed to drop with."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape or q.stride(-1) != 1 or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        raise ValueError(f"q, k, v must be one (T, H, D) shape with unit last strides, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    drop_threshold(p)
    if forward and p > 0 and seed is None:
        raise ValueError("attention dropout needs a seed")


@torch.library.custom_op("bert::triton_attention", mutates_args=())
def triton_attention_op(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float,
                        seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(out (T, H, D), log-sum-exp base 2 (H, T), the mask's bits (H, T, G) uint8) of the tokens within their
    sequences (module doc), q, k and v packed as (T, 3, H, D)."""
    q, k, v = _views(qkv)
    _check(q, k, v, dropout_p, seed)
    if not _on_triton(q):
        lengths = cu_seqlens.diff().tolist()  # the torch path: the CPU (a copy costs nothing there), float64
        return attention_torch(q, k, v, lengths, max_seqlen, dropout_p, seed)
    with torch.cuda.device(q.device):  # Triton launches on the current device
        return launch_forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed)


@triton_attention_op.register_fake
def _(qkv, cu_seqlens, max_seqlen, dropout_p, seed):
    compute = _compute_dtype(qkv.dtype)
    tokens, _, heads, dim = qkv.shape
    return (qkv.new_empty((tokens, heads, dim)), qkv.new_empty((heads, tokens), dtype=compute),
            qkv.new_empty((heads, tokens if dropout_p > 0 else 0, groups_per_row(max_seqlen)), dtype=torch.uint8))


@torch.library.custom_op("bert::triton_attention_backward", mutates_args=())
def triton_attention_backward(grad: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, bits: Tensor,
                              cu_seqlens: Tensor, max_seqlen: int, dropout_p: float) -> Tensor:
    """The packed QKV's gradient, (T, 3, H, D) contiguous in its dtype; the mask from the forward's bits."""
    q, k, v = _views(qkv)
    _check(q, k, v, dropout_p, forward=False)
    if not _on_triton(q):  # the torch path: the CPU, where a stack's copy costs little
        return torch.stack(backward_torch(grad, q, k, v, out, bits, cu_seqlens.diff().tolist(), dropout_p), 1)
    with torch.cuda.device(q.device):
        return launch_backward(grad.contiguous(), q, k, v, out, lse, bits, cu_seqlens, max_seqlen, dropout_p)


@triton_attention_backward.register_fake
def _(grad, qkv, out, lse, bits, cu_seqlens, max_seqlen, dropout_p):
    return qkv.new_empty(qkv.shape)


def _views(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v: the packed (T, 3, H, D) tensor's views."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"the packed QKV must be (T, 3, H, D), got {tuple(qkv.shape)}")
    return qkv.unbind(1)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    qkv, cu_seqlens, max_seqlen, dropout_p, _seed = inputs
    out, lse, bits = output
    ctx.mark_non_differentiable(lse, bits)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(qkv, out, lse, bits, cu_seqlens)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p


def _backward(ctx, grad_out: Tensor | None, *_no_grads: Tensor | None):
    if grad_out is None:
        return (None,) * 5
    qkv, out, lse, bits, cu = ctx.saved_tensors
    dqkv = torch.ops.bert.triton_attention_backward(grad_out, qkv, out, lse, bits, cu, ctx.max_seqlen, ctx.dropout_p)
    return dqkv, None, None, None, None


triton_attention_op.register_autograd(_backward, setup_context=_setup_context)
# traced into compiled graphs by the ops' names, with this module's fakes and backward: an edit here must miss them
key_on_source("bert::triton_attention", __file__)


def check_triton(device: torch.device, head_dim: int | None = None) -> None:
    """ATTENTION=triton on a GPU needs Triton (it ships with torch's CUDA wheels) and, given the model's head
    dimension, one its kernels take (checked when the config is read, not at the first forward)."""
    if device.type != "cuda":
        return
    if triton is None:
        raise ValueError("ATTENTION=triton needs Triton on CUDA (it ships with torch's CUDA wheels); it is not "
                         "installed here: use ATTENTION=varlen")
    if head_dim is not None and head_dim not in HEAD_DIMS:
        raise ValueError(f"ATTENTION=triton on CUDA takes a head dimension (hidden_size / num_attention_heads) in "
                         f"{HEAD_DIMS}, not {head_dim}: use ATTENTION=varlen")


class TritonAttend:
    """The planner's `Attend`: attention of the batch's tokens within their sequences through
    `bert::triton_attention`, a fresh seed a call from torch's generator on the tokens' device. A class, so that a
    float8 QKV (bert.model.fp8_attention) can tell it apart and take its sequences."""

    def __init__(self, seq: SeqLayout):
        self.cu_seqlens, self.max_seqlen = seq.cu_seqlens, seq.max_seqlen

    def __call__(self, qkv: Tensor, dropout_p: float) -> Tensor:
        if qkv.is_cuda and not _on_triton(qkv):  # the torch path on a GPU: a sync a call, and slow
            raise ValueError(f"ATTENTION=triton on CUDA needs fp16/bf16 q, k, v with a head dimension in {HEAD_DIMS} "
                             f"(got {qkv.dtype}, {qkv.shape[-1]}) and Triton: use ATTENTION=varlen")
        # packed: its backward writes the QKV's gradient whole (bert.model.attend)
        return torch.ops.bert.triton_attention(qkv, self.cu_seqlens, self.max_seqlen, dropout_p,
                                               dropout_seed(dropout_p, qkv.device))[0]


def triton_varlen(seq: SeqLayout) -> Attend:
    """The planner (`TritonAttend`)."""
    return TritonAttend(seq)
