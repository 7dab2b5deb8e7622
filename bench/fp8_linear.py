"""Where float8 linears gain or lose on BERT-large's encoder shapes: one linear layer's forward + backward.

PRECISION=fp8 (bert.model.fp8, torchao) ran the driver at 483 samples/s against 690 in bf16 on one H100, both
compiled, and bench/model.py's eager fp8 step at 193 against 611, although float8 GEMMs alone ran 1.5-1.8x
faster than bf16 ones (issue 9). This splits a layer's time into what float8 can save and what it costs: per
encoder linear (T tokens, bf16 weights as under MASTER_WEIGHTS=1) it times

    bf16            nn.Linear in bf16
    fp8-tensorwise  torchao's Float8Linear as PRECISION=fp8 builds it (dynamic per-tensor scales, e4m3
                    activations and weights, e5m2 gradients): amax reductions and casts around each GEMM
    fp8-rowwise     torchao's "rowwise" recipe (a scale per row, CUTLASS kernels)

each eager and, with `--compile MODE`, compiled (inductor fuses the casts into neighbouring kernels), and on
CUDA the three bare GEMMs of a forward + backward (forward, input gradient, weight gradient) in bf16 and in
float8 (`torch._scaled_mm` on operands already cast, unit scales): what float8 could save if the casts cost
nothing. A float8 layer slower than bf16 while its bare GEMMs are faster means the casts eat the gain.
A variant whose first call fails (a kernel or compiler error) becomes a row with its error; the others are timed.

    python bench/fp8_linear.py --device cuda      # writes results/bench/fp8_linear_cuda.json
    .venv/bin/python bench/fp8_linear.py --tokens 512 --compile debug   # CPU: bf16 rows; float8 rows emulated
                                                  # when torchao is installed (a check that it runs, not a speed)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from model import time_steps
from torch import nn

from bert.model.compile import COMPILE_MODES, check_compile
from bert.model.fp8 import float8_config

# BERT-large's four encoder linears: (in, out) features
SHAPES = {"qkv": (1024, 3072), "attention.output": (1024, 1024), "ffn.in": (1024, 4096), "ffn.out": (4096, 1024)}
LAYERS = ("bf16", "fp8-tensorwise", "fp8-rowwise")


def float8_layer(layer: nn.Linear, recipe: str, emulate: bool) -> nn.Module:
    """`layer` swapped for torchao's Float8Linear with `recipe` (an FP8_RECIPE, as the driver builds it)."""
    from torchao.float8 import convert_to_float8_training

    holder = nn.Sequential(layer)
    convert_to_float8_training(holder, config=float8_config(emulate, recipe))
    return holder


def layer_step(kind: str, fin: int, fout: int, tokens: int, device: str, compile: str, emulate: bool):
    """forward + backward of one layer of kind `kind` on (tokens, fin) bf16 input, as a closure."""
    torch.manual_seed(0)
    layer: nn.Module = nn.Linear(fin, fout, device=device, dtype=torch.bfloat16)
    if kind != "bf16":
        layer = float8_layer(layer, kind.removeprefix("fp8-"), emulate)
    if compile != "off":
        backend, mode = COMPILE_MODES[compile]
        # static shapes, as in the driver (K and N never change there): the layers share one forward, and after two
        # shapes dynamo would compile the next ones with a dynamic K
        layer = torch.compile(layer, backend=backend, mode=mode, dynamic=False)
    x = torch.randn(tokens, fin, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, fout, device=device, dtype=torch.bfloat16)

    def step() -> None:
        layer(x).backward(grad)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    return step


def first_calls(steps: dict) -> dict:
    """Call each step once (the compiled ones compile here); a step that raises leaves `steps` and comes back in
    the returned {key: error line}, so one variant's failure costs its row, not the table."""
    failed = {}
    for key, step in list(steps.items()):
        start = time.perf_counter()
        try:
            step()
        except Exception as e:  # noqa: BLE001 - whatever a kernel or the compiler raises
            failed[key] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300]
            del steps[key]
        # as it goes: a run cut off at its time limit still says how far it got and what each compile cost
        print(f"first call {' / '.join(key)}: {time.perf_counter() - start:.1f} s, {failed.get(key, 'ok')}",
              file=sys.stderr, flush=True)
    return failed


def gemms_step(fin: int, fout: int, tokens: int, device: str, float8: bool):
    """The three GEMMs of a linear's forward + backward, bf16 or float8 (`torch._scaled_mm`: the first operand
    row-major, the second column-major; e4m3 activations and weights, e5m2 gradients, as the driver's config)."""
    # (M, K, N, first operand's dtype): forward x W^T, input gradient dY W, weight gradient dY^T x
    shapes = [(tokens, fin, fout, torch.float8_e4m3fn), (tokens, fout, fin, torch.float8_e5m2),
              (fout, tokens, fin, torch.float8_e5m2)]
    one = torch.ones((), device=device)
    operands = []
    for m, k, n, first in shapes:
        a, b = torch.randn(m, k, device=device), torch.randn(n, k, device=device)
        if float8:
            operands.append((a.to(first), b.to(torch.float8_e4m3fn).t()))
        else:
            operands.append((a.bfloat16(), b.bfloat16().t()))

    def step() -> None:
        for i, (a, b) in enumerate(operands):
            if float8:  # fast accumulation in the forward GEMM only, as torchao's recipes
                torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=i == 0)
            else:
                a @ b

    return step


def has_torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", type=int, default=24576, help="tokens per step (96 phase-2 sequences: ~24,500)")
    p.add_argument("--compile", choices=tuple(COMPILE_MODES), default=None,
                   help="also time each layer compiled with this COMPILE mode (CUDA default: default; CPU: off)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None, help="default results/bench/fp8_linear_<device>.json")
    args = p.parse_args(argv)
    if args.tokens % 16:
        p.error("--tokens must be a multiple of 16 (float8 GEMMs)")
    args.compile = args.compile or ("default" if args.device == "cuda" else "off")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    compile = args.compile
    try:
        check_compile(compile, torch.device(args.device))
    except ValueError as e:
        print(f"bench/fp8_linear.py: {e}", file=sys.stderr)
        return 2
    emulate = args.device != "cuda"
    kinds = list(LAYERS) if has_torchao() else ["bf16"]
    if len(kinds) == 1:
        print("bench/fp8_linear.py: torchao is not installed: bf16 rows only (pip install torchao)", file=sys.stderr)
    modes = ["off"] + ([compile] if compile != "off" else [])
    # every layer here is another module through the same forward code: dynamo's default limit of 8 compilations
    # per code object would leave the later layers eager
    torch._dynamo.config.recompile_limit = 64
    steps = {}
    for name, (fin, fout) in SHAPES.items():
        for kind in kinds:
            for mode in modes:
                label = kind if mode == "off" else f"{kind} compiled"
                steps[(name, label)] = layer_step(kind, fin, fout, args.tokens, args.device, mode, emulate)
        if args.device == "cuda":
            steps[(name, "gemms bf16")] = gemms_step(fin, fout, args.tokens, args.device, float8=False)
            steps[(name, "gemms fp8")] = gemms_step(fin, fout, args.tokens, args.device, float8=True)
    start = time.perf_counter()
    failed = first_calls(steps)
    times = time_steps(steps, args.repeats, args.device, quiet=True)
    rows = []
    for (name, label), t in times.items():
        fin, fout = SHAPES[name]
        med = statistics.median(t)
        baseline = "gemms bf16" if label.startswith("gemms") else "bf16 compiled" if "compiled" in label else "bf16"
        base = statistics.median(times[(name, baseline)]) if (name, baseline) in times else float("nan")
        rows.append({"layer": name, "in": fin, "out": fout, "variant": label, "median_ms": med * 1e3,
                     "tflops": 6 * args.tokens * fin * fout / med / 1e12, "speedup_vs_bf16": base / med})
    rows += [{"layer": name, "in": SHAPES[name][0], "out": SHAPES[name][1], "variant": label, "error": error}
             for (name, label), error in failed.items()]
    print(f"{args.tokens} tokens, forward + backward, median of {args.repeats}, {args.device}"
          f"{' (float8 emulated: not a speed)' if emulate and len(kinds) > 1 else ''}")
    print(f"{'layer':>17} {'in x out':>11} {'variant':>25} {'ms':>8} {'TFLOP/s':>8} {'vs bf16':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['layer']:>17} {r['in']:>5}x{r['out']:<5} {r['variant']:>25} failed: {r['error']}")
            continue
        print(f"{r['layer']:>17} {r['in']:>5}x{r['out']:<5} {r['variant']:>25} {r['median_ms']:>8.3f} "
              f"{r['tflops']:>8.1f} {r['speedup_vs_bf16']:>7.2f}x")
    out = args.json or Path(f"results/bench/fp8_linear_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    out.write_text(json.dumps({"device": device_name, "torch": torch.__version__, "tokens": args.tokens,
                               "compile": compile, "repeats": args.repeats, "emulated": emulate and len(kinds) > 1,
                               "seconds": time.perf_counter() - start, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
