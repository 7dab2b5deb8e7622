"""Driver-level throughput: a real `./run_and_time.sh` run against bench/model.py's single step (issue 9).

The driver run is the path users take (a config_*.sh, torchrun, DDP, the data pipeline, clipping, the LR
schedule, logging); the numbers come from its own progress records (`<OUTPUT_DIR>/metrics.jsonl`,
`bert.train.progress`) over a steady-state window that skips the first --warmup-steps, not from the wall time
of the whole script. Next to it, bench/model.py's step (`build_variants`, `make_step`, `time_steps`) times one
forward + backward + optimizer step of the same model, local batch size, attention backend, precision,
optimizer, COMPILE and STATIC_TOKENS on one process with no DDP, loader or logging; driver / bench is the
issue's goal (within 5 %). MFU is against a matmul FLOP/s (bf16 8192^3 on CUDA, fp32 2048^3 on the CPU)
measured in this process before and after the driver run, and, on a GPU, also the driver's own mfu against
the datasheet peak (`bert.train.peak_flops`).

The run claims nothing: TARGET_MLM_ACCURACY is set out of reach (0.999), evaluation past the last step, and
MAX_STEPS = warm-up + window + profile, so the driver ends "aborted" at the step limit (exit status 1), as expected.
The last --profile-steps steps (default 5), after the window, run under the driver's own profiler
(PROFILE_FROM, `bert.train.profile`): where the step's device time goes, by kind of kernel, in the report's
"profile" (rank 0's), with the timeline beside the driver's outputs (output/profile/, kept with --keep).
INIT_CHECKPOINT is empty (speed does not depend on the weights), the division open (random data), no
checkpoint is written.

    python data/make_random_shards.py --out /tmp/shards --samples 200000 --shards 16
    python bench/train_gpu.py --config config_DGXH100_1x8x96x1.sh --gpus 1 --data /tmp/shards
    # CPU, tiny BERT, 2 gloo processes (writes results/bench/train_gpu_cpu.json):
    python bench/train_gpu.py --config config_CPU_1x2.sh --gpus 2 --data /tmp/shards
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from model import build_variants, draw_lengths, make_step, matmul_rate, time_steps
from trial import read_mllog

from bert.config import ConfigError, from_env_and_args
from bert.data.index import LengthIndex
from bert.model import BertConfig
from bert.model.attention import resolve_backend
from bert.model.config import NAMED
from bert.model.precision import compute_dtype
from bert.optim import build_optimizer, build_schedule
from bert.optim.compiled import compile_step, warm_up_step
from bert.synthetic import random_batch
from bert.train.profile import format_table, moved_counters

ROOT = Path(__file__).resolve().parents[1]
OUT_OF_REACH = "0.999"  # TARGET_MLM_ACCURACY: the config accepts (0, 1)
# flag -> environment variable of the driver (bert/config.py)
FLAG_ENV = {"batchsize": "BATCHSIZE", "balance": "BALANCE", "precision": "PRECISION", "compile": "COMPILE",
            "static_tokens": "STATIC_TOKENS", "attention": "ATTENTION", "bert_config": "BERT_CONFIG"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=Path, help="a config_*.sh, sourced as run.sub does")
    p.add_argument("--gpus", type=int, default=1, help="processes (DGXNGPU); gloo processes on a CPU")
    p.add_argument("--data", required=True, type=Path, help="data/make_random_shards.py --out directory")
    for flag, env in FLAG_ENV.items():
        p.add_argument(f"--{flag.replace('_', '-')}", help=f"{env} (default: the config's)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="any other variable, last")
    p.add_argument("--warmup-steps", type=int, help="steps left out of the window (default: 10 CPU, 30 CUDA)")
    p.add_argument("--window-steps", type=int, help="steps measured (default: 30 CPU, 120 CUDA)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="steps after the window run under the driver's profiler (PROFILE_FROM); 0: none")
    p.add_argument("--log-freq", type=int, help="LOG_FREQ, steps per progress record (default: 5 CPU, 10 CUDA)")
    p.add_argument("--bench-repeats", type=int, default=10,
                   help="timed bench/model.py steps (median); 0: driver only (no second compile)")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads of each process (OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=int, default=1800, help="seconds the driver run may take")
    p.add_argument("--keep", type=Path, help="write the driver's outputs here (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="default: results/bench/train_gpu_<cpu|cuda>.json")
    args = p.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (10 if cpu else 30)
    args.window_steps = args.window_steps or (30 if cpu else 120)
    args.log_freq = args.log_freq or (5 if cpu else 10)
    args.json = args.json or Path(f"results/bench/train_gpu_{args.device}.json")
    if min(args.gpus - 1, args.warmup_steps, args.window_steps - 1, args.bench_repeats, args.profile_steps) < 0:
        p.error("need --gpus >= 1, --warmup-steps >= 0, --window-steps >= 1, --bench-repeats >= 0 and "
                "--profile-steps >= 0")
    if args.warmup_steps % args.log_freq or args.window_steps % args.log_freq:
        p.error(f"--warmup-steps ({args.warmup_steps}) and --window-steps ({args.window_steps}) must be multiples "
                f"of --log-freq ({args.log_freq}): the window is made of whole progress intervals")
    if args.window_steps // args.log_freq < 2:
        p.error("the window needs at least two progress intervals (--window-steps >= 2 x --log-freq)")
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    for name in ("train_varlength", "eval_varlength"):
        if not (args.data / name).is_dir():
            p.error(f"--data {args.data}: no {name}/ (make it with data/make_random_shards.py --out {args.data})")
    for item in args.env:
        if "=" not in item or not item.split("=", 1)[0].isidentifier():
            p.error(f"--env {item!r} is not NAME=VALUE")
    return args


def sourced(config: Path, base: Mapping[str, str]) -> dict[str, str]:
    """The environment after `source config` in bash, starting from `base`."""
    out = subprocess.run(["bash", "-c", 'source "$1" >/dev/null && env -0', "bash", str(config.resolve())],
                         env=dict(base), capture_output=True, check=True)
    return dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)


def driver_env(args: argparse.Namespace, out: Path) -> dict[str, str]:
    """The config's environment with the benchmark's settings on top: a bounded run that claims nothing."""
    env = sourced(args.config, os.environ)
    steps = args.warmup_steps + args.window_steps
    profile = {"PROFILE_FROM": str(steps + 1), "PROFILE_STEPS": str(args.profile_steps)} if args.profile_steps else {}
    never = str(10**12)  # samples (the config's bound): no evaluation and no sample limit before MAX_STEPS
    eval_size = LengthIndex.scan(args.data / "eval_varlength").num_samples
    env.update({
        "DATADIR_PHASE2": str(args.data / "train_varlength"), "EVALDIR": str(args.data / "eval_varlength"),
        "DGXNNODES": "1", "DGXNGPU": str(args.gpus), "INIT_CHECKPOINT": "", "MLPERF_DIVISION": "open",
        "TARGET_MLM_ACCURACY": OUT_OF_REACH, "MAX_STEPS": str(steps + args.profile_steps),
        "LOG_FREQ": str(args.log_freq),
        "EVAL_ITER_START_SAMPLES": never, "EVAL_ITER_SAMPLES": never, "MAX_SAMPLES_TERMINATION": never,
        "NUM_EVAL_EXAMPLES": str(min(int(env.get("NUM_EVAL_EXAMPLES", eval_size)), eval_size)),
        "OUTPUT_DIR": str(out / "output"), "MLPERF_LOG": str(out / "result.txt"), "SKIP_CHECKPOINT": "1",
        "SEED": str(args.seed), "PYTHON": sys.executable, "EXTRA_PARAMS": "",
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])),
        **profile,
    })
    if not Path(env.get("BERT_CONFIG", "")).is_file() and env.get("BERT_CONFIG") not in NAMED:
        env["BERT_CONFIG"] = "large"  # the DGX configs name the phase-1 checkpoint's bert_config.json
    env["DEVICE"] = args.device  # a DGX config asks for CUDA; its rehearsal here runs on the CPU
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.threads)
    env.update({env_name: getattr(args, flag) for flag, env_name in FLAG_ENV.items() if getattr(args, flag)})
    env.update(item.split("=", 1) for item in args.env)
    return env


def window(records: list[dict], warmup_steps: int, log_freq: int, last_step: int | None = None) -> list[dict]:
    """The training records whose whole interval lies past `warmup_steps` (and, given `last_step`, ends by it:
    the profiled steps come after), each with its `new_steps`, `new_samples` and `seconds` (recovered from
    samples_per_s and the record before)."""
    training = [r for r in records if "loss" in r]
    picked = []
    for before, r in zip(training, training[1:]):
        if r["step"] - log_freq < warmup_steps or "samples_per_s" not in r:
            continue
        if last_step is not None and r["step"] > last_step:
            continue
        new = r["samples"] - before["samples"]
        picked.append({**r, "new_steps": r["step"] - before["step"], "new_samples": new,
                       "seconds": new / r["samples_per_s"]})
    return picked


def summarise(intervals: list[dict], world: int, matmul_flops: float) -> dict:
    """Window totals per GPU: samples/s (the global count / world), rank 0's tokens/s and TFLOP/s (time
    weighted, i.e. totals over total seconds), MFU against the measured matmul, and the spread of intervals."""
    if not intervals:
        raise ValueError("no progress interval in the window: the run stopped before it (see the driver log)")
    seconds = sum(r["seconds"] for r in intervals)
    rates = [r["samples_per_s"] / world for r in intervals]
    out = {
        "intervals": len(intervals), "steps": sum(r["new_steps"] for r in intervals), "seconds": seconds,
        "samples_per_s_per_gpu": sum(r["new_samples"] for r in intervals) / seconds / world,
        "samples_per_s_per_gpu_min": min(rates), "samples_per_s_per_gpu_median": statistics.median(rates),
        "samples_per_s_per_gpu_max": max(rates),
    }
    if all("tokens_per_s" in r for r in intervals):
        out["tokens_per_s_per_gpu"] = sum(r["tokens_per_s"] * r["seconds"] for r in intervals) / seconds
    if all("tflops" in r for r in intervals):
        out["tflops_per_gpu"] = sum(r["tflops"] * r["seconds"] for r in intervals) / seconds
        out["mfu_vs_matmul"] = out["tflops_per_gpu"] * 1e12 / matmul_flops
    if all("mfu" in r for r in intervals):
        out["mfu_vs_datasheet"] = sum(r["mfu"] * r["seconds"] for r in intervals) / seconds
    return out


def run_stop_status(log: Path) -> str | None:
    """The `run_stop` status in an MLPerf result log (None: no run_stop)."""
    stops = [r for r in read_mllog(log.read_text()) if r["key"] == "run_stop"] if log.is_file() else []
    return stops[-1]["metadata"].get("status") if stops else None


def bench_variant(backend: str, device: str, compile: str, static_tokens: int, precision: str) -> str:
    """bench/model.py's variant name for the driver's model settings (its compiled, static and fp8 variants
    exist for the device's fast backend only: varlen on CUDA, loop on the CPU; fp8 pads to STATIC_TOKENS)."""
    fast = "varlen" if device == "cuda" else "loop"
    if (compile != "off" or static_tokens) and backend != fast:
        raise ValueError(f"bench/model.py has COMPILE and STATIC_TOKENS variants for ATTENTION={fast} only, "
                         f"not {backend}")
    prefix = "compiled" if compile != "off" else ""
    if precision == "fp8":
        return f"{prefix + '-' if prefix else ''}fp8/{backend}"
    if static_tokens:
        prefix = f"{prefix + '-' if prefix else ''}static{static_tokens}"
    return f"{prefix or 'unpadded'}/{backend}"


def bench_step(env: Mapping[str, str], device: str, repeats: int, seed: int) -> dict:
    """bench/model.py's single step with the driver's model, local batch, precision and optimizer (LR on the
    device as the driver's schedule keeps it), on a representative batch of the phase-2 mix."""
    cfg = from_env_and_args([], environ=env)
    model_cfg = BertConfig.load(cfg.model.bert_config_path)
    backend = resolve_backend(cfg.model.attention, device)
    name = bench_variant(backend, device, cfg.model.compile, cfg.model.static_tokens, cfg.model.precision)
    lengths = draw_lengths(cfg.data.train_batch_size, "representative", np.random.default_rng(seed), 1000)
    # words of the model's vocabulary: MLPerf's 30522 overflowed the embedding of a config with fewer
    batch = random_batch(lengths, seed=seed, vocab_size=model_cfg.real_vocab_size).to(device)
    model, loss_fn, flops = build_variants(model_cfg, batch, device, [name], cfg.model.compile,
                                           cfg.model.static_tokens, fp8=cfg.model.precision == "fp8",
                                           last_layer_subset=cfg.model.last_layer_subset,
                                           fp8_linears=cfg.model.fp8_linears, fp8_recipe=cfg.model.fp8_recipe)[name]
    optimizer = build_optimizer(model, cfg.optim, compute_dtype(cfg.model.precision))
    build_schedule(optimizer, cfg.optim)  # puts the LR on the device, as in the driver
    if cfg.optim.compile_optimizer:  # as bert.train.build and the warm-up before run_start
        compile_step(optimizer, cfg.model.compile)
        warm_up_step(optimizer)
    step = make_step(model, loss_fn, device, optimizer, cfg.model.precision, cfg.optim.master_weights)
    median = statistics.median(time_steps({name: step}, repeats, device, quiet=True)[name])
    return {"variant": name, "last_layer_subset": model.last_layer_subset, "optimizer": type(optimizer).__name__,
            "precision": cfg.model.precision,
            "master_weights": cfg.optim.master_weights, "compile_optimizer": cfg.optim.compile_optimizer,
            "batch_lengths": [int(n) for n in lengths], "tokens": int(sum(lengths)), "repeats": repeats,
            "median_s": median, "samples_per_s": len(lengths) / median, "tokens_per_s": int(sum(lengths)) / median,
            "tflops": flops / median / 1e12}


def driver_vs_bench(driver: dict, bench: dict) -> dict[str, float]:
    """Driver per GPU over bench, by samples/s, tokens/s and TFLOP/s (the last two factor out how many tokens
    the batches held: the driver's are balanced draws, the bench's one representative draw)."""
    ratios = {"samples_per_s": driver["samples_per_s_per_gpu"] / bench["samples_per_s"]}
    if "tokens_per_s_per_gpu" in driver:
        ratios["tokens_per_s"] = driver["tokens_per_s_per_gpu"] / bench["tokens_per_s"]
    if "tflops_per_gpu" in driver:
        ratios["tflops"] = driver["tflops_per_gpu"] / bench["tflops"]
    return ratios


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.machine()} cpu, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    out = args.keep or Path(tempfile.mkdtemp(prefix="train_gpu_"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / "result.txt", out / "output" / "metrics.jsonl", out / "output" / "profile" / "rank0.json"):
        stale.unlink(missing_ok=True)  # a result log is never written over (the driver would stop)
    env = driver_env(args, out)
    try:
        from_env_and_args([], environ=env)  # the driver checks this too; here a bad flag fails before timing
    except ConfigError as e:
        print(f"bench/train_gpu.py: {e}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    matmul_before = matmul_rate(args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the GEMM's operands go back to the driver's processes
    print(f"driver: {args.config} on {args.gpus} process(es), {args.warmup_steps} warm-up + {args.window_steps} "
          f"window steps; log {out / 'driver.log'}", flush=True)
    start = time.perf_counter()
    stopped = False  # SIGTERM (bench/cuda_session.sh's step limit): report what the window has, within its 10 s
    previous = signal.signal(signal.SIGTERM, _stop)
    with open(out / "driver.log", "w") as log:
        try:
            driver = subprocess.run(["bash", str(ROOT / "run_and_time.sh")], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=args.timeout)
            returncode = driver.returncode
        except subprocess.TimeoutExpired:
            returncode = None
        except Stopped:
            returncode, stopped = None, True
    try:
        return _report(args, env, out, returncode, stopped, time.perf_counter() - start, matmul_before, load_before)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report(args: argparse.Namespace, env: dict[str, str], out: Path, returncode: int | None, stopped: bool,
            driver_wall: float, matmul_before: float, load_before: tuple[float, float, float]) -> int:
    """The window's figures from the driver's records, the bench step beside them, the JSON: 0 when the driver ended
    as a bounded run does, 1 otherwise (with a JSON all the same when its window was complete)."""
    matmul_after = matmul_before if stopped else matmul_rate(args.device)
    status = run_stop_status(out / "result.txt")
    intended = returncode == 1 and status == "aborted"
    if not intended:
        tail = (out / "driver.log").read_text().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        print(f"bench/train_gpu.py: the driver ended with exit status {returncode} and run_stop {status!r}; a bounded "
              f"run ends 1 / 'aborted' at MAX_STEPS (log: {out / 'driver.log'})", file=sys.stderr)
    metrics = out / "output" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    matmul = (matmul_before + matmul_after) / 2
    last = args.warmup_steps + args.window_steps
    intervals = window(records, args.warmup_steps, args.log_freq, last)
    try:
        if not intended and not any(r["step"] == last for r in intervals):
            raise ValueError(f"the window (to step {last}) is incomplete")
        driver_stats = summarise(intervals, args.gpus, matmul)
    except ValueError as e:
        print(f"bench/train_gpu.py: {e} ({out / 'driver.log'})", file=sys.stderr)
        return 1
    # a driver that failed after its window (in the profiled steps: a crash, the step's time limit) still measured it
    bench = None
    if args.bench_repeats and intended:
        try:
            bench = bench_step(env, args.device, args.bench_repeats, args.seed)
        except Stopped:  # the step's limit during the bench step: the driver's figures still go out
            print("bench/train_gpu.py: stopped during the bench step; reporting the driver alone", file=sys.stderr)
    report = {
        "device": device_name(args.device), "torch": torch.__version__, "config": str(args.config),
        "gpus": args.gpus, "driver_env": driver_settings(env),
        "driver_status": f"aborted at MAX_STEPS={env['MAX_STEPS']} (exit status 1), as intended: "
                         f"TARGET_MLM_ACCURACY={OUT_OF_REACH} is out of reach and no eval runs; not a result"
                         if intended else f"failed after its window: {_failure(returncode, status, stopped, out)}",
        "warmup_steps": args.warmup_steps, "window_steps": args.window_steps, "log_freq": args.log_freq,
        "driver_wall_s": driver_wall, "matmul_flops_per_s": {"before": matmul_before, "after": matmul_after},
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "driver": driver_stats, "bench": bench,
        "driver_vs_bench": driver_vs_bench(driver_stats, bench) if bench else None,
        "window_records": window(records, args.warmup_steps, args.log_freq, last),
        "profile": read_profile(out / "output" / "profile" / "rank0.json") if args.profile_steps else None,
        # torch.compile's counters that moved after run_start ({}: the warm-up compiled everything; None: no compile)
        "compiled_after_run_start": next((r["compiled_after_run_start"] for r in records
                                          if "compiled_after_run_start" in r), None),
    }
    write_report(report, args.json)
    return 0 if intended else 1


class Stopped(Exception):
    """SIGTERM reached the benchmark (its step's time limit)."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped


def _failure(returncode: int | None, status: str | None, stopped: bool, out: Path) -> str:
    """How a driver that measured its window ended: the step's limit, or its status and first error line."""
    if stopped:
        return "stopped by the step's time limit (SIGTERM)"
    errors = [line for line in (out / "driver.log").read_text().splitlines() if line.startswith("error: ")]
    return f"exit status {returncode}, run_stop {status!r}" + (f": {errors[0]}" if errors else "")


def read_profile(path: Path) -> dict | None:
    """Rank 0's profile summary (`bert.train.profile`), None if the driver wrote none."""
    return json.loads(path.read_text()) if path.is_file() else None


def write_report(report: dict, path: Path) -> None:
    print_table(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


def driver_settings(env: Mapping[str, str]) -> str:
    """The variables the config and the benchmark set for `./run_and_time.sh` (not the shell's or the paths
    of this machine's Python), as NAME=VALUE words."""
    noise = {"_", "PWD", "OLDPWD", "SHLVL", "PYTHON", "PYTHONPATH"}
    keys = sorted(k for k, v in env.items() if os.environ.get(k) != v and k not in noise)
    return " ".join(f"{k}={shlex.quote(env[k])}" for k in keys)


def print_table(report: dict) -> None:
    d, b = report["driver"], report["bench"] or {}
    mm = report["matmul_flops_per_s"]
    print(f"{report['device']}, torch {report['torch']}; {report['config']} on {report['gpus']} process(es); "
          f"matmul {mm['before'] / 1e12:.3g} / {mm['after'] / 1e12:.3g} TFLOP/s before / after; load "
          f"{report['load_average_1min']['before']:.2f} / {report['load_average_1min']['after']:.2f}")
    print(f"driver: {report['driver_status']}")
    step = f"{b['variant']}, {b['optimizer']}, {b['precision']}, median of {b['repeats']} steps" if b else "not run"
    print(f"window: steps {report['warmup_steps'] + 1}-{report['warmup_steps'] + report['window_steps']} "
          f"({d['intervals']} records, {d['seconds']:.1f} s); bench: {step}")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    ratios = report["driver_vs_bench"] or {}
    rows = [("samples/s per GPU", d["samples_per_s_per_gpu"], b.get("samples_per_s"), "samples_per_s", ".2f"),
            ("tokens/s per GPU", d.get("tokens_per_s_per_gpu"), b.get("tokens_per_s"), "tokens_per_s", ".0f"),
            ("TFLOP/s per GPU", d.get("tflops_per_gpu"), b.get("tflops"), "tflops", ".4g")]
    print(f"{'':<20}{'driver':>12}{'bench':>12}{'driver/bench':>14}")
    for label, dv, bv, key, spec in rows:
        print(f"{label:<20}{fmt(dv, spec):>12}{fmt(bv, spec):>12}{fmt(ratios.get(key), '.3f'):>14}")
    matmul = (mm["before"] + mm["after"]) / 2
    print(f"{'MFU vs matmul':<20}{fmt(d.get('mfu_vs_matmul'), '.3f'):>12}"
          f"{fmt(b['tflops'] * 1e12 / matmul if b else None, '.3f'):>12}")
    if "mfu_vs_datasheet" in d:
        print(f"{'MFU vs datasheet':<20}{d['mfu_vs_datasheet']:>12.3f}")
    print(f"driver samples/s per GPU by interval: min {d['samples_per_s_per_gpu_min']:.2f}, median "
          f"{d['samples_per_s_per_gpu_median']:.2f}, max {d['samples_per_s_per_gpu_max']:.2f}")
    if report.get("compiled_after_run_start") is not None:
        print(f"compile after run_start: {moved_counters(report['compiled_after_run_start'])}")
    if report.get("profile"):
        print(format_table(report["profile"]))


if __name__ == "__main__":
    sys.exit(main())
