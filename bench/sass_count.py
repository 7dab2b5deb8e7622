"""What LAMB's bias corrections cost a kernel that computes them per element, counted in an H100's machine code (SASS).

Inductor's per-tensor LAMB update (the H200's `compiled-opt` cache, 2026-11-27) broadcast the update count over
its block and computed 1 - b^t in float64 for every element. This compiles that pattern and its replacement (the
corrections loaded, as computed by `bert::lamb_bias_corrections`, bert.optim.bias_correction) for sm_90 with the
ptxas Triton ships, disassembles them with its cuobjdump, and counts instructions: in the kernel, in float64
(D*: DFMA, DADD, DMUL, DSETP...), the calls (libdevice's pow is a subroutine, called once per element) and the
subroutine's own length. No GPU: Triton compiles for a target, not a device. The code has no loop, so a thread
runs each instruction once and the subroutine once a call, for the 8 elements it holds (1,024 over 4 warps):
`per_element` is that run divided by 8.

Two more pairs, for the next candidate: dropout as inductor generates it inside the LayerNorm kernels (`tl.rand`,
one Philox call an element, of whose four numbers it keeps one) and from all four numbers of a call (`tl.rand4x`).
On the H200 (`driver-compiled-flat`, 2026-11-27) the forward's residual + dropout + LayerNorm kernels moved their
10.2 GB (the fake H100's estimate) at 2.0 TB/s, the LayerNorm backward's 12.7 GB at 3.5 TB/s.

    .venv-torch2.11.0-py3.12/bin/python bench/sass_count.py
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
XBLOCK, WARPS = 1024, 4
PER_THREAD = XBLOCK // (32 * WARPS)  # elements each thread holds
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")  # address, opcode
FLOAT64 = re.compile(r"D(ADD|FMA|MUL|SETP|MNMX)\b|MUFU\.\w+64H")  # the float64 pipe's (not DEPBAR, a barrier)


def kernels() -> dict:
    import triton
    import triton.language as tl
    from torch._inductor.runtime.triton_helpers import libdevice

    @triton.jit
    def inlined(t_ptr, m_ptr, out_ptr, n, XBLOCK: tl.constexpr):
        """u = m / (1 - b1^t), the count broadcast first as inductor's kernels did (`tl.where(xmask, ...)`)."""
        x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
        mask = x < n
        t = tl.where(mask, tl.broadcast_to(tl.load(t_ptr), [XBLOCK]), 0.0).to(tl.float64)
        c1 = (1.0 - libdevice.pow(tl.full([1], 0.60466, tl.float64), t)).to(tl.float32)
        tl.store(out_ptr + x, tl.load(m_ptr + x, mask) / c1, mask)

    @triton.jit
    def loaded(c_ptr, m_ptr, out_ptr, n, XBLOCK: tl.constexpr):
        """The same with 1 - b1^t loaded, computed once per step by the op."""
        x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
        mask = x < n
        tl.store(out_ptr + x, tl.load(m_ptr + x, mask) / tl.load(c_ptr), mask)

    @triton.jit
    def dropout(seed, m_ptr, out_ptr, n, XBLOCK: tl.constexpr):
        """Dropout (p 0.1) as inductor writes it into the LayerNorm kernels: one Philox call an element
        (`tl.rand`, which keeps one of the four numbers a call makes)."""
        x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
        mask = x < n
        keep = tl.rand(seed, x.to(tl.uint32)) > 0.1
        tl.store(out_ptr + x, tl.where(keep, tl.load(m_ptr + x, mask) * 1.1111111, 0.0), mask)

    @triton.jit
    def dropout4x(seed, m_ptr, out_ptr, n, XBLOCK: tl.constexpr):
        """The same from all four numbers of a Philox call (`tl.rand4x`): a call for four elements."""
        q = tl.program_id(0) * XBLOCK + 4 * tl.arange(0, XBLOCK // 4)
        r0, r1, r2, r3 = tl.rand4x(seed, (q // 4).to(tl.uint32))
        tl.store(out_ptr + q, tl.where(r0 > 0.1, tl.load(m_ptr + q, q < n) * 1.1111111, 0.0), q < n)
        tl.store(out_ptr + q + 1, tl.where(r1 > 0.1, tl.load(m_ptr + q + 1, q + 1 < n) * 1.1111111, 0.0), q + 1 < n)
        tl.store(out_ptr + q + 2, tl.where(r2 > 0.1, tl.load(m_ptr + q + 2, q + 2 < n) * 1.1111111, 0.0), q + 2 < n)
        tl.store(out_ptr + q + 3, tl.where(r3 > 0.1, tl.load(m_ptr + q + 3, q + 3 < n) * 1.1111111, 0.0), q + 3 < n)

    return {"inlined": inlined, "loaded": loaded, "dropout": dropout, "dropout4x": dropout4x}


def count(sass: str) -> dict:
    """Instructions (the whole cubin's: the subroutine and the padding after EXIT included), float64 ones and calls
    in the disassembly, and the length of the first called subroutine."""
    ops = [(int(a, 16), op) for a, op in INSTRUCTION.findall(sass)]
    calls = [int(t, 16) for t in re.findall(r"CALL\.REL\.NOINC (0x[0-9a-f]+)", sass)]
    subroutine = []
    for address, op in ops:
        if calls and address >= calls[0]:
            subroutine.append(op)
            if op.startswith("RET"):
                break
    return {"instructions": len(ops), "float64": sum(bool(FLOAT64.match(op)) for _, op in ops), "calls": len(calls),
            "subroutine_instructions": len(subroutine),
            "subroutine_float64": sum(bool(FLOAT64.match(op)) for op in subroutine)}


def sm90(kernel, signature: dict, constexprs: dict, warps: int, attrs: dict | None = None) -> tuple[str, str]:
    """`kernel` compiled for sm_90 with the ptxas Triton ships (no GPU), and its cubin read back by Triton's cuobjdump:
    (the disassembly, the resource usage: registers, stack). Needs Triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return tuple(subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                     for flag in ("-sass", "-res-usage"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "results" / "bench" / "sass_count.json"))
    args = p.parse_args()
    try:
        import triton
    except ImportError:
        print("sass_count: needs Triton (torch's CUDA build: bash scripts/test_torch.sh 2.11.0)")
        return 2
    rows = []
    for name, fn in kernels().items():
        first = {"inlined": ("t_ptr", "*fp32"), "loaded": ("c_ptr", "*fp32")}.get(name, ("seed", "i32"))
        signature = {first[0]: first[1], "m_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "XBLOCK": "constexpr"}
        sass, _ = sm90(fn, signature, {"XBLOCK": XBLOCK}, WARPS)
        row = count(sass)
        # what a thread runs, over the elements it holds: the subroutine run once a call
        run = row["instructions"] - row["subroutine_instructions"] + row["calls"] * row["subroutine_instructions"]
        rows.append({"kernel": name, **row, "per_element": round(run / PER_THREAD, 1)})
    print(f"{'kernel (sm_90, XBLOCK 1024, 4 warps)':38} {'SASS':>5} {'float64':>7} {'calls':>5} "
          f"{'subroutine':>10} {'its float64':>11} {'run per element':>15}")
    for r in rows:
        print(f"{r['kernel']:38} {r['instructions']:5} {r['float64']:7} {r['calls']:5} "
              f"{r['subroutine_instructions']:10} {r['subroutine_float64']:11} {r['per_element']:15}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"triton": triton.__version__, "target": "cuda sm_90", "xblock": XBLOCK,
                                           "warps": WARPS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
