"""What LAMB's bias corrections cost a kernel that computes them per element, counted in an H100's machine code (SASS).

Inductor's per-tensor LAMB update (the H200's `compiled-opt` cache, 2026-11-27) broadcast the update count over
its block and computed 1 - b^t in float64 for every element. This compiles that pattern and its replacement (the
corrections loaded, as computed by `bert::lamb_bias_corrections`, bert.optim.bias_correction) for sm_90 with the
ptxas Triton ships, disassembles them with its cuobjdump, and counts instructions: in the kernel, in float64
(D*: DFMA, DADD, DMUL, DSETP...), the calls (libdevice's pow is a subroutine, called once per element) and the
subroutine's own length. No GPU: Triton compiles for a target, not a device. Static counts: a thread runs the
subroutine once per element it holds (8 here: 1,024 elements over 4 warps).

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

    return {"inlined": inlined, "loaded": loaded}


def count(sass: str) -> dict:
    """Instructions, float64 ones and calls in the disassembly, and the length of the first called subroutine."""
    ops = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    calls = [int(t, 16) for t in re.findall(r"CALL\.REL\.NOINC (0x[0-9a-f]+)", sass)]
    subroutine = []
    for address, op in ops:
        if calls and address >= calls[0]:
            subroutine.append(op)
            if op.startswith("RET"):
                break
    return {"instructions": len(ops), "float64": sum(op.startswith("D") for _, op in ops), "calls": len(calls),
            "subroutine_instructions": len(subroutine),
            "subroutine_float64": sum(op.startswith("D") for op in subroutine)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "results" / "bench" / "sass_count.json"))
    args = p.parse_args()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        print("sass_count: needs Triton (torch's CUDA build: bash scripts/test_torch.sh 2.11.0)")
        return 2
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in kernels().items():
            first = "t_ptr" if name == "inlined" else "c_ptr"
            source = ASTSource(fn, signature={first: "*fp32", "m_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                                              "XBLOCK": "constexpr"}, constexprs={"XBLOCK": XBLOCK})
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})
            cubin = Path(tmp) / f"{name}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                                  check=True).stdout
            rows.append({"kernel": name, **count(sass)})
    print(f"{'kernel (sm_90, XBLOCK 1024, 4 warps)':38} {'SASS':>5} {'float64':>7} {'calls':>5} "
          f"{'subroutine':>10} {'its float64':>11}")
    for r in rows:
        print(f"{r['kernel']:38} {r['instructions']:5} {r['float64']:7} {r['calls']:5} "
              f"{r['subroutine_instructions']:10} {r['subroutine_float64']:11}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"triton": triton.__version__, "target": "cuda sm_90", "xblock": XBLOCK,
                                           "warps": WARPS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
