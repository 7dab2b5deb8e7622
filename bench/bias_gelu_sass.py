"""BIAS_GELU=fused's two Triton kernels (bert.model.bias_gelu), its float8 form's backward (bert.model.fp8_bias_gelu)
and the float8 FFN's forward GELU (bert.model.fp8_feed_forward) compiled for an H100, counted in machine code: per
element, registers and stack for each candidate tile, bf16 as under MASTER_WEIGHTS=1.

Each kernel is compiled for sm_90 with the ptxas Triton ships (no GPU) and read back with its cuobjdump
(bench/sass_count.py). The forward has no loop: its instructions over the elements a thread holds (BT x BN over the
warps' threads). The backward loops over its ROWS rows BT at a time: the loop's body (between its back-edge and that
branch's target) over the elements a thread holds an iteration. A thread's registers bound the blocks an SM holds
(65,536 registers); a memory-bound kernel wants several. For comparison, GELU=rational's inductor kernels counted
26.0 and 31.0 an element, torch's GELU 38.6 and 53.1 (bench/gelu_sass.py). Not timed on a GPU.

    .venv-torch2.11.0-py3.12/bin/python bench/bias_gelu_sass.py
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

TILES = [(16, 256, 512, 8), (32, 256, 512, 8), (8, 512, 512, 8), (16, 512, 512, 8), (32, 128, 512, 4)]
BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)")


def loop_body(sass: str, instruction: re.Pattern) -> int:
    """Instructions of the longest loop: from a back-edge's target to the branch."""
    addresses = [int(a, 16) for a, _ in instruction.findall(sass)]
    edges = [(int(to, 16), int(at, 16)) for at, to in BRANCH.findall(sass) if int(to, 16) < int(at, 16)]
    return max((sum(lo <= a <= hi for a in addresses) for lo, hi in edges), default=0)


def usage_of(text: str) -> tuple[int, int]:
    return int(re.search(r"REG:(\d+)", text).group(1)), int(re.search(r"STACK:(\d+)", text).group(1))


def count(tile: tuple[int, int, int, int]) -> list[dict]:
    """BIAS_GELU=fused's two kernels at `tile` (BT, BN, ROWS, warps): a row each."""
    from bert.model import bias_gelu as bg

    bt, bn, rows, _ = tile
    return _count(tile, [("_forward_kernel", bg._forward_kernel, {"H": "*bf16", "B": "*bf16", "Y": "*bf16"},
                          {"BT": bt, "BN": bn}),
                         ("_backward_kernel", bg._backward_kernel,
                          {"G": "*bf16", "H": "*bf16", "B": "*bf16", "DH": "*bf16", "PARTS": "*fp32"},
                          {"BT": bt, "BN": bn, "ROWS": rows})])


def count_fp8(tile: tuple[int, int, int, int]) -> list[dict]:
    """Its float8 form's backward kernel (bert.model.fp8_bias_gelu) and the float8 FFN's forward GELU
    (bert.model.fp8_feed_forward) at `tile`: a row each."""
    from bert.model import fp8_bias_gelu as fbg
    from bert.model import fp8_feed_forward as fff

    bt, bn, rows, _ = tile
    constexprs = {"BT": bt, "BN": bn, "ROWS": rows}
    backward = {"G": "*bf16", "H": "*bf16", "DQ": "*fp8e5", "DQT": "*fp8e5", "SCALE": "*fp32", "PARTS": "*fp32",
                "AMAXES": "*fp32"}
    forward = {"H": "*bf16", "Q": "*fp8e4nv", "QT": "*fp8e4nv", "SCALE": "*fp32", "AMAXES": "*fp32"}
    return _count(tile, [("fp8 _backward_kernel", fbg._backward_kernel, backward, constexprs),
                         ("fp8 ffn _forward_kernel", fff._forward_kernel, forward, constexprs)])


def _count(tile: tuple[int, int, int, int], kernels: list) -> list[dict]:
    import sass_count

    bt, bn, rows, warps = tile
    per_thread = bt * bn / (32 * warps)
    out = []
    for label, kernel, pointers, constexprs in kernels:
        signature = dict(pointers)
        signature.update(tokens="i32", width="i32", **{name: "constexpr" for name in constexprs})
        # float8 runs at STATIC_TOKENS (a multiple of 512), so its token count is a multiple of 16, as Triton's JIT
        # specializes it: the transposed copy's stores are then 16-byte vectors
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
                 if name in pointers or name == "width" or (name == "tokens" and ({"DQT", "QT"} & set(pointers)))}
        sass, usage = sass_count.sm90(kernel, signature, constexprs, warps, attrs)
        looped = "ROWS" in constexprs
        body = loop_body(sass, sass_count.INSTRUCTION) if looped else len(sass_count.INSTRUCTION.findall(sass))
        registers, stack = usage_of(usage)
        out.append({"kernel": label, "tile": list(tile), "instructions": body,
                    "per_element": round(body / per_thread, 1), "registers": registers, "stack_bytes": stack,
                    "blocks_per_sm": min(65536 // max(registers * 32 * warps, 1), 2048 // (32 * warps))})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "results" / "bench" / "bias_gelu_sass.json"))
    args = p.parse_args()
    import torch
    import triton

    from bert.model import bias_gelu as bg

    rows = [row for tile in TILES for row in count(tile) + count_fp8(tile)]
    print(f"{'kernel':24} {'tile (BT, BN, ROWS, warps)':28} {'per element':>11} {'registers':>9} {'stack':>5} "
          f"{'blocks/SM':>9}")
    for r in rows:
        mark = " (default)" if tuple(r["tile"]) == bg.TILE else ""
        print(f"{r['kernel']:24} {str(tuple(r['tile'])):28} {r['per_element']:11.1f} {r['registers']:9d} "
              f"{r['stack_bytes']:5d} {r['blocks_per_sm']:9d}{mark}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                                           "default_tile": list(bg.TILE), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
