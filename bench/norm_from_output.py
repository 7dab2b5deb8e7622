"""What RESIDUAL_NORM=fused-lean costs in gradient accuracy on a trained checkpoint, against RESIDUAL_NORM=fused.

The lean norm's backward recovers x_hat = (y - beta) / gamma from its bf16 output, so y's rounding reaches x_hat
times |x_hat + beta / gamma|: harmless where gamma is near 1 and beta near 0 (a fresh model), not where a trained
norm has a gamma near 0 beside a beta that is not. This takes a phase-1 checkpoint, runs the same batches through
the model in float64 (the reference) and in bf16 weights (as MASTER_WEIGHTS=1 holds them) with each norm, and
prints, for each of the encoder's norms, the largest |beta / gamma| and the relative error of gamma's gradient
(||g - g64|| / ||g64||) with the sum kept and with x_hat from y, the same for that norm's feature of the largest
|beta / gamma| alone, then over all of the model's gradients.
Dropout is off, so the three runs see one function. Random tokens at Wikipedia-like lengths (bert.synthetic).

    .venv/bin/python bench/norm_from_output.py --checkpoint work/data/phase1/minilm_mlm.safetensors \
        --json results/bench/norm_from_output.json

`--driver` runs the driver instead (`./run_and_time.sh`, bench/trial.py's `run_trial`): config_CPU_1x2.sh's phase 2
from that checkpoint, 2 gloo ranks, one seed for every run, 480 samples, in fp32 and in bf16 with fp32 masters,
each under both norms; it prints each run's loss every 10 steps and its three evals.

    .venv/bin/python bench/norm_from_output.py --driver --json results/bench/norm_from_output_driver.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from trial import PHASE2, phase2_run, print_phase2_runs  # noqa: E402

from bert.model import BertConfig, BertForPreTraining  # noqa: E402
from bert.model.dropout_add_norm import FusedResidualOutput, apply_residual_norm  # noqa: E402
from bert.model.init_checkpoint import load_init_checkpoint  # noqa: E402
from bert.synthetic import random_batch  # noqa: E402

KINDS = ("fused", "fused-lean")
PRECISIONS = {"fp32": {"PRECISION": "fp32"}, "bf16-masters": {"PRECISION": "bf16", "MASTER_WEIGHTS": "1"}}


def build(config: str, checkpoint: str, kind: str, dtype: torch.dtype) -> BertForPreTraining:
    model = BertForPreTraining(BertConfig.load(config).with_dropout(0.0), attention="padded")
    apply_residual_norm(model, kind)
    load_init_checkpoint(model, checkpoint)
    return model.to(dtype).train()


def gradients(model: BertForPreTraining, batches: list) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for batch in batches:
        model(batch).loss.backward()
    return {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def measure(config: str, checkpoint: str, batches: list) -> dict:
    reference = build(config, checkpoint, "fused", torch.float64)
    want = gradients(reference, batches)
    got = {kind: gradients(build(config, checkpoint, kind, torch.bfloat16), batches) for kind in KINDS}
    norms = []
    for name, module in reference.named_modules():
        if isinstance(module, FusedResidualOutput):
            gamma, beta = module.LayerNorm.weight.detach(), module.LayerNorm.bias.detach()
            key, worst = f"{name}.LayerNorm.weight", int((beta / gamma).abs().argmax())
            norms.append({"norm": name, "max_beta_over_gamma": float((beta / gamma).abs().max()),
                          "min_abs_gamma": float(gamma.abs().min()),
                          **{f"dgamma_error_{kind}": relative(got[kind][key], want[key]) for kind in KINDS},
                          # the feature of the largest |beta / gamma|: where x_hat from y is the least exact
                          **{f"worst_feature_error_{kind}": relative(got[kind][key][worst], want[key][worst])
                             for kind in KINDS}})
    everything = {f"all_error_{kind}": relative(torch.cat([g.flatten() for g in got[kind].values()]),
                                                torch.cat([want[n].flatten() for n in got[kind]])) for kind in KINDS}
    return {"norms": norms, **everything}


def driver_runs(checkpoint: str, data: str, seed: int) -> list[dict]:
    """Each precision x norm as one driver run at `seed`: its losses (metrics.jsonl) and evals (the result log)."""
    import tempfile

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision, settings in PRECISIONS.items():
            for kind in KINDS:
                run = phase2_run({**settings, "BERT_DATA": data, "INIT_CHECKPOINT": checkpoint, "SEED": str(seed),
                                  "RESIDUAL_NORM": kind}, Path(tmp) / f"{precision}-{kind}")
                runs.append({"precision": precision, "residual_norm": kind, **run})
    return runs


def print_driver(runs: list[dict]) -> None:
    print_phase2_runs(runs, {"precision": 13, "residual_norm": 11})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "work/data/phase1/minilm_mlm.safetensors"))
    parser.add_argument("--config", default="minilm", help="BERT_CONFIG of the checkpoint")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--driver", action="store_true", help="the driver's runs instead (module doc)")
    parser.add_argument("--data", default=str(ROOT / "work/data"), help="BERT_DATA, for --driver")
    parser.add_argument("--seed", type=int, default=7, help="SEED of every --driver run")
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).exists():
        print(f"no checkpoint at {args.checkpoint}: make it with data/phase1_heads.py (scripts/demo.sh does)",
              file=sys.stderr)
        return 1
    if args.driver:
        runs = driver_runs(str(Path(args.checkpoint).resolve()), args.data, args.seed)
        print_driver(runs)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"machine": platform.node(), "torch": torch.__version__,
                                             "checkpoint": Path(args.checkpoint).name, "seed": args.seed,
                                             "settings": PHASE2, "runs": runs}, indent=1) + "\n")
        return 0
    lengths = [[512, 384, 200, 128, 96, 60, 40, 32] for _ in range(args.batches)]
    batches = [random_batch(ls, seed=i, vocab_size=BertConfig.load(args.config).vocab_size)
               for i, ls in enumerate(lengths)]
    result = measure(args.config, args.checkpoint, batches)
    print(f"{'norm':<40} {'max|b/g|':>9} {'min|g|':>8} {'dgamma err fused':>17} {'fused-lean':>11} "
          f"{'its worst feature fused':>24} {'fused-lean':>11}")
    for row in result["norms"]:
        print(f"{row['norm']:<40} {row['max_beta_over_gamma']:>9.2f} {row['min_abs_gamma']:>8.4f} "
              f"{row['dgamma_error_fused']:>17.2e} {row['dgamma_error_fused-lean']:>11.2e} "
              f"{row['worst_feature_error_fused']:>24.2e} {row['worst_feature_error_fused-lean']:>11.2e}")
    print(f"{'every gradient':<40} {'':>9} {'':>8} {result['all_error_fused']:>17.2e} "
          f"{result['all_error_fused-lean']:>11.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.node(), "torch": torch.__version__,
                                         "checkpoint": Path(args.checkpoint).name, "config": args.config,
                                         "tokens_a_batch": sum(lengths[0]), "batches": args.batches, **result},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
