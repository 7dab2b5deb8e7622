"""Gradient reduction strategies on gloo, measured and modelled (Herring [003] §III-IV; issue 10 item 5).

Four gloo processes stand for 2 nodes x 2 GPUs (each gets a DistEnv with local_world_size=2, so the
hierarchical and PS reductions form their node groups as on a cluster). They average the gradients (the
1/W on the loss where a hook reduces, as the driver has it in fp32/bf16) of a model with BERT-large's 302
gradient tensors (Herring's 398 with Q, K, V fused), every dimension divided by --scale (hidden 1024, FFN
4096, vocabulary 30528, positions 512; 24 layers kept): 1/scale^2 of the bytes, the same tensor mix and,
since the bucket cap is scaled with it, the same number of buckets as BERT-large at 25 MB. The backward pass
is trivial (loss = sum_i c_i·sum(p_i)), so a step is the reduction, as the training driver runs it:
`apply_ddp` (GRAD_BUCKETS: ddp or balanced) + `install_clipping(..., reduce=build_reduce(...))`, for every
name in `REDUCTIONS` at run time but `ps` (`timed_variants`), both bucketings, and bf16 communication.
Variants take turns: --rounds rounds of --steps timed steps each, so that load from other processes on a
shared machine hits every variant alike. Each variant's model and wrapper are built once, in the first round,
and warmed up then (until 2026-11-23 they were rebuilt every round, and a dropped balanced wrapper was never freed
until its hooks held it weakly: 16 rounds ran a rank out of memory).

Recorded per variant: every step's time, their median and the fastest, and the CPU seconds all ranks spent
(every thread: the work, which other load moves less than the wall time); bytes sent per rank *computed* from
the bucket sizes with each algorithm's formula (`bert.balance.lab.comm_model`, not counted on the wire);
the α-β prediction for this run from α, β fitted to timed gloo allreduces of two sizes and γ from a timed
local add (the fastest of 9 each: the least disturbed by other load; compare the model with the fastest
step); then the model for BERT-large (336M fp32 gradients, one buffer) on 8...1024 A100s and H100s. Also the bucket-size
spread of DDP's buckets against balanced fusion buffers for the real BERT-large (meta device).

    .venv/bin/python bench/comm.py                # writes results/bench/comm.json and comm.png
    .venv/bin/python bench/comm.py --scale 2 --steps 3
    .venv/bin/python bench/comm.py --only flat/ddp,hierarchical/ddp --rounds 8 --out /tmp/c.json --plot /tmp/c.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bert.balance.lab.comm_model import CLUSTERS, STRATEGIES, Cluster, Link, base_strategy, predict
from bert.config import from_flat
from bert.dist.clip import install_clipping
from bert.dist.ddp import GRAD_BUCKETS, apply_ddp
from bert.dist.env import DistEnv
from bert.dist.fusion import MB, balanced_bounds, bucket_count, ddp_bucket_bytes
from bert.dist.reduce import REDUCTIONS, build_reduce
from bert.model.config import NAMED, pad_vocab
from bert.model.pretraining import BertForPreTraining, shapes_only
from bert.synthetic import random_batch

ROOT = Path(__file__).resolve().parents[1]
GPUS = [8, 16, 32, 64, 128, 256, 512, 1024]
LARGE = NAMED["large"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--local-world", type=int, default=2, help="ranks per simulated node")
    p.add_argument("--scale", type=int, default=4, help="divide BERT-large's dimensions by this")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="at full BERT-large size; scaled with the bytes")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=4, help="rounds; every variant is timed in each, in turn")
    p.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help="comma-separated variants to time (as named in the JSON, e.g. flat/ddp,hierarchical/ddp)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (DDP and fusion fix their order in step 2)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "comm.json")
    p.add_argument("--plot", type=Path, default=ROOT / "results" / "bench" / "comm.png")
    return p.parse_args(argv)


def ready_order_names(model: nn.Module) -> list[str]:
    """`model`'s parameter names in the order the backward pass produces their gradients. Measured on a
    2-layer BERT of the same structure (on the CPU, in a second), then repeated for every layer."""
    tiny = BertForPreTraining(NAMED["tiny"])
    names = {p: n for n, p in tiny.named_parameters()}
    order: list[str] = []
    for p in tiny.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[p]))
    tiny(random_batch([16, 9], vocab_size=1000)).loss.backward()
    head = [n for n in order if ".layer." not in n and "embeddings" not in n]
    layer = [n.replace("layer.1.", "layer.{}.") for n in order if ".layer.1." in n]
    tail = [n for n in order if "embeddings" in n]
    layers = model.config.num_hidden_layers
    out = head + [n.format(i) for i in reversed(range(layers)) for n in layer] + tail
    assert sorted(out) == sorted(n for n, _ in model.named_parameters()), "BERT's parameter names changed"
    return out


def bucket_report(cap_mb: float) -> dict:
    """DDP's buckets (as `apply_ddp` builds them: cap `cap_mb`, after its rebuild in gradient-ready order)
    against balanced fusion buffers, for the real BERT-large in fp32."""
    model = shapes_only(LARGE)
    shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())
    order = ready_order_names(model)
    ddp = ddp_bucket_bytes([shapes[n] for n in order], 4, cap_mb)
    total = sum(ddp)
    bounds = balanced_bounds(total // 4, bucket_count(total, cap_mb * MB))
    balanced = [4 * (b - a) for a, b in zip(bounds, bounds[1:])]
    return {"model": "BERT-large", "tensors": len(shapes), "params": total // 4, "cap_mb": cap_mb,
            "ddp": {"buckets": len(ddp), "max_bytes": max(ddp), "min_bytes": min(ddp), "spread": max(ddp) / min(ddp),
                    "bytes": ddp},
            "balanced": {"buckets": len(balanced), "max_bytes": max(balanced), "min_bytes": min(balanced),
                         "spread": max(balanced) / min(balanced)}}


def scaled_config(scale: int):
    return replace(LARGE, hidden_size=LARGE.hidden_size // scale, intermediate_size=LARGE.intermediate_size // scale,
                   vocab_size=pad_vocab(LARGE.vocab_size // scale), real_vocab_size=LARGE.vocab_size // scale,
                   num_attention_heads=max(1, LARGE.num_attention_heads // scale),
                   max_position_embeddings=LARGE.max_position_embeddings // scale)


class Gradients(nn.Module):
    """The scaled BERT's parameters, registered in BERT's order; loss = sum_i c_i·sum(p_i)."""

    def __init__(self, shapes: list[tuple[int, ...]], rank: int):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
        self.cs = [1.0 + rank + i / len(shapes) for i in range(len(shapes))]

    def forward(self, _: None = None) -> torch.Tensor:
        return sum(p.sum() * c for p, c in zip(self.ps, self.cs))


def uptime() -> str:
    """What `uptime` says: the load averages over 1, 5 and 15 minutes (other agents share the host)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` calls: on a shared machine the minimum is the least disturbed."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def fit_local_link(world: int) -> dict:
    """α, β of the local gloo ring from allreduces of 4 KiB and 8 MiB (fastest of 9 each); γ from a local add."""
    sizes = [1024, 2 * 1024 * 1024]  # float32 elements
    t = [timed(lambda n=n: dist.all_reduce(torch.ones(n)), 9) for n in sizes]
    a, b = torch.ones(sizes[1]), torch.ones(sizes[1])
    gamma = timed(lambda: a.add_(b), 9) / (4 * sizes[1])
    # ring: t = 2(p-1)·α + (p-1)/p·n·(2β + γ); two sizes give β, then α
    k = (world - 1) / world
    beta = ((t[1] - t[0]) / (k * 4 * (sizes[1] - sizes[0])) - gamma) / 2
    alpha = max(0.0, (t[0] - k * 4 * sizes[0] * (2 * beta + gamma)) / (2 * (world - 1)))
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "gamma_s_per_byte": gamma, "allreduce_s": dict(zip(sizes, t))}


def timed_step(step) -> tuple[float, float]:
    """(this rank's seconds, CPU seconds of all ranks and all their threads) of one step. The CPU time is
    the work itself: on an oversubscribed host it moves far less with other load than the wall time does."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    step()
    wall, cpu = time.perf_counter() - start, torch.tensor([time.process_time() - start_cpu])
    dist.all_reduce(cpu)
    return wall, float(cpu)


def timed_variants() -> list[tuple[str, str, str]]:
    """(GRAD_REDUCE, GRAD_BUCKETS, GRAD_COMM_DTYPE) to time: every registered reduction but `ps`, whose server
    processes this in-process bench does not start (tests/test_ps.py checks it; the model prices it), on both
    bucketings in fp32, and each in bf16 on DDP's buckets."""
    names = [r for r in REDUCTIONS if r != "ps"]
    return [(r, b, "fp32") for r in names for b in GRAD_BUCKETS] + [(r, "ddp", "bf16") for r in names]


def worker(rank: int, args: argparse.Namespace, shapes: list, cap_mb: float, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world)
    env = DistEnv(rank, args.world, rank % args.local_world, args.local_world, "localhost", 0)
    fit = fit_local_link(args.world)
    variants = [v for v in timed_variants() if not args.only or variant_key(*v) in args.only]
    reduces: dict = {}  # one Reduce (and its process groups) per strategy and dtype, as a training run builds it
    steps: dict = {}  # one model and wrapper per variant, built in the first round and kept, as in training
    results: dict = {}
    # Rounds: every variant takes its turn in each, so a burst of load on the shared machine hits all alike.
    for _ in range(args.rounds):
        for reduce_name, buckets, comm_dtype in variants:
            key = variant_key(reduce_name, buckets, comm_dtype)
            if key not in steps:
                steps[key] = build_variant(args, rank, env, shapes, cap_mb, reduces, results, reduce_name, buckets,
                                           comm_dtype)
            run = results[key]
            for _ in range(args.steps):
                wall, cpu = timed_step(steps[key])
                run["step_s"].append(wall)
                run["step_cpu_s"].append(cpu)
    if rank == 0:
        torch.save({"fit": fit, "runs": results}, out)
    dist.destroy_process_group()


def build_variant(args: argparse.Namespace, rank: int, env: DistEnv, shapes: list, cap_mb: float, reduces: dict,
                  results: dict, reduce_name: str, buckets: str, comm_dtype: str):
    """The step of one variant (model, wrapper, hook), run --warmup times; its entry in `results`."""
    cfg = from_flat(grad_reduce=reduce_name, grad_buckets=buckets, bucket_cap_mb=cap_mb, grad_comm_dtype=comm_dtype)
    if (reduce_name, comm_dtype) not in reduces:
        reduces[reduce_name, comm_dtype] = build_reduce(cfg.dist, env)
    model = Gradients(shapes, rank)
    wrapper = apply_ddp(model, cfg.dist)
    # the mean's 1/W on the loss, as the driver in fp32/bf16 (bert.dist.reduce.mean_placement)
    clipper = install_clipping(wrapper, "none", 1.0, None, reduce=reduces[reduce_name, comm_dtype], mean_at="loss")

    def step() -> None:
        (wrapper() * clipper.loss_factor).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if buckets == "ddp":
        sizes = [b.buffer().numel() for b in wrapper.reducer._get_zeros_like_grad_buckets()]
    else:
        sizes = [b.numel() for b in wrapper.buffers]
    name = reduce_name if comm_dtype == "fp32" else f"{reduce_name}+{comm_dtype}"  # bf16: 2-byte model
    results[variant_key(reduce_name, buckets, comm_dtype)] = {"reduce": name, "buckets": buckets,
                                                              "bucket_elements": sizes, "step_s": [], "step_cpu_s": []}
    return step


def variant_key(reduce_name: str, buckets: str, comm_dtype: str) -> str:
    """"flat/ddp", "hierarchical+bf16/ddp": how a timed variant is named in the JSON and on --only."""
    return f"{reduce_name}/{buckets}" if comm_dtype == "fp32" else f"{reduce_name}+{comm_dtype}/{buckets}"


def ratios_to_flat(runs: dict, steps: int) -> dict:
    """Each non-flat run's step time over the flat run on the same buckets and dtype: of the medians, and
    per round (mean over mean of the steps both took in that round, so both saw the same load)."""
    out = {}
    for key, r in runs.items():
        flat_key = key.replace(base_strategy(r["reduce"]), "flat", 1)
        if flat_key == key or flat_key not in runs:
            continue
        out[key] = {"vs": flat_key}
        for name, series in (("", "step_s"), ("cpu_", "step_cpu_s")):
            mine, flat = r[series], runs[flat_key][series]
            out[key][f"{name}median"] = statistics.median(mine) / statistics.median(flat)
            out[key][f"{name}per_round"] = [statistics.mean(mine[i:i + steps]) / statistics.mean(flat[i:i + steps])
                                            for i in range(0, min(len(mine), len(flat)), steps)]
    return out


def predictions(params: int) -> dict:
    """BERT-large's gradient, one buffer, every modelled strategy and registered name, on A100 and H100."""
    names = list(dict.fromkeys([*STRATEGIES, *REDUCTIONS]))
    return {cluster: {name: [asdict(predict(name, params, g, c)) | {"gpus": g} for g in GPUS] for name in names}
            for cluster, c in CLUSTERS.items()}


def plot(model: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, cluster in zip(axes, CLUSTERS):
        for name, rows in model[cluster].items():
            ax.plot([r["gpus"] for r in rows], [r["seconds"] * 1e3 for r in rows], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="predicted reduction time (ms)",
               title=f"BERT-large gradient, {CLUSTERS[cluster].name}")
        ax.set_xticks(GPUS, [str(g) for g in GPUS])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    for name, rows in model["A100"].items():  # from 2 nodes on: one node sends nothing over the network
        rows = [r for r in rows if r["gpus"] > CLUSTERS["A100"].gpus_per_node]
        ax.plot([r["gpus"] for r in rows], [r["inter_bytes_per_gpu"] / 1e6 for r in rows], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="MB sent over the network per GPU",
           title="network bytes per GPU, fp32 (8 GPUs per node)")
    ax.set_xticks(GPUS[1:], [str(g) for g in GPUS[1:]])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = set(args.only or ()) - {variant_key(*v) for v in timed_variants()}
    if unknown:
        raise SystemExit(f"--only: unknown variant(s) {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(variant_key(*v) for v in timed_variants())}")
    report = bucket_report(args.bucket_cap_mb)
    scaled = shapes_only(scaled_config(args.scale))
    shapes = [tuple(p.shape) for p in scaled.parameters()]
    params = sum(p.numel() for p in scaled.parameters())
    cap_mb = args.bucket_cap_mb * params / report["params"]  # as many buckets as BERT-large has
    load_before = os.getloadavg()[0]
    uptime_before = uptime()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(worker, args=(args, shapes, cap_mb, os.path.join(tmp, "store"), out), nprocs=args.world)
        raw = torch.load(out)
    fit = raw["fit"]
    local = Cluster("local gloo", args.local_world, Link("gloo", fit["alpha_s"], 1 / fit["beta_s_per_byte"]),
                    Link("gloo", fit["alpha_s"], 1 / fit["beta_s_per_byte"]), fit["gamma_s_per_byte"])
    runs = {}
    for key, r in raw["runs"].items():
        per_bucket = [predict(r["reduce"], n, args.world, local) for n in r["bucket_elements"]]
        runs[key] = {**{k: v for k, v in r.items() if k != "bucket_elements"},
                     "median_step_ms": statistics.median(r["step_s"]) * 1e3,
                     "min_step_ms": min(r["step_s"]) * 1e3,
                     "median_step_cpu_ms": statistics.median(r["step_cpu_s"]) * 1e3,
                     "buckets_count": len(r["bucket_elements"]),
                     "bucket_mb_max_min": [max(r["bucket_elements"]) * 4 / MB, min(r["bucket_elements"]) * 4 / MB],
                     "bytes_sent_per_rank": sum(p.bytes_per_gpu for p in per_bucket),
                     "predicted_step_ms": sum(p.seconds for p in per_bucket) * 1e3,
                     "modelled_as": base_strategy(r["reduce"])}
    ratios = ratios_to_flat(runs, args.steps)
    model = predictions(report["params"])
    print(f"BERT-large buckets at {args.bucket_cap_mb:g} MB, fp32 ({report['tensors']} tensors, "
          f"{report['params'] / 1e6:.1f}M parameters):")
    for kind in ("ddp", "balanced"):
        b = report[kind]
        print(f"  {kind:<9}{b['buckets']:>4} buckets, max {b['max_bytes'] / MB:7.2f} MB, "
              f"min {b['min_bytes'] / MB:7.2f} MB, max/min {b['spread']:.2f}")
    print(f"\n{args.world} gloo processes as {args.world // args.local_world} nodes x {args.local_world}, "
          f"BERT-large / {args.scale} ({params / 1e6:.2f}M parameters, {params * 4 / MB:.1f} MB), cap {cap_mb:.2f} MB, "
          f"load {load_before:.1f}; fit: alpha {fit['alpha_s'] * 1e6:.0f} us, "
          f"{1e-9 / fit['beta_s_per_byte']:.2f} GB/s, gamma {1e-9 / fit['gamma_s_per_byte']:.2f} GB/s")
    print(f"{'reduce/buckets':<24}{'buckets':>8}{'max/min MB':>14}{'ms/step':>10}{'min ms':>9}{'CPU ms':>9}"
          f"{'model ms':>10}{'MB sent/rank':>14}")
    for key, r in runs.items():
        mx, mn = r["bucket_mb_max_min"]
        print(f"{key:<24}{r['buckets_count']:>8}{mx:>8.2f}/{mn:<5.2f}{r['median_step_ms']:>10.1f}{r['min_step_ms']:>9.1f}"
              f"{r['median_step_cpu_ms']:>9.1f}{r['predicted_step_ms']:>10.1f}{r['bytes_sent_per_rank'] / MB:>14.1f}")
    for key, r in ratios.items():
        for name, what in (("", "step"), ("cpu_", "CPU time per step, all ranks")):
            print(f"{key}: {r[name + 'median']:.2f}x flat's median {what} "
                  f"(rounds: {', '.join(f'{x:.2f}' for x in r[name + 'per_round'])})")
    print(f"\nModel, BERT-large fp32 gradient in one buffer ({report['params'] / 1e6:.0f}M parameters):")
    print(f"{'cluster':<8}{'strategy':<16}" + "".join(f"{g:>9}" for g in GPUS) + "   (ms; last: network MB/GPU)")
    for cluster, by_name in model.items():
        for name, rows in by_name.items():
            print(f"{cluster:<8}{name:<16}" + "".join(f"{r['seconds'] * 1e3:>9.1f}" for r in rows)
                  + f"   {rows[-1]['inter_bytes_per_gpu'] / 1e6:.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "setup": {"world": args.world, "local_world": args.local_world, "scale": args.scale, "params": params,
                  "bucket_cap_mb_scaled": cap_mb, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                  "backend": "gloo",
                  "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
                  "uptime_before": uptime_before, "uptime_after": uptime(),
                  "bytes_sent": "computed from bucket sizes with bert.balance.lab.comm_model's formulas, not counted"},
        "bert_large_buckets": report,
        "local_fit": fit,
        "runs": runs,
        "ratio_to_flat": ratios,
        "model": {"clusters": {k: asdict(c) for k, c in CLUSTERS.items()}, "params": report["params"],
                  "predictions": model},
    }, indent=1) + "\n")
    plot(model, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
