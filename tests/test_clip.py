"""Gradient clipping modes against float64 references computed by hand (Samsung [000], Algorithm 1).

Each rank gets fixed, known gradients (loss = sum_i <p_i, G_i^rank>), DDP runs with several gloo
processes, and the gradients DDP leaves in `.grad` are compared with the reference:
  bucket: per bucket, clip to c/sqrt(B) by the bucket's local norm, then average over ranks;
  before: clip the whole local gradient to c by its local norm, then average;
  after:  average, then clip to c by the global norm.
Every case goes through the unit the driver uses: `install_clipping` once, then the Clipper's
`before_step` at every step, with no mode check in the caller. The hooks' Reduce sums; the mean's 1/W
is on each bucket, or (the `*_loss` cases, as the driver in fp32/bf16) on the loss, with a loss scale
too. The float64 cases run the hooks on float64 gradients and must match the reference to rounding
(1e-12).
The bucket layout (which parameters, how many buckets) is recorded from the buckets DDP hands to
the hook, so B is observed, not assumed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bert.dist.clip as clip_unit
from bert.dist.clip import ClipAfterAllreduce, Clipper, install_clipping
from bert.dist.reduce import allreduce_sum

SHAPES = [(24, 32), (32,), (32, 32), (32,), (16, 32), (16,), (40, 16)]
# Gradient magnitudes per parameter, and per step (rank r has 1 + r times them): every clipping mode meets
# gradients on both sides of its limit (a bucket or a whole gradient that is clipped, another left alone), at
# least 7 % away from it; the test checks that it does, or a clip that scaled every gradient would pass.
SCALES = [0.05, 0.001, 0.012, 0.002, 0.003, 0.05, 0.0005]
STEP_GAINS = [0.3, 1.0, 3.0]
C = 1.0
# case: (mode, DDP bucket cap in MB, fp16 loss scale, accumulate a no_sync micro-step first, dtype)
CASE_SETUP = {
    "bucket": ("bucket", 0.004, 1.0, False, torch.float32),  # 4 kB buckets: several per model
    "one_bucket": ("bucket", 1e6, 1.0, False, torch.float32),
    "before": ("before", 0.004, 1.0, False, torch.float32),
    "after": ("after", 0.004, 1.0, False, torch.float32),
    "fp16_scaled": ("bucket", 0.004, 1024.0, False, torch.float32),
    "accumulate": ("bucket", 0.004, 1.0, True, torch.float32),
    # float64 gradients through the same unit: the exact-reference configuration (norms stay float64)
    "bucket_f64": ("bucket", 0.008, 1.0, False, torch.float64),
    "before_f64": ("before", 0.008, 1.0, False, torch.float64),
    "after_f64": ("after", 0.008, 1.0, False, torch.float64),
    "none_f64": ("none", 0.008, 1.0, False, torch.float64),
    # an explicit Reduce (bert.dist.reduce) instead of DDP's built-in allreduce: the comm-hook path
    "after_reduce": ("after", 0.004, 1.0, False, torch.float64),
    # the 1/W on the loss (the hooks only sum): the clip still acts on each rank's own gradient
    "bucket_f64_loss": ("bucket", 0.008, 1.0, False, torch.float64),
    "before_f64_loss": ("before", 0.008, 1.0, False, torch.float64),
    "after_reduce_loss": ("after", 0.004, 1.0, False, torch.float64),
    "fp16_scaled_loss": ("bucket", 0.004, 1024.0, False, torch.float32),
}


class FixedGrad(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES])

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


def fixed_grads(rank: int, step: int, dtype: torch.dtype = torch.float32, micro: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + 100 * micro + step)
    gain = STEP_GAINS[step] * (1 + rank)
    return [(torch.randn(s, generator=gen) * k * gain).to(dtype) for s, k in zip(SHAPES, SCALES)]


def recording(hook, layout: list[list[int]], index_of: dict[int, int]):
    """Wrap a hook so that the bucket layout (parameter indices per bucket) of every call is recorded."""

    def wrapped(state, bucket):
        layout.append([index_of[id(p)] for p in bucket.parameters()])
        return hook(state, bucket)

    return wrapped


def run_case(rank: int, case: str) -> dict:
    mode, cap, scale, accumulate, dtype = CASE_SETUP[case]
    model = FixedGrad(dtype)
    ddp = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
    layout: list[list[int]] = []
    index_of = {id(p): i for i, p in enumerate(model.ps)}
    # install_clipping registers the module's hooks; wrapping them records the layout DDP hands over.
    originals = clip_unit.bucket_clip_hook, clip_unit.clip_before_hook
    clip_unit.bucket_clip_hook = recording(originals[0], layout, index_of)
    clip_unit.clip_before_hook = recording(originals[1], layout, index_of)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scale != 1.0)
    clipper = install_clipping(ddp, mode, C, scaler, reduce=allreduce_sum() if "_reduce" in case else None,
                               mean_at="loss" if case.endswith("_loss") else "bucket")
    assert clipper.loss_factor == (1 / dist.get_world_size() if case.endswith("_loss") else 1.0)
    clip_unit.bucket_clip_hook, clip_unit.clip_before_hook = originals
    assert isinstance(clipper, ClipAfterAllreduce) == (mode == "after") and isinstance(clipper, Clipper)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # only for the scaler's unscale_ in `after`
    result = {"steps": []}
    for step in range(3):  # step 0 uses DDP's initial buckets; they are rebuilt during step 1
        model.zero_grad(set_to_none=True)
        layout.clear()
        if accumulate:
            with ddp.no_sync():
                (ddp(fixed_grads(rank, step, dtype, micro=1)) * clipper.loss_factor).backward()
        scaler.scale(ddp(fixed_grads(rank, step, dtype)) * clipper.loss_factor).backward()
        clipper.before_step(optimizer, scaler)  # what the training loop calls, whatever the mode
        result["steps"].append({
            "grads": [p.grad.detach().clone() / scale for p in model.ps],  # before/bucket leave them scaled
            "layout": [list(b) for b in layout] if mode in ("before", "bucket") else None,
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
    if CASE_SETUP[case][3]:
        gs = [g + a.double() for g, a in zip(gs, fixed_grads(rank, step, micro=1))]
    return gs


def clip(gs: list[torch.Tensor], limit: float, eps: float = 0.0, seen: set | None = None) -> list[torch.Tensor]:
    """`gs` scaled to norm `limit` if above it; `seen` collects whether it was (True) or not (False)."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
    if seen is not None:
        seen.add(norm > limit)
    return [g * min(1.0, limit / (norm + eps)) for g in gs]


def reference(world: int, step: int, case: str, layout: list[list[int]] | None,
              seen: set | None = None) -> list[torch.Tensor]:
    mode = CASE_SETUP[case][0]
    per_rank = []
    for r in range(world):
        gs = local_grads(r, step, case)
        if mode == "before" or case == "one_bucket":
            gs = clip(gs, C, seen=seen)
        elif mode == "bucket":  # Algorithm 1: each bucket to c/sqrt(B)
            for bucket in layout:
                for i, g in zip(bucket, clip([gs[i] for i in bucket], C / math.sqrt(len(layout)), seen=seen)):
                    gs[i] = g
        per_rank.append(gs)
    mean = [sum(rank_gs[i] for rank_gs in per_rank) / world for i in range(len(SHAPES))]
    # `after` is torch's clip_grad_norm_, which divides by norm + 1e-6 (the hooks use the norm alone)
    return clip(mean, C, eps=1e-6, seen=seen) if mode == "after" else mean


CASES = list(CASE_SETUP)


@pytest.mark.slow
def test_clip_modes_match_hand_references(tmp_path):
    world = 3  # an odd world: averaging is a division by 3, not a power of two
    out = str(tmp_path / "grads")
    start_ranks(worker, args=(world, str(tmp_path / "store"), CASES, out), nprocs=world)
    results = [torch.load(f"{out}.{r}") for r in range(world)]
    for case in CASES:
        seen: set[bool] = set()  # whether each clip the reference made was active
        for step in range(3):
            layout = results[0][case]["steps"][step]["layout"]
            if case in ("bucket", "fp16_scaled", "accumulate", "bucket_f64") and step == 2:
                assert len(layout) >= 3, f"{case}: the test needs several buckets, DDP made {layout}"
            if case == "one_bucket":
                assert len(layout) == 1
            want = reference(world, step, case, layout, seen)
            f64 = CASE_SETUP[case][4] == torch.float64
            tol = dict(rtol=1e-12, atol=1e-15) if f64 else dict(rtol=2e-5, atol=1e-7)
            for r in range(world):
                got = results[r][case]["steps"][step]["grads"]
                for i, (g, w) in enumerate(zip(got, want)):
                    assert g.dtype == CASE_SETUP[case][4]
                    where = f"{case} step {step} rank {r} param {i}"
                    torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, w=where: f"{w}: {m}")
        if CASE_SETUP[case][0] != "none":
            assert seen == {True, False}, f"{case}: every clip was {'active' if True in seen else 'idle'}"


def test_the_references_clip_some_gradients_and_not_others():
    """Guards the test itself, quickly (the spawned test checks the same on the layouts DDP made): with several
    buckets bucket-wise and whole-gradient clipping disagree, and every mode's limit is crossed by some
    gradients and not by others, so a clip that also scaled the gradients below its limit would fail."""
    layouts = [[list(range(len(SHAPES)))], [[6, 5, 4], [3, 2], [1, 0]], [[6, 5, 4], [3, 2], [1, 0]]]
    a, b = reference(3, 1, "bucket", layouts[1]), reference(3, 1, "before", None)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) > 1e-3
    for case in ("bucket", "before", "after", "accumulate"):
        seen: set[bool] = set()
        for step, layout in enumerate(layouts):
            reference(3, step, case, layout, seen)
        assert seen == {True, False}, case
