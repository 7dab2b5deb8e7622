"""Compile before `run_start`: one forward and backward on a synthetic batch, leaving no trace (and with
COMPILE_OPTIMIZER=1 two optimizer steps, restored after: `bert.optim.compiled.warm_up_step`), then the
evaluation's forward on synthetic batches of the eval batches' sizes.

`torch.compile` compiles on the first call. Done in the timed run it would count against the result;
the rules leave model initialisation untimed (between init_start and init_stop, at most 20 minutes),
so the driver calls `warm_up` there. The warm-up must not change training: it uses a synthetic batch
(the loader is not touched), calls the bare module (no DDP hooks, no all-reduce), drops the gradients
it made and restores every RNG state it consumed (dropout), so a run with a warm-up takes the same
steps as one without (tests/test_compile.py).

The evaluation needs graphs of its own: dynamo guards on grad mode and on the modules' training flag, so the
first `evaluate` (no grad, eval mode) would compile the whole forward again, inside the timed run (on the CPU
with COMPILE=debug: 2 new graphs and 5-11 s for a 2-layer toy). So the warm-up also runs the eval forward, on
synthetic batches, since the eval set itself may not be read before the clock starts (bert.data.eval_set):
one per distinct eval batch size (a dynamic graph still specialises on sizes 0 and 1, and the CPU's `loop`
backend on the number of sequences). With STATIC_TOKENS the eval batches are padded to token buckets too, and
under a CUDA-graph mode the warm-up runs one batch per padded shape the eval will take, known from the length
index, so every graph the eval replays is recorded before run_start. A run whose limits (MAX_STEPS,
MAX_SAMPLES_TERMINATION) stop it before its first evaluation compiles none (`evaluation_possible`): a throughput
benchmark (bench/train_gpu.py) would otherwise pay a whole inference compile it never uses.

Whether the warm-up covered every graph the run needed shows at its end: `CompileWatch.report` writes
what torch.compile did after run_start (`compiled_after_run_start` in metrics.jsonl, `{}` when nothing). A
recompile there is compile time inside the timed run, and in a throughput window it is a slow interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch import nn

from bert.batch import Batch
from bert.config import TrainConfig
from bert.model import BertConfig
from bert.model.compile import CUDA_GRAPH_MODES
from bert.model.fp8_delayed import AmaxState, DelayedFloat8Linear
from bert.model.last_layer import kept_row_count
from bert.optim.compiled import warm_up_step
from bert.static_shapes import bucket_batch, likely_token_buckets, pad_static
from bert.synthetic import random_batch
from bert.train.compile_cache import load_compile_cache, recording_keys, save_compile_cache, save_keys, served
from bert.train.loop import Run, eval_schedule
from bert.train.mlperf_log import MLPerfLog
from bert.train.profile import compile_counters, compile_report
from bert.train.progress import Progress


def model_sizes(config: BertConfig) -> frozenset[int]:
    """The model's own dimensions. A dynamic size that equals one of them when a graph is first traced is taken for
    that constant: a warm-up batch with as many masked rows as the hidden size made the heads' graph static in the
    masked count, and the first training step recompiled it inside the timed run (CPU, COMPILE=default, SEED=20504)."""
    return frozenset({config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.hidden_size // config.num_attention_heads, config.vocab_size,
                      config.max_position_embeddings, config.type_vocab_size})


def coincides(batch: Batch, avoid: Collection[int] = ()) -> bool:
    """Whether a dynamic size of `batch` (tokens, masked rows, the last layer's kept rows, the longest sequence)
    equals another of them, the number of sequences (or one more: `cu_seqlens`), or one of `avoid`: sizes a first
    trace would tie together. The longest sequence is the padded attention's key-mask width: per layer, a warm-up
    batch whose longest sequence was the hidden size made the layers' graph static in it."""
    b, m = batch.num_sequences, batch.masked_positions.numel()
    sizes = {batch.num_tokens, m, kept_row_count(b, m), batch.seq.max_seqlen}
    return len(sizes) < 4 or bool(sizes & {b, b + 1, *avoid})


def warmup_batch(sequences: int, max_len: int, device: torch.device, vocab_size: int, seed: int = 0,
                 avoid: Collection[int] = (), static_tokens: int = 0) -> Batch:
    """`sequences` random lengths in [2, max_len] (no 0/1 sizes, which compile would specialise on), padded to
    STATIC_TOKENS's buckets when given; drawn again from the next seeds while a size `coincides` (`avoid`: the
    model's, `model_sizes`)."""
    for attempt in range(64):  # 64 draws of random sizes all coinciding: not met; the warm-up then does what it can
        s = seed + attempt * 7919
        lengths = np.random.default_rng(s).integers(2, max_len + 1, size=max(sequences, 2))
        batch = pad_static(random_batch(lengths, seed=s, vocab_size=vocab_size), static_tokens)
        if not coincides(batch, avoid):
            break
    return batch.to(device)


def warm_up(model: nn.Module, batch: Batch, autocast: Callable[[], AbstractContextManager]) -> float:
    """Run forward and backward on `batch` in train mode; returns the seconds it took. `model` may be the data-parallel
    wrapper: its `no_sync` keeps the backward to this rank (no hook, no collective)."""
    cpu_rng = torch.get_rng_state()
    device = batch.input_ids.device
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None  # this rank's GPU alone
    was_training = model.training
    model.train()
    start = time.perf_counter()
    with model.no_sync() if hasattr(model, "no_sync") else nullcontext():
        with autocast():
            loss = model(batch).loss
        loss.backward()
    if batch.input_ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    model.train(was_training)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
    return seconds


def warm_up_eval(model: nn.Module, batch: Batch, autocast: Callable[[], AbstractContextManager]) -> float:
    """Run the evaluation's forward (eval mode, no grad) on `batch`; returns the seconds it took."""
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    with torch.no_grad(), autocast():
        model(batch)
    if batch.input_ids.is_cuda:
        torch.cuda.synchronize()
    model.train(was_training)
    return time.perf_counter() - start


def evaluation_possible(run: Run) -> bool:
    """Whether the run reaches its next evaluation before MAX_STEPS or MAX_SAMPLES_TERMINATION stops it."""
    gbs = run.global_batch_size
    last_samples = min(run.cfg.optim.max_steps, -(-run.cfg.run.max_samples_termination // gbs)) * gbs
    return eval_schedule(run).next_at <= last_samples


def eval_warmup_batches(run: Run, device: torch.device) -> list[Batch]:
    """Synthetic batches (never the eval set's samples): one per distinct size of this rank's eval batches, or
    with STATIC_TOKENS under a CUDA-graph COMPILE mode one per padded shape the eval will take (`EvalSet.shapes`,
    from the length index), so that no graph is recorded at the first evaluation. None when the run cannot reach an
    evaluation."""
    if not evaluation_possible(run):
        return []
    vocab, seed = run.ddp.module.config.real_vocab_size, run.cfg.run.seed
    max_len = min(run.cfg.data.max_seq_length, run.ddp.module.config.max_position_embeddings)
    bucket = run.eval_set.static_tokens  # the eval's own bucket (bert.static_shapes.eval_token_bucket)
    if bucket and run.cfg.model.compile in CUDA_GRAPH_MODES:
        batches = [bucket_batch(tokens, n, bucket, vocab, seed, max_len)
                   for n, tokens in sorted(set(run.eval_set.shapes))]
        return [pad_static(b, bucket).to(device) for b in batches]
    avoid = model_sizes(run.ddp.module.config)
    return [warmup_batch(n, max_len, device, vocab, seed, avoid, bucket) for n in sorted(set(run.eval_set.batch_sizes))]


def warmup_batches(run: Run, device: torch.device) -> list[Batch]:
    """The synthetic batches the warm-up runs: one, or with STATIC_TOKENS under a CUDA-graph COMPILE mode one
    per token bucket the run is likely to meet (`likely_token_buckets` over the training set's lengths), so
    that every graph is recorded before run_start and the timed steps only replay."""
    model_cfg, data = run.cfg.model, run.cfg.data
    model = run.ddp.module
    vocab, seed = model.config.real_vocab_size, run.cfg.run.seed
    max_len = min(data.max_seq_length, model.config.max_position_embeddings)
    bucket, sequences = model_cfg.static_tokens, data.train_batch_size
    if bucket and model_cfg.compile in CUDA_GRAPH_MODES:
        return [pad_static(bucket_batch(b, sequences, bucket, vocab, seed, max_len), bucket).to(device)
                for b in likely_token_buckets(run.loader.sample_lengths, sequences, bucket, max_len)]
    # one dynamic graph serves every token count (and with STATIC_TOKENS every bucket)
    return [warmup_batch(sequences, max_len, device, vocab, seed, model_sizes(model.config), bucket)]


def training_entry(run: Run) -> nn.Module:
    """What the warm-up calls to compile the training graphs: the timed steps reuse whatever it compiled. With
    several ranks and one graph for the model (COMPILE_SCOPE=model) that is the data-parallel wrapper: dynamo cuts a
    graph at DDP's bucket boundaries (its DDPOptimizer) only when it compiles inside DDP's forward, and an uncut graph
    hands every gradient over at the end of the backward, so no all-reduce would overlap it. Otherwise the bare model:
    alone there is nothing to overlap, and per-layer graphs hand their gradients over layer by layer already (cut at
    the buckets too, each layer would be three graphs: less fusion, more launches)."""
    several = run.env.world_size > 1 and run.cfg.model.compile_scope == "model"
    return run.ddp if several else run.ddp.module


def compile_before_run(run: Run, log: MLPerfLog, device: torch.device) -> float | None:
    """With COMPILE set, compile now (untimed init) and log the seconds; None when COMPILE=off. Under a
    CUDA-graph mode each batch runs twice: inductor's graph trees warm a new shape up on its first call and
    record it on the second. With COMPILE_CACHE, what earlier runs compiled is loaded first and what this one used
    is written after (bert.train.compile_cache)."""
    model_cfg = run.cfg.model
    if model_cfg.compile == "off":
        if calibrate_float8(run, device) and run.env.is_main:
            print("float8: the amaxes calibrated on a synthetic batch before run_start (COMPILE=off)", flush=True)
        return None
    if model_cfg.compile_cache:  # every rank fills its own local caches before anything compiles
        loaded = load_compile_cache(model_cfg.compile_cache)
        if run.env.is_main:
            print(loaded, flush=True)
    with recording_keys(enabled=bool(model_cfg.compile_cache) and run.env.is_main, to=model_cfg.compile_cache) as keys:
        seconds = _compile(run, log, device)
    if model_cfg.compile_cache and run.env.is_main:  # the ranks compiled the same graphs: one writes them
        print(save_compile_cache(model_cfg.compile_cache), flush=True)
        print(save_keys(model_cfg.compile_cache, keys), flush=True)
    return seconds


def calibrate_float8(run: Run, device: torch.device) -> bool:
    """FP8_RECIPE=delayed under COMPILE=off: one training forward and backward on the warm-up's synthetic batch
    records the amaxes a new run's first step scales with, as the compiled warm-up's do (`_compile`). Without it that
    step scales at 1 (the amaxes' start), where a gradient under e5m2's smallest value, about 1.5e-5, is flushed to
    zero. A resumed run keeps the amaxes its checkpoint restored. Untimed init on no real sample, its gradients
    dropped and the RNG put back (`warm_up`). Whether it ran."""
    model = run.ddp.module
    if run.cfg.run.resume or not any(isinstance(m, DelayedFloat8Linear) for m in model.modules()):
        return False
    warm_up(model, warmup_batches(run, device)[0], run.autocast)
    return True


def _compile(run: Run, log: MLPerfLog, device: torch.device) -> float:
    """compile_before_run's compiles: the model's warm-up, the eval's, the optimizer's step; the seconds."""
    model_cfg = run.cfg.model
    counted = compile_counters()
    batches = warmup_batches(run, device)
    calls = 2 if model_cfg.compile in CUDA_GRAPH_MODES else 1
    # FP8_RECIPE=delayed: the warm-up's training forward and backward record their amaxes, which calibrate a new
    # run's first step; a resumed run keeps the ones its checkpoint restored (resume is exact)
    amaxes = AmaxState(run.ddp.module)
    restored = amaxes.state_dict() if run.cfg.run.resume else None
    seconds = sum(warm_up(training_entry(run), batch, run.autocast) for batch in batches for _ in range(calls))
    if restored is not None:
        amaxes.load_state_dict(restored)
    eval_batches = eval_warmup_batches(run, device)
    eval_seconds = sum(warm_up_eval(run.ddp.module, batch, run.autocast) for batch in eval_batches
                       for _ in range(calls))
    log.event("model_compile_seconds", round(seconds + eval_seconds, 3),
              metadata={"compile": model_cfg.compile, "shapes": len(batches), "eval_shapes": len(eval_batches)})
    if run.env.is_main:
        shapes = f" on {len(batches)} token buckets" if len(batches) > 1 else ""
        evals = (f"the eval forward on {len(eval_batches)} shapes {eval_seconds:.1f} s" if eval_batches else
                 "no eval forward (the run stops before its first evaluation)")
        print(f"compile: COMPILE={model_cfg.compile}: first forward+backward{shapes} took {seconds:.1f} s, {evals} "
              "(before run_start)", flush=True)
    seconds += eval_seconds
    if run.cfg.optim.compile_optimizer:
        step_seconds = warm_up_step(run.optimizer)
        log.event("optimizer_compile_seconds", round(step_seconds, 3), metadata={"compile": model_cfg.compile})
        if run.env.is_main:
            print(f"compile: COMPILE_OPTIMIZER=1: first two optimizer steps took {step_seconds:.1f} s "
                  "(before run_start)", flush=True)
        seconds += step_seconds
    if run.env.is_main:
        print(served(counted, compile_counters()), flush=True)
    return seconds


class CompileWatch:
    """torch.compile's counters at run_start, for a run that compiles (COMPILE or COMPILE_OPTIMIZER); `report`
    writes the ones that moved since as a progress record, `{}` when none did."""

    def __init__(self, cfg: TrainConfig):
        self.enabled = cfg.model.compile != "off" or cfg.optim.compile_optimizer
        self.at_start = compile_counters() if self.enabled else None

    def report(self, progress: Progress) -> None:
        report = compile_report(self.at_start, compile_counters()) if self.enabled else None
        if report is not None:
            progress.log(compiled_after_run_start=report["in_window"])
