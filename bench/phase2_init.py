"""Phase 2 from a phase-1 checkpoint vs from scratch, in the same wall time, on the CPU default.

Runs of `source config_CPU_1x2.sh; ./run_and_time.sh` (2 gloo processes) on the embedded corpus, one after
the other, each stopped (SIGTERM) `--seconds` after it started (`--only` picks some):

    scratch   BERT_CONFIG=tiny, no checkpoint: the CPU default's LAMB recipe (LR 0.015, batch 8 per rank, 10
              warmup steps)
    minilm    BERT_CONFIG=minilm INIT_CHECKPOINT=minilm: MiniLM-L6-H384's encoder, fresh MLM/NSP heads
              (--minilm-optimizer/--minilm-lr/--minilm-batch; a fresh head wants Adam-sized steps)
    phase1    BERT_CONFIG=minilm INIT_CHECKPOINT=DATA/phase1/minilm_mlm.safetensors: the same encoder with the
              heads fitted to it by data/phase1_heads.py (--minilm-optimizer/--minilm-batch, --phase1-lr)

Both evaluate the same eval samples (the config's NUM_EVAL_EXAMPLES) with an unreachable target, so neither
stops early; the table gives every eval (samples, seconds since run_start, masked-LM accuracy) and the best
accuracy each reached within the budget. The machine is shared: `uptime` is recorded before and after, and
samples are reported beside seconds.

    .venv/bin/python bench/phase2_init.py --data work/data --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trial import read_mllog

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE = "0.99"
SCRATCH = {"BERT_CONFIG": "tiny", "INIT_CHECKPOINT": "", "OPTIMIZER": "lamb", "LR": "0.015", "BATCHSIZE": "8",
           "WARMUP_STEPS": "10", "MAX_STEPS": "1000"}
MINILM = {"BERT_CONFIG": "minilm", "INIT_CHECKPOINT": "minilm", "WARMUP_STEPS": "5", "MAX_STEPS": "1000"}
PHASE1 = {**MINILM, "INIT_CHECKPOINT": "{data}/phase1/minilm_mlm.safetensors"}
VARIANTS = {"scratch": SCRATCH, "minilm": MINILM, "phase1": PHASE1}


def config_env(data: Path, overrides: dict[str, str]) -> dict[str, str]:
    """os.environ after `source config_CPU_1x2.sh` with BERT_DATA set, then the overrides."""
    env = {**os.environ, "BERT_DATA": str(data), "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    for name in ("DATADIR_PHASE2", "EVALDIR"):
        env.pop(name, None)
    out = subprocess.run(["bash", "-c", f'source "{ROOT / "config_CPU_1x2.sh"}" && env -0'], env=env,
                         capture_output=True, text=True, check=True).stdout
    return {**dict(item.split("=", 1) for item in out.split("\0") if "=" in item), **overrides}


def run(name: str, env: dict[str, str], seconds: float, work: Path) -> dict:
    log, out = work / f"{name}.txt", work / f"out_{name}"
    env = {**env, "MLPERF_LOG": str(log), "OUTPUT_DIR": str(out), "TARGET_MLM_ACCURACY": UNREACHABLE,
           "MAX_SAMPLES_TERMINATION": "10000000", "SKIP_CHECKPOINT": "1"}
    proc = subprocess.Popen([str(ROOT / "run_and_time.sh")], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    start = time.time()
    while proc.poll() is None and time.time() - start < seconds:
        time.sleep(1)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # forwarded to the workers: they checkpoint (run_and_time.sh exits 3)
    _, err = proc.communicate(timeout=300)
    lines = read_mllog(log.read_text())
    run_start = next(e["time_ms"] for e in lines if e["key"] == "run_start")
    evals = [{"samples": e["metadata"]["epoch_num"], "seconds": round((e["time_ms"] - run_start) / 1000, 1),
              "accuracy": round(e["value"], 4)} for e in lines if e["key"] == "eval_accuracy"]
    init = round((run_start - next(e["time_ms"] for e in lines if e["key"] == "init_start")) / 1000, 1)
    keep = ("BERT_CONFIG", "INIT_CHECKPOINT", "OPTIMIZER", "LR", "BATCHSIZE", "WARMUP_STEPS", "MAX_STEPS",
            "EVAL_ITER_START_SAMPLES", "EVAL_ITER_SAMPLES", "NUM_EVAL_EXAMPLES", "EVAL_BATCHSIZE", "SEED")
    return {"env": {k: env.get(k, "") for k in keep}, "exit_status": proc.returncode, "init_seconds": init,
            "evals": evals, "stderr_tail": err.strip().splitlines()[-3:]}


def best_within(evals: list[dict], seconds: float) -> dict | None:
    within = [e for e in evals if e["seconds"] <= seconds]
    return max(within, key=lambda e: e["accuracy"]) if within else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=ROOT / "work" / "data", help="data/prepare.py --embedded output")
    p.add_argument("--seconds", type=float, default=300, help="wall time of each run, from its start")
    p.add_argument("--seed", default="7")
    p.add_argument("--eval-every", default="160", help="EVAL_ITER_START_SAMPLES and EVAL_ITER_SAMPLES of both")
    p.add_argument("--eval-examples", default="200", help="NUM_EVAL_EXAMPLES of both: the same eval samples")
    p.add_argument("--minilm-optimizer", default="adam")
    p.add_argument("--minilm-lr", default="0.001")
    p.add_argument("--minilm-batch", default="4", help="sequences per rank")
    p.add_argument("--phase1-lr", default="0.0001", help="LR of the phase1 run (its heads are already fitted)")
    p.add_argument("--only", choices=tuple(VARIANTS), nargs="*", default=tuple(VARIANTS))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "phase2_from_minilm.json")
    args = p.parse_args(argv)
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = {}
    with tempfile.TemporaryDirectory(prefix="phase2_init_") as tmp:
        for name in args.only:
            common = {"SEED": args.seed, "EVAL_ITER_START_SAMPLES": args.eval_every,
                      "EVAL_ITER_SAMPLES": args.eval_every, "NUM_EVAL_EXAMPLES": args.eval_examples}
            tuned = {"OPTIMIZER": args.minilm_optimizer, "BATCHSIZE": args.minilm_batch,
                     "LR": args.phase1_lr if name == "phase1" else args.minilm_lr}
            variant = {k: v.format(data=args.data.resolve()) for k, v in VARIANTS[name].items()}
            env = config_env(args.data.resolve(), {**variant, **common, **(tuned if name != "scratch" else {})})
            results[name] = run(name, env, args.seconds, Path(tmp))
            print(f"{name}: exit {results[name]['exit_status']}, {len(results[name]['evals'])} evals", flush=True)
    # Compared at the time both had: the budget minus the slower initialisation.
    horizon = args.seconds - max(r["init_seconds"] for r in results.values())
    for r in results.values():
        r["best_within_horizon"] = best_within(r["evals"], horizon)
    report = {"command": " ".join([sys.executable, *sys.argv]), "seconds_per_run": args.seconds,
              "horizon_seconds_since_run_start": round(horizon, 1), "uptime_before": uptime_before,
              "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "cpus": os.cpu_count(), "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'run':8} {'samples':>8} {'seconds':>8} {'mlm_acc':>8}")
    for name, r in results.items():
        for e in r["evals"]:
            print(f"{name:8} {e['samples']:>8} {e['seconds']:>8} {e['accuracy']:>8.4f}")
    for name, r in results.items():
        b = r["best_within_horizon"]
        print(f"best within {horizon:.0f} s of run_start: {name} " +
              (f"{b['accuracy']:.4f} at {b['samples']} samples, {b['seconds']} s" if b else "no eval"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
