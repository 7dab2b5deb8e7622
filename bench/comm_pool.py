"""Several bench/comm.py runs pooled: is a strategy within a margin of flat, beyond the noise of a shared host?

One comm.py run times 16 rounds; on the 2-core VM its median ratio moves by several percent from run to run
(other processes, page cache, which core a rank lands on). This reads the runs' JSONs, pools the per-round
ratios to flat of every variant they share (each round: both variants' mean step, taken back to back), and
prints the median of the runs' medians, the pooled median and its bootstrap 95 % interval (2000 resamples of
the rounds), for wall time and for the CPU time of all ranks. Writes the same figures as JSON.

    for i in 1 2 3 4 5 6; do .venv/bin/python bench/comm.py --only flat/ddp,hierarchical/ddp --rounds 16 \
        --out results/bench/comm_runs/$i.json --plot /tmp/comm_run.png; done
    .venv/bin/python bench/comm_pool.py results/bench/comm.json results/bench/comm_runs/*.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bootstrap_median(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median of `values` resampled with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def pool(runs: list[dict]) -> dict:
    """{variant: figures} for every variant with a ratio to flat in all `runs` (comm.py's JSON)."""
    shared = set.intersection(*(set(r["ratio_to_flat"]) for r in runs))
    out = {}
    for key in sorted(shared):
        ratios = [r["ratio_to_flat"][key] for r in runs]
        out[key] = {"vs": ratios[0]["vs"], "runs": len(runs)}
        for name, label in (("", "wall"), ("cpu_", "cpu")):
            rounds = [x for r in ratios for x in r[f"{name}per_round"]]
            low, high = bootstrap_median(rounds)
            out[key][label] = {"run_medians": [r[f"{name}median"] for r in ratios],
                               "median_of_runs": statistics.median(r[f"{name}median"] for r in ratios),
                               "rounds": len(rounds), "pooled_median": statistics.median(rounds),
                               "pooled_median_95": [low, high]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="bench/comm.py JSONs")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "comm_pooled.json")
    args = p.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    pooled = pool(runs)
    if not pooled:
        raise SystemExit("comm_pool.py: the runs share no variant with a ratio to flat")
    print(f"{'variant':<24}{'':<6}{'runs':>5}{'median of runs':>16}{'rounds':>8}{'pooled median':>15}{'95 %':>16}"
          "   run medians")
    for key, r in pooled.items():
        for label in ("wall", "cpu"):
            f = r[label]
            low, high = f["pooled_median_95"]
            print(f"{key:<24}{label:<6}{r['runs']:>5}{f['median_of_runs']:>16.3f}{f['rounds']:>8}"
                  f"{f['pooled_median']:>15.3f}{f'{low:.3f}-{high:.3f}':>16}   "
                  + ", ".join(f"{x:.2f}" for x in f["run_medians"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": [str(path) for path in args.runs], "ratio_to_flat": pooled,
                                    "bootstrap": "2000 resamples of the pooled rounds, seed 0"}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
