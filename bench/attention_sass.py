"""What `ATTENTION=triton`'s kernels cost an element, counted in their sm_90 machine code, and what that predicts for a
BERT-large step against torch's FlashAttention-2 as the H100 ran it. No GPU: Triton compiles for a target.

Each kernel (bert.model.triton_attention) is compiled for sm_90 with Triton's ptxas as its launcher would have it
(pointers and strides divisible by 16, BERT's head dimension 64, bf16), disassembled with Triton's cuobjdump, and its
inner loop (the longest backward branch) counted: instructions, Hopper's warpgroup MMAs (HGMMA), special-function ones
(MUFU: exp2), and instructions an element of the (BM, BN) score tile, over the threads. The loop is the kernel: its
prologue runs once a program.

The estimate: an H100 SM issues 4 warp instructions a clock (128 thread instructions) and its tensor cores do 4,096
bf16 FLOP a clock (989 TFLOP/s dense over 132 SMs at 1.83 GHz), so a score element costs at least
max(ALU, MMA) clocks and at most their sum (no overlap); the loop's other instructions are all counted as ALU. Elements
a step: the sum over a batch's sequences of L^2, times 16 heads and 24 layers, for 96 sequences of the phase-2 length
mix (`bert.lengths.WIKI_PHASE2`), and the tiles each kernel computes, cut ones whole. FlashAttention-2 on the H100
(2026-11-26, `driver-compiled-opt`'s profile): 6.72 ms forward, 17.09 ms backward a step. Not a measurement: latency,
occupancy (255 registers a thread: one 8-warp forward program an SM, two 4-warp backward ones) and memory are outside
it.

    .venv-torch2.11.0-py3.12/bin/python bench/attention_sass.py

`--candidates` counts instead every candidate tile bench/attention_tiles.py times on a GPU, with dropout (what the
machine code says of each before the GPU's timings; results/bench/attention_sass_candidates.json).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # sass_count

from sass_count import sm90  # noqa: E402

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
SM_CLOCK_HZ, SMS = 1.83e9, 132
ALU_PER_CLOCK, MMA_FLOP_PER_CLOCK = 128, 4096
FLASH2_H100_MS = {"forward": 6.72, "backward": 17.09}
HEADS, LAYERS, HEAD_DIM, BATCH = 16, 24, 64, 96
# what Triton's launcher finds divisible by 16 at BERT-large's shapes (T, the token count, varies: left out)
DIVISIBLE = {"sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "so_t", "so_h", "sdo_t", "sdo_h", "sd_t", "groups"}
MMA_FLOP = {"_forward": 2 * 2 * HEAD_DIM, "_backward_kv": 4 * 2 * HEAD_DIM, "_backward_q": 3 * 2 * HEAD_DIM}


def signatures(ta, dtype: str = "bf16", float8: bool = False) -> list[tuple]:
    """(kernel, (BM, BN, warps), its signature) for each of the three kernels, q, k, v in `dtype` (Triton's name);
    with `float8`, the backward's gradient in e5m2 (a float8 QKV's, bert.model.fp8_attention) and the forward's
    output in e4m3 only (bert.model.fp8_attention_block), which the dQ kernel reads for delta."""
    half = f"*{dtype}"
    grad = "*fp8e5" if float8 else half
    out8 = "*fp8e4nv" if float8 else half  # the output in e4m3 only, which the dQ kernel reads for delta
    float8_args = {"SCALE": "*fp32", "AMAXES": "*fp32", "PARTS": "*fp32", "GRAD_T": grad if float8 else "*fp32"}
    qkv = {"Q": half, "K": half, "V": half}
    strides = {n: "i32" for n in ("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h")}
    scales = {"qk_scale": "fp32", "sm_scale": "fp32", "drop_scale": "fp32"}
    sizes = {"tokens": "i32", "groups": "i32"}
    flags = {"D": "constexpr", "BM": "constexpr", "BN": "constexpr", "DROPOUT": "constexpr"}
    backward_flags = {**flags, "FLOAT8": "constexpr"}
    return [
        (ta._forward, ta.FORWARD_TILE, {**qkv, "OUT": half, "LSE": "*fp32", "BITS": "*u8", "cu": "*i32",
                                        "seed": "*i64", **sizes, "threshold": "i32", "qk_scale": "fp32",
                                        "drop_scale": "fp32", **strides, "so_t": "i32", "so_h": "i32",
                                        "OQ": out8, "OQT": out8, "SCALE": "*fp32", "AMAXES": "*fp32",
                                        **backward_flags}),
        (ta._backward_kv, ta.BACKWARD_TILE, {**qkv, "DO": half, "LSE": "*fp32", "DELTA": "*fp32", "BITS": "*u8",
                                             "DK": grad, "DV": grad, "cu": "*i32", **sizes, **scales, **strides,
                                             "sdo_t": "i32", "sdo_h": "i32", "sd_t": "i32", **float8_args,
                                             **backward_flags}),
        (ta._backward_q, ta.BACKWARD_TILE, {**qkv, "DO": half, "OUT": out8, "LSE": "*fp32", "DELTA": "*fp32",
                                            "BITS": "*u8", "DQ": grad, "cu": "*i32", **sizes, **scales, **strides,
                                            "sdo_t": "i32", "sdo_h": "i32", "so_t": "i32", "so_h": "i32", "sd_t": "i32",
                                            **float8_args, "OUT_INV": "*fp32", **backward_flags,
                                            "OUT_E4M3": "constexpr"}),
    ]


def inner_loop(sass: str) -> list[str]:
    """The opcodes of the longest loop: from a backward branch's target to the branch."""
    ops = [(int(a, 16), op, rest) for a, op, rest in INSTRUCTION.findall(sass)]
    loops = [(int(m.group(1), 16), a) for a, op, rest in ops if op.startswith("BRA")
             for m in [re.search(r"0x([0-9a-f]+)", rest)] if m and int(m.group(1), 16) < a]
    if not loops:
        return []
    low, high = max(loops, key=lambda span: span[1] - span[0])
    return [op for a, op, _ in ops if low <= a <= high]


def count(kernel, tile: tuple[int, int, int], signature: dict, dropout: bool, dim: int = HEAD_DIM) -> dict:
    """One kernel compiled for sm_90 as its launcher would have it: its inner loop's counts, registers, stack (a
    kernel FLOAT8 where its signature's gradient, or output copy, is float8)."""
    *blocks, warps = tile
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name].startswith("*") or name in DIVISIBLE}
    constexprs = {"D": dim, "BM": blocks[0], "BN": blocks[1], "DROPOUT": dropout}
    if "FLOAT8" in signature:
        constexprs["FLOAT8"] = "fp8" in (signature.get("DQ") or signature.get("DK") or signature["OQ"])
    if "OUT_E4M3" in signature:
        constexprs["OUT_E4M3"] = "fp8" in signature["OUT"]
    sass, usage = sm90(kernel, signature, constexprs, warps, attrs)
    body = inner_loop(sass)
    per_thread = blocks[0] * blocks[1] / (32 * warps)  # score elements a thread holds each iteration
    mma = sum(op.startswith("HGMMA") for op in body)
    return {"kernel": kernel.fn.__name__, "dropout": dropout, "blocks": list(blocks), "warps": warps,
            "loop_instructions": len(body), "hgmma": mma, "mufu": sum(op.startswith("MUFU") for op in body),
            "per_element": round((len(body) - mma) / per_thread, 1),
            "loop_local": sum(op.startswith(("LDL", "STL")) for op in body),  # spills inside the loop
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1))}


def elements(blocks: tuple[int, int], seed: int = 0) -> tuple[float, float]:
    """(score elements a step's kernels compute, whole tiles, cut ones too; the useful ones, sum L^2) for one batch
    of the phase-2 mix, times heads and layers."""
    from bert.lengths import WIKI_PHASE2

    lengths = WIKI_PHASE2.sample(BATCH, np.random.default_rng(seed))
    bm, bn = blocks
    tiles = sum(-(-int(n) // bm) * bm * -(-int(n) // bn) * bn for n in lengths)
    return float(tiles) * HEADS * LAYERS, float(np.square(lengths.astype(np.float64)).sum()) * HEADS * LAYERS


def candidates(ta) -> list[dict]:
    """bench/attention_tiles.py's candidate tiles of each kernel, counted with dropout (bf16, D 64)."""
    from attention_tiles import DKDV, DQ, FORWARD

    tiles = {"_forward": FORWARD, "_backward_q": DQ, "_backward_kv": DKDV}
    return [count(kernel, tile, signature, True)
            for kernel, _, signature in signatures(ta) for tile in tiles[kernel.fn.__name__]]


def write(path: str | Path, triton, rows: list[dict], **more) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"triton": triton.__version__, "target": "cuda sm_90", "rows": rows, **more},
                                     indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="default: results/bench/attention_sass.json (_candidates.json)")
    p.add_argument("--candidates", action="store_true", help="count bench/attention_tiles.py's candidate tiles")
    args = p.parse_args()
    try:
        import triton
    except ImportError:
        print("attention_sass: needs Triton (torch's CUDA build: bash scripts/test_torch.sh 2.11.0)")
        return 2
    from bert.model import triton_attention as ta

    if args.candidates:
        rows = candidates(ta)
        print(f"{'kernel (sm_90, bf16, D 64, dropout)':36} {'BM x BN, warps':>14} {'HGMMA':>5} {'ALU/element':>11} "
              f"{'regs':>4} {'stack':>5}")
        for r in rows:
            shape = f"{r['blocks'][0]}x{r['blocks'][1]},{r['warps']}"
            print(f"{r['kernel']:36} {shape:>14} {r['hgmma']:5} {r['per_element']:11} {r['registers']:4} "
                  f"{r['stack_bytes']:5}")
        write(args.json or ROOT / "results" / "bench" / "attention_sass_candidates.json", triton, rows)
        return 0
    rows = [count(kernel, tile, signature, dropout)
            for kernel, tile, signature in signatures(ta) for dropout in (False, True)]
    print(f"{'kernel (sm_90, bf16, D 64)':26} {'dropout':>7} {'BM x BN':>8} {'loop':>5} {'HGMMA':>5} {'MUFU':>5} "
          f"{'ALU/element':>11} {'regs':>4} {'stack':>5}")
    for r in rows:
        print(f"{r['kernel']:26} {r['dropout']!s:>7} {r['blocks'][0]:>3} x {r['blocks'][1]:<3} "
              f"{r['loop_instructions']:5} {r['hgmma']:5} {r['mufu']:5} {r['per_element']:11} {r['registers']:4} "
              f"{r['stack_bytes']:5}")
    estimate = {}
    for phase, kernels in (("forward", ("_forward",)), ("backward", ("_backward_kv", "_backward_q"))):
        low = high = 0.0
        for r in rows:
            if r["dropout"] and r["kernel"] in kernels:
                computed, useful = elements(tuple(r["blocks"]))
                alu, mma = r["per_element"] / ALU_PER_CLOCK, MMA_FLOP[r["kernel"]] / MMA_FLOP_PER_CLOCK
                low += computed * max(alu, mma) / (SM_CLOCK_HZ * SMS) * 1e3
                high += computed * (alu + mma) / (SM_CLOCK_HZ * SMS) * 1e3
        estimate[phase] = {"issue_bound_ms": round(low, 2), "no_overlap_ms": round(high, 2),
                           "flash2_h100_ms": FLASH2_H100_MS[phase],
                           "tiles_computed_over_useful": round(computed / useful, 3)}
        print(f"{phase:9} with dropout, a BERT-large step of 96 sequences: {low:5.2f}-{high:5.2f} ms by issue rate "
              f"(FlashAttention-2 on the H100: {FLASH2_H100_MS[phase]} ms)")
    write(args.json or ROOT / "results" / "bench" / "attention_sass.json", triton, rows, step_estimate=estimate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
