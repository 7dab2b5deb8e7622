"""Parameter-server reduction (`GRAD_REDUCE=ps`, Herring [003] §III-A) against the flat allreduce.

One spawn of 3 workers + 2 servers (gloo, the layout the driver builds: workers first on the node, then
servers) checks, on float64 buffers:
  * raw buffers of many sizes (shorter than the server count included), several in flight at once:
    equal to the float64 sum of every worker's buffer (a Reduce sums), computed here from the known inputs;
  * DDP through `install_clipping` (GRAD_CLIP after / bucket / before) over 3 steps, across DDP's
    bucket rebuild, with the 1/W on the loss as the driver has it in fp32: the gradients equal those of
    the same DDP with the flat allreduce, to round-off;
  * the servers really did the work: each served exactly as many buffers as the workers sent.
The whole driver under torchrun (2 workers + 1 server) is checked against a flat run of the same seed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from slurm_idle import needs_slurm
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bert.config import ConfigError, from_env_and_args, from_flat
from bert.dist import ps
from bert.dist.clip import install_clipping
from bert.dist.env import DistEnv, init_distributed
from bert.dist.reduce import allreduce_mean, build_reduce

ROOT = Path(__file__).resolve().parents[1]
WORKERS, SERVERS = 3, 2
SIZES = [1, 2, 3, 7, 64, 1001, 4097]  # 1 and 2 leave a server an empty shard; odd sizes, uneven shards
SHAPES = [(24, 32), (32,), (32, 32), (32,), (16, 32), (16,), (40, 16)]
SCALES = [3.0, 0.001, 0.5, 0.002, 0.02, 5.0, 0.0005]  # some buckets clip, some do not
CLIPS = ["after", "bucket", "before"]


def buffer(rank: int, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n), dtype=torch.float64)
            * (1 + rank)).to(dtype)


class FixedGrad(nn.Module):
    """loss = sum_i <p_i, G_i>: the gradient of p_i is G_i, known on every rank."""

    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES])

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


def fixed_grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=gen, dtype=torch.float64) * k * (1 + rank) for s, k in zip(SHAPES, SCALES)]


def ddp_grads(rank: int, clip: str, reduce) -> list[list[torch.Tensor]]:
    """As the driver runs it in fp32: the hook sums (ps, or an allreduce for clip-before/bucket), the loss carries
    the 1/W; with reduce=None and `after`, DDP's own mean."""
    model = FixedGrad()
    ddp = DDP(model, bucket_cap_mb=0.008, gradient_as_bucket_view=True)  # several buckets
    clipper = install_clipping(ddp, clip, 1.0, None, reduce=reduce, mean_at="loss")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    steps = []
    for step in range(3):  # step 0 uses DDP's first buckets; they are rebuilt during step 1
        model.zero_grad(set_to_none=True)
        (ddp(fixed_grads(rank, step)) * clipper.loss_factor).backward()
        clipper.before_step(optimizer, scaler)
        steps.append([p.grad.detach().clone() for p in model.ps])
    return steps


def process(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)  # 5 processes on 2 cores
    job = DistEnv(rank, world, rank, world, "127.0.0.1", port)
    cfg = from_flat(grad_reduce="ps", ps_servers=SERVERS, dist_timeout_s=120).dist
    if ps.is_server(job, cfg):  # the driver's entry point; its report line goes to a file
        Path(f"{out}.pid{rank}").write_text(str(os.getpid()))
        with open(f"{out}.log{rank}", "w") as sys.stderr:
            torch.save({"status": ps.serve(job, cfg), "index": ps.layout(job, cfg.ps_servers).index},
                       f"{out}.{rank}")
        return
    env = ps.worker_env(job, cfg)
    init_distributed(env, torch.device("cpu"), cfg.dist_timeout_s, store=ps.connect_worker(job, cfg))
    if env.rank == 0:  # a pre-emption signal: the servers must outlive it (the workers stop them)
        for server in range(WORKERS, world):
            os.kill(int(Path(f"{out}.pid{server}").read_text()), signal.SIGTERM)
    reduce = build_reduce(cfg, env)
    result: dict = {"env": env}
    sent = [buffer(env.rank, n) for n in SIZES]
    futures = [reduce(t) for t in sent]  # all in flight before the first is awaited
    result["raw"] = [(f.wait() is t, t.clone()) for f, t in zip(futures, sent)]
    result["float32"] = reduce(buffer(env.rank, 1001, torch.float32)).wait().clone()
    result["ddp"] = {clip: (ddp_grads(env.rank, clip, reduce), ddp_grads(env.rank, clip, None)) for clip in CLIPS}
    flat = buffer(env.rank, 1001)
    result["allreduce_mean"] = allreduce_mean()(flat).wait().clone()  # the flat reduction, for comparison
    result["buffers_sent"] = ps.client().seq
    ps.disconnect()
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ps_equals_flat_allreduce_for_raw_buffers_and_every_clip_mode(tmp_path):
    from ports import free_port
    from ranks import start_ranks

    world = WORKERS + SERVERS
    out = str(tmp_path / "r")
    # forked from a preloaded server (tests/ranks.py): 5 fresh interpreters importing torch on a loaded 2-core
    # machine took 50 s
    start_ranks(process, args=(world, free_port(), out), nprocs=world)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    workers, servers = results[:WORKERS], results[WORKERS:]
    assert [w["env"].rank for w in workers] == [0, 1, 2] and {w["env"].world_size for w in workers} == {WORKERS}
    assert [(s["index"], s["status"]) for s in servers] == [(0, 0), (1, 0)]  # SIGTERM did not end them
    # every buffer reached both servers, nothing went around them
    (sent,) = {w["buffers_sent"] for w in workers}
    for s in range(SERVERS):
        assert served(Path(f"{out}.log{WORKERS + s}").read_text(), WORKERS, server=s) == sent
    tight = dict(rtol=1e-12, atol=1e-15)
    for n, *got in zip(SIZES, *[w["raw"] for w in workers]):
        want = sum(buffer(r, n) for r in range(WORKERS))
        for in_place, t in got:
            assert in_place  # the sum lands in the buffer DDP handed over
            torch.testing.assert_close(t, want, **tight)
    want32 = sum(buffer(r, 1001, torch.float32).double() for r in range(WORKERS))
    for w in workers:
        assert w["float32"].dtype == torch.float32
        torch.testing.assert_close(w["float32"].double(), want32, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w["allreduce_mean"], sum(buffer(r, 1001) for r in range(WORKERS)) / WORKERS,
                                   **tight)
    for clip in CLIPS:
        for r, w in enumerate(workers):
            by_ps, by_flat = w["ddp"][clip]
            for step, (a, b) in enumerate(zip(by_ps, by_flat)):
                for i, (x, y) in enumerate(zip(a, b)):
                    where = f"{clip} step {step} worker {r} param {i}"
                    torch.testing.assert_close(x, y, **tight, msg=lambda m, w=where: f"{w}: {m}")
        # the test can fail: the clip actually changed something, so a reduction that skipped it would differ
        unclipped = sum(fixed_grads(r, 2)[0] for r in range(WORKERS)) / WORKERS
        assert not torch.allclose(workers[0]["ddp"][clip][0][2][0], unclipped)


def test_layout_puts_servers_last_on_every_node():
    # 2 nodes of 4 processes, 1 server each: workers 0-2 on node 0, 3-5 on node 1; servers 0 and 1
    jobs = [DistEnv(r, 8, r % 4, 4, "h", 1) for r in range(8)]
    got = [ps.layout(j, 1) for j in jobs]
    assert [(g.is_server, g.index) for g in got] == [
        (False, 0), (False, 1), (False, 2), (True, 0), (False, 3), (False, 4), (False, 5), (True, 1)]
    assert {(g.workers, g.servers) for g in got} == {(6, 2)}
    assert [g.ps_rank for g in got] == [0, 1, 2, 6, 3, 4, 5, 7]
    cfg = from_flat(grad_reduce="ps", ps_servers=1).dist
    assert ps.worker_env(jobs[5], cfg) == DistEnv(4, 6, 1, 3, "h", 1)
    assert ps.worker_env(jobs[5], from_flat(grad_reduce="flat").dist) == jobs[5]
    assert ps.shard_sizes(7, 3) == [3, 2, 2] and ps.shard_sizes(1, 2) == [1, 0]
    for numel, servers in ((11, 4), (1001, 7), (3, 5), (64, 8)):  # equal shards (Herring): at most one apart
        sizes = ps.shard_sizes(numel, servers)
        assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="PS_SERVERS=4"):
        ps.layout(jobs[0], 4)


BASE = {"DATADIR_PHASE2": "x", "EVALDIR": "x", "BERT_CONFIG": "tiny", "BATCHSIZE": "8", "LR": "1e-3",
        "MAX_STEPS": "10"}


@pytest.mark.parametrize("env, culprit", [
    ({"GRAD_REDUCE": "ps", "PS_SERVERS": "0"}, "$PS_SERVERS"),
    ({"GRAD_REDUCE": "ps", "PS_SERVERS": "1.5"}, "$PS_SERVERS"),
    ({"GRAD_REDUCE": "parameter_server"}, "$GRAD_REDUCE"),
])
def test_bad_ps_settings_fail_at_parse_time(env, culprit):
    with pytest.raises(ConfigError) as e:
        from_env_and_args([], {**BASE, **env})
    assert culprit in str(e.value)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def short_run_env(data: Path, out: Path, reduce: str, gpus: int) -> dict[str, str]:
    """4 steps of tiny BERT, several DDP buckets per step, GRAD_CLIP=bucket; STEPS_THIS_JOB ends the job after
    step 4 with a checkpoint and exit 0 in every process (no launcher kills a server still printing); rank 0 tells
    run_and_time.sh, which ends as a pre-empted run does, status 3."""
    from test_harness import config_env, data_env

    return config_env("config_CPU_1x2.sh", **data_env(data), BERT_CONFIG="tiny", BATCHSIZE="8", LR="1e-3",
                      MAX_STEPS="10", STEPS_THIS_JOB="4", LOG_FREQ="1", ATTENTION="padded", SEED="7",
                      OPTIMIZER="lamb", GRAD_CLIP="bucket", BUCKET_CAP_MB="0.2", EVAL_ITER_START_SAMPLES="100000",
                      NUM_EVAL_EXAMPLES="256", EVAL_BATCHSIZE="128", DGXNGPU=str(gpus), OUTPUT_DIR=str(out),
                      MLPERF_LOG=str(out / "result_0.txt"), GRAD_REDUCE=reduce, PS_SERVERS="1",
                      OMP_NUM_THREADS="1", EXTRA_PARAMS="")


def served(stderr: str, workers: int, server: int = 0) -> int:
    """The buffer count in a server's last line."""
    found = re.search(rf"ps server {server}: (\d+) buffers from {workers} workers, stopped cleanly", stderr)
    assert found, stderr[-3000:]
    return int(found.group(1))


@pytest.mark.slow
def test_driver_with_a_parameter_server_trains_like_flat(tmp_path, synthetic_data):
    """run_and_time.sh starts 2 workers + 1 server under torchrun; losses and final weights equal a flat
    run's to round-off."""

    def run(reduce: str) -> tuple[subprocess.CompletedProcess, Path]:
        out = tmp_path / reduce
        proc = subprocess.run([str(ROOT / "run_and_time.sh")], env=short_run_env(synthetic_data, out, reduce, 2),
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        return proc, out

    with ThreadPoolExecutor(max_workers=2) as pool:
        (by_ps, ps_out), (by_flat, flat_out) = pool.map(run, ["ps", "flat"])
    assert served(by_ps.stderr, 2) >= 4 * 3  # several buckets in each of the 4 steps
    assert "ps server" not in by_flat.stderr
    # both stop after step 4 with a checkpoint: every process, the server too, exited 0, and the script says 3
    assert by_ps.returncode == by_flat.returncode == 3, by_ps.stderr[-3000:]
    assert "launch:" not in by_ps.stderr and re.search(r"^PREEMPTED,bert,7,", by_ps.stdout, re.M)
    losses = [[m["loss"] for m in metrics(out)] for out in (ps_out, flat_out)]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    weights = [load_file(out / "checkpoints" / "step_00000004" / "model.safetensors") for out in (ps_out, flat_out)]
    assert weights[0].keys() == weights[1].keys()
    for name, w in weights[0].items():
        torch.testing.assert_close(w, weights[1][name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slurm
@pytest.mark.slow
@needs_slurm
def test_slurm_step_with_a_server_task(tmp_path, synthetic_data):
    """Under srun the server is an extra task: 1 worker + 1 server on one node (run.sub's layout, 2 CPUs)."""
    out = tmp_path / "slurm"
    proc = subprocess.run(["srun", "-N1", "--ntasks=2", "--ntasks-per-node=2", "-l", str(ROOT / "run_and_time.sh")],
                          env={**short_run_env(synthetic_data, out, "ps", 1), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:]  # the job's steps done: task 0 says 3
    assert re.search(r"^0: PREEMPTED,bert,7,", proc.stdout, re.M), proc.stdout[-3000:]
    assert served(proc.stderr, 1) >= 4 * 3  # srun -l: the line comes as "1: ps server 0: ..."
    assert len(metrics(out)) == 4 and json.loads((out / "config.json").read_text())["resolved"]["world_size"] == 1


@pytest.mark.parametrize("overrides, message", [
    ({"GRAD_REDUCE": "ps", "PS_SERVERS": "0"}, "$PS_SERVERS"),
    ({"GRAD_REDUCE": "ps", "EXTRA_PARAMS": "--ps_servers 2"}, "not in EXTRA_PARAMS"),
    ({"EXTRA_PARAMS": "--grad_reduce ps"}, "not in EXTRA_PARAMS"),
], ids=["zero-servers", "servers-in-extra-params", "ps-in-extra-params"])
def test_launcher_refuses_a_server_count_it_cannot_honour(overrides, message):
    """run_and_time.sh counts the processes from GRAD_REDUCE/PS_SERVERS: it stops before starting anything."""
    from test_harness import config_env

    out = subprocess.run([str(ROOT / "run_and_time.sh")], env=config_env("config_CPU_1x2.sh", **overrides),
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "STARTING TIMING RUN" not in out.stdout


@pytest.mark.parametrize("overrides, processes", [
    ({}, 2), ({"GRAD_REDUCE": "ps"}, 3), ({"GRAD_REDUCE": "ps", "PS_SERVERS": "2"}, 4),
], ids=["flat", "one-server", "two-servers"])
def test_torchrun_is_asked_for_the_workers_and_the_servers(overrides, processes, tmp_path):
    """config_CPU_1x2.sh's 2 workers plus PS_SERVERS servers on the node."""
    from test_harness import config_env, recorded_start

    started = recorded_start(tmp_path, config_env("config_CPU_1x2.sh", **overrides))
    assert f"bert.dist.launch --standalone --nnodes=1 --nproc_per_node={processes} " in started


class _Headers:
    """A stand-in process group for `serve_loop`: worker w's header is `headers[w]`; nothing else is sent."""

    def __init__(self, headers: list[list[int]]):
        self.headers = headers

    def recv(self, tensors, source, tag):
        assert tag == ps.HEADER
        tensors[0].copy_(torch.tensor(self.headers[source]))
        return SimpleNamespace(wait=lambda *timeout: True)


def test_server_refuses_workers_out_of_step():
    """Every worker's header for one exchange must agree (sequence, kind, length, dtype); a worker one buffer
    ahead of the others would otherwise be summed with their previous buffer."""
    me = ps.Layout(workers=3, servers=1, is_server=True, index=0)
    stop = [4, ps.STOP, 0, 0]
    assert ps.serve_loop(_Headers([stop, stop, stop]), me) == 0
    for worker, field in ((1, 0), (2, 2), (2, 1)):  # a later sequence number, another length, another kind
        headers = [list(stop), list(stop), list(stop)]
        headers[worker][field] += 1
        with pytest.raises(RuntimeError, match=f"worker {worker} sent .* out of step"):
            ps.serve_loop(_Headers(headers), me)


def cuda_process(rank: int, world: int, port: int, out: str) -> None:
    """Two workers with their buffers on GPU 0 (the workers' own group is gloo: one GPU serves both) and a server."""
    job = DistEnv(rank, world, rank, world, "127.0.0.1", port)
    cfg = from_flat(grad_reduce="ps", ps_servers=1, dist_timeout_s=120).dist
    if ps.is_server(job, cfg):
        ps.serve(job, cfg)
        return
    env = ps.worker_env(job, cfg)
    init_distributed(env, torch.device("cpu"), cfg.dist_timeout_s, store=ps.connect_worker(job, cfg))
    reduce = build_reduce(cfg, env)
    sent = [buffer(env.rank, n).to("cuda") for n in SIZES] + [buffer(env.rank, 4097, torch.bfloat16).to("cuda")]
    # a kernel queued ahead, so the buckets' copies out must wait for the device, not the host
    torch.cuda._sleep(50_000_000)
    futures = [reduce(t) for t in sent]
    got = [(f.wait() is t, t.is_cuda) for f, t in zip(futures, sent)]
    torch.cuda.current_stream().synchronize()  # what DDP's stream waits for is all that counts; then read
    torch.save({"got": got, "sums": [t.cpu() for t in sent]}, f"{out}.{env.rank}")
    ps.disconnect()
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_buckets_go_through_pinned_copies_and_come_back_summed(tmp_path):
    """On a GPU the client copies each bucket out and its sum back without holding the autograd thread (pinned
    memory, an event, a stream of its own): the sums still land in the buckets DDP handed over."""
    from ports import free_port

    out = str(tmp_path / "c")
    mp.start_processes(cuda_process, args=(3, free_port(), out), nprocs=3, start_method="spawn")
    for rank in range(2):
        result = torch.load(f"{out}.{rank}", weights_only=False)
        assert result["got"] == [(True, True)] * len(result["sums"])
        for n, t in zip(SIZES, result["sums"]):
            torch.testing.assert_close(t, buffer(0, n) + buffer(1, n), rtol=1e-12, atol=1e-15)
        bf16 = (buffer(0, 4097, torch.bfloat16).double() + buffer(1, 4097, torch.bfloat16).double()).to(torch.bfloat16)
        torch.testing.assert_close(result["sums"][-1], bf16, rtol=1e-2, atol=1e-2)
