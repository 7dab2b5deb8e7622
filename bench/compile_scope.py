"""COMPILE_SCOPE: how long the first compiled forward+backward takes, whole model against per layer.

The driver compiles before run_start (`bert.train.warmup`), inside the rules' untimed initialisation, but
that time still comes out of every run's 20-minute init budget and out of every debugging cycle. One graph
for the model traces all its layers; per layer, the encoder layers share one graph, so one layer is traced (and
the last, which keeps only the loss rows after its attention: `bert.model.last_layer`) (`bert.model.compile`).
This times `warm_up` (the driver's first call) for each scope, counts the graphs dynamo
made, and times the next steps on new token counts (no recompilation expected in either scope).

    .venv/bin/python bench/compile_scope.py                      # BERT-large, COMPILE=debug, on the CPU
    python3 bench/compile_scope.py --device cuda --compile default   # on a GPU: inductor's code generation too

COMPILE=debug (dynamo + AOT autograd, run eagerly) measures the tracing, which does not depend on the device;
inductor adds code generation per graph. Writes results/bench/compile_scope[_cuda].json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bert.model import BertConfig, BertForPreTraining
from bert.model.compile import COMPILE_MODES, COMPILE_SCOPES, compile_model
from bert.train.build import autocast_for
from bert.train.warmup import warm_up, warmup_batch

ROOT = Path(__file__).resolve().parents[1]


def one_scope(scope: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = BertConfig.load(args.bert_config)
    model = compile_model(BertForPreTraining(cfg, device=device).to(device), args.compile, device, scope)
    autocast = autocast_for("bf16" if device.type == "cuda" else "fp32", device)  # the driver's, without masters
    first = warm_up(model, warmup_batch(args.sequences, args.max_len, device, cfg.real_vocab_size, seed=0), autocast)
    later = [warm_up(model, warmup_batch(args.sequences, args.max_len, device, cfg.real_vocab_size, seed=s), autocast)
             for s in range(1, args.steps + 1)]
    return {"scope": scope, "first_s": round(first, 2), "later_s": round(sorted(later)[len(later) // 2], 3),
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bert-config", default="large")
    p.add_argument("--compile", default="debug", choices=[m for m in COMPILE_MODES if m != "off"])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sequences", type=int, default=4, help="sequences per batch (random lengths up to --max-len)")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="later steps timed, each on new token counts")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    print(f"{'scope':<8} {'first fwd+bwd s':>16} {'later s':>8} {'graphs':>7}")
    for scope in COMPILE_SCOPES:
        row = one_scope(scope, args)
        rows.append(row)
        print(f"{row['scope']:<8} {row['first_s']:>16} {row['later_s']:>8} {row['graphs']:>7}", flush=True)
    out = args.out or ROOT / "results" / "bench" / f"compile_scope{'_cuda' if args.device == 'cuda' else ''}.json"
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (2-core VM)"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"machine": machine, "torch": torch.__version__, **settings, "rows": rows}, indent=1)
                   + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
