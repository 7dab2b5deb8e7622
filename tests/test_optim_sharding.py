"""Weight-update sharding (bert.optim.sharded) against the unsharded optimizer, in 3 gloo processes.

One spawn of 3 ranks (an odd world: the flat gradient does not split evenly, tensors span shards):
  * LAMB and AdamW x clip modes after/before/bucket: the same DDP model, fixed per-rank gradients, 3
    steps through the pieces the driver builds (install_clipping with `hook_clip_mode`/`local_only`,
    build_optimizer with OPTIMIZER_SHARDING, the LR schedule) against the unsharded optimizer with
    DDP's own allreduce. float64 parameters: equal to 1e-12 relative (the order of the sums differs, so
    not bit for bit; the test prints the largest difference);
  * the whole state_dict of the sharded optimizer equals the unsharded one (same keys and shapes);
  * resume at another world size: the state saved at world 3 is loaded by a sharded optimizer over 2
    ranks and by an unsharded one at world 1; both continue identically;
  * fp16: with an inf in one rank's local gradient, ShardedGradScaler makes every rank skip the step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.config import from_flat
from bert.dist.clip import install_clipping
from bert.dist.reduce import mean_placement
from bert.optim import build_optimizer, build_schedule, hook_clip_mode
from bert.optim.param_groups import decay_groups
from bert.optim.sharded import ShardedOptimizer, build_sharded, local_only

SHAPES = {"dense_weight": (7, 5), "dense_bias": (7,), "LayerNorm_weight": (7,), "out_weight": (3, 7),
          "zero_weight": (2, 3), "LayerNorm_bias": (7,)}  # 83 elements: shards of 28, 28, 27
CASES = [(o, c) for o in ("lamb", "adam") for c in ("after", "before", "bucket")]
STEPS, C = 3, 0.5
STEP_GAINS = (0.01, 1.0, 2.0)  # step 0's gradients are under every clip limit, the later ones over it


class FixedGrad(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.ps = nn.ParameterDict({n: nn.Parameter(torch.randn(s, generator=gen).to(dtype) * (n != "zero_weight"))
                                    for n, s in SHAPES.items()})

    def forward(self, gs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((self.ps[n] * gs[n]).sum() for n in SHAPES)


def grads(rank: int, step: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    gain = STEP_GAINS[step] * (1 + rank)
    return {n: (torch.randn(s, generator=gen) * gain).to(dtype) for n, s in SHAPES.items()}


def config(optimizer: str, clip: str, sharding: bool):
    return from_flat(learning_rate=0.05, max_steps=10, warmup_steps=1, optimizer=optimizer, grad_clip=clip,
                     max_grad_norm=C, weight_decay_rate=0.1, opt_epsilon=1e-6, optimizer_sharding=sharding).optim


def train(rank: int, optimizer: str, clip: str, sharding: bool) -> tuple[FixedGrad, torch.optim.Optimizer, list]:
    cfg = config(optimizer, clip, sharding)
    model = FixedGrad()
    ddp = DDP(model, bucket_cap_mb=0.0003, gradient_as_bucket_view=True)  # 300 B: several buckets
    clipper = install_clipping(ddp, hook_clip_mode(cfg), C, None, reduce=local_only() if sharding else None,
                               mean_at=mean_placement("fp32", sharding))  # as bert.train.build
    opt = build_optimizer(model, cfg)
    schedule = build_schedule(opt, cfg)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    weights = []
    for step in range(STEPS):
        (ddp(grads(rank, step)) * clipper.loss_factor).backward()
        clipper.before_step(opt, scaler)
        scaler.step(opt)
        schedule.step()
        opt.zero_grad(set_to_none=True)
        weights.append({n: p.detach().clone() for n, p in model.ps.items()})
    return model, opt, weights


def continue_from(state: dict, weights: dict, optimizer: str, group) -> list[dict]:
    """Two more steps from a saved state with the same gradient on every rank (so the mean is exact)."""
    cfg = config(optimizer, "none", group is not None)
    model = FixedGrad()
    model.load_state_dict({f"ps.{n}": w for n, w in weights.items()})
    opt = build_sharded(decay_groups(model, cfg.weight_decay_rate), cfg, torch.tensor(0.0), group) if group \
        else build_optimizer(model, cfg)
    schedule = build_schedule(opt, cfg)
    opt.load_state_dict(state)
    schedule.load_state_dict({"updates": torch.tensor(float(STEPS), dtype=torch.float64)})
    out = []
    for step in range(2):
        for n, p in model.ps.items():
            p.grad = grads(9, step)[n]
        opt.step()
        schedule.step()
        out.append({n: p.detach().clone() for n, p in model.ps.items()})
    return out


def fp16_skip(rank: int) -> dict:
    cfg = config("lamb", "after", True)
    model = FixedGrad(torch.float32)
    before = {n: p.detach().clone() for n, p in model.ps.items()}
    opt = build_optimizer(model, cfg)
    build_schedule(opt, cfg)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the loop scales the loss first; that creates the scale tensor
    for n, p in model.ps.items():
        p.grad = grads(rank, 0, torch.float32)[n] * 1024
    if rank == 1:
        model.ps["out_weight"].grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    return {"scale": scaler.get_scale(), "unchanged": all(torch.equal(before[n], p) for n, p in model.ps.items())}


def worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = {"cases": {}}
    pair = dist.new_group([0, 1])  # every rank creates it; only 0 and 1 use it
    for optimizer, clip in CASES:
        _, plain, want = train(rank, optimizer, clip, False)
        _, sharded, got = train(rank, optimizer, clip, True)
        assert isinstance(sharded, ShardedOptimizer)
        # state_dict is a collective; deep copies, as a checkpoint file is (state dicts hold live tensors)
        whole_sharded, whole_plain = copy.deepcopy(sharded.state_dict()), copy.deepcopy(plain.state_dict())
        case = {"want": want, "got": got, "state": (whole_plain, whole_sharded),
                "state_len": sum(t.numel() for s in sharded.inner.state.values() for t in s.values()
                                 if torch.is_tensor(t) and t.dim())}
        if clip == "after" and rank < 2:  # resume the world-3 state at world 2 (sharded) and world 1 (plain)
            case["resumed"] = (continue_from(copy.deepcopy(whole_sharded), got[-1], optimizer, pair),
                               continue_from(copy.deepcopy(whole_sharded), got[-1], optimizer, None),
                               continue_from(copy.deepcopy(whole_plain), want[-1], optimizer, None))
        result["cases"][(optimizer, clip)] = case
    result["fp16"] = fp16_skip(rank)
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def close(a: dict, b: dict) -> None:
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-12, atol=1e-14, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.slow
def test_sharded_update_matches_unsharded(tmp_path):
    world = 3
    out = str(tmp_path / "result")
    start_ranks(worker, args=(world, str(tmp_path / "store"), out), nprocs=world)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    worst: dict = {}
    for key in CASES:
        for r in range(world):
            case = results[r]["cases"][key]
            for step in range(STEPS):
                close(case["got"][step], case["want"][step])
                assert all(torch.equal(case["got"][step][n], results[0]["cases"][key]["got"][step][n])
                           for n in SHAPES), f"{key}: replicas differ after the all-gather"
            assert any(not torch.equal(case["want"][0][n], case["want"][-1][n]) for n in SHAPES)  # it trained
            plain, sharded = case["state"]
            assert plain["state"].keys() == sharded["state"].keys() and len(plain["state"]) == len(SHAPES)
            for i, s in plain["state"].items():
                assert s.keys() == sharded["state"][i].keys()
                for k, v in s.items():
                    torch.testing.assert_close(sharded["state"][i][k], v, rtol=1e-12, atol=1e-14)
            assert [g["params"] for g in plain["param_groups"]] == [g["params"] for g in sharded["param_groups"]]
            # each rank holds 1/3 of the moments: 2 x 28 (or 27) elements, not 2 x 83
            assert case["state_len"] == 2 * (28 if r < 2 else 27)
        worst[key] = max(float(((results[r]["cases"][key]["got"][s][n] - results[r]["cases"][key]["want"][s][n]).abs()
                                   / results[r]["cases"][key]["want"][s][n].abs().clamp(min=1e-300)).max())
                           for r in range(world) for s in range(STEPS) for n in SHAPES)
        if key[1] == "after":
            for r in range(2):
                at_two, at_one, plain = results[r]["cases"][key]["resumed"]
                for step in range(2):
                    close(at_two[step], plain[step])
                    close(at_one[step], plain[step])
                assert any(not torch.equal(at_one[-1][n], results[r]["cases"][key]["got"][-1][n]) for n in SHAPES)
    # Not bit-for-bit: a ring collective's addition order per element depends on where the element falls in
    # the buffer, and a bucket's allreduce and the flat reduce-scatter cut the buffer differently.
    print("max relative difference to the unsharded optimizer:", worst)
    for r in range(world):
        assert results[r]["fp16"] == {"scale": 512.0, "unchanged": True}, (r, results[r]["fp16"])


def test_the_gradients_are_under_the_clip_limit_at_one_step_and_over_it_at_the_others():
    """Guards the test above: a clip that also scaled gradients under its limit must change some step."""
    world = 3
    for step in range(STEPS):
        local = [torch.linalg.vector_norm(torch.cat([g.ravel() for g in grads(r, step).values()]))
                 for r in range(world)]
        mean = torch.linalg.vector_norm(sum(torch.cat([g.ravel() for g in grads(r, step).values()])
                                            for r in range(world)) / world)
        assert (max(local) < C and mean < C) if step == 0 else (min(local) > C and mean > C), (step, local, mean)
