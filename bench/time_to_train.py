"""Time to train on a cluster: a step-time model, calibrated once per GPU type, checked on published results.

    time_to_train = samples_to_converge(GBS) / GBS x step + evaluations       (MLPerf times from run_start)
    step          = local_batch x c x imbalance + exposed all-reduce + optimizer

c is one GPU's compute seconds per sample with perfect balance. It comes from ONE published result
per GPU type (NVIDIA's 1 x DGX A100 and 1 x DGX H100, solved for c through this same model), from a
per-GPU training rate (--rate), or from a `bench/model.py` JSON (--model-json). Every other published
point is then predicted, not fitted, and its error printed. The terms:

    samples_to_converge  the RCP mean of [MLPerf-logging]'s own rcps_bert.json (ruleset 5.0.0), pruned and
                         linearly interpolated between batch sizes exactly as its rcp_checker does
    imbalance            the load-balance lab's simulation (`bert.balance.lab.simulate`): the most-loaded
                         GPU's tokens / the mean, for the strategy, GPU count and local batch (compute is
                         taken as proportional to tokens)
    all-reduce           α-β (`bert.balance.lab.exchange_model`, Herring [003] §IV) of BERT-large's fp16/bf16
                         gradient: flat = one ring over every GPU at the per-GPU InfiniBand share;
                         hierarchical = reduce-scatter in the node (NVLink), all-reduce of 1/8 across nodes,
                         all-gather in the node. `overlap` of it hides behind the backward (2/3 of compute)
    optimizer            LAMB/Adam is memory bound: bytes per parameter / HBM bandwidth; sharded divides it by N
                         (reduce-scatter + all-gather move what one all-reduce moves, so comm is unchanged)
    evaluations          one per eval interval, 10,000 samples split over the GPUs, forward only (c / 3)

    .venv/bin/python bench/time_to_train.py                        # table, JSON, PNG
    .venv/bin/python bench/time_to_train.py --rate 631 --system H100   # your measured rate per H100
    .venv/bin/python bench/time_to_train.py --model-json results/bench/model_cuda.json --system H100
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

from bert.balance import STRATEGIES
from bert.balance.lab.exchange_model import NVLINK, Link, modelled_all_gather_seconds

ROOT = Path(__file__).resolve().parents[1]

BERT_LARGE_PARAMETERS = 335_000_000  # BERT-large with the 30528-row embedding (what MLPerf trains)
GRADIENT_BYTES = 2 * BERT_LARGE_PARAMETERS  # fp16/bf16 gradient all-reduce
# LAMB/Adam per parameter: fp32 weight, m, v read and written (24 B), fp32 gradient read (4), the 16-bit
# weight copy written (2), and LAMB's second pass over the update and weight for the trust ratio (~6).
OPTIMIZER_BYTES_PER_PARAMETER = 36
HBM_EFFICIENCY = 0.8  # share of peak HBM bandwidth an elementwise fused kernel reaches (assumed)
EVAL_SAMPLES = 10_000
EVAL_COST = 1 / 3  # forward only: a training step is forward + backward = 3 forwards
BACKWARD_SHARE = 2 / 3  # the part of compute the all-reduce can hide behind
DEFAULT_OVERLAP = 0.8  # DDP buckets: all but the last buckets' all-reduce runs during the backward (assumed)
REDUCES = ("flat", "hierarchical")
OPTIMIZERS = ("replicated", "sharded")
BALANCES = (*STRATEGIES, "packing")  # packing: the lab's simulation of pre-packed data (NVIDIA's packed configs)
RCP_RULESET = "5.0.0"
MAX_GBS = 16384  # the largest RCP: above it the rcp_checker says "Missing RCP"


class BadInput(ValueError):
    """A setting the model cannot use: reported as one line, exit 2."""


@dataclass(frozen=True)
class System:
    """One GPU type in its DGX node; link and memory figures are vendor numbers, not measurements."""

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    hbm_bytes_per_s: float


SYSTEMS = {
    # DGX A100: NVLink3 (NCCL ~240 GB/s per GPU), 8 x HDR 200 Gb/s NICs = 25 GB/s per GPU, A100-80GB HBM2e 2.0 TB/s.
    "A100": System("A100", 8, NVLINK, Link("HDR InfiniBand, 1 NIC per GPU", 6e-6, 25e9), 2.0e12),
    # DGX H100: NVLink4 (NCCL ~360 GB/s per GPU), 8 x NDR 400 Gb/s NICs = 50 GB/s per GPU, H100-SXM HBM3 3.35 TB/s.
    "H100": System("H100", 8, Link("NVLink4-class", 2e-6, 360e9), Link("NDR InfiniBand, 1 NIC per GPU", 6e-6, 50e9),
                   3.35e12),
}  # fmt: skip


@dataclass(frozen=True)
class Technique:
    balance: str = "global"  # a bert.balance strategy, or "packing"
    reduce: str = "flat"  # flat | hierarchical
    optimizer: str = "replicated"  # replicated | sharded
    overlap: float = DEFAULT_OVERLAP  # share of the all-reduce that may hide behind the backward

    def check(self) -> Technique:
        if self.balance not in BALANCES:
            raise BadInput(f"unknown balance strategy {self.balance!r}; choose one of {', '.join(BALANCES)}")
        if self.reduce not in REDUCES:
            raise BadInput(f"unknown reduction {self.reduce!r}; choose one of {', '.join(REDUCES)}")
        if self.optimizer not in OPTIMIZERS:
            raise BadInput(f"unknown optimizer placement {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if not 0.0 <= self.overlap <= 1.0:
            raise BadInput(f"overlap {self.overlap} is not in [0, 1]")
        return self

    @property
    def label(self) -> str:
        return f"{self.balance}/{self.reduce}/{self.optimizer}"


@dataclass(frozen=True)
class Run:
    """What one time-to-train prediction needs besides the technique."""

    system: str
    gpus: int
    local_batch: int  # sequences per GPU per optimizer step (BATCHSIZE x GRADIENT_STEPS)
    samples: float  # samples to converge
    eval_interval: int

    @property
    def gbs(self) -> int:
        return self.gpus * self.local_batch


def get_system(name: str) -> System:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise BadInput(f"unknown system {name!r}; choose one of {', '.join(SYSTEMS)}") from None


# ---------------------------------------------------------------------------------------------- the terms


def allreduce_seconds(nbytes: float, gpus: int, reduce: str, system: System) -> float:
    """α-β time of an all-reduce of `nbytes` (a reduce-scatter and an all-gather cost the same)."""
    g = system.gpus_per_node
    if gpus <= g:  # one node: both are a ring over NVLink
        return 2 * modelled_all_gather_seconds(nbytes, gpus, system.intra)
    if reduce == "flat":
        return 2 * modelled_all_gather_seconds(nbytes, gpus, system.inter)
    nodes = gpus // g
    in_node = modelled_all_gather_seconds(nbytes, g, system.intra)
    return 2 * in_node + 2 * modelled_all_gather_seconds(nbytes / g, nodes, system.inter)


def optimizer_seconds(system: System, gpus: int, optimizer: str) -> float:
    """One LAMB/Adam step over BERT-large, memory bound; sharded, each GPU updates 1/N of it."""
    seconds = BERT_LARGE_PARAMETERS * OPTIMIZER_BYTES_PER_PARAMETER / (HBM_EFFICIENCY * system.hbm_bytes_per_s)
    return seconds / gpus if optimizer == "sharded" else seconds


@cache
def imbalance(balance: str, gpus: int, gpus_per_node: int, local_batch: int, seed: int = 0) -> float:
    """Most-loaded GPU's tokens / mean tokens, from the load-balance lab (Wikipedia phase-2 mix)."""
    import numpy as np

    from bert.balance import get_strategy
    from bert.balance.lab.length_pmf import LengthPMF
    from bert.balance.lab.simulate import pack, simulate, simulate_packing
    from bert.lengths import WIKI_PHASE2

    if gpus == 1:
        return 1.0
    pmf = LengthPMF.from_mix(WIKI_PHASE2)
    rng = np.random.default_rng(seed)
    trials = max(50, 400_000 // (gpus * local_batch))  # ~400k sequences per point
    if balance == "packing":
        packed = pack(pmf)
        packs = max(1, round(local_batch / packed.ratio))
        spread = simulate_packing(packed, gpus, packs, trials, rng)
    else:
        spread = simulate(get_strategy(balance), pmf, gpus, gpus_per_node, local_batch, trials, rng)
    return spread.avg_max / spread.mean


@dataclass(frozen=True)
class Prediction:
    minutes: float
    step_s: float
    compute_s: float  # the most-loaded GPU's forward + backward
    comm_s: float  # the whole all-reduce
    exposed_comm_s: float  # what the backward does not hide
    optimizer_s: float
    train_s: float
    eval_s: float
    steps: float
    evals: float
    imbalance: float
    samples_per_s: float


def predict(c: float, run: Run, tech: Technique, imbalance_factor: float | None = None) -> Prediction:
    """Time to train with `c` compute seconds per sample per GPU (see the module docstring)."""
    system = get_system(run.system)
    imb = imbalance_factor if imbalance_factor is not None else imbalance(
        tech.balance, run.gpus, system.gpus_per_node, run.local_batch)  # fmt: skip
    compute = run.local_batch * c * imb
    comm = allreduce_seconds(GRADIENT_BYTES, run.gpus, tech.reduce, system) if run.gpus > 1 else 0.0
    exposed = comm - min(tech.overlap * comm, BACKWARD_SHARE * compute)
    opt = optimizer_seconds(system, run.gpus, tech.optimizer)
    step = compute + exposed + opt
    steps = run.samples / run.gbs
    evals = run.samples / run.eval_interval  # expected count: the run stops at the eval that reaches the target
    eval_s = evals * EVAL_SAMPLES / run.gpus * c * EVAL_COST
    train_s = steps * step
    total = train_s + eval_s
    return Prediction(total / 60, step, compute, comm, exposed, opt, train_s, eval_s, steps, evals, imb,
                      run.samples / total)  # fmt: skip


def calibrate(minutes: float, run: Run, tech: Technique) -> float:
    """The c for which `predict` gives `minutes` (time to train rises with c, so bisect)."""
    imb = imbalance(tech.balance, run.gpus, get_system(run.system).gpus_per_node, run.local_batch)
    lo, hi = 0.0, 10.0
    if predict(lo, run, tech, imb).minutes >= minutes:
        raise BadInput(f"{minutes} min is faster than communication and optimizer alone allow at {run.gpus} GPUs")
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(mid, run, tech, imb).minutes < minutes else (lo, mid)
    return (lo + hi) / 2


def c_from_rate(rate: float, local_batch: int, system: System) -> float:
    """c from one GPU's training rate (samples/s) at `local_batch`, whose step includes a replicated optimizer."""
    if not rate > 0:
        raise BadInput(f"rate {rate} samples/s is not positive")
    step = local_batch / rate
    opt = optimizer_seconds(system, 1, "replicated")
    if step <= opt:
        raise BadInput(f"rate {rate} samples/s at batch {local_batch} leaves no time beyond the optimizer step")
    return (step - opt) / local_batch


def rate_from_model_json(path: Path) -> tuple[float, int, str]:
    """(BERT-large samples/s, batch, note) from a bench/model.py JSON: its fastest unpadded variant, scaled by
    matmul FLOPs to BERT-large when the bench ran a smaller model (the CPU default is 2 layers, BERT-base width)."""
    if not path.is_file():
        raise BadInput(f"model JSON {path} does not exist")
    try:
        report = json.loads(path.read_text())
        unpadded = [r for r in report["results"] if r["variant"].startswith("unpadded")]
        lengths, masked = report["batch_lengths"], report["masked_tokens"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise BadInput(f"model JSON {path} is not a bench/model.py result ({type(err).__name__}: {err})") from None
    if not unpadded:
        raise BadInput(f"model JSON {path} has no unpadded result to take the rate from")
    best = max(unpadded, key=lambda r: r["samples_per_s"])
    from bert.model.config import NAMED
    from bert.model.flops import StepShape, train_flops

    # BERT-large run as the bench ran its model: with the last-layer subset or without (JSONs from before it: without)
    large = train_flops(NAMED["large"], StepShape.unpadded(lengths, masked, bool(best.get("last_layer_subset"))))
    scale = best["flops_per_step"] / large
    note = f"{path}: {best['variant']} {best['samples_per_s']:.4g} samples/s on {report['device']}"
    if scale < 0.999:
        note += f", x {scale:.4g} (matmul FLOPs of its model / BERT-large's)"
    return best["samples_per_s"] * scale, len(lengths), note


# ---------------------------------------------------------------------------------------------- RCPs


@dataclass(frozen=True)
class RCPTable:
    path: str
    points: dict[int, float]  # pruned RCP means by batch size, as the rcp_checker uses them
    full: dict[int, float]

    def samples(self, gbs: int) -> tuple[float, str]:
        """Samples to converge at `gbs` and how it was found (the rcp_checker's rule, `check_directory`)."""
        if gbs in self.points:
            return self.points[gbs], "RCP found"
        below = [b for b in self.points if b < gbs]
        above = [b for b in self.points if b > gbs]
        if below and above:
            lo, hi = max(below), min(above)
            mean = self.points[lo] + (self.points[hi] - self.points[lo]) * (gbs - lo) / (hi - lo)
            return mean, f"interpolated {lo}..{hi}"
        if above:
            return self.points[min(above)], f"smallest RCP ({min(above)})"
        raise BadInput(f"no RCP at or above global batch {gbs} (the largest is {max(self.points)}): Missing RCP")


@cache
def load_rcps(ruleset: str = RCP_RULESET) -> RCPTable:
    """BERT's RCPs from the installed mlperf-logging, pruned by its own RCP_Checker."""
    import logging

    from mlperf_logging.rcp_checker import rcp_checker

    logging.getLogger().setLevel(logging.WARNING)
    checker = rcp_checker.RCP_Checker("training", ruleset, "bert", verbose=False)
    path = Path(checker._construct_json_filename("training", ruleset, "bert"))
    path = path.relative_to(Path(rcp_checker.__file__).parents[2])  # mlperf_logging/rcp_checker/...: no site path
    pruned = {int(r["BS"]): float(r["RCP Mean"]) for r in checker.pruned_rcp_data.values()}
    full = {int(r["BS"]): float(r["RCP Mean"]) for r in checker.rcp_data.values()}
    return RCPTable(str(path), dict(sorted(pruned.items())), dict(sorted(full.items())))


def rules_eval_interval(gbs: int) -> int:
    """The rules' evaluation interval in samples: FLOOR(0.05 x (230.23 x GBS + 3,000,000), 25,000)."""
    return math.floor(0.05 * (230.23 * gbs + 3_000_000) / 25_000) * 25_000


# ---------------------------------------------------------------------------------------------- published results


@dataclass(frozen=True)
class Published:
    """A published MLPerf BERT result [MLPerf-results] (olympic mean of 10 runs) and the techniques its code ran."""

    name: str
    system: str
    gpus: int
    local_batch: int  # sequences per GPU (packed configs: packs x 2)
    gbs: int
    minutes: float
    samples: float  # mean samples trained, as published
    tech: Technique
    calibration: bool = False


# NVIDIA: exchange padding (global) or packed data, DistributedFusedLAMB (sharded, reductions after the
# backward unless --dwu-overlap-reductions), NCCL's intra/inter-node reduction (hierarchical).
# Samsung: stratified + node presort + snake, DDP all-reduce overlapped with the backward, replicated Adam.
_NV = Technique("global", "hierarchical", "sharded", 0.0)
PUBLISHED = (
    Published("v2.1 NVIDIA 1xDGX A100", "A100", 8, 56, 448, 16.88, 2.46e6, _NV, calibration=True),
    Published("v2.1 NVIDIA 8xDGX A100", "A100", 64, 48, 3072, 2.50, 2.73e6, _NV),
    Published("v2.0 NVIDIA 128xDGX A100 (packed)", "A100", 1024, 4, 4096, 0.421, 2.79e6,
              replace(_NV, balance="packing")),
    Published("v2.0 Samsung 128xDGX A100", "A100", 1024, 16, 16384, 0.372, 2.93e6,
              Technique("samsung", "flat", "replicated", DEFAULT_OVERLAP)),
    Published("v3.0 NVIDIA 1xDGX H100 (packed)", "H100", 8, 96, 768, 5.47, 2.52e6, replace(_NV, balance="packing"),
              calibration=True),
    Published("v3.0 NVIDIA 8xDGX H100", "H100", 64, 72, 4608, 0.898, 2.88e6, _NV),
    Published("v3.1 NVIDIA 434xDGX H100 (packed)", "H100", 3472, 4, 13888, 0.119, 5.46e6,
              Technique("packing", "hierarchical", "sharded", DEFAULT_OVERLAP)),
)  # fmt: skip
# Issue 9: this harness's driver as config_DGXH100_1x8x96x1.sh ran it on 2026-11-23 (bf16 weights, fp32 masters, LAMB,
# eager), batch 96, one H100, the whole step: results/bench/train_gpu_cuda_bf16.json (540 before master weights).
# The config now compiles the model and the update: 800 on an H200 (train_gpu_h200_compiled-opt.json), not yet
# measured on an H100, so the H100 figure stays the measured one.
OUR_H100_RATE = 631.0


def calibrations() -> dict[str, float]:
    """c per GPU type, each from its single calibration result (with the samples it published)."""
    out = {}
    for p in PUBLISHED:
        if p.calibration:
            run = Run(p.system, p.gpus, p.local_batch, p.samples, rules_eval_interval(p.gbs))
            out[p.system] = calibrate(p.minutes, run, p.tech)
    return out


def validate(cs: dict[str, float], rcps: RCPTable) -> dict:
    rows = []
    for p in PUBLISHED:
        interval = rules_eval_interval(p.gbs)
        rcp, how = rcps.samples(p.gbs)
        with_rcp = predict(cs[p.system], Run(p.system, p.gpus, p.local_batch, rcp, interval), p.tech)
        with_pub = predict(cs[p.system], Run(p.system, p.gpus, p.local_batch, p.samples, interval), p.tech)
        rows.append({**{k: v for k, v in asdict(p).items() if k != "tech"}, "technique": asdict(p.tech),
                     "rcp_samples": rcp, "rcp": how, "predicted_min_rcp": with_rcp.minutes,
                     "predicted_min_published_samples": with_pub.minutes,
                     "error_rcp": with_rcp.minutes / p.minutes - 1,
                     "error_published_samples": with_pub.minutes / p.minutes - 1,
                     "step_ms": with_pub.step_s * 1e3, "imbalance": with_pub.imbalance})  # fmt: skip
    checked = [r for r in rows if not r["calibration"]]

    def mean_abs(key: str) -> float:
        return sum(abs(r[key]) for r in checked) / len(checked)

    summary = {"points": len(checked), "mean_abs_error_rcp": mean_abs("error_rcp"),
               "max_abs_error_rcp": max(abs(r["error_rcp"]) for r in checked),
               "mean_abs_error_published_samples": mean_abs("error_published_samples"),
               "max_abs_error_published_samples": max(abs(r["error_published_samples"]) for r in checked)}  # fmt: skip
    return {"rows": rows, "summary": summary}


# ---------------------------------------------------------------------------------------------- configs and curve


def sourced(config: Path) -> dict[str, str]:
    """The variables a config exports (sourced in a clean bash)."""
    out = subprocess.run(["bash", "-c", f'source "{config}" && env -0'], env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode != 0:
        raise BadInput(f"{config}: sourcing failed: {out.stderr.strip().splitlines()[-1:]}")
    return dict(item.split("=", 1) for item in out.stdout.split("\0") if "=" in item)


def config_rows(paths: list[Path], cs: dict[str, float], rcps: RCPTable, our_c: dict[str, float]) -> list[dict]:
    rows = []
    for path in paths:
        env = sourced(path)
        system = env.get("DGXSYSTEM", "").removeprefix("DGX").split("_")[0]
        get_system(system)
        try:
            gpus = int(env["DGXNNODES"]) * int(env["DGXNGPU"])
            local = int(env["BATCHSIZE"]) * int(env.get("GRADIENT_STEPS", "1"))
            interval = int(env.get("EVAL_ITER_SAMPLES") or rules_eval_interval(gpus * local))
        except (KeyError, ValueError) as err:
            raise BadInput(f"{path}: missing or bad setting ({err})") from None
        # This harness: DDP (overlapped all-reduce), GRAD_REDUCE, replicated optimizer (no sharding setting yet).
        tech = Technique(env.get("BALANCE", "global"), env.get("GRAD_REDUCE", "flat"), "replicated").check()
        samples, how = rcps.samples(gpus * local)
        run = Run(system, gpus, local, samples, interval)
        nv = predict(cs[system], run, tech)
        row = {"config": path.name, "system": system, "gpus": gpus, "local_batch": local, "gbs": run.gbs,
               "eval_interval": interval, "rcp_samples": samples, "rcp": how, "technique": asdict(tech),
               "minutes_published_rate": nv.minutes, "step_ms": nv.step_s * 1e3,
               "imbalance": nv.imbalance, "exposed_comm_ms": nv.exposed_comm_s * 1e3,
               "optimizer_ms": nv.optimizer_s * 1e3, "eval_s": nv.eval_s}  # fmt: skip
        if system in our_c:
            row["minutes_our_rate"] = predict(our_c[system], run, tech).minutes
        rows.append(row)
    return rows


def curve_local_batch(system: str, gpus: int) -> int:
    """The curve's recipe: the calibration's local batch, shrunk so the global batch stays within the RCPs."""
    base = next(p.local_batch for p in PUBLISHED if p.calibration and p.system == system)
    return max(1, min(base, MAX_GBS // gpus))


def curve(cs: dict[str, float], rcps: RCPTable, gpus_list: list[int], balances: list[str],
          overlap: float) -> list[dict]:  # fmt: skip
    rows = []
    for system, c in cs.items():
        for gpus in gpus_list:
            local = curve_local_batch(system, gpus)
            samples, _ = rcps.samples(gpus * local)
            run = Run(system, gpus, local, samples, rules_eval_interval(gpus * local))
            for balance in balances:
                for reduce in REDUCES:
                    for optimizer in OPTIMIZERS:
                        tech = Technique(balance, reduce, optimizer, overlap)
                        p = predict(c, run, tech)
                        rows.append({"system": system, "gpus": gpus, "local_batch": local, "gbs": run.gbs,
                                     "rcp_samples": samples, "technique": tech.label, "minutes": p.minutes,
                                     "step_ms": p.step_s * 1e3, "imbalance": p.imbalance,
                                     "exposed_comm_ms": p.exposed_comm_s * 1e3, "optimizer_ms": p.optimizer_s * 1e3,
                                     "samples_per_s": p.samples_per_s})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------- output


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    systems = list(report["calibration"]["c_s_per_sample"])
    fig, axes = plt.subplots(1, len(systems), figsize=(6.5 * len(systems), 5.2), squeeze=False)
    labels = sorted({r["technique"] for r in report["curve"]})
    balances = sorted({lab.split("/")[0] for lab in labels})
    colors = dict(zip(balances, ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange")))
    for ax, system in zip(axes[0], systems):
        for lab in labels:
            balance, reduce, optimizer = lab.split("/")
            pts = [r for r in report["curve"] if r["system"] == system and r["technique"] == lab]
            ax.plot([r["gpus"] for r in pts], [r["minutes"] for r in pts], color=colors[balance],
                    linestyle="-" if reduce == "hierarchical" else "--",
                    marker="o" if optimizer == "sharded" else "x", markersize=4, linewidth=1.2, label=lab)  # fmt: skip
        for v in report["validation"]["rows"]:
            if v["system"] != system:
                continue
            ax.scatter(v["gpus"], v["minutes"], s=70, facecolors="none", edgecolors="black", zorder=5)
            ax.scatter(v["gpus"], v["predicted_min_rcp"], s=40, marker="*", color="black", zorder=5)
            who = v["name"].split(" ")[1] + (" cal." if v["calibration"] else "")
            offset = (6, -10 if "Samsung" in who else 4)
            ax.annotate(f"{who} {v['error_rcp']:+.0%}", (v["gpus"], v["minutes"]), textcoords="offset points",
                        xytext=offset, fontsize=7)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("predicted time to train (min)")
        ax.set_title(f"{system}: rate from the published 8-GPU result; GBS = GPUs x min(local, 16384/GPUs)",
                     fontsize=8.5)  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].scatter([], [], s=70, facecolors="none", edgecolors="black", label="published (MLPerf)")
    axes[0][0].scatter([], [], s=40, marker="*", color="black", label="predicted for it (RCP samples)")
    axes[0][0].legend(fontsize=7, title="balance/reduce/optimizer", title_fontsize=7, loc="upper right")
    fig.suptitle("BERT time to train: samples_to_converge(GBS) x step / GBS + eval "
                 "(solid: hierarchical, dashed: flat; o: sharded, x: replicated optimizer)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(report: dict) -> None:
    v = report["validation"]
    print("validation against published MLPerf BERT results (c from one calibration per GPU type, no per-point fit)")
    print(f"{'result':36} {'GPUs':>5} {'GBS':>6} {'published':>9} {'pred(RCP)':>9} {'err':>6} "
          f"{'pred(pub.samples)':>17} {'err':>6}")  # fmt: skip
    for r in v["rows"]:
        tag = " (calibration)" if r["calibration"] else ""
        print(f"{r['name'][:36]:36} {r['gpus']:>5} {r['gbs']:>6} {r['minutes']:>9.3f} {r['predicted_min_rcp']:>9.3f} "
              f"{r['error_rcp']:>+6.0%} {r['predicted_min_published_samples']:>17.3f} "
              f"{r['error_published_samples']:>+6.0%}{tag}")  # fmt: skip
    s = v["summary"]
    print(f"error over {s['points']} predicted points: RCP samples mean |err| {s['mean_abs_error_rcp']:.0%} "
          f"(max {s['max_abs_error_rcp']:.0%}); published samples (throughput model only) mean |err| "
          f"{s['mean_abs_error_published_samples']:.0%} "
          f"(max {s['max_abs_error_published_samples']:.0%})\n")  # fmt: skip
    print("configs (this harness's techniques; minutes from run_start, RCP samples)")
    print(f"{'config':32} {'GPUs':>5} {'GBS':>6} {'technique':28} {'step ms':>8} {'imb':>6} {'min':>7} {'ours':>7}")
    for r in report["configs"]:
        t = r["technique"]
        ours = f"{r['minutes_our_rate']:7.2f}" if "minutes_our_rate" in r else "      -"
        label = f"{t['balance']}/{t['reduce']}/{t['optimizer']}"
        print(f"{r['config']:32} {r['gpus']:>5} {r['gbs']:>6} {label:28} "
              f"{r['step_ms']:>8.1f} {r['imbalance']:>6.3f} {r['minutes_published_rate']:>7.2f} {ours}")  # fmt: skip
    print(f"ours: {report['calibration']['our_rate']}\n")
    marks = [g for g in (8, 64, 128, 1024) if g in {r["gpus"] for r in report["curve"]}]
    print("curve: predicted minutes by technique (balance/reduce/optimizer)")
    print(f"{'system technique':40}" + "".join(f"{g:>9}" for g in marks))
    for system in report["calibration"]["c_s_per_sample"]:
        for lab in sorted({r["technique"] for r in report["curve"]}):
            pts = {r["gpus"]: r["minutes"] for r in report["curve"] if r["system"] == system and r["technique"] == lab}
            print(f"{system + ' ' + lab:40}" + "".join(f"{pts[g]:>9.2f}" for g in marks))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the usage too)
        print(f"time_to_train: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, help="your per-GPU training rate (samples/s, one GPU, optimizer included)")
    p.add_argument("--rate-batch", type=int, default=96, help="local batch the --rate was measured at")
    p.add_argument("--model-json", type=Path, help="a bench/model.py JSON: its fastest unpadded rate (BERT-large)")
    p.add_argument("--system", default="H100", help=f"GPU type --rate/--model-json ran on ({', '.join(SYSTEMS)})")
    p.add_argument("--gpus", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--balances", nargs="+", default=["none", "samsung"], help="strategies on the curve")
    p.add_argument("--overlap", type=float, default=DEFAULT_OVERLAP, help="share of the all-reduce hidden (curve)")
    p.add_argument("--configs", nargs="+", type=Path, help="default: every config_DGX*.sh")
    p.add_argument("--json", type=Path, default=Path("results/bench/time_to_train.json"))
    p.add_argument("--png", type=Path, default=Path("results/bench/time_to_train.png"))
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every bad setting fails here, before any simulation."""
    get_system(args.system)
    for balance in args.balances:
        Technique(balance=balance, overlap=args.overlap).check()
    Technique(overlap=args.overlap).check()
    if any(g < 1 for g in args.gpus):
        raise BadInput(f"--gpus {args.gpus}: every count must be positive")
    if args.rate is not None and not args.rate > 0:
        raise BadInput(f"--rate {args.rate} samples/s is not positive")
    if args.rate_batch < 1:
        raise BadInput(f"--rate-batch {args.rate_batch} is not positive")
    if args.model_json is not None and not args.model_json.is_file():
        raise BadInput(f"--model-json {args.model_json} does not exist")
    for path in args.configs or []:
        if not path.is_file():
            raise BadInput(f"config {path} does not exist")


def run(args: argparse.Namespace) -> dict:
    our_c = {"H100": c_from_rate(OUR_H100_RATE, 96, SYSTEMS["H100"])}
    rate_note = f"H100: this harness's driver, {OUR_H100_RATE} samples/s at batch 96 (issue 9)"
    system = get_system(args.system)
    if args.model_json is not None:
        rate, batch, note = rate_from_model_json(args.model_json)
        our_c = {system.name: c_from_rate(rate, batch, system)}
        rate_note = f"{system.name}: {note}"
    elif args.rate is not None:
        our_c = {system.name: c_from_rate(args.rate, args.rate_batch, system)}
        rate_note = f"{system.name}: --rate {args.rate} samples/s at batch {args.rate_batch}"
    rcps = load_rcps()
    cs = calibrations()
    paths = args.configs or sorted(ROOT.glob("config_DGX*_*x*.sh"))
    paths = [p for p in paths if not p.name.endswith("_common.sh")]
    # A link to another listed config (config_DGXA100_128x8.sh) would repeat its row.
    paths = [p for p in paths if not (p.is_symlink() and p.resolve() in {q.resolve() for q in paths if q != p})]
    return {
        "model": __doc__.split("\n\n")[1],
        "assumptions": {
            "systems": {k: asdict(s) for k, s in SYSTEMS.items()},
            "gradient_bytes": GRADIENT_BYTES,
            "optimizer_bytes_per_parameter": OPTIMIZER_BYTES_PER_PARAMETER,
            "hbm_efficiency": HBM_EFFICIENCY,
            "overlap": args.overlap,
            "backward_share": BACKWARD_SHARE,
            "eval_samples": EVAL_SAMPLES,
            "eval_cost": EVAL_COST,
            "length_mix": "bert.lengths.WIKI_PHASE2",
        },  # fmt: skip
        "rcp": {"file": rcps.path, "ruleset": RCP_RULESET, "pruned_means": rcps.points, "all_means": rcps.full},
        "calibration": {
            "c_s_per_sample": cs,
            "samples_per_s_per_gpu": {k: 1 / c for k, c in cs.items()},
            "from": [p.name for p in PUBLISHED if p.calibration],
            "our_rate": rate_note,
            "our_c_s_per_sample": our_c,
        },  # fmt: skip
        "validation": validate(cs, rcps),
        "configs": config_rows(paths, cs, rcps, our_c),
        "curve": curve(cs, rcps, args.gpus, args.balances, args.overlap),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        report = run(args)
    except BadInput as err:
        print(f"time_to_train: error: {err}", file=sys.stderr)
        return 2
    print_tables(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.png)
    print(f"\nwrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
