"""How many step shapes a run meets under STATIC_TOKENS, and how many a CUDA-graph run records in its timed steps.

Under COMPILE=reduce-overhead inductor records one CUDA graph per distinct (T, M) shape, and a recording costs
about a step or more. On one H100 (results/bench/train_gpu_cuda_graphs.json) STATIC_TOKENS=512 ran at 471
samples/s against 690 compiled without graphs, its progress intervals swinging between 389 and 689. This
counts, for batches of the phase-2 length mix ([000] appendix C) masked as create_pretraining_data masks
(`bert.data.format.predictions_per_sequence`, as data/make_random_shards.py writes them):

    shapes      distinct (T, M) pairs over `--steps` steps of one rank
    timed_new   pairs first met after `--warmup-steps` (each one recorded inside the timed run)
    warmed_new  the same when the warm-up first records every bucket `likely_token_buckets` names
                (bert.train.warmup), which is what the driver now does
    token_waste padding tokens over real tokens
    rows_waste  padding masked rows over real ones

for M padded to its own bucket of 64 (the rule before) and to the bound that ties it to T's bucket
(bert.static_shapes.masked_rows_bound, the rule now). Mean over `--seeds` runs.

The eval: rank 0's slice of `--eval-examples` samples of the same mix over `--eval-worlds` GPUs, in batches
of `--eval-batch` (EVAL_BATCHSIZE), as `bert.data.eval_set.batch_shapes` cuts it:

    unpadded    distinct (sequences, T) shapes without STATIC_TOKENS (each recorded at the first evaluation)
    eval bucket the eval's token bucket, STATIC_TOKENS capped at 512 (bert.static_shapes.eval_token_bucket)
    padded      distinct shapes padded to the eval bucket (each recorded by the warm-up, before run_start)
    token_waste padding tokens over real tokens
    padded to STATIC_TOKENS, token_waste   the same padded to STATIC_TOKENS itself (the rule before the cap)

CPU only, seconds.

    .venv/bin/python bench/static_shapes.py     # writes results/bench/static_shapes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bert.data.eval_set import batch_shapes, eval_slice
from bert.data.format import predictions_per_sequence
from bert.lengths import WIKI_PHASE2
from bert.static_shapes import (
    MASKED_BUCKET,
    eval_token_bucket,
    likely_token_buckets,
    masked_rows_bound,
    padded_tokens,
    round_up,
)

RULES = ("own bucket", "tied to T")


def one_run(bucket: int, batch: int, steps: int, warmup_steps: int, rule: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    warmed = {(b, round_up(masked_rows_bound(b, batch), MASKED_BUCKET))
              for b in likely_token_buckets(WIKI_PHASE2.sample(100_000, rng), batch, bucket)}
    seen, first, tokens, pad_tokens, rows, pad_rows = set(), {}, 0, 0, 0, 0
    for step in range(steps):
        lengths = WIKI_PHASE2.sample(batch, rng)
        t, m = int(lengths.sum()), int(predictions_per_sequence(lengths).sum())
        t_pad = padded_tokens(t, bucket)
        m_pad = round_up(m if rule == RULES[0] else max(m, masked_rows_bound(t_pad, batch)), MASKED_BUCKET)
        first.setdefault((t_pad, m_pad), step)
        seen.add((t_pad, m_pad))
        tokens, pad_tokens, rows, pad_rows = tokens + t, pad_tokens + t_pad - t, rows + m, pad_rows + m_pad - m
    late = [shape for shape, step in first.items() if step >= warmup_steps]
    return {"shapes": len(seen), "timed_new": len(late), "warmed_new": sum(s not in warmed for s in late),
            "token_waste": pad_tokens / tokens, "rows_waste": pad_rows / rows}


def eval_row(bucket: int, batch: int, examples: int, world: int, seeds: int) -> dict:
    """Rank 0's eval batches: distinct shapes unpadded, padded to the eval's bucket (`eval_token_bucket`, what
    the driver does) and to STATIC_TOKENS itself (what it did before), with the extra tokens each computes."""
    runs, eval_bucket = [], eval_token_bucket(bucket)
    for seed in range(seeds):
        lengths = WIKI_PHASE2.sample(examples, np.random.default_rng(seed))[eval_slice(examples, world, 0)]
        plain = batch_shapes(lengths, batch)
        padded, coarse = batch_shapes(lengths, batch, eval_bucket), batch_shapes(lengths, batch, bucket)
        real = sum(t for _, t in plain)
        runs.append({"batches": len(plain), "unpadded": len(set(plain)), "padded": len(set(padded)),
                     "token_waste": sum(t for _, t in padded) / real - 1, "padded_to_static_tokens": len(set(coarse)),
                     "token_waste_at_static_tokens": sum(t for _, t in coarse) / real - 1})
    return {"static_tokens": bucket, "eval_bucket": eval_bucket, "eval_batch": batch, "world": world,
            **{k: float(np.mean([r[k] for r in runs])) for k in runs[0]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="STATIC_TOKENS values")
    p.add_argument("--batch", type=int, default=96, help="sequences per step and rank")
    p.add_argument("--steps", type=int, default=150, help="steps of the run (bench/train_gpu.py's 30 + 120)")
    p.add_argument("--warmup-steps", type=int, default=30, help="steps before the timed window")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--eval-examples", type=int, default=10_000, help="NUM_EVAL_EXAMPLES")
    p.add_argument("--eval-batch", type=int, default=16, help="EVAL_BATCHSIZE (the driver's default)")
    p.add_argument("--eval-worlds", type=int, nargs="+", default=[1, 8], help="GPUs the eval set is split over")
    p.add_argument("--json", type=Path, default=Path("results/bench/static_shapes.json"))
    args = p.parse_args(argv)
    rows = []
    for bucket in args.buckets:
        for rule in RULES:
            runs = [one_run(bucket, args.batch, args.steps, args.warmup_steps, rule, s) for s in range(args.seeds)]
            rows.append({"static_tokens": bucket, "masked_rule": rule,
                         **{k: float(np.mean([r[k] for r in runs])) for k in runs[0]}})
    print(f"batch {args.batch}, {args.steps} steps ({args.warmup_steps} before the window), mean of {args.seeds} runs")
    print(f"{'STATIC_TOKENS':>13} {'masked rows':>12} {'shapes':>7} {'timed_new':>10} {'warmed_new':>11} "
          f"{'token_waste':>12} {'rows_waste':>11}")
    for r in rows:
        print(f"{r['static_tokens']:>13} {r['masked_rule']:>12} {r['shapes']:>7.1f} {r['timed_new']:>10.1f} "
              f"{r['warmed_new']:>11.1f} {r['token_waste']:>12.3f} {r['rows_waste']:>11.3f}")
    evals = [eval_row(bucket, args.eval_batch, args.eval_examples, world, args.seeds)
             for bucket in args.buckets for world in args.eval_worlds]
    print(f"\neval: {args.eval_examples} examples, EVAL_BATCHSIZE={args.eval_batch}, rank 0's slice, "
          f"mean of {args.seeds} draws")
    print(f"{'STATIC_TOKENS':>13} {'GPUs':>5} {'batches':>8} {'unpadded':>9} {'eval bucket':>12} {'padded':>7} "
          f"{'token_waste':>12} {'padded to STATIC_TOKENS':>24} {'token_waste':>12}")
    for r in evals:
        print(f"{r['static_tokens']:>13} {r['world']:>5} {r['batches']:>8.0f} {r['unpadded']:>9.1f} "
              f"{r['eval_bucket']:>12} {r['padded']:>7.1f} {r['token_waste']:>12.3f} "
              f"{r['padded_to_static_tokens']:>24.1f} {r['token_waste_at_static_tokens']:>12.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"batch": args.batch, "steps": args.steps, "warmup_steps": args.warmup_steps,
                                     "seeds": args.seeds, "rows": rows, "eval_examples": args.eval_examples,
                                     "eval": evals}, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
