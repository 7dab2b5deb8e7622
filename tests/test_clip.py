"""Gradient clipping modes against float64 references computed by hand (Samsung [000], Algorithm 1).

Each rank gets fixed, known gradients (loss = sum_i <p_i, G_i^rank>), DDP runs with several gloo
processes, and the gradients DDP leaves in `.grad` are compared with the reference:
  bucket: per bucket, clip to c/sqrt(B) by the bucket's local norm, then average over ranks;
  before: clip the whole local gradient to c by its local norm, then average;
  after:  average, then clip to c by the global norm.
The bucket layout (which parameters, how many buckets) is recorded from the buckets DDP hands to
the hook, so B is observed, not assumed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.dist.clip import (
    BeforeClipState,
    BucketClipState,
    DdpBucketCount,
    bucket_clip_hook,
    clip_after_allreduce,
    clip_before_hook,
)

SHAPES = [(24, 32), (32,), (32, 32), (32,), (16, 32), (16,), (40, 16)]
SCALES = [3.0, 0.001, 0.5, 0.002, 0.02, 5.0, 0.0005]  # some buckets clip, some do not
C = 1.0


class FixedGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in SHAPES])

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


def fixed_grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=gen) * k * (1 + rank) for s, k in zip(SHAPES, SCALES)]


def recording(hook):
    """Wrap a hook so that the bucket layout of every call is recorded in state.layout."""

    def wrapped(state, bucket):
        ids = [id(p) for p in bucket.parameters()]
        state.layout.append([state.index_of[i] for i in ids])
        return hook(state, bucket)

    return wrapped


def run_case(rank: int, case: str) -> dict:
    model = FixedGrad()
    cap = 1e6 if case == "one_bucket" else 0.004  # 4 kB buckets: several per model
    ddp = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
    scale = 1024.0 if case == "fp16_scaled" else 1.0
    if case == "before":
        state = BeforeClipState(C, lambda: torch.tensor(scale))
        hook = clip_before_hook
    elif case != "after":
        state = BucketClipState(C, DdpBucketCount(ddp), lambda: torch.tensor(scale))
        hook = bucket_clip_hook
    if case != "after":
        state.layout, state.index_of = [], {id(p): i for i, p in enumerate(model.ps)}
        ddp.register_comm_hook(state, recording(hook))
    result = {"steps": []}
    for step in range(3):  # step 0 uses DDP's initial buckets; they are rebuilt during step 1
        model.zero_grad(set_to_none=True)
        if case != "after":
            state.layout.clear()
        if case == "accumulate":
            with ddp.no_sync():
                ddp(fixed_grads(rank, 10 * step)).backward()
        ddp([g * scale for g in fixed_grads(rank, step)]).backward()
        if case == "after":
            clip_after_allreduce(model.parameters(), C)
        result["steps"].append({
            "grads": [p.grad.detach().clone() / scale for p in model.ps],
            "layout": [list(b) for b in state.layout] if case != "after" else None,
        })
    return result


def worker(rank: int, world: int, store: str, cases: list[str], out_path: str) -> None:
    torch.set_num_threads(1)  # 3 processes on 2 cores: more threads would only spin
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {case: run_case(rank, case) for case in cases}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def local_grads(rank: int, step: int, case: str) -> list[torch.Tensor]:
    gs = [g.double() for g in fixed_grads(rank, step)]
    if case == "accumulate":
        gs = [g + a.double() for g, a in zip(gs, fixed_grads(rank, 10 * step))]
    return gs


def clip(gs: list[torch.Tensor], limit: float) -> list[torch.Tensor]:
    norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
    return [g * min(1.0, limit / norm) for g in gs]


def reference(world: int, step: int, case: str, layout: list[list[int]] | None) -> list[torch.Tensor]:
    per_rank = []
    for r in range(world):
        gs = local_grads(r, step, case)
        if case in ("before", "one_bucket"):
            gs = clip(gs, C)
        elif case != "after":  # Algorithm 1: each bucket to c/sqrt(B)
            for bucket in layout:
                for i, g in zip(bucket, clip([gs[i] for i in bucket], C / math.sqrt(len(layout)))):
                    gs[i] = g
        per_rank.append(gs)
    mean = [sum(rank_gs[i] for rank_gs in per_rank) / world for i in range(len(SHAPES))]
    return clip(mean, C) if case == "after" else mean


CASES = ["bucket", "one_bucket", "before", "after", "fp16_scaled", "accumulate"]


@pytest.mark.slow
def test_clip_modes_match_hand_references(tmp_path):
    world = 3  # an odd world: averaging is a division by 3, not a power of two
    out = str(tmp_path / "grads")
    mp.spawn(worker, args=(world, str(tmp_path / "store"), CASES, out), nprocs=world)
    results = [torch.load(f"{out}.{r}") for r in range(world)]
    for case in CASES:
        for step in range(3):
            layout = results[0][case]["steps"][step]["layout"]
            if case in ("bucket", "fp16_scaled", "accumulate") and step == 2:
                assert len(layout) >= 3, f"{case}: the test needs several buckets, DDP made {layout}"
            if case == "one_bucket":
                assert len(layout) == 1
            want = reference(world, step, case, layout)
            for r in range(world):
                got = results[r][case]["steps"][step]["grads"]
                for i, (g, w) in enumerate(zip(got, want)):
                    where = f"{case} step {step} rank {r} param {i}"
                    torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=1e-7, msg=lambda m, w=where: f"{w}: {m}")


def test_bucket_clipping_differs_from_clip_before_when_buckets_are_many(tmp_path):
    """Guards the test itself: with several buckets the two references must disagree."""
    layout = [[0, 1], [2, 3], [4, 5, 6]]
    a, b = reference(2, 0, "bucket", layout), reference(2, 0, "before", None)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) > 1e-3
