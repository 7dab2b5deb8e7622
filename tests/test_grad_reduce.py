"""Gradient reduction strategies (GRAD_REDUCE) and compressed communication (GRAD_COMM_DTYPE) through DDP.

One spawn of 4 gloo processes laid out as 2 simulated nodes x 2 ranks (an explicit DistEnv) runs every
clipping mode with every reduction, built by `build_reduce` from a config as the trainer does, with the
mean's 1/W on the loss (the driver's choice in fp32/bf16) and on each bucket (its choice in fp16):
  hierarchical == flat to float32 round-off (float64: to 1e-12, and equal to the float64 mean by hand);
  bf16/fp16 communication stays within the bound of bert.dist.compress against the fp32 result:
      |compressed - fp32| <= (N+1)(u + 2 u32) mean_r |g_r| + (N+1) eta   elementwise (none/before/bucket:
      clipping before the reduction only shrinks |g_r|), and in the 2-norm for `after` (clipping the mean
      is a projection onto a ball, which is 1-Lipschitz);
  and the compression really rounds (the error exceeds what fp32 could produce).
Bucket sizes are odd: uneven chunks for the send/receive exchange (gloo's default), padding for the
reduce_scatter/all_gather exchange (NCCL's default, run here on gloo in float64).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port
from ranks import start_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.config import ConfigError, from_env_and_args, from_flat, launcher_layout
from bert.dist.clip import install_clipping
from bert.dist.env import DistEnv
from bert.dist.hierarchical import HierarchicalSum, node_groups
from bert.dist.reduce import build_reduce, divided, mean_placement

WORLD, NODE = 4, 2
SHAPES = [(7, 13), (33,), (16, 9), (5,), (21, 3), (1,)]  # odd sizes: uneven or padded shards
SCALES = [3.0, 0.001, 0.5, 0.002, 0.02, 5.0]
C, STEPS, CAP_MB = 1.0, 2, 0.0002  # 200-byte buckets: several per model
MODES = ("none", "after", "before", "bucket")
PLACEMENTS = ("loss", "bucket")  # where the 1/W goes (bert.dist.reduce)
# name: (GRAD_REDUCE, GRAD_COMM_DTYPE, gradient dtype)
REDUCES = {
    "flat": ("flat", "fp32", torch.float32),
    "hierarchical": ("hierarchical", "fp32", torch.float32),
    "flat_f64": ("flat", "fp32", torch.float64),
    "hierarchical_f64": ("hierarchical", "fp32", torch.float64),
    "flat_bf16": ("flat", "bf16", torch.float32),
    "flat_fp16": ("flat", "fp16", torch.float32),
    "hierarchical_bf16": ("hierarchical", "bf16", torch.float32),
    "hierarchical_fp16": ("hierarchical", "fp16", torch.float32),
    # the NCCL path (reduce_scatter / all_gather) on gloo; gloo's own default exchanges by send/receive
    "hierarchical_collective_f64": ("hierarchical", "fp32", torch.float64),
    # NCCL's whole default: the collective exchange with every step issued by the hook (`issue="caller"`)
    "hierarchical_caller_f64": ("hierarchical", "fp32", torch.float64),
}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
SUBNORMAL_STEP = {"bf16": 2.0**-133, "fp16": 2.0**-24}
U32 = 2.0**-24


class FixedGrad(nn.Module):
    """loss = sum_i <p_i, G_i>: the gradient of p_i is exactly G_i."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES])

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


def fixed_grads(rank: int, step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * k * (1 + rank)).to(dtype)
            for s, k in zip(SHAPES, SCALES)]


def run(mode: str, reduce, dtype: torch.dtype, rank: int, mean_at: str) -> list[list[torch.Tensor]]:
    model = FixedGrad(dtype)
    ddp = DDP(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=True)
    clipper = install_clipping(ddp, mode, C, None, reduce=reduce, mean_at=mean_at)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    steps = []
    for step in range(STEPS):  # step 0 on DDP's first buckets, step 1 on the rebuilt ones
        model.zero_grad(set_to_none=True)
        (ddp(fixed_grads(rank, step, dtype)) * clipper.loss_factor).backward()
        clipper.before_step(optimizer, scaler)
        steps.append([p.grad.detach().clone() for p in model.ps])
    return steps


def recorded(reduce, sizes: list[int]):
    """The reduction, noting the size of every buffer it is handed."""

    def wrapped(flat: torch.Tensor):
        sizes.append(flat.numel())
        return reduce(flat)

    return wrapped


def worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    env = DistEnv(rank, WORLD, rank % NODE, NODE, "localhost", 0)  # 2 nodes x 2 ranks on one host
    results, sizes = {}, {(name, mode, at): [] for name in REDUCES for mode in MODES for at in PLACEMENTS}
    for name, (strategy, comm, dtype) in REDUCES.items():
        cfg = from_flat(grad_reduce=strategy, grad_comm_dtype=comm).dist
        reduce = build_reduce(cfg, env)  # process groups built once per reduction, reused by every mode
        if "collective" in name or "caller" in name:
            reduce = HierarchicalSum(NODE, exchange="collective", issue="caller" if "caller" in name else None)
        nccl_path = "collective" in name or "caller" in name
        assert getattr(reduce, "exchange", None) in (None, "collective" if nccl_path else "p2p")
        assert (reduce is None) == (name in ("flat", "flat_f64"))
        for mode in MODES:
            for at in PLACEMENTS:
                key = name, mode, at
                results[key] = run(mode, recorded(reduce, sizes[key]) if reduce else None, dtype, rank, at)
        if name == "hierarchical_fp16":  # 40000 on every rank: a node sum before the division would overflow fp16
            probe = divided(reduce, WORLD)(torch.full((11,), 40000.0)).wait()
    torch.save((results, sizes, probe), f"{out}.{rank}")
    dist.destroy_process_group()


def mean_abs(step: int) -> list[torch.Tensor]:
    """mean_r |g_r|, in float64: the scale every rounding error of the mean is relative to."""
    per_rank = [fixed_grads(r, step, torch.float32) for r in range(WORLD)]
    return [sum(gs[i].double().abs() for gs in per_rank) / WORLD for i in range(len(SHAPES))]


@pytest.mark.slow
def test_strategies_match_flat_allreduce_for_every_clip_mode(tmp_path):
    out = str(tmp_path / "grads")
    start_ranks(worker, args=(str(tmp_path / "store"), out), nprocs=WORLD)
    results = [torch.load(f"{out}.{r}")[0] for r in range(WORLD)]
    sizes = torch.load(f"{out}.0")[1]
    # fp16 communication, 1/W on the bucket: divided before the node sum (2 x 40000 > 65504, fp16's max)
    for r in range(WORLD):
        assert torch.equal(torch.load(f"{out}.{r}")[2], torch.full((11,), 40000.0)), r
    # the cases the test is for: several buckets once DDP rebuilt them (step 1), some of odd size
    for at in PLACEMENTS:
        assert len(sizes["hierarchical", "bucket", at]) >= 1 + 3
        assert any(n % NODE for n in sizes["hierarchical", "none", at])
        assert len(sizes["hierarchical", "before", at]) == STEPS  # clip-before: one concatenated reduction per step
    for rank in range(1, WORLD):  # every rank holds the same mean
        for key, steps in results[rank].items():
            for got, want in zip(steps, results[0][key]):
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (key, rank)
    for at in PLACEMENTS:
        check_against_flat({(name, mode): steps for (name, mode, p), steps in results[0].items() if p == at}, at)
    # 1/W on the loss instead of on each bucket changes only rounding (exactly nothing for W = 4): in particular
    # the clip hooks still clip each rank's own gradient by its own norm
    for (name, mode, at), steps in results[0].items():
        if at == "loss" and name.endswith("f64"):
            for got, want in zip(steps, results[0][name, mode, "bucket"]):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15, msg=f"{name} {mode}")


def check_against_flat(res: dict, at: str) -> None:
    """Rank 0's gradients of every strategy against DDP's own flat allreduce, with the 1/W placed `at`."""
    for step in range(STEPS):
        scale = mean_abs(step)
        # An independent reference for the unclipped float64 case: the mean by hand.
        per_rank = [fixed_grads(r, step, torch.float64) for r in range(WORLD)]
        by_hand = [sum(gs[i] for gs in per_rank) / WORLD for i in range(len(SHAPES))]
        for g, w in zip(res["hierarchical_f64", "none"][step], by_hand):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
        for mode in MODES:
            where = f"{mode} step {step}, 1/W on the {at}"
            for name in ("hierarchical_f64", "hierarchical_collective_f64", "hierarchical_caller_f64"):
                for g, f in zip(res[name, mode][step], res["flat_f64", mode][step]):
                    torch.testing.assert_close(g, f, rtol=1e-12, atol=1e-15, msg=f"{name} {where}")
            flat = res["flat", mode][step]
            for g, f, s in zip(res["hierarchical", mode][step], flat, scale):
                assert g.dtype == torch.float32
                assert ((g.double() - f.double()).abs() <= 4 * (WORLD + 1) * U32 * (s + f.double().abs())).all(), where
            for comm in ("bf16", "fp16"):
                u, eta = UNIT_ROUNDOFF[comm], SUBNORMAL_STEP[comm]
                for strategy in ("flat", "hierarchical"):
                    got = res[f"{strategy}_{comm}", mode][step]
                    err = [(g.double() - f.double()).abs() for g, f in zip(got, flat)]
                    bound = [(WORLD + 1) * ((u + 2 * U32) * s + eta) for s in scale]
                    what = f"{strategy} {comm} {where}"
                    assert all(g.dtype == torch.float32 for g in got), what
                    if mode == "after":
                        norm = lambda ts: math.sqrt(sum(float((t * t).sum()) for t in ts))  # noqa: E731
                        assert norm(err) <= norm(bound), what
                    else:
                        assert all((e <= b).all() for e, b in zip(err, bound)), what
                    # the cast really happened: fp32 alone could not be off by this much
                    rel = max(float((e / f.double().abs().clamp(min=1e-30)).max()) for e, f in zip(err, flat))
                    assert rel > u / 16, what


def test_the_mean_goes_on_the_loss_except_under_fp16_or_optimizer_sharding():
    """bert.train.build's rule: fp16 keeps the backward at its loss scale (each bucket is divided before its
    sum); the sharded optimizer's reduce-scatter divides; elsewhere the loss carries the 1/W."""
    assert [mean_placement(p, False) for p in ("fp32", "bf16", "fp8", "fp16")] == ["loss", "loss", "loss", "bucket"]
    assert {mean_placement(p, True) for p in ("fp32", "bf16", "fp16")} == {"optimizer"}
    with pytest.raises(ValueError, match="mean_at must be one of loss, bucket, optimizer, got 'wire'"):
        install_clipping(None, "none", 1.0, mean_at="wire")


def test_divided_hands_the_sum_each_buffer_over_the_world():
    """The `bucket` placement: the Reduce sums buffers already divided by W, so W equal buffers give their mean
    back. A stand-in sum over 4 ranks that all hold `flat` (no process group)."""
    handed = []

    def sum_of_four(flat: torch.Tensor) -> torch.futures.Future:
        handed.append(flat.clone())
        done = torch.futures.Future()
        done.set_result(flat * 4)
        return done

    flat = torch.tensor([8.0, -2.0, 1.0, 0.0])
    assert divided(sum_of_four, 4)(flat.clone()).wait().tolist() == [8.0, -2.0, 1.0, 0.0]
    assert handed[0].tolist() == [2.0, -0.5, 0.25, 0.0]


def test_build_reduce_takes_the_configured_node_size_else_the_launchers(monkeypatch):
    """GRAD_REDUCE_NODE_SIZE overrides the launcher's local world size (a stand-in HierarchicalSum: no groups); its
    groups time out after DIST_TIMEOUT, as the default group does (not torch's 10 minutes for a NCCL subgroup)."""
    from datetime import timedelta

    import bert.dist.reduce as reduce_module

    monkeypatch.setattr(reduce_module, "HierarchicalSum", lambda node_size, timeout: ("hierarchical", node_size,
                                                                                      timeout))
    env = DistEnv(0, 8, 0, 4, "localhost", 0)
    assert build_reduce(from_flat(grad_reduce="hierarchical").dist, env) == ("hierarchical", 4, timedelta(seconds=300))
    assert build_reduce(from_flat(grad_reduce="hierarchical", grad_reduce_node_size=2, dist_timeout_s=60).dist,
                        env) == ("hierarchical", 2, timedelta(seconds=60))
    assert build_reduce(from_flat(grad_reduce="flat").dist, env) is None  # DDP's own allreduce, no hook


def test_node_groups_are_blocks_and_strided_peers():
    assert node_groups(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert node_groups(4, 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="does not divide"):
        node_groups(6, 4)


def test_launcher_layout_from_torchrun_slurm_or_shell_config():
    assert launcher_layout({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == ((16, "$WORLD_SIZE"),
                                                                              (8, "$LOCAL_WORLD_SIZE"))
    assert launcher_layout({"SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8(x2)"})[1] == (
        8, "$SLURM_NTASKS_PER_NODE")
    assert launcher_layout({"DGXNNODES": "128", "DGXNGPU": "8"}) == ((1024, "$DGXNNODES x $DGXNGPU"), (8, "$DGXNGPU"))
    assert launcher_layout({}) is None


BASE = {"DATADIR_PHASE2": "x", "EVALDIR": "x", "BERT_CONFIG": "tiny", "BATCHSIZE": "8", "LR": "1e-3",
        "MAX_STEPS": "10"}


@pytest.mark.parametrize("env", [
    {"GRAD_REDUCE": "hierarchical", "GRAD_REDUCE_NODE_SIZE": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
    {"GRAD_REDUCE": "hierarchical", "GRAD_REDUCE_NODE_SIZE": "16", "DGXNNODES": "1", "DGXNGPU": "8"},
    {"GRAD_REDUCE": "hierarchical", "SLURM_NTASKS": "7", "SLURM_NTASKS_PER_NODE": "4,3"},
])
def test_node_size_that_does_not_divide_the_world_fails_at_parse_time(env):
    with pytest.raises(ConfigError) as e:
        from_env_and_args([], {**BASE, **env})
    assert "$GRAD_REDUCE_NODE_SIZE" in str(e.value) and "does not divide" in str(e.value), str(e.value)


def test_valid_layouts_parse():
    for env in ({"GRAD_REDUCE": "hierarchical", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
                {"GRAD_REDUCE": "hierarchical", "DGXNNODES": "128", "DGXNGPU": "8", "GRAD_REDUCE_NODE_SIZE": "4"},
                {"GRAD_REDUCE": "flat", "SLURM_NTASKS": "7", "SLURM_NTASKS_PER_NODE": "4,3"}):  # flat has no nodes
        from_env_and_args([], {**BASE, **env})


def test_hierarchical_refuses_a_node_size_that_does_not_divide_the_world(tmp_path):
    """The run-time check behind the parse-time one (a layout the config could not see)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="does not divide"):
            HierarchicalSum(2)
        flat = torch.arange(5.0)
        assert torch.equal(HierarchicalSum(1)(flat).wait(), torch.arange(5.0))  # a world of one: the identity
    finally:
        dist.destroy_process_group()


def test_the_p2p_exchange_is_refused_on_nccl(tmp_path, monkeypatch):
    """Every rank posts a receive, then a send, to the same peer: gloo serves them as they come, NCCL would hold
    each receive on the GPU until the peer's send, queued behind the peer's own receive. NCCL gets the collective
    exchange by default; asking it for p2p is an error, not a hang. NCCL's steps are issued by the caller (in bucket
    order on every rank: no thread whose timing could interleave the three groups differently), gloo's by a worker."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert (HierarchicalSum(1).exchange, HierarchicalSum(1).issue) == ("p2p", "worker")
        with pytest.raises(ValueError, match="the caller issues the collective exchange only"):
            HierarchicalSum(1, issue="caller")
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        assert (HierarchicalSum(1).exchange, HierarchicalSum(1).issue) == ("collective", "caller")
        with pytest.raises(ValueError, match="p2p exchange is for gloo"):
            HierarchicalSum(1, exchange="p2p")
        with pytest.raises(ValueError, match="the worker thread is for gloo"):
            HierarchicalSum(1, issue="worker")
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


SIZES = [5, 12, 1, 33, 8, 7, 64, 2, 19, 3, 40, 11]  # odd and even, one smaller than the node
# gloo's defaults (sends/receives, a worker thread), the NCCL exchange under the worker, and NCCL's defaults (the
# collective exchange, every step issued by the caller)
ISSUES = [("p2p", "worker"), ("collective", "worker"), ("collective", "caller")]


def sum_worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    got = {}
    for exchange, issue in ISSUES:
        reduce = HierarchicalSum(NODE, exchange=exchange, issue=issue)
        for pattern in ("at once", "one by one", "in pairs"):
            flats = [rank_buffer(rank, n, k) for k, n in enumerate(SIZES)]
            if pattern == "at once":  # every buffer queued before the worker takes any: steps 2 batched
                futures = [reduce(f) for f in flats]
            elif pattern == "one by one":  # the worker idles between buffers
                futures = []
                for f in flats:
                    futures.append(reduce(f))
                    futures[-1].wait()
            else:  # two queued, the older waited for, so arrivals and all-gathers interleave
                futures = []
                for f in flats:
                    futures.append(reduce(f))
                    if len(futures) % 2 == 0:
                        futures[-2].wait()
            got[exchange, issue, pattern] = [fut.wait().clone() for fut in futures]
    torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


def rank_buffer(rank: int, n: int, k: int) -> torch.Tensor:
    """Integers in float64: every summation order gives the same sum exactly."""
    return torch.arange(n, dtype=torch.float64) * (rank + 1) + 1000 * k + 10 * rank


def test_hierarchical_sums_buffers_handed_over_at_once_one_by_one_or_interleaved(tmp_path):
    out = str(tmp_path / "sums")
    context = start_ranks(sum_worker, args=(str(tmp_path / "store"), out), nprocs=WORLD, join=False)
    deadline = 120  # a rank waiting on a peer that issued in another order would hang: fail instead
    while not context.join(timeout=1):
        deadline -= 1
        if deadline <= 0:
            for p in context.processes:
                p.kill()
            pytest.fail("HierarchicalSum did not finish in 120 s: the ranks issued their steps in different orders")
    want = [sum(rank_buffer(r, n, k) for r in range(WORLD)) for k, n in enumerate(SIZES)]
    for rank in range(WORLD):
        got = torch.load(f"{out}.{rank}")
        assert len(got) == 3 * len(ISSUES)
        for case, sums in got.items():
            assert len(sums) == len(SIZES), case
            for k, (g, w) in enumerate(zip(sums, want)):
                assert torch.equal(g, w), (rank, case, k)


@pytest.mark.slow
def test_two_torchrun_launchers_form_nodes_from_their_local_ranks(tmp_path):
    """2 launchers x 2 ranks: the nodes are the launchers' ranks, and the sum is right (float64, and bf16)."""
    script = Path(__file__).parent / "multiproc" / "reduce_ranks.py"
    port = free_port()
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
         "2", "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for node in (0, 1)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in launchers]
    finally:  # a launcher left waiting for its peer must not outlive the test
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(logs)
    sys.path.insert(0, str(script.parent))
    from reduce_ranks import rank_values

    records = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("rank*.json"))}
    assert sorted(records) == [0, 1, 2, 3]
    values = [rank_values(r) for r in range(4)]
    total = sum(values)
    scale = sum(v.abs() for v in values)
    for rank, record in records.items():
        assert record["intra"] == ([0, 1] if rank < 2 else [2, 3]) and record["inter"] == [rank % 2, rank % 2 + 2]
        torch.testing.assert_close(torch.tensor(record["fp32"], dtype=torch.float64), total, rtol=1e-12, atol=1e-15)
        err = (torch.tensor(record["bf16"], dtype=torch.float64) - total).abs()
        assert (err <= 5 * UNIT_ROUNDOFF["bf16"] * scale).all() and err.max() > 0, rank


def _node_sum_worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    results = {}
    for node_size in (WORLD, NODE):  # one node of 4 (3 peers a rank: DGX nodes have 7), and 2 nodes of 2
        for exchange, issue in ISSUES:
            reduce = HierarchicalSum(node_size, exchange=exchange, issue=issue)
            for n in (1, 7, 1001):  # chunks of unequal size, and fewer elements than ranks
                flat = torch.arange(n, dtype=torch.float64) * (rank + 1) + rank / 3
                results[node_size, exchange, issue, n] = reduce(flat).wait().clone()
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_hierarchical_sum_adds_every_peers_chunk_for_any_node_size(tmp_path):
    """The sum over the world, by hand, for a node of 4 ranks as well as 2: with one peer per node (the test
    above) a node sum that kept only the first peer's chunk would still be right."""
    out = str(tmp_path / "sums")
    start_ranks(_node_sum_worker, args=(str(tmp_path / "store"), out), nprocs=WORLD)
    for rank in range(WORLD):
        results = torch.load(f"{out}.{rank}")
        assert len(results) == 2 * len(ISSUES) * 3
        for (node_size, exchange, issue, n), got in results.items():
            want = sum(torch.arange(n, dtype=torch.float64) * (r + 1) + r / 3 for r in range(WORLD))
            torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-12,
                                       msg=f"{node_size} {exchange} {issue} {n} {rank}")


def nccl_hierarchical_worker(rank: int, out_path: str) -> None:
    """A burst of buffers through the hierarchical sum in a group made as the driver makes it on a GPU (NCCL alone),
    a world of one: every step issued by the caller (NCCL's default), each on a stream of its own; each buffer must
    come back as it went (the sum over one rank), and while a kernel queued ahead of the steps still runs, neither
    the host nor the caller's stream waits for them (only the futures do)."""
    from bert.dist.env import init_distributed

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_distributed(DistEnv(0, 1, 0, 1, "localhost", 0), device, timeout_s=60)
    try:
        reduce = HierarchicalSum(1)
        assert (reduce.exchange, reduce.issue) == ("collective", "caller")
        gen = torch.Generator(device=device).manual_seed(0)
        flats = [torch.randn(n, generator=gen, device=device) for n in SIZES]
        want = [f.clone() for f in flats]
        steps = reduce._step_streams(flats[0])
        with torch.cuda.stream(steps[0]):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every step 1
        futures = [reduce(f) for f in flats]
        host_went_on = not steps[2].query()  # the last step 3 still to come: the host waited for none
        caller = torch.cuda.Event()
        caller.record()
        caller.synchronize()  # the caller's stream is done while the steps still run: it waits for none either
        caller_not_held = not steps[2].query()
        got = [fut.wait() for fut in futures]
        torch.save({"exact": all(torch.equal(g, w) for g, w in zip(got, want)), "streams": len(reduce._streams),
                    "host_went_on": host_went_on, "caller_not_held": caller_not_held}, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_hierarchical_sum_chains_its_steps_on_streams_over_nccl(tmp_path):
    mp.spawn(nccl_hierarchical_worker, args=(str(tmp_path / "out"),), nprocs=1)
    out = torch.load(tmp_path / "out")
    assert out == {"exact": True, "streams": 1, "host_went_on": True, "caller_not_held": True}


@pytest.mark.parametrize("backend,bound,call", [("nccl", torch.device("cuda", 0), "split_group"),
                                                ("nccl", None, "new_subgroups_by_enumeration"),
                                                ("gloo", None, "new_subgroups_by_enumeration")])
def test_each_partition_is_one_communicator_split_on_a_bound_nccl_group(monkeypatch, backend, bound, call):
    """At 128 x 8 the three partitions (nodes; one local rank across nodes; nodes again) were 128 + 8 + 128 world-wide
    new_group calls, each an ncclCommSplit of the world communicator; on NCCL with the default group bound to a GPU
    each partition is now one split. The calls are recorded, not made (no NCCL here)."""
    import types

    from bert.dist import hierarchical

    calls = []

    def record(name, result):
        return lambda *a, **k: calls.append((name, k.get("split_ranks", a[0] if a else None))) or result

    default_group = types.SimpleNamespace(bound_device_id=bound)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default_group)
    monkeypatch.setattr(dist, "split_group", record("split_group", "mine"))
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", record("new_subgroups_by_enumeration", ("mine", [])))
    parts = [[0, 1], [2, 3]]
    assert hierarchical.own_subgroup(parts, None) == "mine" and calls == [(call, parts)]
