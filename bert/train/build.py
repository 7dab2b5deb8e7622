"""Build every part of a run from the config: model, DDP, optimizer, schedule, scaler, data, logs."""

from __future__ import annotations

import functools
import random
from datetime import timedelta

import numpy as np
import torch

from bert.config import ModelConfig, TrainConfig
from bert.data.index_agreement import check_index_agreement
from bert.data.limits import SampleLimits
from bert.data.manifest import check_data_for_division
from bert.data.pipeline import EvalSet, TrainLoader
from bert.dist.clip import install_clipping
from bert.dist.ddp import apply_ddp
from bert.dist.env import DistEnv
from bert.dist.reduce import build_reduce, mean_placement
from bert.dist.shard_plan import build_shard_plan
from bert.model import BertConfig, BertForPreTraining
from bert.model.attention import check_attention
from bert.model.bias_gelu import apply_bias_gelu, check_bias_gelu
from bert.model.compile import check_compile, compile_model
from bert.model.dropout_add_norm import apply_residual_norm, check_residual_norm
from bert.model.fp8 import apply_precision, check_fp8
from bert.model.gelu import apply_gelu
from bert.model.init_checkpoint import load_init_checkpoint
from bert.model.precision import autocast_dtype, compute_dtype
from bert.optim import build_optimizer, build_schedule, hook_clip_mode
from bert.optim.compiled import compile_step
from bert.optim.gather_ahead import gather_in_forward
from bert.optim.sharded import local_only
from bert.optim.sharded_master import AgreedGradScaler
from bert.static_shapes import eval_token_bucket
from bert.train.checkpoint import latest_checkpoint, load_checkpoint
from bert.train.faults import StopAgreement, stop_interval
from bert.train.loop import Run
from bert.train.mlperf_log import MLPerfLog
from bert.train.peak_flops import device_peak_flops
from bert.train.profile import StepProfiler
from bert.train.progress import Progress


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: ModelConfig, device: torch.device) -> BertForPreTraining:
    """Weights in fp32; bf16/fp16 come from autocast, or, with MASTER_WEIGHTS=1, from the optimizer casting
    the model (`build_optimizer`); fp8 swaps the encoder linears for float8 ones (`bert.model.fp8`), RESIDUAL_NORM=fused
    each sublayer's dropout + add + LayerNorm for one kernel (`bert.model.dropout_add_norm`), GELU=rational
    each GELU for one with fewer instructions (`bert.model.gelu`), BIAS_GELU=fused the FFN's bias and GELU for one
    kernel each way (`bert.model.bias_gelu`). The same
    seed on every rank gives the same initialisation (DDP broadcasts rank 0's weights anyway), which is also
    what a bare-encoder INIT_CHECKPOINT leaves in the heads. COMPILE compiles
    the forward in place (it runs on the first call: see `bert.train.warmup`)."""
    check_compile(cfg.compile, device)  # before any work: COMPILE or PRECISION that cannot run here is a config error
    check_fp8(cfg.precision, device, cfg.fp8_recipe)
    bert_config = BertConfig.load(cfg.bert_config_path)
    check_attention(cfg.attention, device, cfg.precision, bert_config.head_dim)
    check_residual_norm(cfg.residual_norm, device)
    check_bias_gelu(cfg.bias_gelu, device)
    model = BertForPreTraining(bert_config, attention=cfg.attention, device=device,
                               last_layer_subset=cfg.last_layer_subset)
    apply_residual_norm(model, cfg.residual_norm)
    apply_bias_gelu(model, cfg.bias_gelu)
    apply_gelu(model, cfg.gelu)
    if cfg.init_checkpoint:
        load_init_checkpoint(model, cfg.init_checkpoint)
    model = apply_precision(model.to(device), cfg.precision, device, cfg.fp8_linears, cfg.fp8_recipe)
    return compile_model(model, cfg.compile, device, cfg.compile_scope, cfg.combo_kernels)


def autocast_for(precision: str, device: torch.device, master_weights: bool = False):
    """bf16/fp16 autocast over fp32 weights; off under fp32 and under master weights (`autocast_dtype`), whose
    bf16/fp16 kernels accumulate in fp32 and whose model takes its losses in fp32 (`bert.model.pretraining`)."""
    dtype = autocast_dtype(precision, master_weights)
    if dtype is None:
        return functools.partial(torch.autocast, device.type, enabled=False)
    return functools.partial(torch.autocast, device.type, dtype=dtype)


def build_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """fp16's loss scale (disabled otherwise). A sharded update reduce-scatters the gradients itself, so every rank
    must agree on an overflowed step from its own gradients: ShardedGradScaler when it unscales them, our
    AgreedGradScaler when the sharded masters take the scale and flag into their step."""
    sharded = cfg.optim.optimizer_sharding
    kind = torch.amp.GradScaler
    if sharded and cfg.optim.master_weights:
        kind = AgreedGradScaler
    elif sharded:  # imported here: torch's FSDP package, which it lives in, takes 0.7 s to import, in every process
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as kind
    return kind(device.type, init_scale=cfg.model.init_loss_scale, enabled=cfg.model.precision == "fp16")


def sample_limits(arch: BertConfig, max_seq_length: int) -> SampleLimits:
    """What every sample is checked against: what the model takes (bert.data.limits)."""
    return SampleLimits(arch.real_vocab_size, arch.type_vocab_size, min(arch.max_position_embeddings, max_seq_length))


def build_eval_set(cfg: TrainConfig, env: DistEnv, device: torch.device, limits: SampleLimits) -> EvalSet:
    """This rank's part of the eval set: its index checked now, its samples read at the first evaluation, in the
    timed run (bert.data.eval_set)."""
    data = cfg.data
    return EvalSet(data.eval_dir, data.eval_batch_size, env.world_size, env.rank, data.num_eval_examples, device,
                   static_tokens=eval_token_bucket(cfg.model.static_tokens, data.max_seq_length), limits=limits)


def build_run(cfg: TrainConfig, env: DistEnv, device: torch.device, log: MLPerfLog) -> Run:
    data, seed = cfg.data, cfg.run.seed
    check_data_for_division(cfg.log.division, data.input_dir, data.eval_dir)
    seed_everything(seed)
    model = build_model(cfg.model, device)
    torch.manual_seed(seed + env.rank)  # dropout differs across ranks, as it does across the global batch
    sharded = cfg.optim.optimizer_sharding
    scaler = build_scaler(cfg, device)
    # Before DDP: with MASTER_WEIGHTS=1 it casts the model, and DDP's buckets take the parameters' dtype.
    plan = None
    if sharded and cfg.optim.master_weights:  # the sharded masters' collectives (OPTIMIZER_SHARD_PLAN): groups now
        plan = build_shard_plan(cfg.optim.optimizer_shard_plan, cfg.dist.grad_reduce_node_size or env.local_world_size,
                                timedelta(seconds=cfg.dist.dist_timeout_s))
    optimizer = build_optimizer(model, cfg.optim, compute_dtype(cfg.model.precision), plan)
    if cfg.optim.compile_optimizer:
        compile_step(optimizer, cfg.model.compile)  # compiled before run_start by bert.train.warmup
    ddp = apply_ddp(model, cfg.dist)
    if hasattr(optimizer, "attach"):  # the sharded masters start their reduce-scatters from DDP's backward
        optimizer.attach(ddp)
    if cfg.optim.optimizer_shard_gather == "forward":  # and the next forward waits for their all-gathers
        gather_in_forward(model, optimizer)
    clipper = install_clipping(ddp, hook_clip_mode(cfg.optim), cfg.optim.max_grad_norm, scaler,
                               reduce=local_only() if sharded else build_reduce(cfg.dist, env),
                               mean_at=mean_placement(cfg.model.precision, sharded))
    schedule = build_schedule(optimizer, cfg.optim)
    limits = sample_limits(model.config, data.max_seq_length)
    loader = TrainLoader(data.input_dir, data.train_batch_size, env.world_size, env.rank, env.local_world_size,
                         strategy=data.balance, seed=seed, shuffle_buffer=data.shuffle_buffer, device=device,
                         static_tokens=cfg.model.static_tokens, limits=limits, worker=data.loader_worker)
    eval_set = build_eval_set(cfg, env, device, limits)
    check_index_agreement(device, loader.plan.index, eval_set.index)  # node-local copies of the data must agree
    stop = StopAgreement(timedelta(seconds=cfg.dist.dist_timeout_s), every=stop_interval(env.world_size))
    stop.install_signal_handlers()
    return Run(cfg, env, ddp, clipper, optimizer, schedule, scaler, loader, eval_set,
               autocast_for(cfg.model.precision, device, cfg.optim.master_weights), log,
               Progress(cfg.run.output_dir, env.is_main, resume=cfg.run.resume,
                        peak_flops=device_peak_flops(device, cfg.model.precision, cfg.run.peak_tflops)), stop,
               eval_samples=eval_set.num_examples,
               profiler=StepProfiler(cfg.run.profile_from, cfg.run.profile_steps, cfg.run.output_dir, env.rank, device,
                                     announce=env.is_main))


def resume(run: Run) -> None:
    """Continue from the newest checkpoint in output_dir (a clear error if there is none)."""
    where = latest_checkpoint(run.cfg.run.output_dir)
    if where is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {run.cfg.run.output_dir}/checkpoints")
    load_checkpoint(where, run.ddp.module, run.shared_parts(), run.env.rank, run.rank_parts())
