"""The resolved run as recorded in config.json: what the config left to the machine, resolved."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bert.config import from_flat
from bert.dist.clip import ClipAfterAllreduce, Clipper
from bert.dist.env import DistEnv
from bert.optim import build_optimizer
from bert.train.record import resolved_record


def test_auto_attention_lamb_and_layout_are_resolved_on_a_cpu():
    cfg = from_flat(attention="auto", optimizer="lamb", learning_rate=1e-3, max_steps=10, train_batch_size=4)
    model = torch.nn.Linear(3, 2)
    run = SimpleNamespace(cfg=cfg, env=DistEnv(3, 16, 3, 8, "localhost", 0),
                          optimizer=build_optimizer(model, cfg.optim),
                          clipper=ClipAfterAllreduce(model.parameters(), 1.0),
                          scaler=torch.amp.GradScaler("cpu", enabled=False), global_batch_size=64, eval_samples=100)
    record = resolved_record(run, torch.device("cpu"))
    resolved = record["resolved"]
    assert resolved["attention_backend"] == "loop"  # auto -> per-sequence SDPA without CUDA
    assert resolved["optimizer_class"] == "bert.optim.lamb.Lamb"  # no apex FusedLAMB on a CPU
    assert (resolved["world_size"], resolved["nodes"], resolved["ranks_per_node"]) == (16, 2, 8)
    assert resolved["clipper_class"] == "ClipAfterAllreduce" and resolved["fp16_loss_scaling"] is False
    assert record["config"]["model"]["attention"] == "auto"  # the configured value is kept beside the resolved one
    assert record["versions"] == {**record["versions"], "torch": torch.__version__, "cuda": torch.version.cuda}


def test_master_weights_record_the_weight_dtype_the_update_and_no_autocast():
    cfg = from_flat(optimizer="lamb", learning_rate=1e-3, max_steps=10, train_batch_size=4, precision="bf16",
                    master_weights=True)
    model = torch.nn.Linear(3, 2)
    run = SimpleNamespace(cfg=cfg, env=DistEnv(0, 1, 0, 1, "localhost", 0),
                          optimizer=build_optimizer(model, cfg.optim, torch.bfloat16), clipper=Clipper(),
                          scaler=torch.amp.GradScaler("cpu", enabled=False), global_batch_size=4, eval_samples=10)
    resolved = resolved_record(run, torch.device("cpu"))["resolved"]
    assert resolved["optimizer_class"] == "bert.optim.master.MasterWeights"
    assert resolved["update_class"] == "bert.optim.lamb.Lamb"  # on the fp32 masters
    assert (resolved["weight_dtype"], resolved["master_weights"], resolved["autocast"]) == ("bfloat16", True, False)
