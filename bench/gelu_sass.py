"""The FFN's GELU kernels as inductor generates them for an H100, counted in machine code: torch's GELU (libdevice's erf
and exp) against GELU=rational (bert.model.gelu: erfc as a rational function of one exp2).

BERT-large's FFN up-projection, GELU(x W^T + b) at 24,576 tokens (1,024 -> 4,096, bf16 as under MASTER_WEIGHTS=1),
compiled forward and backward on the fake H100 (bench/fake_h100.py: no GPU; cuBLAS adds the bias in the GEMM's
epilogue, so the GELU kernels read the GEMM's output). Each Triton kernel inductor generated is compiled again for
sm_90 at one fixed block (XBLOCK 1,024, 4 warps: 8 elements a thread, no loop) with the ptxas Triton ships, and its
SASS counted as bench/sass_count.py reads it (NOPs after EXIT left out). Per element: the kernel's instructions / 8;
MUFU: the special-function unit's (ex2, rsqrt, rcp). A bound for each kernel on an H100 SXM, the larger of its bytes
at 3.35 TB/s and its instructions at the issue rate (132 SMs x 4 schedulers x 32 lanes a clock, at 1.755 GHz: 29.7 T
thread-instructions/s); on the H200 (2026-11-26) the GELU forward kernels took 0.15 ms a call and the backward's
0.21 ms, near the instruction bound (docs/journal.md, "Flash attention with dropout in Triton", its "GELU's
instructions"). Not timed on a GPU.

    .venv-torch2.11.0-py3.12/bin/python bench/gelu_sass.py
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

TOKENS, HIDDEN, INTERMEDIATE = 24576, 1024, 4096
XBLOCK, WARPS = 1024, 4
PER_THREAD = XBLOCK // (32 * WARPS)
H100_TB_S = 3.35
ISSUE_PER_S = 132 * 4 * 32 * 1.755e9  # thread-instructions a second, every scheduler issuing each clock
KERNEL = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)'''", re.S)


def generated_kernels(cache: Path) -> dict[tuple[str, str], str]:
    """Every Triton kernel's source in inductor's output code under `cache`, by its pass and name (a backward
    graph's wrapper takes the tangents; each graph numbers its kernels from 0)."""
    found = {}
    for path in cache.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "def call(" not in text:  # a kernel's own file, not a graph's wrapper
            continue
        for name, source in KERNEL.findall(text):
            found["backward" if "tangents_" in text else "forward", name] = source
    return found


def jitted(name: str, source: str, where: Path):
    """The kernel's @triton.jit function, with inductor's autotuning decorator taken off (Triton reads a jitted
    function's source from its file, so it is written to one), and its signature."""
    signature = ast.literal_eval(re.search(r"'signature': (\{.*?\})", source).group(1))
    body = re.sub(r"@triton_heuristics\.\w+\(.*?\)\n(?=@triton\.jit)", "", source, flags=re.S)
    path = where / f"{name}.py"
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name), signature


def child(kind: str) -> dict:
    """In a process with fake_h100's stand-ins: compile the FFN up-projection with `kind`'s GELU, count its kernels."""
    import fake_h100

    mode = fake_h100.install()
    import torch
    import torch.nn.functional as F
    from sass_count import INSTRUCTION, sm90

    from bert.model.gelu import RationalGELU

    if not fake_h100.backward_ready():
        raise RuntimeError("a backward needs fake_h100.native_env's stand-ins (a C compiler, cc)")
    activation = RationalGELU() if kind == "rational" else torch.nn.GELU()

    def ffn_up(x, w, b):
        return activation(F.linear(x, w, b))

    with mode, torch.device("cuda", 0):
        x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(INTERMEDIATE, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(INTERMEDIATE, dtype=torch.bfloat16, requires_grad=True)
        y = torch.compile(ffn_up)(x, w, b)
        y.backward(torch.randn_like(y))
    rows = []
    with tempfile.TemporaryDirectory() as where:
        for (pass_, name), source in sorted(generated_kernels(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])).items(),
                                            key=lambda item: item[0][0] == "backward"):
            if not name.startswith("triton_poi_"):  # the bias gradient's column sums: the same in both
                continue
            fn, signature = jitted(name, source, Path(where))
            sass, _ = sm90(fn, signature, {"XBLOCK": XBLOCK}, WARPS)
            ops = [op for _, op in INSTRUCTION.findall(sass) if op != "NOP"]  # NOP: the padding after EXIT
            gb = float(re.search(r"'kernel_num_gb': ([0-9.e-]+)", source).group(1))
            per_element = len(ops) / PER_THREAD
            rows.append({"kind": kind, "kernel": name, "pass": pass_, "sass": len(ops),
                         "per_element": round(per_element, 1),
                         "mufu_per_element": round(sum(op.startswith("MUFU") for op in ops) / PER_THREAD, 2),
                         "calls": sum(op.startswith("CALL") for op in ops), "gb": gb,
                         "bytes_ms": round(gb / H100_TB_S, 3),
                         "issue_ms": round(per_element * TOKENS * INTERMEDIATE / ISSUE_PER_S * 1e3, 3)})
    return {"kind": kind, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "results" / "bench" / "gelu_sass.json"))
    p.add_argument("--timeout", type=int, default=900, help="seconds a variant")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a variant in this process (the parent's child)
    args = p.parse_args()
    if args.one:
        print("ROW " + json.dumps(child(args.one)))
        return 0
    import fake_h100

    why = fake_h100.usable()
    if why:
        print(f"gelu_sass: {why}; run it with torch's CUDA build (bash scripts/test_torch.sh 2.11.0 makes one)")
        return 2
    env = {**os.environ, "PYTHONPATH": str(ROOT), **fake_h100.stand_ins()}
    rows, failed = [], []
    for kind in ("torch", "rational"):
        got = fake_h100.run_cold([sys.executable, __file__, "--one", kind], env, args.timeout)
        if "rows" not in got:
            failed.append(f"{kind}: {got.get('error')}")
        rows += got.get("rows", [])
    print(f"{'GELU':9} {'kernel (sm_90, XBLOCK 1024, 4 warps)':44} {'pass':8} {'SASS':>5} {'/elem':>6} {'MUFU':>5} "
          f"{'GB':>6} {'ms@3.35TB/s':>11} {'ms@issue':>8} {'bound ms':>8}")
    for r in rows:
        r["bound_ms"] = max(r["bytes_ms"], r["issue_ms"])
        print(f"{r['kind']:9} {r['kernel']:44} {r['pass']:8} {r['sass']:5} {r['per_element']:6} "
              f"{r['mufu_per_element']:5} {r['gb']:6.3f} {r['bytes_ms']:11} {r['issue_ms']:8} {r['bound_ms']:8}")
    for line in failed:
        print("FAILED", line)
    import torch
    import triton

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"torch": torch.__version__, "triton": triton.__version__,
                                           "target": "cuda sm_90 (bench/fake_h100.py)", "tokens": TOKENS,
                                           "intermediate": INTERMEDIATE, "xblock": XBLOCK, "warps": WARPS,
                                           "issue_per_s": ISSUE_PER_S, "tb_s": H100_TB_S, "rows": rows}, indent=1)
                               + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
