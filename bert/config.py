"""The run's configuration in typed sections, read from defaults < environment < command line.

    cfg.data    where the shards are, batch sizes, load balancing      (bert.data, bert.balance)
    cfg.model   the network, its weights, attention, precision         (bert.model)
    cfg.optim   optimizer, schedule, gradient clipping, accumulation   (bert.optim, bert.dist.clip)
    cfg.dist    DDP buckets, collective timeout, gradient reduction    (bert.dist)
    cfg.run     output folder, seed, eval cadence, stop, checkpoints   (bert.train)
    cfg.log     the MLPerf result log and the submission fields        (bert.train.mlperf_log)

Each builder takes only its section (`build_optimizer(model, cfg.optim)`), so a package below
`bert.train` never imports the trainer. Every field keeps the flag of the public MLPerf
submissions (`--field_name`, flat: no section prefix) and, where the shell configs set it, an
environment variable. A selector (`BALANCE`, `ATTENTION`, `OPTIMIZER`, `GRAD_CLIP`) is checked
against the registry of the package that implements it; numbers must be finite and within
bounds. Any failure is a `ConfigError` naming the flag and the variable.

This module is torch-free and imports no other `bert` module at import time: the registries are
looked up by name when a config is validated.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from bert.dist.slurm import tasks_per_node  # torch-free, as this module

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # fp8: encoder linears in float8, the rest bf16 (bert.model.fp8)
FP8_TOKEN_ALIGN = 16  # float8 weight-gradient GEMMs contract over the tokens (bert.model.fp8.ALIGN)
DIVISIONS = ("closed", "open")
DEVICES = ("auto", "cuda", "cpu")  # auto: the rank's GPU when torch sees one, else the CPU
INT_LIMIT = 2**53  # beyond this a shell value like 1e30 cannot be a count of anything
# ATTENTION backends whose attention shapes change with every batch's lengths, even under STATIC_TOKENS
SHAPE_PER_BATCH_ATTENTION = ("grouped", "loop")


def opt(default: Any, help: str, env: str | None = None, *, choices: tuple[str, ...] | None = None,
        registry: str | None = None, required: bool = False, low: float | None = None, high: float | None = None,
        low_open: bool = False, high_open: bool = False) -> Any:
    """A config field. `registry` ("module:NAME") names the collection of valid selector values;
    `low`/`high` bound a number, inclusive unless `low_open`/`high_open`."""
    meta = {"help": help, "env": env, "choices": choices, "registry": registry, "required": required,
            "low": low, "high": high, "low_open": low_open, "high_open": high_open}
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    input_dir: str = opt("", "directory of varlength training shards", env="DATADIR_PHASE2", required=True)
    eval_dir: str = opt("", "directory holding the varlength eval set", env="EVALDIR", required=True)
    train_batch_size: int = opt(0, "sequences per rank per micro-step", env="BATCHSIZE", required=True,
                                low=1, high=65536)
    eval_batch_size: int = opt(16, "sequences per rank per eval step", env="EVAL_BATCHSIZE", low=1, high=65536)
    num_eval_examples: int = opt(10000, "eval-set size", env="NUM_EVAL_EXAMPLES", low=1, high=10**7)
    max_seq_length: int = opt(512, "longest sequence", env="MAX_SEQ_LENGTH", low=1, high=65536)
    max_predictions_per_seq: int = opt(76, "masked positions per sequence at most", env="MAX_PRED",
                                       low=1, high=65536)
    balance: str = opt("none", "load-balance strategy", env="BALANCE", registry="bert.balance:STRATEGIES")
    shuffle_buffer: int = opt(10000, "samples in the shuffle buffer (TPU [004] §3.5)", env="SHUFFLE_BUFFER",
                              low=0, high=10**9)
    loader_worker: str = opt("thread", "where training batches are read and collated: a thread of the trainer, or a "
                             "child process, which shares no interpreter lock with the step's kernel launches "
                             "(bert.data.process_prefetch)", env="LOADER_WORKER",
                             registry="bert.data.process_prefetch:LOADER_WORKERS")


@dataclass
class ModelConfig:
    bert_config_path: str = opt("", "bert_config.json, or a named config such as 'tiny'", env="BERT_CONFIG",
                                required=True)
    init_checkpoint: str = opt("", "phase-1 weights (ours, HF or converted TF), or a named one (minilm: see "
                               "bert.model.init_checkpoint); a bare encoder gets fresh heads; empty = random init",
                               env="INIT_CHECKPOINT")
    attention: str = opt("auto", "attention backend", env="ATTENTION",
                         registry="bert.model.attention:ATTENTION_CHOICES")
    precision: str = opt("fp32", "compute precision", env="PRECISION", choices=PRECISIONS)
    fp8_linears: str = opt("all", "with PRECISION=fp8, which of each encoder layer's linears run in float8 (all: QKV, "
                           "attention output, both FFN; ffn; ffn-qkv)", env="FP8_LINEARS",
                           registry="bert.model.fp8:FP8_LINEAR_SETS")
    fp8_recipe: str = opt("tensorwise", "with PRECISION=fp8, the scaling recipe: torchao's (tensorwise; rowwise; "
                          "rowwise-gw-hp: rowwise, the weight-gradient GEMM in bf16) or ours, delayed (the previous "
                          "step's amax, no torchao; bert.model.fp8_delayed)", env="FP8_RECIPE",
                          registry="bert.model.fp8:FP8_RECIPES")
    residual_norm: str = opt("torch", "how each sublayer closes, dropout(dense + bias) + residual -> LayerNorm: "
                             "torch's modules (eager, or fused by inductor under COMPILE), or fused: one Triton kernel "
                             "each way with a Philox call per four elements and the mask kept as bits "
                             "(bert.model.dropout_add_norm), or fused-lean: the same, its backward from the output "
                             "as apex's memory-efficient LayerNorm, no sum kept", env="RESIDUAL_NORM",
                             registry="bert.model.dropout_add_norm:RESIDUAL_NORMS")
    gelu: str = opt("torch", "the FFN's and MLM head's exact GELU: torch's (erf), or rational: erfc as a rational "
                    "function of one exp2, fewer instructions an element in the compiled GELU kernels, within 6e-8 |x| "
                    "(bert.model.gelu); needs a COMPILE mode", env="GELU", registry="bert.model.gelu:GELUS")
    bias_gelu: str = opt("torch", "the FFN's bias + GELU: the dense layer's bias in its GEMM and the GELU module, or "
                         "fused: added in one Triton kernel each way with the GELU (GELU=rational's formula), its "
                         "gradient summed in the backward's pass, not by a kernel of its own (bert.model.bias_gelu)",
                         env="BIAS_GELU", registry="bert.model.bias_gelu:BIAS_GELUS")
    init_loss_scale: float = opt(2.0**16, "initial fp16 loss scale", env="INIT_LOSS_SCALE", low=1.0, high=2.0**64)
    compile: str = opt("off", "torch.compile mode of the model, compiled before run_start", env="COMPILE",
                       registry="bert.model.compile:COMPILE_MODES")
    compile_scope: str = opt("model", "what one compiled graph holds: the model, or each layer apart (overlaps "
                             "the gradient hand-over with the backward under GRAD_BUCKETS=balanced)",
                             env="COMPILE_SCOPE", registry="bert.model.compile:COMPILE_SCOPES")
    combo_kernels: bool = opt(False, "inductor's combo kernels: independent small kernels of a compiled graph (the "
                              "float8 scales, amax records and seeds, a few bytes each) launched as one, for the "
                              "model's graphs and the compiled update's; bert.model.compile", env="COMBO_KERNELS")
    compile_cache: str = opt("", "a file of torch.compile's artifacts: loaded before the warm-up compiles, rewritten "
                             "after it, so a later run (a fresh container, another node) skips code generation; "
                             "a name ending .gz is gzip-compressed; bert.train.compile_cache; empty = off",
                             env="COMPILE_CACHE")
    last_layer_subset: bool = opt(True, "the last encoder layer, after its attention, runs only the [CLS] and masked "
                                  "rows the losses read (exact; HazyResearch's --last_layer_subset; "
                                  "bert.model.last_layer)", env="LAST_LAYER_SUBSET")
    static_tokens: int = opt(0, "pad each batch's tokens to a multiple of this (padding sequences; masked rows "
                             "to a multiple of 64; eval batches to a multiple of min(this, MAX_SEQ_LENGTH)) for few "
                             "shapes; 0 = off",
                             env="STATIC_TOKENS", low=0, high=65536)


@dataclass
class OptimConfig:
    optimizer: str = opt("lamb", "optimizer", env="OPTIMIZER", registry="bert.optim:OPTIMIZERS")
    learning_rate: float = opt(0.0, "peak learning rate", env="LR", required=True, low=0.0, low_open=True,
                                high=1e6)  # above it the weights overflow within steps
    opt_lamb_beta_1: float = opt(0.9, "beta1 (LAMB and ADAM)", env="OPT_LAMB_BETA_1", low=0.0, high=1.0)
    opt_lamb_beta_2: float = opt(0.999, "beta2 (LAMB and ADAM)", env="OPT_LAMB_BETA_2", low=0.0, high=1.0)
    opt_epsilon: float = opt(1e-6, "epsilon (Samsung's ADAM: 1e-9)", env="EPSILON", low=0.0, low_open=True, high=1.0)
    weight_decay_rate: float = opt(0.01, "decoupled weight decay; 0 on biases and LayerNorm",
                                   env="WEIGHT_DECAY_RATE", low=0.0, high=10.0)
    gradient_accumulation_steps: int = opt(1, "micro-steps per optimizer step", env="GRADIENT_STEPS",
                                           low=1, high=65536)
    warmup_steps: int = opt(0, "linear warmup length in steps", env="WARMUP_STEPS", low=0, high=INT_LIMIT)
    start_warmup_step: int = opt(0, "step at which warmup starts (may be negative)", env="START_WARMUP_STEP",
                                 low=-INT_LIMIT, high=INT_LIMIT)
    max_steps: int = opt(0, "optimizer steps of the LR schedule", env="MAX_STEPS", required=True,
                         low=1, high=10**9)
    lr_max_steps: int = opt(0, "step where polynomial decay ends and the LR is held (0 = max_steps)",
                            env="LR_MAX_STEPS", low=0, high=10**9)
    end_learning_rate: float = opt(0.0, "LR reached at lr_max_steps", env="END_LR", low=0.0, high=10.0)
    lr_poly_power: float = opt(1.0, "polynomial decay power", env="LR_POLY_POWER", low=0.0, high=100.0)
    grad_clip: str = opt("after", "where gradients are clipped", env="GRAD_CLIP",
                         registry="bert.dist.clip:CLIP_MODES")
    max_grad_norm: float = opt(1.0, "clip threshold c", env="MAX_GRAD_NORM", low=0.0, low_open=True, high=1e6)
    optimizer_sharding: bool = opt(False, "each rank updates 1/N of the weights: reduce-scatter, update, all-gather "
                                   "(TPU [004] §3.2; bert.optim.sharded, with MASTER_WEIGHTS=1 "
                                   "bert.optim.sharded_master)", env="OPTIMIZER_SHARDING")
    optimizer_shard_blocks: int = opt(1, "the sharded masters' reduce-scatter in this many blocks of the flat layout, "
                                      "each started from the backward once its gradients are in (NVIDIA's "
                                      "--dwu-num-blocks with --dwu-overlap-reductions; 1: after the backward)",
                                      env="OPTIMIZER_SHARD_BLOCKS", low=1, high=64)
    optimizer_shard_plan: str = opt("flat", "how the sharded masters' gradient reaches its owners: one reduce-scatter "
                                    "over every rank (flat, TPU [004] §3.2), inside the node then across the nodes "
                                    "(2d, [004] §3.3), or inside the node then an allreduce across (node, NVIDIA's "
                                    "DistributedFusedLAMB); nodes of GRAD_REDUCE_NODE_SIZE; bert.dist.shard_plan",
                                    env="OPTIMIZER_SHARD_PLAN", registry="bert.dist.shard_plan:SHARD_PLANS")
    optimizer_shard_gather: str = opt("step", "where the sharded masters' all-gather of the updated weights is "
                                      "waited for: at the end of the step, or block by block in the next forward, "
                                      "which it then overlaps (TPU [004] §3.2; bert.optim.gather_ahead)",
                                      env="OPTIMIZER_SHARD_GATHER", registry="bert.optim.sharded_master:SHARD_GATHERS")
    compile_optimizer: bool = opt(False, "compile the optimizer step (MASTER_WEIGHTS=1: the update over the "
                                  "fp32 masters) with COMPILE's backend, no CUDA graphs; bert.optim.compiled",
                                  env="COMPILE_OPTIMIZER")
    master_weights: bool = opt(False, "the model's weights in the compute dtype (PRECISION, autocast off), fp32 "
                               "masters and state in the optimizer (bert.optim.master)", env="MASTER_WEIGHTS")
    optimizer_layout: str = opt("tensors", "LAMB over a list of tensors, or over flat buffers of whole rows "
                                "(MASTER_WEIGHTS=1 only; bert.optim.flat)", env="OPTIMIZER_LAYOUT",
                                registry="bert.optim.flat:LAYOUTS")


@dataclass
class DistConfig:
    bucket_cap_mb: float = opt(25.0, "DDP bucket size", env="BUCKET_CAP_MB", low=0.0, low_open=True, high=1e5)
    dist_timeout_s: int = opt(300, "collective timeout: a dead rank ends the job after this", env="DIST_TIMEOUT",
                              low=1, high=10**6)
    grad_reduce: str = opt("flat", "how gradients are averaged over the ranks", env="GRAD_REDUCE",
                           registry="bert.dist.reduce:REDUCTIONS")
    ps_servers: int = opt(1, "parameter-server processes per node with GRAD_REDUCE=ps (launched on top of DGXNGPU)",
                          env="PS_SERVERS", low=1, high=64)
    grad_buckets: str = opt("ddp", "gradient buckets: DDP's, or equal-size fusion buffers (Herring [003] §III-1)",
                            env="GRAD_BUCKETS", registry="bert.dist.ddp:GRAD_BUCKETS")
    grad_reduce_node_size: int = opt(0, "ranks per node for GRAD_REDUCE=hierarchical and OPTIMIZER_SHARD_PLAN=2d or "
                                     "node (0 = the launcher's "
                                     "LOCAL_WORLD_SIZE / Slurm tasks per node / DGXNGPU)",
                                     env="GRAD_REDUCE_NODE_SIZE", low=0, high=65536)
    grad_comm_dtype: str = opt("fp32", "dtype the gradients travel in (fp32 = no cast)", env="GRAD_COMM_DTYPE",
                               registry="bert.dist.compress:COMM_DTYPES")


@dataclass
class RunConfig:
    device: str = opt("auto", "where each rank computes: auto (its GPU when torch sees one, else the CPU); cuda (a "
                      "GPU or a one-line error, so a node without one cannot train a GPU config on its CPU); cpu",
                      env="DEVICE", choices=DEVICES)
    output_dir: str = opt("./results", "checkpoints, metrics.jsonl, config.json", env="OUTPUT_DIR")
    seed: int = opt(42, "random seed", env="SEED", low=0, high=2**63 - 1)
    max_samples_termination: int = opt(14_000_000, "stop (aborted) after this many samples",
                                       env="MAX_SAMPLES_TERMINATION", low=1, high=10**12)
    eval_iter_start_samples: int = opt(0, "first eval at this sample count (0 = rules' formula)",
                                       env="EVAL_ITER_START_SAMPLES", low=0, high=10**12)
    eval_iter_samples: int = opt(0, "eval every this many samples (0 = rules' formula)", env="EVAL_ITER_SAMPLES",
                                 low=0, high=10**12)
    target_mlm_accuracy: float = opt(0.720, "stop with success at this eval MLM accuracy",
                                     env="TARGET_MLM_ACCURACY", low=0.0, low_open=True, high=1.0,
                                     high_open=True)
    log_freq: int = opt(50, "host-device sync and progress line every N steps", env="LOG_FREQ", low=1, high=10**9)
    peak_tflops: float = opt(0.0, "peak TFLOP/s of one GPU for the progress line's mfu "
                             "(0 = from bert.train.peak_flops by device name)", env="PEAK_TFLOPS", low=0.0, high=1e5)
    checkpoint_every: int = opt(0, "checkpoint every N steps (0 = only at the end)", env="CHECKPOINT_EVERY",
                                low=0, high=10**9)
    skip_checkpoint: bool = opt(False, "write no final checkpoint (BERT-large: 1.3 GB per run)", env="SKIP_CHECKPOINT")
    resume: bool = opt(False, "continue from the latest checkpoint in output_dir", env="RESUME")
    profile_from: int = opt(0, "profile optimizer steps from this one with torch.profiler: kernels by kind and a trace "
                            "under output_dir/profile (0 = off; bert.train.profile; the profiled steps are slower, so "
                            "not in a result run)", env="PROFILE_FROM", low=0, high=10**9)
    profile_steps: int = opt(5, "steps in the profiled window", env="PROFILE_STEPS", low=1, high=1000)
    steps_this_job: int = opt(0, "optimizer steps this job may take, then checkpoint and exit (0 = no limit; "
                              "for walltime-limited jobs, continued with --resume)", env="STEPS_THIS_JOB",
                              low=0, high=10**9)


@dataclass
class LogConfig:
    mlperf_log: str = opt("", "result log path (rank 0); empty = stdout only", env="MLPERF_LOG")
    cache_cleared: bool = opt(False, "the launcher dropped the page cache before this run (logged as cache_clear)",
                              env="CACHE_CLEARED")
    division: str = opt("open", "submission division", env="MLPERF_DIVISION", choices=DIVISIONS)
    org: str = opt("bert-harness", "submitting organisation", env="MLPERF_ORG")
    platform: str = opt("cpu", "system name", env="DGXSYSTEM")
    status: str = opt("onprem", "system status", env="MLPERF_STATUS")


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    run: RunConfig = field(default_factory=RunConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def global_batch_size_per_rank(self) -> int:
        return self.data.train_batch_size * self.optim.gradient_accumulation_steps

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def validate(self, environ: Mapping[str, str] | None = None) -> None:
        """Raise ConfigError for the first bad value: a selector not in its registry, a missing required
        value, a non-finite or out-of-bounds number, a node size that does not divide the launcher's world
        (checked when `environ` states the layout)."""
        for section, f in config_fields():
            check_value(f, getattr(getattr(self, section), f.name))
        if self.optim.optimizer_sharding and self.dist.grad_reduce != "flat":  # its reduce-scatter is the reduction
            raise ConfigError("grad_reduce", "GRAD_REDUCE", self.dist.grad_reduce, "cannot be combined with "
                              "OPTIMIZER_SHARDING=1 (the sharded update reduce-scatters the gradients itself)")
        if self.optim.optimizer_sharding and self.dist.grad_comm_dtype != "fp32":
            raise ConfigError("grad_comm_dtype", "GRAD_COMM_DTYPE", self.dist.grad_comm_dtype, "cannot be combined "
                              "with OPTIMIZER_SHARDING=1 (its reduce-scatter sends the gradients' own dtype)")
        shardable = registry_names("bert.optim.sharded:SHARDABLE") if self.optim.optimizer_sharding else ()
        if self.optim.optimizer_sharding and self.optim.optimizer not in shardable:
            raise ConfigError("optimizer", "OPTIMIZER", self.optim.optimizer,
                              f"cannot be sharded (OPTIMIZER_SHARDING=1 supports {', '.join(shardable)})")
        if self.optim.compile_optimizer and self.model.compile == "off":
            raise ConfigError("compile_optimizer", "COMPILE_OPTIMIZER", True, "needs a COMPILE mode to compile the "
                              "step with (COMPILE=off): set COMPILE_OPTIMIZER=0 with COMPILE=off")
        if self.model.combo_kernels and self.model.compile not in registry_names("bert.model.compile:INDUCTOR_MODES"):
            raise ConfigError("combo_kernels", "COMBO_KERNELS", True, f"is inductor's and has no effect with COMPILE="
                              f"{self.model.compile}: set an inductor COMPILE mode, or COMBO_KERNELS=0")
        if self.model.compile_cache and self.model.compile == "off":
            raise ConfigError("compile_cache", "COMPILE_CACHE", self.model.compile_cache, "has nothing to keep with "
                              "COMPILE=off: set a COMPILE mode, or leave COMPILE_CACHE empty")
        if self.model.gelu == "rational" and self.model.compile == "off":
            raise ConfigError("gelu", "GELU", "rational", "is written for inductor to fuse into one kernel each way; "
                              "with COMPILE=off it runs a dozen kernels each way, slower than torch's: set a COMPILE "
                              "mode, or GELU=torch")
        if self.model.bias_gelu == "fused" and self.model.precision == "fp8" and self.model.fp8_recipe != "delayed":
            raise ConfigError("bias_gelu", "BIAS_GELU", "fused", f"cannot be combined with FP8_RECIPE="
                              f"{self.model.fp8_recipe}: torchao's float8 linear keeps its bias in its own GEMM and "
                              "the module's GELU; with PRECISION=fp8 it takes FP8_RECIPE=delayed "
                              "(bert.model.fp8_bias_gelu), or set BIAS_GELU=torch")
        if self.model.compile != "off" and self.model.compile_scope == "model" and self.dist.grad_buckets != "ddp":
            raise ConfigError("compile_scope", "COMPILE_SCOPE", "model", f"cannot be combined with GRAD_BUCKETS="
                              f"{self.dist.grad_buckets} (one graph for the whole model hands every gradient over at "
                              "the end of its backward: no communication would overlap it); set COMPILE_SCOPE=layers")
        graphs = registry_names("bert.model.compile:CUDA_GRAPH_MODES")
        if self.model.compile in graphs and self.optim.gradient_accumulation_steps > 1:
            # a micro-step's .grad is the backward graph's output, in the graph pool: the next replay overwrites it,
            # silently (pytorch/pytorch#96693, #169545)
            raise ConfigError("gradient_accumulation_steps", "GRADIENT_STEPS", self.optim.gradient_accumulation_steps,
                              f"cannot be combined with COMPILE={self.model.compile} (CUDA graphs overwrite the "
                              "gradients a micro-step leaves for the next one); use COMPILE=default")
        if self.model.compile in graphs and self.model.compile_scope == "layers":
            # without a pending backward each layer's call starts a new graph generation, which frees the previous
            # layer's output, this layer's input: the eval forward (no grad) fails on the first evaluation
            raise ConfigError("compile_scope", "COMPILE_SCOPE", "layers", f"cannot be combined with COMPILE="
                              f"{self.model.compile} (CUDA graphs per layer overwrite each other's outputs in the "
                              "eval forward); set COMPILE_SCOPE=model")
        if self.model.compile in graphs and self.model.attention in SHAPE_PER_BATCH_ATTENTION:
            # their kernels' shapes are each group's rows x width or each sequence's length, which STATIC_TOKENS does
            # not fix: a new recording almost every step. `auto` passes: varlen on CUDA, loop where no graph is recorded
            raise ConfigError("attention", "ATTENTION", self.model.attention, f"cannot be combined with COMPILE="
                              f"{self.model.compile} (its attention shapes follow each batch's lengths, which "
                              "STATIC_TOKENS does not fix: a CUDA graph recorded almost every step); use "
                              "ATTENTION=varlen or padded with STATIC_TOKENS, or COMPILE=default")
        if self.optim.compile_optimizer and self.optim.optimizer_sharding:
            raise ConfigError("compile_optimizer", "COMPILE_OPTIMIZER", True, "cannot be combined with "
                              "OPTIMIZER_SHARDING=1 (its step runs collectives)")
        if self.model.precision == "fp8" and (not self.model.static_tokens or
                                              self.model.static_tokens % FP8_TOKEN_ALIGN):
            raise ConfigError("static_tokens", "STATIC_TOKENS", self.model.static_tokens, "must be a positive multiple "
                              f"of {FP8_TOKEN_ALIGN} with PRECISION=fp8 (float8 weight-gradient GEMMs contract over "
                              "the token count)")
        for name, env, default in (("fp8_linears", "FP8_LINEARS", "all"), ("fp8_recipe", "FP8_RECIPE", "tensorwise")):
            value = getattr(self.model, name)
            if value != default and self.model.precision != "fp8":
                raise ConfigError(name, env, value, f"has no effect without PRECISION=fp8 "
                                  f"(PRECISION={self.model.precision})")
        # PRECISION=fp8 is allowed in the closed division: [MLPerf-rules] "Numerical formats" pre-approves fp8
        # with per-tensor scaling (bert.model.fp8).
        if self.optim.master_weights and self.model.precision not in ("bf16", "fp16", "fp8"):
            raise ConfigError("master_weights", "MASTER_WEIGHTS", True, "needs PRECISION=bf16, fp16 or fp8, not "
                              f"{self.model.precision} (the model's weights take its compute dtype)")
        optim = self.optim
        if optim.optimizer_shard_blocks > 1 and not (optim.master_weights and optim.optimizer_sharding):
            raise ConfigError("optimizer_shard_blocks", "OPTIMIZER_SHARD_BLOCKS", optim.optimizer_shard_blocks,
                              "needs OPTIMIZER_SHARDING=1 and MASTER_WEIGHTS=1 (the sharded masters' reduce-scatter)")
        if optim.optimizer_shard_plan != "flat" and not (optim.master_weights and optim.optimizer_sharding):
            raise ConfigError("optimizer_shard_plan", "OPTIMIZER_SHARD_PLAN", optim.optimizer_shard_plan,
                              "needs OPTIMIZER_SHARDING=1 and MASTER_WEIGHTS=1 (the sharded masters' collectives)")
        if optim.optimizer_shard_gather != "step" and optim.optimizer_shard_blocks == 1:
            raise ConfigError("optimizer_shard_gather", "OPTIMIZER_SHARD_GATHER", optim.optimizer_shard_gather,
                              "needs OPTIMIZER_SHARD_BLOCKS > 1 (with one block the first layer waits for the whole "
                              "all-gather), and so OPTIMIZER_SHARDING=1 and MASTER_WEIGHTS=1")
        if optim.optimizer_shard_blocks > 1 and (optim.grad_clip not in ("after", "none")
                                                 or self.dist.grad_buckets != "ddp"):
            raise ConfigError("optimizer_shard_blocks", "OPTIMIZER_SHARD_BLOCKS", optim.optimizer_shard_blocks,
                              f"needs GRAD_CLIP=after or none and GRAD_BUCKETS=ddp (GRAD_CLIP={optim.grad_clip}, "
                              f"GRAD_BUCKETS={self.dist.grad_buckets}): the blocks leave from the backward, before a "
                              "clip in DDP's hook")
        if optim.master_weights and optim.optimizer_sharding and optim.optimizer_layout != "flat":
            raise ConfigError("optimizer_layout", "OPTIMIZER_LAYOUT", optim.optimizer_layout, "must be flat with "
                              "MASTER_WEIGHTS=1 and OPTIMIZER_SHARDING=1 (the masters are sharded by rows of the flat "
                              "layout; bert.optim.sharded_master)")
        if optim.optimizer_layout == "flat" and not (optim.master_weights and optim.optimizer == "lamb"):
            raise ConfigError("optimizer_layout", "OPTIMIZER_LAYOUT", "flat", "needs MASTER_WEIGHTS=1 and "
                              f"OPTIMIZER=lamb (MASTER_WEIGHTS={int(optim.master_weights)}, "
                              f"OPTIMIZER={optim.optimizer}): the flat buffers are the fp32 masters'")
        if environ is not None:
            check_node_size(self.dist, environ, self.optim.optimizer_shard_plan)
        if self.run.resume and self.log.division == "closed":  # training rules: a result is one contiguous run
            raise ConfigError("resume", "RESUME", True, "is not allowed in the closed division (a timed run may "
                              "not be continued); set MLPERF_DIVISION=open to finish it as a non-result")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}


def _count(environ: Mapping[str, str], name: str) -> int | None:
    """A positive count from the launcher; None if absent or malformed (the launcher scripts report those).
    (Slurm's per-node lists are bert.dist.slurm's.)"""
    digits = environ.get(name, "").strip()
    return int(digits) if digits.isdigit() and int(digits) > 0 else None


def launcher_layout(environ: Mapping[str, str]) -> tuple[tuple[int, str], tuple[int, str]] | None:
    """((world size, variable), (ranks per node, variable)) as the launcher states them: torchrun's
    WORLD_SIZE/LOCAL_WORLD_SIZE, Slurm's SLURM_NTASKS/SLURM_NTASKS_PER_NODE, or, before the launch
    (`run_and_time.sh` runs the check first), the shell config's DGXNNODES x DGXNGPU. None if unknown."""
    world, node = _count(environ, "WORLD_SIZE"), _count(environ, "LOCAL_WORLD_SIZE")
    # srun's layout under torchrun's names has no LOCAL_WORLD_SIZE: Slurm's per-node count then (bert.dist.env)
    slurm = world is None or (node is None and environ.get("SLURM_NTASKS") == environ.get("WORLD_SIZE"))
    if not slurm:
        return (world, "$WORLD_SIZE"), (node or world, "$LOCAL_WORLD_SIZE" if node else "$WORLD_SIZE")
    world, per_node = _count(environ, "SLURM_NTASKS"), tasks_per_node(environ)
    if world:
        return (world, "$SLURM_NTASKS"), ((per_node[0], f"${per_node[1]}") if per_node else (world, "$SLURM_NTASKS"))
    nodes, gpus = _count(environ, "DGXNNODES"), _count(environ, "DGXNGPU")
    if nodes and gpus:
        return (nodes * gpus, "$DGXNNODES x $DGXNGPU"), (gpus, "$DGXNGPU")
    return None


def check_node_size(dist: DistConfig, environ: Mapping[str, str], shard_plan: str = "flat") -> None:
    """Hierarchical reduction and the node-wise shard plans split the world into nodes of equal size: the node size
    must divide it."""
    layout = launcher_layout(environ)
    if layout is None or (dist.grad_reduce != "hierarchical" and not dist.grad_reduce_node_size
                          and shard_plan == "flat"):
        return
    (world, world_var), (launcher_node, node_var) = layout
    node = dist.grad_reduce_node_size or launcher_node
    if world % node:
        what = "" if dist.grad_reduce_node_size else f"means the launcher's {launcher_node} ranks per node " \
            f"({node_var}), which "
        raise ConfigError("grad_reduce_node_size", "GRAD_REDUCE_NODE_SIZE", dist.grad_reduce_node_size,
                          f"{what}does not divide the world size {world} ({world_var}) into equal nodes "
                          f"for " + (f"GRAD_REDUCE={dist.grad_reduce}" if shard_plan == "flat" else
                                     f"OPTIMIZER_SHARD_PLAN={shard_plan}"))


class ConfigError(ValueError):
    def __init__(self, name: str, env: str | None, value: Any, problem: str):
        where = f"--{name}" + (f" / ${env}" if env else "")
        super().__init__(f"config: {where} = {value!r} {problem}")


def config_fields() -> Iterator[tuple[str, dataclasses.Field]]:
    """(section name, field) for every field, in declaration order."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f


def registry_names(ref: str) -> tuple[str, ...]:
    """The valid values of a selector: the keys of the registry `module:NAME` (imported on first use)."""
    module, name = ref.split(":")
    return tuple(getattr(importlib.import_module(module), name))


def check_value(f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    fail = lambda problem: ConfigError(f.name, meta["env"], value, problem)  # noqa: E731
    choices = meta["choices"] or (registry_names(meta["registry"]) if meta["registry"] else None)
    if choices and value not in choices:
        raise fail(f"must be one of {', '.join(choices)}")
    if meta["required"] and value in ("", 0, 0.0):
        raise fail("is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):
        raise fail("must be a finite number")
    low, high = meta["low"], meta["high"]
    if low is not None and (value <= low if meta["low_open"] else value < low):
        raise fail(f"must be {'>' if meta['low_open'] else '>='} {low:g}")
    if high is not None and (value >= high if meta["high_open"] else value > high):
        raise fail(f"must be {'<' if meta['high_open'] else '<='} {high:g}")


def parse_value(f: dataclasses.Field, raw: str, source: str) -> Any:
    """A string from the environment or the command line as the field's type."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    bad = ConfigError(f.name, f.metadata["env"], raw, f"from {source} is not a valid {kind}")
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise bad
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            pass
        try:  # 4.5e6, as the shell configs write it
            as_float = float(raw)
        except ValueError:
            raise bad from None
        if not math.isfinite(as_float):
            raise ConfigError(f.name, f.metadata["env"], raw, "must be a finite number")
        if as_float != int(as_float):
            raise bad
        return int(as_float)
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise bad from None
    return raw


def from_env_and_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> TrainConfig:
    """Defaults, then environment variables, then `--flag value` arguments; validated."""
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    by_name = {f.name: (s, f) for s, f in config_fields()}
    for section, f in config_fields():
        env = f.metadata["env"]
        if env and env in environ:
            values[section][f.name] = parse_value(f, environ[env], f"${env}")
    parser = argparse.ArgumentParser(description="MLPerf BERT phase-2 pre-training",
                                     argument_default=argparse.SUPPRESS)
    for section, f in config_fields():
        parser.add_argument(f"--{f.name}", type=str, help=f"[{section}] {f.metadata['help']}")
    for name, raw in vars(parser.parse_args(argv)).items():
        section, f = by_name[name]
        values[section][name] = parse_value(f, raw, f"--{name}")
    cfg = TrainConfig(**{s: SECTIONS[s](**kw) for s, kw in values.items()})
    cfg.validate(environ)
    return cfg


def from_flat(**values: Any) -> TrainConfig:
    """A config from flat field names, as the flags spell them (`learning_rate=...`), not validated:
    for tests and benchmarks that set a few fields by hand."""
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    section_of = {f.name: s for s, f in config_fields()}
    for name, value in values.items():
        if name not in section_of:
            raise TypeError(f"no config field named {name!r}")
        sections[section_of[name]][name] = value
    return TrainConfig(**{s: SECTIONS[s](**kw) for s, kw in sections.items()})


def env_of(name: str) -> str | None:
    """The environment variable of a field, by its flag name."""
    return next(f.metadata["env"] for _, f in config_fields() if f.name == name)
