"""Plot a run: eval MLM accuracy vs training samples from its result log, and the training loss from
the driver's metrics.jsonl when given, to one PNG.

    python logging/plot_run.py results/CPU_1x2/bert/result_0.txt --metrics OUTPUT_DIR/metrics.jsonl --out run.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402
from result_log import read_events, values  # noqa: E402


def read_metrics(path: Path, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if x_key in record and y_key in record:
                xs.append(record[x_key])
                ys.append(record[y_key])
            elif number == 1 and x_key not in record:
                raise SystemExit(f"plot_run: {path}:1 has no {x_key!r} (keys: {sorted(record)}); see --x-key")
    return xs, ys


def plot(log: Path, metrics: Path | None, x_key: str, y_key: str, target: float) -> plt.Figure:
    events = read_events(log)
    evals = [e for e in events if e.key == "eval_accuracy"]
    if not evals:
        raise SystemExit(f"plot_run: {log} has no eval_accuracy lines")
    status = next((e.metadata.get("status") for e in events if e.key == "run_stop"), "no run_stop")
    gbs = (values(events, "global_batch_size") or ["?"])[0]
    panels = 2 if metrics else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3.2 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.plot([e.metadata["epoch_num"] for e in evals], [e.value for e in evals], "o-", label="eval MLM accuracy")
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target}")
    ax.set_ylabel("MLM accuracy")
    ax.set_title(f"{log.name}: GBS {gbs}, {status}")
    ax.legend(loc="lower right")
    if metrics:
        xs, ys = read_metrics(metrics, x_key, y_key)
        axes[1][0].plot(xs, ys, linewidth=1)
        axes[1][0].set_ylabel(f"training {y_key}")
    axes[-1][0].set_xlabel("training samples")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="MLPerf result log")
    p.add_argument("--metrics", type=Path, help="metrics.jsonl written by run_pretraining.py")
    p.add_argument("--x-key", default="samples", help="metrics.jsonl field with the sample count")
    p.add_argument("--y-key", default="loss", help="metrics.jsonl field to plot")
    p.add_argument("--target", type=float, default=0.720)
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = p.parse_args(argv)
    plot(args.log, args.metrics, args.x_key, args.y_key, args.target).savefig(args.out, dpi=100)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
