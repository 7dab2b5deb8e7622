"""What `RESIDUAL_NORM=fused-lean`'s kernels (bert.model.dropout_add_norm) cost a row, counted in their sm_90 machine
code, against the bytes the row moves: whether a BERT-large step's norms are bound by the H100's issue rate or by its
memory. No GPU: Triton compiles for a target.

Each kernel is compiled for sm_90 with Triton's ptxas as its launcher has it for BERT-large (1,024 elements a row,
bf16 activations and weights, pointers divisible by 16, 4 warps) in the float8 candidate's variants (the e4m3 copy
and its transpose, no saved sum; the backward's e5m2 gradient, its transpose, x_hat from y) and in bf16's, and its
per-row loop (the longest backward branch) counted, Philox's high products (IMAD.HI) among it. A row costs an SM at
least loop x warps / 4 clocks to issue (4 warp instructions a clock) and bytes / (3.35 TB/s over 132 SMs at 1.83 GHz,
13.9 B a clock) to move: the larger bounds it, their sum is the no-overlap time. A step: 48 norms each way over
24,576 tokens (96 sequences); the float8 candidate's forward takes half its norms twice (the FFN's close). Not a
measurement: latency, occupancy and the DRAM's real rate are outside it.

    .venv-torch2.11.0-py3.12/bin/python bench/norm_sass.py

`--tree DIR` counts another checkout's kernels, e.g. the tile the forty-third session replaced:
`git worktree add /tmp/before 0376fbc && .venv-torch2.11.0-py3.12/bin/python bench/norm_sass.py --tree /tmp/before
--json results/bench/norm_sass_0376fbc.json` (its kernels name the row's block W, 2 V).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # sass_count, attention_sass

from attention_sass import INSTRUCTION, inner_loop  # noqa: E402
from sass_count import sm90  # noqa: E402

N, TOKENS, NORMS, WARPS = 1024, 24576, 48, 4
SM_CLOCK_HZ, SMS, BANDWIDTH = 1.83e9, 132, 3.35e12
BYTES_A_CLOCK = BANDWIDTH / (SMS * SM_CLOCK_HZ)


def forward_signature(float8: bool) -> dict:
    q = "*fp8e4nv" if float8 else "*bf16"
    names = dict(h="*bf16", res="*bf16", gamma="*bf16", beta="*bf16", dense_bias="*bf16", seed="*i64", y="*bf16",
                 s="*bf16", bits="*u8", mean_out="*fp32", rstd_out="*fp32", yq=q, cast_scale="*fp32", amaxes="*fp32",
                 y2="*bf16", yqt=q, rows="i32", n="i32", threshold="i32", scale="fp32", eps="fp32")
    return {**names, **dict.fromkeys(("BLOCK", "ROWS", "DROPOUT", "DENSE_BIAS", "FLOAT8", "TWICE", "TRANSPOSE",
                                      "SUM"), "constexpr")}


def backward_signature(float8: bool) -> dict:
    g = "*fp8e5" if float8 else "*bf16"
    names = dict(dy="*bf16", dy2="*bf16", s="*bf16", bits="*u8", mean_in="*fp32", rstd_in="*fp32", gamma="*bf16",
                 beta="*bf16", dh=g, ds="*bf16", sums="*fp32", cast_scale="*fp32", amaxes="*fp32", dht=g, rows="i32",
                 n="i32", scale="fp32")
    return {**names, **dict.fromkeys(("BLOCK", "ROWS", "DROPOUT", "FLOAT8", "ROUND", "SECOND", "TRANSPOSE",
                                      "FROM_Y"), "constexpr")}


def variants() -> list[tuple[str, str, bool, dict, float]]:
    """(name, kernel, float8, flags, bytes an element) for the candidate's norms and bf16's."""
    out = []
    for dropout in (False, True):
        for twice in (False, True):  # the FFN's close stores the layer's output twice (bert.model.layers' Stream)
            out.append((f"forward float8{' twice' if twice else ''}", "_forward_rows", True,
                        dict(ROWS=32, DROPOUT=dropout, DENSE_BIAS=False, FLOAT8=True, TWICE=twice, TRANSPOSE=True,
                             SUM=False), 2 + 2 + 2 + 1 + 1 + 2 * twice + dropout / 8))
        out.append(("forward bf16", "_forward_rows", False,
                    dict(ROWS=1, DROPOUT=dropout, DENSE_BIAS=True, FLOAT8=False, TWICE=False, TRANSPOSE=False,
                         SUM=False), 2 + 2 + 2 + dropout / 8))
        out.append(("backward float8, two gradients", "_backward_rows", True,
                    dict(ROWS=32, DROPOUT=dropout, FLOAT8=True, ROUND="bf16", SECOND=True, TRANSPOSE=True,
                         FROM_Y=True), 2 + 2 + 2 + 1 + 1 + 2 + dropout / 8))
        out.append(("backward bf16", "_backward_rows", False,
                    dict(ROWS=32, DROPOUT=dropout, FLOAT8=False, ROUND="bf16", SECOND=False, TRANSPOSE=False,
                         FROM_Y=True), 2 + 2 + 2 + 2 + dropout / 8))
    return out


def count(dan, name: str, kernel_name: str, float8: bool, flags: dict, per_element: float) -> dict:
    import triton.language as tl

    kernel = getattr(dan, kernel_name)
    block = "V" if "V" in kernel.arg_names else "W"  # the row's block: V bytes of mask, or (before) W = 2 V counters
    v = dan.bytes_per_row(N) if block == "V" else dan.words_per_row(N) // 2
    signature = (forward_signature if kernel_name == "_forward_rows" else backward_signature)(float8)
    signature = {(block if k == "BLOCK" else k): t for k, t in signature.items()}
    constexprs = {block: v if block == "V" else 2 * v, **flags}
    if "ROUND" in constexprs:
        constexprs["ROUND"] = tl.bfloat16
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(signature)
             if signature[arg].startswith("*") or arg == "n"}
    sass, usage = sm90(kernel, signature, constexprs, WARPS, attrs)
    # a program of one row (bf16's forward) has no loop: its whole code runs a row (the padding after it left out)
    body = inner_loop(sass) or [op for _, op, _ in INSTRUCTION.findall(sass) if op != "NOP"][:-1]
    loop = len(body)
    issue = loop * WARPS / 4
    memory = N * per_element / BYTES_A_CLOCK
    return {"kernel": name, "dropout": flags["DROPOUT"], "loop_instructions": loop,
            # Philox's 32-bit high products, two a round: a thread's eight elements need two calls' worth
            "high_products": sum(op == "IMAD.HI.U32" for op in body),
            "per_element": round(loop * 32 * WARPS / N, 1), "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "bytes_per_element": round(per_element, 3), "issue_clocks": issue, "memory_clocks": round(memory),
            "bound": "issue" if issue > memory else "memory",
            "step_ms": round(max(issue, memory) * NORMS * TOKENS / (SMS * SM_CLOCK_HZ) * 1e3, 2),
            "step_ms_no_overlap": round((issue + memory) * NORMS * TOKENS / (SMS * SM_CLOCK_HZ) * 1e3, 2)}


def commit(tree: str) -> str:
    """The counted checkout's commit, `+` where its work tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "results" / "bench" / "norm_sass.json"))
    p.add_argument("--tree", default=str(ROOT), help="the checkout whose kernels are counted (default: this one)")
    args = p.parse_args()
    try:
        import triton
    except ImportError:
        print("norm_sass: needs Triton (torch's CUDA build: bash scripts/test_torch.sh 2.11.0)")
        return 2
    tree = Path(args.tree).resolve()
    if not (tree / "bert" / "model" / "dropout_add_norm.py").is_file():
        print(f"norm_sass: {tree} is not a checkout of this project (no bert/model/dropout_add_norm.py)")
        return 2
    sys.path.insert(0, str(tree))
    dan = importlib.import_module("bert.model.dropout_add_norm")
    rows = [count(dan, *v) for v in variants()]
    print(f"{'kernel (sm_90, N 1024, 4 warps)':34} {'dropout':>7} {'loop':>5} {'/elem':>5} {'IMAD.HI':>7} {'regs':>4} "
          f"{'B/elem':>6} "
          f"{'issue':>5} {'memory':>6} {'bound':>6} {'48 a step, ms':>13}")
    for r in rows:
        print(f"{r['kernel']:34} {r['dropout']!s:>7} {r['loop_instructions']:5} {r['per_element']:5} "
              f"{r['high_products']:7} {r['registers']:4} {r['bytes_per_element']:6} {r['issue_clocks']:5.0f} "
              f"{r['memory_clocks']:6} "
              f"{r['bound']:>6} {r['step_ms']:6.2f}-{r['step_ms_no_overlap']:.2f}")
    step = {}
    for dropout in (False, True):
        forward = [r["step_ms"] for r in rows if r["dropout"] == dropout and r["kernel"].startswith("forward float8")]
        step[f"float8_forward_ms{'_dropout' if dropout else ''}"] = round(sum(forward) / len(forward), 2)
    print(f"the float8 candidate's 48 forward norms a step, with dropout: {step['float8_forward_ms_dropout']} ms at "
          f"least (without: {step['float8_forward_ms']})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"triton": triton.__version__, "target": "cuda sm_90",
                                           "commit": commit(args.tree), "rows": rows,
                                           "step_estimate": step}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
