"""Training-step throughput: padded vs unpadded BERT (each attention backend) vs HF BertForPreTraining.

One training step is forward + backward + AdamW step on one batch whose lengths are drawn from the
Wikipedia phase-2 mix (`bert.lengths.WIKI_PHASE2`). One draw of 16 is a poor sample of the mix (its
fill spreads +-9 %), and the padded/unpadded ratio follows the fill, so the default batch is
representative by construction rather than picked: of `--candidates` seeded draws, the one whose
maximum is the mix's maximum (as in 98.5 % of batches of 16) and whose (token count, sum of squared
lengths) -- what the linear layers and attention cost -- is nearest, in Mahalanobis distance, to its
exact expectation n x (E[length], E[length^2]), computed from the mix's probability mass function.
`--draw random` takes the first draw, `--draw stratified` gives each length stratum round(n x share).
All variants get the same config, the same batch and dropout 0.1 (attention dropout included, as
BERT trains). Repeats are interleaved round-robin (this VM is noisy) and the median is reported,
next to a matmul FLOP/s measured in the same rounds. On a CPU shared with other jobs, wall time
mostly measures the neighbours; `--threads 1 --clock cpu` times the process's own CPU seconds
instead (one thread, so no OpenMP thread waits on a descheduled sibling), which keeps the ratios
between variants meaningful.

    padded            our model, zero-padded to the batch maximum, key-padding mask, MLM head on masked rows
    unpadded/<name>   our model on the concatenated tokens with attention backend <name> (on CUDA: flash varlen, our
                      Triton kernels, `triton`, and on torch >= 2.14 cuDNN's ragged attention, `cudnn`, side by
                      side); every unpadded row runs the
                      last layer on the [CLS] and masked rows only after its attention (LAST_LAYER_SUBSET=1, the
                      default)
    full-last/<name>  unpadded/<name> with the last layer on every token (LAST_LAYER_SUBSET=0): the subset's gain
    static<N>/<name>  unpadded/<name> on the batch padded to a multiple of N tokens (`--static-tokens N`,
                      bert.static_shapes), charged for the padding it computes
    compiled/<name>   unpadded/<name> under torch.compile (`--compile MODE`, bert.model.compile; compiled in
                      the untimed warm-up step), for varlen and, on CUDA, triton; compiled-static<N>/<name> with both
    fp8/<name>        `--precision fp8` (CUDA, compute capability >= 8.9, torchao): the encoder linears in float8
                      (bert.model.fp8) on the batch padded to a multiple of N tokens (`--static-tokens`, else 16);
                      compiled-fp8/<name> also compiled. On the CPU these are skipped with a line saying why.
                      master-fp8/<name> (and compiled-master-fp8/<name>): the same float8 GEMMs on bf16 weights,
                      fp32 masters (PRECISION=fp8 with MASTER_WEIGHTS=1), no autocast
    master-bf16/<name>  unpadded/<name> as MASTER_WEIGHTS=1 runs it (bert.optim.master): bf16 weights, no
                      autocast, the AdamW step on fp32 masters (cast the gradients up, update, copy back), on CPU too
    fused-norm/<name>  unpadded/<name> with RESIDUAL_NORM=fused: each sublayer's bias + dropout + residual +
                      LayerNorm one Triton kernel each way (bert.model.dropout_add_norm; on the CPU its torch path,
                      there to check that it runs); compiled-fused-norm/<name> (with `--compile MODE`) against
                      compiled/<name>, where inductor fuses the same chain itself
    compiled-rational-gelu/<name>  compiled/<name> with GELU=rational: erfc as a rational function of one exp2
                      (bert.model.gelu), fewer instructions an element in inductor's GELU kernels (bench/gelu_sass.py)
    compiled-bias-gelu/<name>  compiled/<name> with BIAS_GELU=fused: the FFN's bias and GELU our Triton kernel each
                      way, the bias gradient summed in the backward's pass (bert.model.bias_gelu)
    master-bf16-lamb/<name>  the same with the driver's LAMB (`build_optimizer`: decay groups, the schedule's
                      device LR, `after` clip in the step; foreach LAMB, or apex FusedLAMB when installed);
                      master-bf16-lamb-copt/<name> (with `--compile MODE`) with that update compiled
                      (COMPILE_OPTIMIZER=1, bert.optim.compiled; capturable LAMB, warmed up untimed), the model
                      eager: the two rows isolate the optimizer's cost
    hf                transformers BertForPreTraining (SDPA), padded, MLM head on every token

Our model computes Q, K and V with one fused GEMM (`attention.self.qkv`); results written before that
change (results/bench/*.json of earlier commits) measured three separate projections.

CPU default: BERT-base width (768, 12 heads, 3072) with 2 layers, fp32, batch 16. CUDA default:
BERT-large, bf16 autocast, batch 56. The master-bf16 rows compute in bf16 on either device (on a CPU
without bf16 matrix units that is slower than fp32: the row is there to check that it runs).

    .venv/bin/python bench/model.py                      # writes results/bench/model_cpu.json
    .venv/bin/python bench/model.py --threads 1 --clock cpu   # on a busy machine
    python bench/model.py --device cuda                  # writes results/bench/model_cuda.json
    python bench/model.py --device cuda --compile default --static-tokens 512   # adds compiled and static rows
    python bench/model.py --device cuda --compile default --static-tokens 512 --precision fp8   # and fp8 rows
    python bench/model.py --device cuda --variants unpadded/varlen master-bf16/varlen   # autocast vs master weights
    python bench/model.py --device cuda --batch-size 96 --variants unpadded/varlen unpadded/cudnn --profile
                                           # flash vs cuDNN (torch >= 2.14), with each step's attention kernels timed
    python bench/model.py --device cuda --compile default --variants master-bf16/varlen master-bf16-lamb/varlen \
        master-bf16-lamb-copt/varlen    # fused AdamW vs eager LAMB vs compiled LAMB, all on fp32 masters
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bert.balance.lab.length_pmf import LengthPMF
from bert.balance.stratify import strata_counts
from bert.batch import Batch
from bert.config import from_flat
from bert.lengths import WIKI_PHASE2
from bert.model import BertConfig, BertForPreTraining
from bert.model.attention import length_groups
from bert.model.bias_gelu import apply_bias_gelu, check_bias_gelu
from bert.model.compile import COMPILE_MODES, check_compile, compile_model
from bert.model.cudnn_varlen import backward_is_fixed as cudnn_backward_is_fixed
from bert.model.dropout_add_norm import apply_residual_norm, check_residual_norm
from bert.model.flops import StepShape, train_flops
from bert.model.fp8 import check_fp8, convert_to_fp8
from bert.model.gelu import apply_gelu
from bert.model.last_layer import kept_row_count
from bert.model.padding import PadLayout, pad
from bert.model.precision import autocast_dtype  # the driver's rule (fp8: bf16 outside the float8 GEMMs)
from bert.optim import build_optimizer, build_schedule
from bert.optim.compiled import compile_step, warm_up_step
from bert.optim.master import MasterWeights
from bert.static_shapes import MASKED_BUCKET, pad_to_buckets
from bert.synthetic import random_batch
from bert.train.profile import StepProfiler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--config", help="named config or bert_config.json (default: base on CPU, large on CUDA)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers (default: 2 on CPU)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: 16 on CPU, 56 on CUDA)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (each variant once per round)")
    p.add_argument("--variants", nargs="+", help="subset of variant names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draw", default="representative", choices=("representative", "random", "stratified"),
                   help="how the batch's lengths are drawn (see the module docstring)")
    p.add_argument("--candidates", type=int, default=1000, help="draws the representative batch is chosen from")
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU; default: torch's choice)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"), help="cpu: process CPU time (CPU only)")
    p.add_argument("--json", type=Path, help="default: results/bench/model_<device>.json")
    p.add_argument("--compile", default="off", help="COMPILE mode for the compiled/* variants and the compiled "
                   "optimizer of master-bf16-lamb-copt/* (off: none; on the CPU inductor takes minutes: try debug)")
    p.add_argument("--static-tokens", type=int, default=0, help="token bucket of the static<N>/* variants (0: none)")
    p.add_argument("--profile", action="store_true", help="after timing, one more step of each variant under "
                   "torch.profiler: its device time by kind of kernel (bert.train.profile) in the table and JSON")
    p.add_argument("--precision", choices=("default", "fp8"), default="default",
                   help="fp8: add the fp8/* variants (CUDA); every other variant runs bf16 on CUDA, fp32 on the CPU")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.config = args.config or ("large" if cuda else "base")
    args.layers = args.layers or (None if cuda else 2)
    args.batch_size = args.batch_size or (56 if cuda else 16)
    args.json = args.json or Path(f"results/bench/model_{args.device}.json")
    if args.candidates < 1:
        p.error("--candidates must be at least 1")
    if cuda and args.clock == "cpu":
        p.error("--clock cpu is for CPU runs")
    if args.compile not in COMPILE_MODES:
        p.error(f"--compile must be one of {', '.join(COMPILE_MODES)}")
    if args.static_tokens < 0:
        p.error("--static-tokens must be 0 (none) or a positive token bucket")
    if args.precision == "fp8" and args.static_tokens % 16:
        p.error("--precision fp8 needs --static-tokens to be a multiple of 16 (float8 GEMMs)")
    return args


def draw_lengths(n: int, draw: str, rng: np.random.Generator, candidates: int) -> np.ndarray:
    """`n` lengths from WIKI_PHASE2 by `draw` (representative, random or stratified; see the docstring)."""
    mix = WIKI_PHASE2
    if draw == "random":
        return mix.sample(n, rng)
    if draw == "stratified":
        counts = strata_counts(mix, mix.edges, n)
        pool = mix.sample(100 * n, rng)
        stratum = np.searchsorted(np.asarray(mix.edges), pool, side="left")
        return np.concatenate([pool[stratum == s][:c] for s, c in enumerate(counts)])
    # Summary statistics (token count: linear cost; sum of squares: attention cost), their exact mean and
    # covariance for a batch of n, and each candidate's Mahalanobis distance from that mean.
    pmf = LengthPMF.from_mix(mix).probs
    k = np.arange(1, len(pmf) + 1, dtype=np.float64)
    stats = np.stack([k, k**2])
    mean = n * (stats @ pmf)
    centred = stats - (stats @ pmf)[:, None]
    precision = np.linalg.inv(n * (centred * pmf) @ centred.T)
    draws = [mix.sample(n, rng) for _ in range(candidates)]

    def distance(d: np.ndarray) -> float:
        delta = np.array([d.sum(), (d.astype(np.float64) ** 2).sum()]) - mean
        return float(delta @ precision @ delta)

    return min(draws, key=lambda d: (d.max() != mix.edges[-1], distance(d)))


def hf_step_inputs(batch: Batch) -> dict:
    layout = PadLayout.build(batch.seq)
    labels = torch.full((layout.rows * layout.width,), -100, device=batch.input_ids.device)
    labels = labels.index_copy(0, layout.slots[batch.masked_positions], batch.masked_labels)
    return {"input_ids": pad(batch.input_ids, layout), "token_type_ids": pad(batch.segment_ids, layout),
            "attention_mask": layout.key_mask.long(), "labels": labels.view(layout.rows, layout.width),
            "next_sentence_label": batch.nsp_labels}


def attention_backends(device: str) -> list[str]:
    """The unpadded/<name> rows: every backend the device runs (varlen, triton and cudnn need CUDA (triton's torch
    path is the CPU's reference, not a contender there); cudnn a torch whose ragged backward works,
    `bert.model.cudnn_varlen.MIN_TORCH`)."""
    cuda = ["varlen", "triton"] + (["cudnn"] if cudnn_backward_is_fixed() else [])
    return ["loop", "grouped", "padded"] + (cuda if device == "cuda" else [])


def variant_names(device: str, compile: str = "off", static_tokens: int = 0, fp8: bool = False) -> list[str]:
    """Every variant `build_variants` builds for these settings, in its order (--variants picks among them)."""
    backends = attention_backends(device)
    fast = "varlen" if device == "cuda" else "loop"
    names = ["padded", *(f"unpadded/{b}" for b in backends), f"full-last/{fast}"]
    names += [f"static{static_tokens}/{fast}"] if static_tokens else []
    names += [f"master-bf16/{fast}", f"master-bf16-lamb/{fast}", f"fused-norm/{fast}"]
    if compile != "off":
        names += [f"master-bf16-lamb-copt/{fast}", f"compiled/{fast}", f"compiled-fused-norm/{fast}",
                  f"compiled-rational-gelu/{fast}", f"compiled-bias-gelu/{fast}"]
        names += ["compiled/triton"] if device == "cuda" else []
        names += [f"compiled-static{static_tokens}/{fast}"] if static_tokens else []
    if fp8:
        names += [f"fp8/{fast}", f"master-fp8/{fast}"]
        names += [f"compiled-fp8/{fast}", f"compiled-master-fp8/{fast}"] if compile != "off" else []
    return names + ["hf"]


def build_variants(cfg: BertConfig, batch: Batch, device: str, names: list[str] | None, compile: str = "off",
                   static_tokens: int = 0, fp8: bool = False, last_layer_subset: bool = True,
                   fp8_linears: str = "all", fp8_recipe: str = "tensorwise") -> dict:
    """name -> (model, step loss function, executed matmul FLOPs per step (`bert.model.flops`): each variant
    is charged for the rows and attention pairs it computes, padding included). `last_layer_subset=False` runs
    every variant's last layer on every token (LAST_LAYER_SUBSET=0), as full-last/* always does; the fp8 variants
    swap the linears of `fp8_linears` with `fp8_recipe` (FP8_LINEARS, FP8_RECIPE)."""
    lengths, M = batch.seq.lengths, len(batch.masked_labels)
    T, B, L = sum(lengths), len(lengths), max(lengths)
    grouped_pairs = sum(len(g) * max(lengths[j] for j in g) ** 2 for g in length_groups(lengths))
    backends = attention_backends(device)
    specs = {"padded": ("loop", lambda m: m.forward_padded(batch).loss, B * L, B * L * L, M, B, False)}
    for name in backends:
        pairs = {"grouped": grouped_pairs, "padded": B * L * L}.get(name, sum(n * n for n in lengths))
        specs[f"unpadded/{name}"] = (name, lambda m: m(batch).loss, T, pairs, M, B, False)
    fast = "varlen" if device == "cuda" else "loop"
    specs[f"full-last/{fast}"] = specs[f"unpadded/{fast}"]
    if static_tokens:
        static = pad_to_buckets(batch, static_tokens, MASKED_BUCKET)
        extra = static.seq.lengths[-1]
        static_spec = (fast, lambda m: m(static).loss, static.num_tokens, sum(n * n for n in lengths) + extra**2,
                       len(static.masked_labels), B + 1)
        specs[f"static{static_tokens}/{fast}"] = (*static_spec, False)
    specs[f"master-bf16/{fast}"] = specs[f"unpadded/{fast}"]
    specs[f"master-bf16-lamb/{fast}"] = specs[f"fused-norm/{fast}"] = specs[f"unpadded/{fast}"]
    if compile != "off":
        specs[f"master-bf16-lamb-copt/{fast}"] = specs[f"unpadded/{fast}"]  # the optimizer compiled, not the model
        specs[f"compiled/{fast}"] = specs[f"compiled-fused-norm/{fast}"] = (*specs[f"unpadded/{fast}"][:-1], True)
        specs[f"compiled-rational-gelu/{fast}"] = specs[f"compiled-bias-gelu/{fast}"] = specs[f"compiled/{fast}"]
        if device == "cuda":
            specs["compiled/triton"] = (*specs["unpadded/triton"][:-1], True)
        if static_tokens:
            specs[f"compiled-static{static_tokens}/{fast}"] = (*static_spec, True)
    fp8_names = set()
    if fp8:  # float8 weight-gradient GEMMs need a token count that is a multiple of 16
        fp8_batch = pad_to_buckets(batch, static_tokens or 16, MASKED_BUCKET)
        fp8_spec = (fast, lambda m: m(fp8_batch).loss, fp8_batch.num_tokens,
                    sum(n * n for n in lengths) + fp8_batch.seq.lengths[-1] ** 2, len(fp8_batch.masked_labels), B + 1)
        specs[f"fp8/{fast}"] = specs[f"master-fp8/{fast}"] = (*fp8_spec, False)
        if compile != "off":
            specs[f"compiled-fp8/{fast}"] = specs[f"compiled-master-fp8/{fast}"] = (*fp8_spec, True)
        fp8_names = {name for name in specs if "fp8/" in name}
    specs["hf"] = (None, None, B * L, B * L * L, B * L, B, False)
    assert list(specs) == variant_names(device, compile, static_tokens, fp8), "variant_names is out of step"
    variants = {}
    for name, (backend, loss_fn, tokens, pairs, head_rows, sequences, compiled) in specs.items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        subset = last_layer_subset and backend is not None and name != "padded" and not name.startswith("full-last/")
        if backend is None:
            model, loss_fn = hf_model(cfg), _hf_loss(hf_step_inputs(batch))
        else:
            model = BertForPreTraining(cfg, attention=backend, device=device, last_layer_subset=subset).to(device)
            if name in fp8_names:
                convert_to_fp8(model, linears=fp8_linears, recipe=fp8_recipe)
            if "fused-norm/" in name:
                check_residual_norm("fused", torch.device(device))
                apply_residual_norm(model, "fused")
            if "rational-gelu/" in name:
                apply_gelu(model, "rational")
            if "bias-gelu/" in name:
                check_bias_gelu("fused", torch.device(device))
                apply_bias_gelu(model, "fused")
            if compiled:  # compiles on its first call: the untimed warm-up step
                compile_model(model, compile, torch.device(device))
        shape = StepShape(tokens=tokens, attention_pairs=pairs, sequences=sequences, head_rows=head_rows,
                          last_rows=kept_row_count(sequences, head_rows) if subset else None)
        variants[name] = (model.to(device).train(), loss_fn, train_flops(cfg, shape))
    return variants


def hf_model(cfg: BertConfig) -> torch.nn.Module:
    import transformers  # benchmark-only dependency

    return transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
        hidden_dropout_prob=cfg.hidden_dropout_prob, attention_probs_dropout_prob=cfg.attention_probs_dropout_prob,
        attn_implementation="sdpa"))


def _hf_loss(inputs: dict):
    return lambda m: m(**inputs).loss


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, clock) -> float:
    sync(device)
    start = clock()
    fn()
    sync(device)
    return clock() - start


def make_step(model, loss_fn, device: str, optimizer: torch.optim.Optimizer | None = None,
              precision: str | None = None, master_weights: bool = False):
    """One training step as a closure: forward + backward + `optimizer` (default AdamW) under `precision`'s
    autocast as the driver's (default bf16 on CUDA, fp32 on the CPU; fp16 runs without a loss scaler), none
    under master weights."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    dtype = autocast_dtype(precision or ("bf16" if device == "cuda" else "fp32"), master_weights)
    autocast = (lambda: torch.autocast(device, dtype=dtype)) if dtype else contextlib.nullcontext

    def step() -> None:
        with autocast():
            loss = loss_fn(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # between steps, other variants' activations use the memory

    return step


def master_step(model, loss_fn, device: str):
    """The step as MASTER_WEIGHTS=1 runs it: the model cast to bf16 by a MasterWeights optimizer (AdamW on the
    fp32 masters), no autocast."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")  # noqa: E731
    optimizer = MasterWeights([{"params": list(model.parameters())}], adamw, torch.bfloat16)
    return make_step(model, loss_fn, device, optimizer, master_weights=True)


def master_lamb_step(model, loss_fn, device: str, compile: str = "off"):
    """MASTER_WEIGHTS=1 with the driver's LAMB, as `bert.train.build` makes it (COMPILE_OPTIMIZER=1 when `compile`
    is a mode: the update compiled and warmed up here, untimed); the model itself stays eager."""
    cfg = from_flat(optimizer="lamb", learning_rate=1e-4, warmup_steps=10, max_steps=1000, weight_decay_rate=0.01,
                    grad_clip="after", master_weights=True, precision="bf16", compile=compile,
                    compile_optimizer=compile != "off").optim
    optimizer = build_optimizer(model, cfg, torch.bfloat16)
    build_schedule(optimizer, cfg)  # the LR as a device tensor, as in the driver
    if compile != "off":
        compile_step(optimizer, compile)
        # printed now: a run cut off at its time limit still shows what the compile cost (never timed on a GPU)
        print(f"bench/model.py: compiled LAMB: first two steps {warm_up_step(optimizer):.1f} s", file=sys.stderr,
              flush=True)
    return make_step(model, loss_fn, device, optimizer, master_weights=True)


def step_for(name: str, model, loss_fn, device: str, compile: str):
    """The training step a variant times: master weights (AdamW or LAMB) or autocast over fp32 weights."""
    if name.startswith("master-bf16-lamb"):
        return master_lamb_step(model, loss_fn, device, compile if "-copt/" in name else "off")
    return (master_step if "master-" in name else make_step)(model, loss_fn, device)


def time_steps(steps: dict, repeats: int, device: str, clock=time.perf_counter, quiet: bool = False
               ) -> dict[str, list[float]]:
    """One untimed warm-up call of each step (allocator, optimizer state, kernel selection, compilation), then
    `repeats` rounds, each calling every step once (interleaved: a noisy machine hits all alike); the seconds."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for r in range(repeats):
        for name, step in steps.items():
            times[name].append(timed(step, device, clock))
        if not quiet:
            print(f"round {r + 1}/{repeats}: " + ", ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items()),
                  file=sys.stderr)
    return times


def profile_step(step, device: str) -> dict:
    """One more call of `step` under the driver's profiler (`bert.train.profile`): its summary (ms per kind)."""
    with tempfile.TemporaryDirectory() as tmp:
        profiler = StepProfiler(first=1, steps=1, out_dir=tmp, device=torch.device(device))
        with profiler.step(1):
            step()
        return json.loads((Path(tmp) / "profile" / "rank0.json").read_text())


def matmul_rate(device: str, repeats: int = 5) -> float:
    """FLOP/s of `make_matmul`'s GEMM: the median of `repeats` timed calls after one warm-up."""
    matmul, flops = make_matmul(device)
    return flops / statistics.median(time_steps({"matmul": matmul}, repeats, device, quiet=True)["matmul"])


def make_matmul(device: str):
    """A large GEMM in the step's compute dtype; returns (fn, FLOPs per call)."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (2048, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    reps = 20 if device == "cuda" else 2
    return (lambda: [a @ b for _ in range(reps)]), 2 * n**3 * reps


DRAW_RULES = {
    "representative": "of {candidates} seeded draws of {n} from WIKI_PHASE2, the one with max = 512 whose (sum, sum of "
                      "squares) of lengths is nearest (Mahalanobis) to its exact expectation {n} x (E[L], E[L^2])",
    "random": "the first seeded draw of {n} from WIKI_PHASE2",
    "stratified": "round({n} x share) lengths from each WIKI_PHASE2 stratum",
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/model.py: --device cuda but CUDA is not available", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    known = variant_names(args.device, args.compile, args.static_tokens, args.precision == "fp8")
    unknown = [name for name in args.variants or () if name not in known]
    if unknown:  # a misspelt row would otherwise be left out without a word
        print(f"bench/model.py: --variants: no variant {', '.join(unknown)} with these settings; "
              f"choose from {' '.join(known)}", file=sys.stderr)
        return 2
    cfg = BertConfig.load(args.config)
    if args.layers:
        cfg = replace(cfg, num_hidden_layers=args.layers)
    lengths = draw_lengths(args.batch_size, args.draw, np.random.default_rng(args.seed), args.candidates)
    batch = random_batch(lengths, seed=args.seed).to(args.device)
    mean_length = LengthPMF.from_mix(WIKI_PHASE2).mean
    try:
        check_compile(args.compile, torch.device(args.device))
    except ValueError as e:
        print(f"bench/model.py: {e}", file=sys.stderr)
        return 2
    fp8 = args.precision == "fp8"
    if fp8:
        try:
            check_fp8("fp8", torch.device(args.device))
        except ValueError as e:
            print(f"bench/model.py: fp8/* variants skipped: {e}", file=sys.stderr)
            fp8 = False
    variants = build_variants(cfg, batch, args.device, args.variants, args.compile, args.static_tokens, fp8)
    steps = {name: step_for(name, model, loss_fn, args.device, args.compile)
             for name, (model, loss_fn, _) in variants.items()}
    matmul, matmul_flops = make_matmul(args.device)
    steps["matmul"] = matmul

    load_before = os.getloadavg()[0]  # the machine may be shared: record how busy it was
    times = time_steps(steps, args.repeats, args.device, clock)
    profiles = {name: profile_step(step, args.device) for name, step in steps.items() if name != "matmul"} \
        if args.profile else {}

    matmul_rate = matmul_flops / statistics.median(times.pop("matmul"))
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for name, (model, _, flops) in variants.items():
        achieved = flops / med[name]
        rows.append({
            "variant": name, "median_s": med[name], "samples_per_s": len(lengths) / med[name],
            "last_layer_subset": bool(getattr(model, "last_layer_subset", False)),  # HF's model has no such thing
            "tokens_per_s": int(sum(lengths)) / med[name],
            "vs_padded": med["padded"] / med[name] if "padded" in med else None,
            "vs_hf": med["hf"] / med[name] if "hf" in med else None,
            "flops_per_step": flops, "achieved_flops": achieved, "fraction_of_matmul": achieved / matmul_rate,
            "times_s": times[name],
            "profile": profiles.get(name),
        })
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "config": cfg.to_dict(), "precision": "bf16" if args.device == "cuda" else "fp32",
        "draw": args.draw, "draw_rule": DRAW_RULES[args.draw].format(n=len(lengths), candidates=args.candidates),
        "seed": args.seed, "batch_lengths": [int(n) for n in lengths],
        "tokens": int(sum(lengths)), "max_len": int(max(lengths)),
        "fill": int(sum(lengths)) / (len(lengths) * int(max(lengths))),
        "mix_mean_length": mean_length, "mix_expected_fill": mean_length / WIKI_PHASE2.edges[-1],
        "masked_tokens": len(batch.masked_labels), "repeats": args.repeats, "clock": args.clock,
        "compile": args.compile, "static_tokens": args.static_tokens, "qkv": "fused",
        "fp8": "encoder linears in float8 (torchao), the rest bf16" if fp8 else None,
        "matmul_flops_per_s": matmul_rate,
        "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
        "results": rows,
    }
    print_table(report)
    for name, summary in profiles.items():
        kinds = ", ".join(f"{k['kind']} {k['ms_per_step']:.2f}" for k in summary["kinds"][:6])
        print(f"{name}: {summary['busy_ms_per_step']:.1f} ms busy of {summary['wall_ms_per_step']:.1f}; {kinds}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"{report['device']}, torch {report['torch']}, {report['precision']}: hidden {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} layers; batch {len(report['batch_lengths'])} seqs, {report['tokens']} tokens "
          f"(fill {report['fill']:.1%}, mix expects {report['mix_expected_fill']:.1%}); "
          f"median of {report['repeats']} ({report['clock']} clock); "
          f"matmul {report['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s")
    print(f"{report['draw']} batch: {report['draw_rule']}")
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"
    print(f"{'variant':<30}{'s/step':>8}{'samples/s':>11}{'tokens/s':>10}{'vs padded':>11}{'vs HF':>8}"
          f"{'GFLOP/s':>9}{'/matmul':>9}")
    for r in report["results"]:
        print(f"{r['variant']:<30}{r['median_s']:>8.3f}{r['samples_per_s']:>11.2f}{r['tokens_per_s']:>10.0f}"
              f"{ratio(r['vs_padded']):>11}{ratio(r['vs_hf']):>8}{r['achieved_flops'] / 1e9:>9.1f}"
              f"{r['fraction_of_matmul']:>9.2f}")


if __name__ == "__main__":
    sys.exit(main())
