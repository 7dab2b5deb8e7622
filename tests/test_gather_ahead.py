"""OPTIMIZER_SHARD_GATHER=forward (bert.optim.gather_ahead) against the step's own all-gather, in 2 gloo processes.

The reference is the same sharded masters with gather="step" (tests/test_sharded_master.py checks those against
the unsharded update): waiting for the all-gather later changes no value, so every loss and weight must be equal,
bit for bit. gloo's all-gather of a few hundred kB may well be over before the forward reads its block, so a missing
wait could go unseen; the plan here (`DeferredPlan`) therefore moves nothing until its all-gather is waited for. A
unit that reads its weights without waiting reads other ranks' rows of the step before: the run without the hooks
shows that this changes the losses.

A tiny BERT of 3 layers in 3 blocks of the flat layout (rows of 2,048 elements), 2 ranks, 4 steps through DDP with
the reduce-scatters started from the backward, an eval forward between steps; eager, and for 2 steps compiled as
one graph and per layer (dynamo calls the waits between the units, in order). Every all-gather is waited for once
(by a unit, or without the hooks by the next step), and a checkpoint's load between a step and the next forward is
not overwritten by the step's all-gathers landing after it.
"""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks
from test_loop import BATCH, finish, make_run
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bert.train.loop as loop
from bert.config import ConfigError, from_env_and_args
from bert.dist.clip import install_clipping
from bert.dist.hierarchical import Pending
from bert.dist.reduce import mean_placement
from bert.dist.shard_plan import FlatPlan
from bert.model import BertConfig, BertForPreTraining
from bert.model.compile import compile_model
from bert.optim.gather_ahead import forward_units, gather_in_forward, settle, unit_blocks
from bert.optim.master import fp32_weights
from bert.optim.param_groups import decay_groups
from bert.optim.sharded import local_only
from bert.optim.sharded_master import ShardedMasters
from bert.synthetic import random_batch

WORLD, BLOCKS, STEPS = 2, 3, 4
VOCAB = 1998


def small_model() -> BertForPreTraining:
    torch.manual_seed(0)
    cfg = replace(BertConfig.load("tiny"), vocab_size=2000, real_vocab_size=VOCAB, num_hidden_layers=3)
    return BertForPreTraining(cfg.with_dropout(0.0), attention="padded")


class DeferredPlan(FlatPlan):
    """FlatPlan whose async all-gathers move nothing until waited for, and then move the rows the rank held when it
    started them, as a collective in flight would; `events` records when each block arrives."""

    def __init__(self, events: list):
        super().__init__()
        self.events, self.issued, self.arrived = events, 0, 0

    def all_gather(self, block: torch.Tensor, async_op: bool = False) -> Pending | None:
        if not async_op:
            return super().all_gather(block)
        b, self.issued = self.issued % BLOCKS, self.issued + 1  # `step` issues blocks 0..B-1 in order
        n = block.numel() // self.owners
        mine = block[self.owner * n:(self.owner + 1) * n]
        sent = mine.clone()  # what a collective in flight reads: the rank's rows when it was started

        def arrive() -> None:
            mine.copy_(sent)
            super(DeferredPlan, self).all_gather(block)
            self.events.append(("gathered", b))
            self.arrived += 1

        return Pending([], then=arrive)


def build(gather: str, events: list) -> tuple[BertForPreTraining, ShardedMasters]:
    model = small_model()
    return model, ShardedMasters(decay_groups(model, 0.01), torch.bfloat16, torch.tensor(2e-3), blocks=BLOCKS,
                                 plan=DeferredPlan(events), gather=gather)


def train(rank: int, gather: str, hooks: bool = True, scope: str | None = None, steps: int = STEPS,
          evaluate: bool = True) -> dict:
    events = []
    model, opt = build(gather, events)
    ddp = DDP(model)
    opt.attach(ddp)
    clipper = install_clipping(ddp, "none", 1.0, None, reduce=local_only(), mean_at=mean_placement("bf16", True))
    if hooks and gather == "forward":
        gather_in_forward(model, opt)
    if scope is not None:
        compile_model(model, "debug", torch.device("cpu"), scope)
    units = forward_units(model)
    for i, unit in enumerate(units):  # after the waits, which were registered first
        unit.register_forward_pre_hook(lambda m, a, i=i: events.append(("unit", i)))
    losses, pending = [], []
    for step in range(steps):
        events.clear()
        batch = random_batch((37, 5, 128, 2 + step), seed=10 * rank + step, vocab_size=VOCAB)
        loss = ddp(batch).loss
        (loss * clipper.loss_factor).backward()
        opt.step()
        pending.append(len(opt.gathers))
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if step == 1 and evaluate:  # an evaluation between two steps reads the weights through the same hooks
            model.eval()
            with torch.no_grad():
                losses.append(model(random_batch((20, 64), seed=99, vocab_size=VOCAB)).loss.float())
            model.train()
    first_forward = list(events)  # the last step's training forward (events since its start)
    settle(opt)
    low = {n: p.detach().clone() for n, p in model.named_parameters()}
    with fp32_weights(opt):
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "low": low, "masters": masters, "pending": pending,
            "events": first_forward, "unit_blocks": unit_blocks(units, opt), "left": len(opt.gathers),
            "issued": opt.plan.issued, "arrived": opt.plan.arrived, "steps": steps}


def load_while_gathering(rank: int) -> dict[str, torch.Tensor]:
    """A checkpoint's load (`masters_in_model`) between a step and the next forward: the step's all-gathers must be
    waited for before it, or they land after it, over the loaded weights."""
    model, opt = build("forward", [])
    gather_in_forward(model, opt)
    batch = random_batch((37, 5), seed=rank, vocab_size=VOCAB)
    model(batch).loss.backward()
    opt.step()
    with fp32_weights(opt):
        for p in model.parameters():
            p.copy_(torch.full_like(p, 0.375))
    model(batch)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    # compiled: 2 steps and no eval (an eval recompiles every graph for the eval mode: half a minute under `model`,
    # whose graph the waits cut at every unit), against the `step` run of the same
    result = {"step": train(rank, "step"), "forward": train(rank, "forward"),
              "unhooked": train(rank, "forward", hooks=False),
              "short": train(rank, "step", steps=2, evaluate=False),
              "compiled": {scope: train(rank, "forward", scope=scope, steps=2, evaluate=False)
                           for scope in ("model", "layers")},
              "loaded": load_while_gathering(rank)}
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("gather_ahead")
    start_ranks(worker, args=(str(tmp / "store"), str(tmp / "out")), nprocs=WORLD)
    return [torch.load(tmp / f"out.{r}", weights_only=False) for r in range(WORLD)]


def equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in b)


@pytest.mark.slow
def test_waiting_in_the_forward_changes_no_value(results):
    for r in results:
        for got in (r["forward"], *r["compiled"].values()):
            want = r["step"] if got["steps"] == STEPS else r["short"]
            assert torch.equal(got["losses"], want["losses"])
            assert equal(got["low"], want["low"]) and equal(got["masters"], want["masters"])
    assert equal(results[0]["forward"]["low"], results[1]["forward"]["low"])  # every rank's model whole


@pytest.mark.slow
def test_a_load_between_the_step_and_the_forward_is_not_overwritten_by_the_gathers(results):
    for r in results:
        assert all(torch.equal(w, torch.full_like(w, 0.375)) for w in r["loaded"].values())


@pytest.mark.slow
def test_without_the_waits_the_forward_reads_stale_rows(results):
    for r in results:
        assert not torch.equal(r["unhooked"]["losses"], r["step"]["losses"])


@pytest.mark.slow
def test_each_unit_waits_for_its_blocks_and_the_last_arrive_after_the_first_units_ran(results):
    for r in results:
        assert r["step"]["pending"] == [0] * STEPS
        for run in (r["forward"], *r["compiled"].values(), r["unhooked"]):
            assert run["issued"] == run["arrived"] == BLOCKS * run["steps"]  # each waited for once: a unit or a step
        for run in (r["forward"], *r["compiled"].values()):
            assert run["pending"] == [BLOCKS] * run["steps"] and run["left"] == 0
            events, needs = run["events"], run["unit_blocks"]
            assert sorted(e[1] for e in events if e[0] == "gathered") == list(range(BLOCKS))
            for at, (kind, i) in enumerate(events):
                if kind == "unit":  # every block the unit reads arrived before it ran
                    assert set(needs[i]) <= {b for k, b in events[:at] if k == "gathered"}, (i, events)
            assert events.index(("gathered", BLOCKS - 1)) > events.index(("unit", 0))  # overlap: not all up front
        assert r["unhooked"]["events"][:1] != [("gathered", 0)]  # the control: nothing arrived before the forward


def test_the_driver_waits_in_each_unit_and_settles_before_each_evaluation(world_of_one, synthetic_data, tmp_path,
                                                                          monkeypatch):
    """The real `build_run` and `train` (a world of one): the run's model waits once per unit for that unit's blocks,
    and no all-gather is still in flight when an evaluation starts (a rank without eval batches would wait in no
    forward) or when `train` returns."""
    run = make_run(synthetic_data, tmp_path, optimizer_sharding=True, master_weights=True, precision="bf16",
                   optimizer_layout="flat", optimizer_shard_blocks=BLOCKS, optimizer_shard_gather="forward",
                   max_steps=4, eval_iter_start_samples=BATCH, eval_iter_samples=2 * BATCH)
    opt, waits, in_flight = run.optimizer, [], []
    wait = opt.wait_gathered
    opt.wait_gathered = lambda blocks=None: (waits.append(blocks), wait(blocks))  # the hooks look it up per call
    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda *a: (in_flight.append(len(opt.gathers)), real(*a))[1])
    finish(run)
    units = unit_blocks(forward_units(run.ddp.module), opt)
    per_forward = [list(b) for b in waits if b is not None]
    assert len(per_forward) == 6 * len(units)  # 4 training forwards and 2 evaluations, each unit once
    assert sorted(per_forward[:len(units)]) == sorted(units)
    assert in_flight == [0, 0] and not opt.gathers  # evaluations after steps 1 and 3; the end after step 4


def test_every_parameter_lies_in_a_unit():
    model = small_model()
    params = list(model.parameters())
    fake = types.SimpleNamespace(params=params, blocks_of=[range(i % 3, i % 3 + 1) for i in range(len(params))])
    blocks = unit_blocks(forward_units(model), fake)
    assert blocks[0] == [0, 1, 2] and all(blocks)  # the embeddings' parameters lie in every block here
    model.extra = nn.Parameter(torch.zeros(3))  # read by no unit
    fake.params = list(model.parameters())
    fake.blocks_of.append(range(0, 1))
    with pytest.raises(ValueError, match="1 parameters lie in no forward unit"):
        unit_blocks(forward_units(model), fake)


SHARDED = {"DATADIR_PHASE2": "/d", "EVALDIR": "/e", "BERT_CONFIG": "tiny", "BATCHSIZE": "8", "LR": "1e-3",
           "MAX_STEPS": "10", "OPTIMIZER_SHARDING": "1", "MASTER_WEIGHTS": "1", "PRECISION": "bf16",
           "OPTIMIZER_LAYOUT": "flat"}


def config(**env: str):
    return from_env_and_args([], {**SHARDED, **env})


def test_the_config_takes_forward_with_blocks_only():
    forward = config(OPTIMIZER_SHARD_BLOCKS="3", OPTIMIZER_SHARD_GATHER="forward")
    assert forward.optim.optimizer_shard_gather == "forward"
    assert config().optim.optimizer_shard_gather == "step"
    with pytest.raises(ConfigError, match=r"OPTIMIZER_SHARD_GATHER = 'forward' needs OPTIMIZER_SHARD_BLOCKS > 1"):
        config(OPTIMIZER_SHARD_GATHER="forward")
    with pytest.raises(ConfigError, match=r"OPTIMIZER_SHARD_GATHER = 'ahead' must be one of step, forward"):
        config(OPTIMIZER_SHARD_BLOCKS="3", OPTIMIZER_SHARD_GATHER="ahead")
    with pytest.raises(ConfigError, match="OPTIMIZER_SHARD_BLOCKS"):  # blocks need the sharded masters
        config(OPTIMIZER_SHARDING="0", OPTIMIZER_SHARD_BLOCKS="3", OPTIMIZER_SHARD_GATHER="forward")
