"""Samples to target for gradient clipping after / before / bucket-wise, and ADAM vs LAMB (Samsung [000] Table 3).

Samsung [000] Table 3 compares the clipping modes by accuracy after a fixed 2.9M samples (GBS 16384, each
mode's hyperparameters found by HPO); here the same question is asked the other way round: how many samples
each mode needs to reach a fixed target, each a real `./run_and_time.sh` run of `bench/trial.py` (the tiny
from-scratch BERT on the embedded corpus, 2 gloo ranks), over several seeds. A run that misses the target is
censored at the sample limit. The arms share every setting but the ones named below; the LRs are the CPU
demo's LAMB value and a common ADAM value, not searched per arm as in [000] (`bench/hpo.py` does that).

    .venv/bin/python bench/clip_convergence.py                  # all arms x 3 seeds; resumes from the JSON
    .venv/bin/python bench/clip_convergence.py --seeds 1 2 3 4 5 --arms lamb-after lamb-bucket
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trial import BASE, TrialError, run_trial  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "results/bench/clip_convergence.json"
OUT_PNG = ROOT / "results/bench/clip_convergence.png"

ADAM = {"OPTIMIZER": "adam", "LR": "0.001"}
ARMS: dict[str, dict[str, str]] = {
    "lamb-after": {"GRAD_CLIP": "after"},
    "lamb-before": {"GRAD_CLIP": "before"},
    "lamb-bucket": {"GRAD_CLIP": "bucket"},
    # [000]'s submission: ADAM with bucket-wise clipping, against LAMB with the same clipping.
    "adam-bucket": {"GRAD_CLIP": "bucket", **ADAM},
    "adam-after": {"GRAD_CLIP": "after", **ADAM},
}


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per arm: mean, standard deviation, min, max of samples to target (censored runs count at the limit)."""
    by_arm: dict[str, list[dict]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(run)
    summary = {}
    for arm, rows in by_arm.items():
        samples = [r["samples"] for r in rows]
        summary[arm] = {
            "n": len(samples),
            "mean": statistics.fmean(samples),
            "std": statistics.stdev(samples) if len(samples) > 1 else 0.0,
            "min": min(samples),
            "max": max(samples),
            "censored": sum(r["censored"] for r in rows),
        }
    return summary


def plot(runs: list[dict], summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if a in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for x, arm in enumerate(arms):
        rows = [r for r in runs if r["arm"] == arm]
        for r in rows:
            left.scatter(x, r["samples"], marker="^" if r["censored"] else "o", color=f"C{x}", alpha=0.7)
        s = summary[arm]
        left.errorbar(x + 0.15, s["mean"], yerr=s["std"], fmt="s", color="k", capsize=4)
        curves = [dict(r["evals"]) for r in rows]
        points = sorted(set().union(*curves))
        mean = [statistics.fmean(c[p] for c in curves if p in c) for p in points]
        right.plot(points, mean, label=arm, color=f"C{x}")
    target = float(BASE["TARGET_MLM_ACCURACY"])
    left.set_xticks(range(len(arms)), arms)
    left.set_ylabel("samples to target (triangle: censored at the limit)")
    left.set_title(f"samples to MLM accuracy {target} per seed; mean ± std")
    right.axhline(target, color="gray", ls="--", lw=1)
    right.set_xlabel("samples")
    right.set_ylabel("eval MLM accuracy (mean over the seeds still running)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--work", type=Path, default=Path("/tmp/clip_convergence"), help="trial directories")
    parser.add_argument("--json", type=Path, default=OUT_JSON)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
    args = parser.parse_args()

    done = json.loads(args.json.read_text())["runs"] if args.json.exists() else []
    have = {(r["arm"], r["seed"]) for r in done}
    runs = list(done)
    # Seeds outermost: a partial sweep still has every arm at the first seeds.
    for seed in [] if args.plot_only else args.seeds:
        for arm in args.arms:
            if (arm, seed) in have:
                continue
            out = args.work / f"{arm}-seed{seed}-{os.getpid()}"
            try:
                result = run_trial({**ARMS[arm], "SEED": str(seed)}, out)
            except TrialError as e:
                sys.exit(f"error: {arm} seed {seed}: {e}")
            runs.append({"arm": arm, "seed": seed, **{k: result[k] for k in
                                                       ("samples", "censored", "status", "evals", "wall_s")}})
            print(f"{arm:12s} seed {seed}: {result['samples']} samples"
                  f"{' (censored)' if result['censored'] else ''}, {result['wall_s']} s", flush=True)
            record(args.json, runs, args.arms)
    summary = record(args.json, runs, args.arms)
    print(f"{'arm':12s} {'n':>2s} {'mean':>7s} {'std':>6s} {'min':>5s} {'max':>5s} censored")
    for arm, s in summary.items():
        print(f"{arm:12s} {s['n']:2d} {s['mean']:7.0f} {s['std']:6.0f} {s['min']:5d} {s['max']:5d} {s['censored']}")
    plot(runs, summary, OUT_PNG)
    print(f"wrote {args.json} and {OUT_PNG}")


def record(path: Path, runs: list[dict], arms: list[str]) -> dict[str, dict]:
    summary = summarize(runs)
    load = os.getloadavg()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "what": "samples to target per clipping mode / optimizer, real runs of bench/trial.py (Samsung [000] Table 3)",
        "settings": BASE, "arms": {a: ARMS[a] for a in ARMS}, "world": int(BASE["DGXNGPU"]),
        "machine": "2-core shared CPU VM, gloo", "loadavg_at_write": [round(x, 2) for x in load],
        "summary": summary, "runs": runs}, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
