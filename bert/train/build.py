"""Build every part of a run from the config: model, DDP, optimizer, schedule, scaler, data, logs."""

from __future__ import annotations

import functools
import random

import numpy as np
import torch

from bert.data.manifest import check_data_for_division
from bert.data.pipeline import TrainLoader, eval_batches
from bert.dist.clip import LossScale
from bert.dist.ddp import apply_ddp
from bert.dist.env import DistEnv
from bert.model import BertConfig, BertForPreTraining
from bert.model.checkpoint import load_pretrained
from bert.optim import build_optimizer, build_schedule
from bert.train.checkpoint import latest_checkpoint, load_checkpoint
from bert.train.config import TrainConfig
from bert.train.evaluate import count_eval_samples
from bert.train.faults import StopAgreement
from bert.train.loop import Run
from bert.train.mlperf_log import MLPerfLog
from bert.train.progress import Progress

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: TrainConfig, device: torch.device) -> BertForPreTraining:
    """Weights are fp32 masters; bf16/fp16 come from autocast. The same seed on every rank gives the
    same initialisation (DDP broadcasts rank 0's weights anyway)."""
    model = BertForPreTraining(BertConfig.load(cfg.bert_config_path), attention=cfg.attention, device=device)
    if cfg.init_checkpoint:
        load_pretrained(model, cfg.init_checkpoint)
    return model.to(device)


def autocast_for(cfg: TrainConfig, device: torch.device):
    if cfg.precision == "fp32":
        return functools.partial(torch.autocast, device.type, enabled=False)
    return functools.partial(torch.autocast, device.type, dtype=AUTOCAST_DTYPES[cfg.precision])


def loss_scale_of(scaler: torch.amp.GradScaler) -> LossScale:
    """The current scale as a device tensor, for the clipping hooks (get_scale() would sync the host)."""
    return lambda: scaler._get_scale_async() if scaler.is_enabled() else 1.0


def build_run(cfg: TrainConfig, env: DistEnv, device: torch.device, log: MLPerfLog) -> Run:
    check_data_for_division(cfg.division, cfg.input_dir, cfg.eval_dir)
    seed_everything(cfg.seed)
    model = build_model(cfg, device)
    torch.manual_seed(cfg.seed + env.rank)  # dropout differs across ranks, as it does across the global batch
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_loss_scale, enabled=cfg.precision == "fp16")
    ddp = apply_ddp(model, cfg, loss_scale_of(scaler))
    optimizer = build_optimizer(model, cfg)
    schedule = build_schedule(optimizer, cfg)
    loader = TrainLoader(cfg.input_dir, cfg.train_batch_size, env.world_size, env.rank, env.local_world_size,
                         strategy=cfg.balance, seed=cfg.seed, shuffle_buffer=cfg.shuffle_buffer, device=device)
    eval_set = eval_batches(cfg.eval_dir, cfg.eval_batch_size, env.world_size, env.rank, cfg.num_eval_examples,
                            device)
    stop = StopAgreement()
    stop.install_signal_handlers()
    return Run(cfg, env, ddp, optimizer, schedule, scaler, loader, eval_set, autocast_for(cfg, device), log,
               Progress(cfg.output_dir, env.is_main, resume=cfg.resume), stop,
               eval_samples=count_eval_samples(eval_set))


def resume(run: Run) -> None:
    """Continue from the newest checkpoint in output_dir (a clear error if there is none)."""
    where = latest_checkpoint(run.cfg.output_dir)
    if where is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {run.cfg.output_dir}/checkpoints")
    parts = {"optimizer": run.optimizer, "schedule": run.schedule, "scaler": run.scaler, "state": run.state}
    load_checkpoint(where, run.ddp.module, parts, run.env.rank, {"loader": run.loader})
