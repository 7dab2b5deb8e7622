"""Delayed float8's first step with and without the amaxes calibrated: its encoder weight gradients against float64.

A new delayed float8 run's amaxes start at each format's max, so its first step casts at scale 1: e5m2 then flushes
every gradient under about 1.5e-5 to zero. The driver's warm-up calibrates them on a synthetic batch before
run_start, compiled or not (bert.train.warmup, `calibrate_float8` under COMPILE=off). This measures what that pass
is worth on BERT tiny (the tests' model, no dropout): one batch's encoder weight gradients (all 2-d weights of the
encoder) at the amaxes' start and after one calibration pass on another batch, each against the same model's
float64 gradients, as the share of elements exactly zero and the relative error ||g - g64|| / ||g64||.

    .venv/bin/python bench/fp8_first_step.py --json results/bench/fp8_first_step.json   # seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from norm_from_output import gradients, relative  # noqa: E402

from bert.model import BertConfig, BertForPreTraining  # noqa: E402
from bert.model.fp8 import convert_to_fp8  # noqa: E402
from bert.synthetic import random_batch  # noqa: E402

LENGTHS = [128] * 4 + [64] * 4  # 768 tokens: float8's weight gradients contract over a multiple of 16


def encoder_weight_grads(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """`batch`'s gradients of the encoder's 2-d weights (the float8 linears' among them), in float64."""
    return {name: g for name, g in gradients(model, [batch]).items()
            if name.startswith("bert.encoder.") and g.dim() == 2}


def measure(config: str, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    cfg = BertConfig.load(config).with_dropout(0.0)
    base = BertForPreTraining(cfg, attention="padded")
    calibration, measured = (random_batch(LENGTHS, seed=seed + i, vocab_size=cfg.vocab_size) for i in (1, 2))
    reference = encoder_weight_grads(copy.deepcopy(base).double(), measured)
    rows = []
    for calibrated in (False, True):
        model = copy.deepcopy(base)
        convert_to_fp8(model, recipe="delayed")
        if calibrated:
            encoder_weight_grads(model, calibration)  # records the amaxes; its gradients are dropped
        grads = encoder_weight_grads(model, measured)
        got = torch.cat([g.flatten() for g in grads.values()])
        zeros = float((got == 0).double().mean())
        error = relative(got, torch.cat([reference[name].flatten() for name in grads]))
        rows.append({"amaxes": "calibrated" if calibrated else "at their start", "zero_share": round(zeros, 4),
                     "relative_error_vs_float64": round(error, 4)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = measure(args.config, args.seed)
    print(f"{'amaxes':<16} {'zero share':>10} {'error vs float64':>17}")
    for r in rows:
        print(f"{r['amaxes']:<16} {r['zero_share']:>10.3f} {r['relative_error_vs_float64']:>17.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.node(), "torch": torch.__version__, "config": args.config,
                                         "tokens": sum(LENGTHS), "seed": args.seed, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
