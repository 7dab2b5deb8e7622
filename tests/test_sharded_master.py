"""Sharded master weights (bert.optim.sharded_master) against the unsharded flat update, in 4 gloo processes.

The reference is `MasterWeights` over `FlatLamb` (itself checked against the per-tensor LAMB and float64 in
tests/test_flat_lamb.py and tests/test_master_weights.py), fed the mean gradient directly. The ranks' gradients are
multiples of 1/64 small enough that every bf16 sum of them is exact, so the sharded run's mean is the reference's in
every bit whatever order the collective adds in, and what is left to differ is the norms' summation order.

One spawn of 4 ranks, rows of 4 elements (tensors span shards; the rows do not split evenly):
  * 3 steps with GRAD_CLIP=after active at two of them: the gathered masters equal the reference's within fp32
    rounding, every rank's model holds the same bf16 weights, and those are the masters rounded;
  * the same through the driver's pieces (DDP with `local_only`, `install_clipping`, `build_optimizer` from the
    config) against DDP's allreduce under `MasterWeights`, clip modes after and before (this one to bf16 rounding:
    its clipped gradients no longer sum exactly);
  * state_dict equals the reference's (Lamb's per-tensor layout) and comes back whole from a load; resumed at world 2
    (sharded) and world 1 (unsharded) both continue as the reference does; an empty state restarts the moments and
    update counts;
  * `masters_in_model` shows the whole fp32 masters and takes what is written into them;
  * a missing gradient is an error; no gradients at all, no step;
  * fp16 under loss scaling: an overflow in one rank's gradients makes every rank skip and halve its scale, as the
    unsharded run where the mean overflowed;
  * OPTIMIZER_SHARD_BLOCKS=3: the same update by hand and with the blocks' reduce-scatters started from DDP's
    backward (after a warm-up backward and under gradient accumulation, where `no_sync` must start nothing).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from ranks import start_ranks
from script_modules import load_script
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.config import ConfigError, from_env_and_args, from_flat
from bert.dist.clip import install_clipping
from bert.dist.reduce import mean_placement
from bert.dist.shard_plan import FlatPlan, build_shard_plan
from bert.optim import build_optimizer, build_schedule, hook_clip_mode
from bert.optim.flat import FlatLamb
from bert.optim.master import MasterWeights, fp32_weights
from bert.optim.param_groups import decay_groups
from bert.optim.sharded import local_only
from bert.optim.sharded_master import AgreedGradScaler, ShardedMasters, rows_below, shard_part

ROOT = Path(__file__).resolve().parents[1]
WORLD, CHUNK, STEPS, C, LR, SCALE = 4, 4, 3, 0.6, 0.05, 2.0**10
SHAPES = {"dense_weight": (7, 5), "dense_bias": (7,), "LayerNorm_weight": (7,), "out_weight": (3, 7),
          "zero_weight": (2, 3), "LayerNorm_bias": (13,)}  # 9+2+2+6+2+4 = 25 rows of 4: 7 a rank, the last 4 padding
GAINS = (0.1, 1.0, 3.0)  # the clip (0.6) is inactive at step 0 and active after


class FixedGrad(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.ps = nn.ParameterDict({n: nn.Parameter(torch.randn(s, generator=gen) * (n != "zero_weight"))
                                    for n, s in SHAPES.items()})

    def forward(self, gs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((self.ps[n] * gs[n]).sum() for n in gs)  # a tensor left out of `gs` gets no gradient


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """k/64 for |k| <= 15 at most, times a power of two: four of them sum exactly in bf16."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    scale = 2.0 ** round(torch.log2(torch.tensor(GAINS[step])).item())
    return {n: (torch.randint(-15, 16, s, generator=gen) / 64 * scale).bfloat16() for n, s in SHAPES.items()}


def mean_grads(step: int, ranks: range) -> dict[str, torch.Tensor]:
    each = [grads(r, step) for r in ranks]
    total = {n: sum(g[n].double() for g in each) for n in SHAPES}
    return {n: (g / len(ranks)).bfloat16() for n, g in total.items()}


def sharded(model: nn.Module, group=None, clip: float | None = C, blocks: int = 1, plan=None) -> ShardedMasters:
    """Over `plan`, or one reduce-scatter over `group` (None: every rank)."""
    return ShardedMasters(decay_groups(model, 0.1), torch.bfloat16, torch.tensor(LR), eps=1e-6, clip_after=clip,
                          chunk=CHUNK, blocks=blocks, plan=plan or FlatPlan(group))


def reference(model: nn.Module, clip: float | None = C) -> MasterWeights:
    inner = functools.partial(FlatLamb, lr=torch.tensor(LR), eps=1e-6, chunk=CHUNK)
    return MasterWeights(decay_groups(model, 0.1), inner, torch.bfloat16, clip)


def masters_of(opt: torch.optim.Optimizer, model: FixedGrad) -> dict[str, torch.Tensor]:
    with fp32_weights(opt):  # every rank: a collective for the sharded one
        return {n: p.detach().clone() for n, p in model.ps.items()}


def run_direct(rank: int, blocks: int = 1, plan=None) -> dict:
    model, ref_model = FixedGrad(), FixedGrad()
    opt, ref = sharded(model, blocks=blocks, plan=plan), reference(ref_model)
    for step in range(STEPS):
        local, mean = grads(rank, step), mean_grads(step, range(WORLD))
        for n, p in model.ps.items():
            p.grad = local[n]
        for n, p in ref_model.ps.items():
            p.grad = mean[n]
        opt.step()
        ref.step()
    low = {n: p.detach().clone() for n, p in model.ps.items()}  # before masters_in_model refreshes them
    return {"got": masters_of(opt, model), "want": masters_of(ref, ref_model), "low": low,
            "state": (copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())),
            "model": model, "opt": opt}


def run_hooked(rank: int, blocks: int, plan=None) -> dict:
    """Through DDP's backward with the reduce-scatters started from it (`attach`): a warm-up backward in `no_sync`
    first (nothing may start), then each step in two micro-steps of half the gradient, the first in `no_sync`."""
    model = FixedGrad()
    opt = sharded(model, blocks=blocks, plan=plan)
    ddp = DDP(model, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
    opt.attach(ddp)
    install_clipping(ddp, "none", C, None, reduce=local_only(), mean_at=mean_placement("bf16", True))
    launched = []
    reduce_block = opt._reduce_block
    opt._reduce_block = lambda b, async_op=False: launched.append(b) or reduce_block(b, async_op)
    with ddp.no_sync():
        ddp(grads(rank, 0)).backward()
    started = [len(opt.works)]
    opt.zero_grad(set_to_none=True)
    for step in range(STEPS):
        half = {n: g / 2 for n, g in grads(rank, step).items()}
        with ddp.no_sync():
            ddp(half).backward()
        started.append(len(opt.works))
        ddp(half).backward()
        started.append(len(opt.works))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"got": masters_of(opt, model), "started": started, "filled": len(opt.filled), "launched": launched}


def run_stale(rank: int, blocks: int, plan=None, synced: bool = False, partial: bool = False
              ) -> dict[str, torch.Tensor]:
    """A synced backward no step takes (a warm-up on the bare module; `partial`: one where a tensor gets no gradient,
    so some blocks never start), then a step whose only backward is in `no_sync` (or, `synced`, a synced one): the
    step takes that backward's gradients, not the reduce-scatters the first one started."""
    model = FixedGrad()
    opt = sharded(model, blocks=blocks, plan=plan)
    ddp = DDP(model, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
    opt.attach(ddp)
    install_clipping(ddp, "none", C, None, reduce=local_only(), mean_at=mean_placement("bf16", True))
    unwaited = set()  # every work started must be waited for before its buffers are written again

    def reduce_block(b, async_op=False, reduce_block=opt._reduce_block):
        work = reduce_block(b, async_op)
        if work is not None:
            unwaited.add(work)
            work.wait = functools.partial(lambda w, wait: unwaited.discard(w) or wait(), work, work.wait)
        return work

    opt._reduce_block = reduce_block
    ddp.module({n: g for n, g in grads(rank, 0).items() if not (partial and n == "out_weight")}).backward()
    opt.zero_grad(set_to_none=True)
    with contextlib.nullcontext() if synced else ddp.no_sync():
        ddp({n: -g for n, g in grads(rank, 0).items()}).backward()
    opt.step()
    assert not unwaited, f"{len(unwaited)} reduce-scatters never waited for"
    return masters_of(opt, model)


def run_fp16_sum_overflow(group) -> dict:
    """3 ranks (the division by 3 rounds up): each rank's fp16 gradient is finite, their reduced sum is not. Every
    rank skips and halves its scale."""
    model = FixedGrad()
    before = {n: p.detach().clone() for n, p in model.ps.items()}
    opt = ShardedMasters(decay_groups(model, 0.1), torch.float16, torch.tensor(LR), eps=1e-6, plan=FlatPlan(group),
                         chunk=CHUNK)
    scaler = AgreedGradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))
    for p in model.ps.values():
        p.grad = torch.zeros(p.shape, dtype=torch.float16)
    model.ps["out_weight"].grad[0, 0] = 65504.0
    scaler.step(opt)
    scaler.update()
    return {"scale": scaler.get_scale(), "unchanged": all(torch.equal(before[n], w)
                                                          for n, w in masters_of(opt, model).items())}


def run_driver_pieces(rank: int, clip: str, sharding: bool) -> dict[str, torch.Tensor]:
    """As bert.train.build wires it: the optimizer first (it casts the model), then DDP and the clipping hook."""
    cfg = from_flat(learning_rate=LR, max_steps=10, warmup_steps=1, optimizer="lamb", grad_clip=clip, max_grad_norm=C,
                    weight_decay_rate=0.1, opt_epsilon=1e-6, master_weights=True, optimizer_layout="flat",
                    optimizer_sharding=sharding, precision="bf16").optim
    model = FixedGrad()
    opt = build_optimizer(model, cfg, torch.bfloat16)
    ddp = DDP(model, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)  # 100 B: several buckets
    clipper = install_clipping(ddp, hook_clip_mode(cfg), C, None, reduce=local_only() if sharding else None,
                               mean_at=mean_placement("bf16", sharding))
    schedule = build_schedule(opt, cfg)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in range(STEPS):
        (ddp(grads(rank, step)) * clipper.loss_factor).backward()
        clipper.before_step(opt, scaler)
        scaler.step(opt)
        schedule.step()
        opt.zero_grad(set_to_none=True)
    return masters_of(opt, model)


def continue_from(state: dict, weights: dict[str, torch.Tensor], group, use_sharded: bool) -> dict:
    """Two more steps from a saved state, the same gradient on every rank."""
    model = FixedGrad()
    model.load_state_dict({f"ps.{n}": w for n, w in weights.items()})
    opt = sharded(model, group, clip=None) if use_sharded else reference(model, clip=None)
    opt.load_state_dict(copy.deepcopy(state))
    for step in range(2):
        same = grads(9, step)
        for n, p in model.ps.items():
            p.grad = same[n]
        opt.step()
    return masters_of(opt, model)


def run_fp16(rank: int, plan=None) -> dict:
    """fp16 under loss scaling, rank 1 alone overflowing at step 1: every rank skips that step and halves its scale,
    as the unsharded run does where the mean gradient overflowed."""
    model, ref_model = FixedGrad(), FixedGrad()
    opt = ShardedMasters(decay_groups(model, 0.1), torch.float16, torch.tensor(LR), eps=1e-6, clip_after=C,
                         chunk=CHUNK, plan=plan)
    ref = MasterWeights(decay_groups(ref_model, 0.1), functools.partial(FlatLamb, lr=torch.tensor(LR), eps=1e-6,
                                                                         chunk=CHUNK), torch.float16, C)
    scaler, ref_scaler = AgreedGradScaler("cpu", init_scale=SCALE), torch.amp.GradScaler("cpu", init_scale=SCALE)
    for s in (scaler, ref_scaler):
        s.scale(torch.ones(()))  # the loop scales the loss first; that makes the scale tensor
    scales = []
    for step in range(STEPS):
        local, mean = grads(rank, step), mean_grads(step, range(WORLD))
        if step == 1:
            mean["out_weight"][0, 0] = float("inf")
            if rank == 1:
                local["out_weight"][0, 0] = float("inf")
        for m, g, s in ((model, local, scaler), (ref_model, mean, ref_scaler)):
            for n, p in m.ps.items():  # the loss scaled by the scaler's scale: a power of two, so exact
                p.grad = (g[n].float() * s.get_scale()).half()
        for s, o in ((scaler, opt), (ref_scaler, ref)):
            s.step(o)
            s.update()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    return {"got": masters_of(opt, model), "want": masters_of(ref, ref_model), "scales": scales}


def gathered_both_ways(rank: int, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """A block whose slice `plan.owner` holds this rank's values, all-gathered as `step` does it (in one call) and
    as OPTIMIZER_SHARD_GATHER=forward does (started, then waited for: under 2d the second stage in the wait)."""
    n, out = 3, []
    for async_op in (False, True):
        block = torch.zeros(plan.owners * n, dtype=torch.bfloat16)
        block[plan.owner * n:(plan.owner + 1) * n] = torch.arange(1, n + 1) + 10 * rank
        work = plan.all_gather(block, async_op=async_op)
        if work is not None:
            work.wait()
        out.append(block)
    return out[0], out[1]


def worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    pair = dist.new_group([0, 1])  # every rank creates them; only their members use them
    triple = dist.new_group([0, 1, 2])
    direct = run_direct(rank)
    result = {k: direct[k] for k in ("got", "want", "low", "state")}
    result["pieces"] = {clip: (run_driver_pieces(rank, clip, True), run_driver_pieces(rank, clip, False))
                        for clip in ("after", "before")}
    state, ref_state = direct["state"]
    if rank < 2:
        result["resumed"] = (continue_from(state, direct["got"], pair, True),
                             continue_from(state, direct["got"], None, False),
                             continue_from(ref_state, direct["want"], None, False))
    model, opt = direct["model"], direct["opt"]
    with fp32_weights(opt):  # a checkpoint's load writes the masters
        for p in model.ps.values():
            p.copy_(torch.full_like(p, 0.375))
    result["loaded"] = (masters_of(opt, model), {n: p.detach().clone() for n, p in model.ps.items()})
    for p in model.ps.values():
        p.grad = torch.ones_like(p)
    model.ps["dense_bias"].grad = None
    try:
        opt.step()
    except ValueError as e:
        result["missing"] = str(e)
    for p in model.ps.values():
        p.grad = None
    before = masters_of(opt, model)
    opt.step()
    result["no_grads_unchanged"] = all(torch.equal(before[n], w) for n, w in masters_of(opt, model).items())
    reloaded = sharded(FixedGrad())  # loaded, then saved again before any step: the same state
    reloaded.load_state_dict(copy.deepcopy(state))
    result["reloaded_state"] = copy.deepcopy(reloaded.state_dict())
    # an empty state loaded into a stepped optimizer: its next step is a first step, as a new optimizer's
    opt.load_state_dict({"state": {}, "param_groups": state["param_groups"]})
    fresh_model = FixedGrad()
    fresh_model.load_state_dict({f"ps.{n}": w for n, w in before.items()})
    fresh = sharded(fresh_model)
    for o, m in ((opt, model), (fresh, fresh_model)):
        g = grads(rank, 2)  # each its own tensors
        for n, p in m.ps.items():
            p.grad = g[n]
        o.step()
    result["restarted"] = (masters_of(opt, model), masters_of(fresh, fresh_model))
    result["fp16"] = run_fp16(rank)
    three = run_direct(rank, blocks=3)
    result["blocks"] = {"direct": three["got"], "hooked": run_hooked(rank, blocks=3),
                        "hooked_one": run_hooked(rank, blocks=1),
                        "again": masters_of(three["opt"], three["model"]),  # each rank's rows written back whole
                        "stale": (run_stale(rank, 2), run_stale(rank, 1))}
    if rank < 3:
        result["fp16_sum_overflow"] = run_fp16_sum_overflow(triple)
    result["plans"] = {}
    result["gathered_flat"] = gathered_both_ways(rank, FlatPlan())
    for name in ("2d", "node"):  # 2 nodes of 2 ranks; every rank builds the groups, in the same order
        plan = build_shard_plan(name, 2)
        one, three = run_direct(rank, plan=plan), run_direct(rank, blocks=3, plan=plan)
        result["plans"][name] = {"got": one["got"], "low": one["low"], "state": one["state"][0],
                                 "owner": plan.owner, "shard": one["opt"].masters.clone(),
                                 "blocks": three["got"], "hooked": run_hooked(rank, 3, plan)["got"],
                                 "fp16": run_fp16(rank, plan), "gathered": gathered_both_ways(rank, plan),
                                 "stale": (run_stale(rank, 3, plan, synced=True), run_stale(rank, 1, plan),
                                           run_stale(rank, 3, plan, synced=True, partial=True))}
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def close(a: dict, b: dict, rtol: float = 2e-6, atol: float = 1e-7) -> None:
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("sharded_master")
    start_ranks(worker, args=(str(tmp / "store"), str(tmp / "out")), nprocs=WORLD)
    return [torch.load(tmp / f"out.{r}", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
def test_the_sharded_update_equals_the_unsharded_flat_one(results):
    first = results[0]
    for r in results:
        close(r["got"], first["want"])
        for n, w in r["low"].items():  # every rank's model is whole, the same bits, the masters rounded
            assert torch.equal(w, first["low"][n]) and torch.equal(w, r["got"][n].bfloat16()), n
    moved = max((first["got"][n] - p).abs().max().item() for n, p in FixedGrad().ps.items())
    assert moved > 0.05  # the comparison is not vacuous: 3 steps at LR 0.05 moved the weights


@pytest.mark.slow
def test_the_driver_pieces_give_the_unsharded_weights(results):
    """DDP's bf16 allreduce against the reduce-scatter. `after`: the same exact sums, so the same weights to fp32
    rounding (0.0 apart when written). `before` clips each rank's local gradient in the hook to values no longer
    exact in a bf16 sum, which the two collectives add in different orders: 6e-4 apart when written, against 0.05
    between clipping before and not clipping at all."""
    for r in results:
        for clip, (got, want) in r["pieces"].items():
            close(got, want, **({"rtol": 0, "atol": 3e-3} if clip == "before" else {}))
            close(got, results[0]["pieces"][clip][0], rtol=0, atol=0)


@pytest.mark.slow
def test_the_state_is_the_unsharded_ones_and_resumes_at_any_world_size(results):
    state, ref_state = results[0]["state"]
    assert state["param_groups"] == ref_state["param_groups"] or all(
        {k: v for k, v in a.items() if k != "lr"} == {k: v for k, v in b.items() if k != "lr"}
        for a, b in zip(state["param_groups"], ref_state["param_groups"]))
    assert state["state"].keys() == ref_state["state"].keys() and len(state["state"]) == len(SHAPES)
    for i, s in state["state"].items():
        want = ref_state["state"][i]
        assert float(s["step"]) == float(want["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert s[key].shape == want[key].shape
            torch.testing.assert_close(s[key], want[key], rtol=1e-5, atol=1e-9)
    for r in results:
        again = r["reloaded_state"]
        assert again["state"].keys() == state["state"].keys()
        assert all(torch.equal(torch.as_tensor(again["state"][i][k]), torch.as_tensor(s[k]))
                   for i, s in state["state"].items() for k in s)
        restarted, new = r["restarted"]
        close(restarted, new, rtol=0, atol=0)
    for r in results[:2]:
        at_two, at_one, ref_continued = r["resumed"]
        close(at_two, ref_continued)
        close(at_one, ref_continued)


@pytest.mark.slow
def test_masters_in_model_loads_the_masters_and_the_model(results):
    for r in results:
        masters, low = r["loaded"]
        assert all(torch.equal(m, torch.full_like(m, 0.375)) and m.dtype == torch.float32 for m in masters.values())
        assert all(torch.equal(w, torch.full_like(w, 0.375)) and w.dtype == torch.bfloat16 for w in low.values())


@pytest.mark.slow
def test_a_missing_gradient_fails_and_none_at_all_skips(results):
    for r in results:
        assert "tensor 5 of 6 has no gradient" in r["missing"] and "OPTIMIZER_SHARDING=1" in r["missing"]
        assert r["no_grads_unchanged"]


@pytest.mark.slow
def test_fp16_ranks_skip_an_overflow_of_the_sum_of_finite_gradients(results):
    for r in results[:3]:
        assert r["fp16_sum_overflow"] == {"scale": 0.5, "unchanged": True}


@pytest.mark.slow
def test_fp16_ranks_skip_an_overflow_together_and_keep_one_scale(results):
    for r in results:
        close(r["fp16"]["got"], results[0]["fp16"]["want"])
        assert r["fp16"]["scales"] == [(SCALE, SCALE), (SCALE / 2, SCALE / 2), (SCALE / 2, SCALE / 2)]
    moved = max((results[0]["fp16"]["got"][n] - p).abs().max().item() for n, p in FixedGrad().ps.items())
    assert moved > 0.05


@pytest.mark.slow
def test_blocks_started_from_the_backward_give_the_same_update(results):
    """3 blocks of 4 slices of 3 rows (tensors span blocks): by hand and started from DDP's backward, where nothing
    starts in `no_sync` (the warm-up, the first micro-step) and every block with a gradient starts in the synced one
    (one block, the default, starts none: the step reduces)."""
    want = results[0]["want"]
    for r in results:
        close(r["blocks"]["direct"], want)
        close(r["blocks"]["again"], r["blocks"]["direct"], rtol=0, atol=0)
        hooked = r["blocks"]["hooked"]
        close(hooked["got"], want)
        assert hooked["filled"] == 3 and hooked["started"] == [0] + [0, 3] * STEPS, hooked["started"]
        assert hooked["launched"] == [2, 1, 0] * STEPS  # last block first, on every rank
        stale, unsharded_way = r["blocks"]["stale"]
        close(stale, unsharded_way, rtol=0, atol=0)
        close(r["blocks"]["hooked_one"]["got"], want)
        assert r["blocks"]["hooked_one"]["started"] == [0] * (1 + 2 * STEPS)


def test_shard_parts_match_the_rows_counted_one_by_one():
    """A rank owns slice r of each of B blocks of N slices of k rows. Each row of its shard belongs to the tensor a
    plain walk over the layout says, in the layout's order; each tensor's rows there are contiguous."""
    gen = torch.Generator().manual_seed(3)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    for _ in range(300):
        counts = torch.randint(1, 6, (draw(1, 7),), generator=gen).tolist()
        first, blocks, world, k = draw(0, 5), draw(1, 4), draw(1, 5), draw(1, 4)
        rank = draw(0, world)
        starts = [(b * world + rank) * k for b in range(blocks)]
        owner_of = {first + j: i for i, n in enumerate(counts) for j in range(sum(counts[:i]), sum(counts[:i]) + n)}
        owned = [row for s in starts for row in range(s, s + k)]
        before = sum(row < first for row in owned)  # the shard rows of earlier groups
        mine = [owner_of[row] for row in owned if row in owner_of]
        part = shard_part(first, counts, functools.partial(rows_below, starts=starts, rows=k), torch.device("cpu"))
        assert part.owner.tolist() == mine and part.first == before and part.last - part.first == len(mine)
        assert part.ends.tolist()[-1] == len(mine) and (part.ends >= part.begins).all()
        assert [e - b for b, e in zip(part.begins.tolist(), part.ends.tolist())] == [mine.count(i) for i in
                                                                                     range(len(counts))]
        assert all(mine[b:e] == [i] * (e - b) for i, (b, e) in enumerate(zip(part.begins.tolist(),
                                                                               part.ends.tolist())))


BASE = {"DATADIR_PHASE2": "/d", "EVALDIR": "/e", "BERT_CONFIG": "tiny", "BATCHSIZE": "8", "LR": "1e-3",
        "MAX_STEPS": "10", "MASTER_WEIGHTS": "1", "OPTIMIZER_SHARDING": "1"}


@pytest.mark.parametrize("env, message", [
    ({"PRECISION": "bf16"}, r"\$OPTIMIZER_LAYOUT = 'tensors' must be flat with MASTER_WEIGHTS=1 and "
                            "OPTIMIZER_SHARDING=1"),
    ({"PRECISION": "bf16", "OPTIMIZER_LAYOUT": "flat", "OPTIMIZER": "adam"}, r"needs MASTER_WEIGHTS=1 and "
                                                                             "OPTIMIZER=lamb"),
])
def test_the_config_refuses_what_is_not_built(env, message):
    with pytest.raises(ConfigError, match=message) as err:
        from_env_and_args([], {**BASE, **env})
    assert "\n" not in str(err.value)


def test_fp16_sharded_masters_get_the_scaler_whose_ranks_agree():
    """The sharded masters take GradScaler's flag into their step (no unscale_, where ShardedGradScaler agrees)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from bert.train.build import build_scaler

    def scaler(**env: str) -> torch.amp.GradScaler:
        cfg = from_env_and_args([], {**BASE, "PRECISION": "fp16", "OPTIMIZER_LAYOUT": "flat", **env})
        return build_scaler(cfg, torch.device("cpu"))

    assert type(scaler()) is AgreedGradScaler and scaler().is_enabled()
    assert type(scaler(MASTER_WEIGHTS="0", OPTIMIZER_LAYOUT="tensors")) is ShardedGradScaler
    assert type(scaler(OPTIMIZER_SHARDING="0")) is torch.amp.GradScaler


@pytest.mark.parametrize("env, message", [
    ({"OPTIMIZER_SHARDING": "0"}, "needs OPTIMIZER_SHARDING=1 and MASTER_WEIGHTS=1"),
    ({"GRAD_CLIP": "bucket"}, "needs GRAD_CLIP=after or none and GRAD_BUCKETS=ddp"),
    ({"GRAD_BUCKETS": "balanced"}, "needs GRAD_CLIP=after or none and GRAD_BUCKETS=ddp"),
])
def test_blocks_need_the_sharded_masters_and_no_clip_in_the_hook(env, message):
    base = {**BASE, "PRECISION": "bf16", "OPTIMIZER_LAYOUT": "flat", "OPTIMIZER_SHARD_BLOCKS": "4"}
    assert from_env_and_args([], base).optim.optimizer_shard_blocks == 4
    with pytest.raises(ConfigError, match=message) as err:
        from_env_and_args([], {**base, **env})
    assert "$OPTIMIZER_SHARD_BLOCKS" in str(err.value) and "\n" not in str(err.value)


def test_a_node_wise_plan_needs_the_sharded_masters_and_nodes_that_divide_the_world():
    base = {**BASE, "PRECISION": "bf16", "OPTIMIZER_LAYOUT": "flat", "OPTIMIZER_SHARD_PLAN": "node"}
    cfg = from_env_and_args([], {**base, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert cfg.optim.optimizer_shard_plan == "node"
    with pytest.raises(ConfigError, match=r"launcher's 4 ranks per node \(\$LOCAL_WORLD_SIZE\), which does not divide "
                                          r"the world size 6 \(\$WORLD_SIZE\) into equal nodes for "
                                          r"OPTIMIZER_SHARD_PLAN=node$"):
        from_env_and_args([], {**base, "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match=r"\$OPTIMIZER_SHARD_PLAN = 'node' needs OPTIMIZER_SHARDING=1 and "
                                          "MASTER_WEIGHTS=1"):
        from_env_and_args([], {**base, "OPTIMIZER_SHARDING": "0"})
    with pytest.raises(ConfigError, match="OPTIMIZER_SHARD_PLAN = '3d' must be one of flat, 2d, node"):
        from_env_and_args([], {**base, "OPTIMIZER_SHARD_PLAN": "3d"})


def test_the_config_takes_bf16_fp16_and_fp8_flat_lamb():
    for precision in ("bf16", "fp16", "fp8"):
        cfg = from_env_and_args([], {**BASE, "PRECISION": precision, "OPTIMIZER_LAYOUT": "flat",
                                     "STATIC_TOKENS": "512", "GRAD_CLIP": "after"})
        assert cfg.optim.master_weights and cfg.optim.optimizer_sharding and hook_clip_mode(cfg.optim) == "none"


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def driver(data: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = dict(input_dir=data / "train_varlength", eval_dir=data / "eval_varlength", bert_config_path="tiny",
                output_dir=out, train_batch_size=4, learning_rate=3e-3, max_steps=4, warmup_steps=2, log_freq=1,
                eval_iter_start_samples=10**9, num_eval_examples=64, attention="padded", seed=11, precision="bf16",
                master_weights=1, optimizer_sharding=1, optimizer_layout="flat", optimizer_shard_blocks=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "run_pretraining.py"), *[x for k, v in args.items() for x in (f"--{k}", str(v))], *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_the_driver_resumes_a_sharded_run_exactly(tmp_path):
    """2 ranks under torchrun, the reduce-scatters in 2 blocks started from the backward: 2 steps (the warm-up), a
    checkpoint (moments and masters gathered), --resume for 2 more (the decay) == 4 steps in one go, every loss and
    the saved fp32 weights. The split run takes OPTIMIZER_SHARD_PLAN=2d over nodes of one rank (the network
    reduce-scatter alone: the same sums of two values, the same owners) and waits for the all-gathers in the next
    forward (OPTIMIZER_SHARD_GATHER=forward, its checkpoint after them), so it must match the flat one bit for bit,
    and records its plan."""
    from safetensors.torch import load_file

    data = tmp_path / "data"
    # in this process: a subprocess of its own would import numpy, h5py and torch again (3 CPU-seconds)
    assert load_script("data/make_synthetic_dataset.py").main(["--out", str(data), "--train-samples", "256",
                                                               "--eval-samples", "64"]) == 0
    whole, split = tmp_path / "whole", tmp_path / "split"
    plan = ("--optimizer_shard_plan", "2d", "--grad_reduce_node_size", "1", "--optimizer_shard_gather", "forward")
    jobs = [driver(data, whole), driver(data, split, "--steps_this_job", "2", *plan)]
    (rc_whole, log_whole), (rc_first, log_first) = map(finish, jobs)
    assert rc_whole == 1, log_whole[-3000:]  # max_steps before the target: aborted
    assert rc_first == 0, log_first[-3000:]
    rc_second, log_second = finish(driver(data, split, "--resume", "1", *plan))
    assert rc_second == 1, log_second[-3000:]
    assert len(losses(whole)) == 4 and losses(split) == losses(whole)
    records = [json.loads((out / "config.json").read_text()) for out in (whole, split)]
    assert [r["resolved"]["shard_plan"] for r in records] == ["FlatPlan, 2 owners", "TwoDPlan, 2 owners"]
    assert [r["config"]["optim"]["optimizer_shard_gather"] for r in records] == ["step", "forward"]
    a = load_file(whole / "checkpoints" / "step_00000004" / "model.safetensors")
    b = load_file(split / "checkpoints" / "step_00000004" / "model.safetensors")
    assert {t.dtype for t in a.values()} == {torch.float32}
    assert all(torch.equal(a[n], b[n]) for n in a)
    first = load_file(split / "checkpoints" / "step_00000002" / "model.safetensors")
    assert any(not torch.equal(first[n], a[n]) for n in a)


@pytest.mark.slow
def test_an_all_gather_started_then_waited_for_equals_one_done_at_once(results):
    """OPTIMIZER_SHARD_GATHER=forward's path through each plan, 4 ranks as 2 nodes of 2: the same block, every slice
    filled, as the all-gather `step` waits for at once (which the tests above check against the reference)."""
    for r in results:
        for sync, later in (r["gathered_flat"], *(r["plans"][name]["gathered"] for name in ("2d", "node"))):
            assert torch.equal(sync, later) and bool((sync != 0).all())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["2d", "node"])
def test_the_node_wise_plans_give_the_same_update(results, name):
    """OPTIMIZER_SHARD_PLAN over 2 nodes of 2 ranks: the reduce-scatter inside the node then across ([004] §3.3), or
    then an allreduce across (NVIDIA's group of one node). The same masters as the unsharded flat update within fp32
    rounding (the norms' partial sums are added in another order), one block or three (by hand and started from
    DDP's backward), the same whole state, and fp16's skip agreed over both nodes. Who owns what: 2d gives rank
    (node j, local l) slice 2 l + j of 4; node gives local rank l slice l of 2, the same rows on both nodes."""
    first = results[0]
    for r in results:
        plan = r["plans"][name]
        for key in ("got", "blocks", "hooked"):
            close(plan[key], first["want"])
        for n, w in plan["low"].items():
            assert torch.equal(w, results[0]["plans"][name]["low"][n]) and torch.equal(w, plan["got"][n].bfloat16())
        want = first["state"][1]["state"]
        assert plan["state"]["state"].keys() == want.keys()
        for i, s in plan["state"]["state"].items():
            assert float(s["step"]) == float(want[i]["step"]) == STEPS
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(s[key], want[i][key], rtol=1e-5, atol=1e-9)
        fp16 = plan["fp16"]
        close(fp16["got"], first["fp16"]["want"])
        # a warm-up's reduce-scatters (both stages) that no step took, then a synced backward started from DDP's
        # hooks: the step takes the second backward's gradients, as with one block, started by the step itself
        close(plan["stale"][0], plan["stale"][1])
        close(plan["stale"][2], plan["stale"][1])  # after a backward that left blocks unstarted, too
        assert not torch.equal(plan["stale"][0]["dense_weight"], plan["got"]["dense_weight"])
        assert [s for s, _ in fp16["scales"]] == [s for _, s in first["fp16"]["scales"]]
    owners = [r["plans"][name]["owner"] for r in results]
    assert owners == ([0, 2, 1, 3] if name == "2d" else [0, 1, 0, 1])
    shards = [r["plans"][name]["shard"] for r in results]
    if name == "node":  # each node updates a whole copy: rank 2 holds rank 0's rows
        assert torch.equal(shards[0], shards[2]) and torch.equal(shards[1], shards[3])
    else:
        assert all(not torch.equal(a, b) for i, a in enumerate(shards) for b in shards[i + 1:])
