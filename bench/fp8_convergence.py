"""What the float8 candidate costs in convergence: the driver's phase 2 from a trained checkpoint in fp32, in bf16 with
fp32 masters and in delayed float8 with fp32 masters, each seed the same for all three.

The float8 candidate is issue 9's fastest GPU row (`bench/cuda_session.sh`,
`driver-fp8-delayed-lean-norm-triton-biasgelu...`): FP8_RECIPE=delayed with every linear inside one of our float8
Functions (ATTENTION=triton, RESIDUAL_NORM=fused-lean, BIAS_GELU=fused). Every run here takes those settings, with
the precision the only difference, so what moves is float8's rounding and scaling: the e4m3 activations and weights,
the e5m2 gradients, scales from the previous step's amax. On the CPU our kernels run their torch paths and the float8
GEMMs are fp32 GEMMs of the same exact products (bert/model/fp8_gemm.py), so the float8 numerics are the GPU's up to
the order of the GEMMs' sums. `COMPILE=debug` (dynamo's capture, eager kernels) gives every run the driver's warm-up,
whose forward and backward calibrate the float8 amaxes before the first step as on the GPU. `STATIC_TOKENS`, which
float8 needs, is set for all three (padding changes no loss or gradient).

The unit is bench/trial.py's PHASE2 (config_CPU_1x2.sh: MiniLM from its checkpoint, 2 gloo ranks, 480 samples, an
eval every 160). bf16's distance from fp32 is the yardstick: float8 is as good as bf16 here if its evals sit as
close to fp32's, seed by seed.

    .venv/bin/python bench/fp8_convergence.py --json results/bench/fp8_convergence.json   # about 2 minutes a run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from trial import PHASE2, phase2_run, print_phase2_runs  # noqa: E402

CANDIDATE = {"ATTENTION": "triton", "RESIDUAL_NORM": "fused-lean", "BIAS_GELU": "fused", "STATIC_TOKENS": "128",
             "COMPILE": "debug"}
PRECISIONS = {
    "fp32": {"PRECISION": "fp32"},
    "bf16-masters": {"PRECISION": "bf16", "MASTER_WEIGHTS": "1"},
    "fp8-delayed": {"PRECISION": "fp8", "FP8_RECIPE": "delayed", "MASTER_WEIGHTS": "1"},
}


def runs(checkpoint: str, data: str, seeds: list[int], precisions: list[str]) -> list[dict]:
    """Each seed x precision as one driver run: its status, losses and evals."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name in precisions:
                run = phase2_run({**CANDIDATE, **PRECISIONS[name], "BERT_DATA": data, "INIT_CHECKPOINT": checkpoint,
                                  "SEED": str(seed)}, Path(tmp) / f"{name}-{seed}")
                out.append({"precision": name, "seed": seed, **run})
                print(f"  {name} seed {seed}: {run['status']}, evals "
                      f"{' '.join(f'{a:.4f}' for _, a in run['evals'])}, {run['wall_s']} s", flush=True)
    return out


def gaps(rows: list[dict], key: str = "evals") -> dict[str, float]:
    """Each precision's largest |value - fp32's| over the seeds and points, `key` "evals" (accuracy at each eval's
    samples) or "losses" (the loss at each logged step): the same point, the same seed."""
    reference = {(r["seed"], at): value for r in rows if r["precision"] == "fp32" for at, value in r[key]}
    worst: dict[str, float] = {}
    for r in rows:
        for at, value in r[key]:
            worst[r["precision"]] = max(worst.get(r["precision"], 0.0), abs(value - reference[(r["seed"], at)]))
    return worst


def print_table(rows: list[dict]) -> None:
    print_phase2_runs(rows, {"precision": 13, "seed": 5})
    if any(r["precision"] == "fp32" for r in rows):
        for key, what in (("evals", "eval"), ("losses", "loss")):
            print(f"largest |{what} - fp32's|: " + ", ".join(f"{k} {v:.4f}" for k, v in gaps(rows, key).items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "work/data/phase1/minilm_mlm.safetensors"))
    parser.add_argument("--data", default=str(ROOT / "work/data"), help="BERT_DATA")
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--table", type=Path, help="print the table of a JSON this wrote, and run nothing")
    args = parser.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["runs"])
        return 0
    if not Path(args.checkpoint).exists():
        print(f"no checkpoint at {args.checkpoint}: make it with data/phase1_heads.py (scripts/demo.sh does)",
              file=sys.stderr)
        return 1
    rows = runs(str(Path(args.checkpoint).resolve()), args.data, args.seeds, args.precisions)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.node(), "torch": torch.__version__,
                                         "checkpoint": Path(args.checkpoint).name, "seeds": args.seeds,
                                         "settings": {**PHASE2, **CANDIDATE}, "precisions": PRECISIONS,
                                         "largest_gap_to_fp32": {key: gaps(rows, key) for key in ("evals", "losses")}
                                         if "fp32" in args.precisions else None,
                                         "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
