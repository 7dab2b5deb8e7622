"""The optimizer step alone, on BERT-large's parameters: milliseconds per step of MasterWeights' update (bf16
weights, fp32 masters, LAMB, `after` clip) by layout (OPTIMIZER_LAYOUT) and compile setting (COMPILE_OPTIMIZER).

Each variant runs in its own process (a compile that fails or crashes costs its row only, with its error), builds
the update beside an eager per-tensor one over the same weights, takes 3 steps on the same random gradients in
both and reports the largest difference between their masters, then times `--steps` more with CUDA events (the
host clock on the CPU). The flat layout's per-tensor sums have three forms (`--sums`): a float64 running sum (the
module's), torch.segment_reduce, and index_add (atomics).

    python bench/optimizer_step.py --device cuda --variants flat-eager flat-compiled tensors-eager
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name: (OPTIMIZER_LAYOUT, COMPILE_OPTIMIZER, per-tensor sums of the flat layout)
    "tensors-eager": ("tensors", False, None),
    "tensors-compiled": ("tensors", True, None),
    "flat-eager": ("flat", False, "cumsum64"),
    "flat-compiled": ("flat", True, "cumsum64"),
    "flat-compiled-segment": ("flat", True, "segment_reduce"),
    "flat-compiled-index-add": ("flat", True, "index_add"),
    "flat-sharded-eager": ("sharded", False, None),  # OPTIMIZER_SHARDING=1 over one rank: its collectives' cost
}


def use_sums(kind: str) -> None:
    """Replace bert.optim.flat.tensor_sums by another form of the same sums."""
    import torch

    from bert.optim import flat

    if kind == "segment_reduce":
        flat.tensor_sums = lambda rows, part: torch.segment_reduce(rows, "sum", lengths=part.ends - part.begins)
    elif kind == "index_add":
        flat.tensor_sums = lambda rows, part: torch.zeros(len(part.ends), device=rows.device).index_add_(
            0, part.owner, rows)


def masters(run: tuple) -> list:
    """The fp32 masters, whole, in the model's parameter order (a sharded optimizer gathers them)."""
    from bert.optim.master import fp32_weights

    with fp32_weights(run[1]):
        return [p.detach().clone() for p in run[0].parameters()]


def run_variant(name: str, device: str, steps: int, model_name: str) -> dict:
    import torch

    from bert.config import from_flat
    from bert.model import BertConfig, BertForPreTraining
    from bert.optim import build_optimizer, build_schedule
    from bert.optim.compiled import compile_step, warm_up_step

    layout, compiled, sums = VARIANTS[name]
    if sums:
        use_sums(sums)

    if layout == "sharded":  # a process group of one rank (NCCL on a GPU, as the driver's)
        import tempfile

        import torch.distributed as dist

        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                                init_method=f"file://{tempfile.mkdtemp()}/store")

    def build(layout: str, compiled: bool):
        torch.manual_seed(0)
        model = BertForPreTraining(BertConfig.load(model_name), attention="loop").to(device)
        cfg = from_flat(learning_rate=1e-3, max_steps=1000, weight_decay_rate=0.01, grad_clip="after",
                        master_weights=True, precision="bf16", optimizer_sharding=layout == "sharded",
                        optimizer_layout="flat" if layout == "sharded" else layout, compile_optimizer=compiled).optim
        opt = build_optimizer(model, cfg, torch.bfloat16)
        return model, opt, build_schedule(opt, cfg)

    runs = [build(layout, compiled), build("tensors", False)]  # the variant, and the eager per-tensor reference
    gen = torch.Generator(device=device).manual_seed(1)
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):  # the same gradients, kept for every step
        p.grad = torch.randn(p.shape, generator=gen, device=device).to(p.dtype)
        q.grad = p.grad.clone()
    compile_s = 0.0
    if compiled:
        compile_step(runs[0][1], "default")
        compile_s = warm_up_step(runs[0][1])

    def step(run) -> None:
        run[1].step()
        run[2].step()

    for _ in range(3):
        for run in runs:
            step(run)
    diff = max(float((a - b).abs().max()) for a, b in zip(*map(masters, runs)))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(runs[0])
    sync()
    ms = (time.perf_counter() - start) / steps * 1e3
    return {"variant": name, "layout": layout, "compiled": compiled, "sums": sums, "compile_s": round(compile_s, 1),
            "ms_per_step": round(ms, 3), "max_master_diff_vs_eager_tensors": diff,
            "params": sum(p.numel() for p in runs[0][0].parameters())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--variants", nargs="+", default=["tensors-eager", "flat-eager", "flat-compiled"],
                   choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="large", help="BERT config name (tiny for a quick CPU check)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per variant")
    p.add_argument("--json", type=Path, default=ROOT / "results/bench/optimizer_step.json")
    p.add_argument("--run", help=argparse.SUPPRESS)  # a child: one variant, one JSON line
    args = p.parse_args()
    if args.run:
        try:
            print(json.dumps(run_variant(args.run, args.device, args.steps, args.model)))
        except Exception as e:  # the row says what failed and where; the traceback goes to stderr
            traceback.print_exc()
            frame = traceback.extract_tb(e.__traceback__)[-1]
            first = (str(e).strip().splitlines() or [""])[0]
            print(json.dumps({"variant": args.run, "error": f"{type(e).__name__}: {first[:300]}",
                              "where": f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"}))
        return 0
    rows = []
    for name in args.variants:
        cmd = [sys.executable, __file__, "--run", name, "--device", args.device, "--steps", str(args.steps),
               "--model", args.model]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"variant": name, "error": f"exit {out.returncode}"}
            if "error" in row:
                sys.stderr.write(out.stderr[-4000:])
        except subprocess.TimeoutExpired:
            row = {"variant": name, "error": f"over {args.timeout} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'variant':26} {'ms/step':>9} {'compile s':>10} {'max diff':>10}  error")
    for r in rows:
        print(f"{r['variant']:26} {r.get('ms_per_step', float('nan')):9.2f} {r.get('compile_s', float('nan')):10.1f} "
              f"{r.get('max_master_diff_vs_eager_tensors', float('nan')):10.2e}  {r.get('error', '')}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    import torch

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "model": args.model,
                                     "steps": args.steps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
