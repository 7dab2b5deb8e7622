"""Host syncs per training step, for every optimizer, precision, clip mode and step layout the driver offers.

On a GPU each host sync in the step stops the host until the device has drained its queue (and keeps the
step out of a CUDA graph): `bert.train.host_syncs` explains and finds them, on the CPU too. For each case
this builds a run the way the driver does (`bert.train.build.build_run`: a one-layer micro BERT, one gloo
process, random shards of the phase-2 length mix), trains `--warmup` steps, then counts the syncs of `--steps` more
`train_step`s and of a whole `train()` of two progress intervals (its progress line reads the loss, the mean
over the ranks: one sync per interval by design, two under fp16 with the loss scale; the LR comes from the host).

    .venv/bin/python bench/host_syncs.py          # writes results/bench/host_syncs.json; about a minute
    python3 bench/host_syncs.py --device cuda     # on a GPU, NCCL: also torch's own sync detector

Columns: per_step (syncs per steady-state train_step), per_interval (syncs per progress interval of
`train()`, steps and progress line together), where (the project line that asked, and how often). On a GPU,
cuda_per_step: the synchronizing CUDA calls torch's sync debug mode reports per step (copies to the host
included, which the op count cannot see), with their messages under cuda_where. The attention backend is
`loop` on the CPU and `auto` (flash varlen) on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bert.config import TrainConfig, from_flat
from bert.data.format import write_varlength_shard
from bert.dist.env import DistEnv
from bert.train.build import build_run
from bert.train.host_syncs import count_host_syncs, cuda_sync_warnings
from bert.train.loop import Run, train, train_step
from bert.train.mlperf_log import MLPerfLog

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
LOG_FREQ = 3
VOCAB = 1024


@dataclass(frozen=True)
class Case:
    name: str
    settings: dict = field(default_factory=dict)  # config fields, as the flags spell them


def cases() -> Iterator[Case]:
    """Every optimizer x precision x master weights x clip mode, then the step layouts on the bf16 master path
    (the H100 configs') and the fp16 one (the A100 configs')."""
    for optimizer, precision, master, clip in itertools.product(
            ("lamb", "adam"), ("fp32", "bf16", "fp16"), (False, True), ("after", "before", "bucket", "none")):
        if master and precision == "fp32":  # refused: the masters are fp32 copies of a bf16/fp16 model
            continue
        yield Case(f"{optimizer} {precision}{' master' if master else ''} clip={clip}",
                   dict(optimizer=optimizer, precision=precision, master_weights=master, grad_clip=clip))
    for precision in ("bf16", "fp16"):
        base = dict(optimizer="lamb", precision=precision, master_weights=True)
        yield Case(f"lamb {precision} master, 2 micro-steps", {**base, "gradient_accumulation_steps": 2})
        yield Case(f"lamb {precision} master, STATIC_TOKENS=128", {**base, "static_tokens": 128})
        yield Case(f"lamb {precision} master, balanced buffers", {**base, "grad_buckets": "balanced"})
        yield Case(f"lamb {precision} master, bf16 communication", {**base, "grad_comm_dtype": "bf16"})
        yield Case(f"lamb {precision} master, BALANCE=samsung", {**base, "balance": "samsung"})
        for attention in ("padded", "grouped"):
            yield Case(f"lamb {precision} master, ATTENTION={attention}", {**base, "attention": attention})
        yield Case(f"lamb {precision} master, OPTIMIZER_SHARDING=1",  # bert.optim.sharded_master
                   {**base, "optimizer_sharding": True, "optimizer_layout": "flat"})
    for optimizer, precision in itertools.product(("lamb", "adam"), ("fp32", "bf16", "fp16")):
        yield Case(f"{optimizer} {precision} OPTIMIZER_SHARDING=1",
                   dict(optimizer=optimizer, precision=precision, optimizer_sharding=True))


def write_random_shards(out: Path, train_samples: int = 96, eval_samples: int = 8, max_length: int = 512) -> Path:
    """A training shard and an eval shard of random tokens with the phase-2 length mix (data/make_random_shards),
    its strata scaled to end at `max_length` (their shares kept), and the micro BERT's config."""
    sys.path.insert(0, str(ROOT / "data"))
    from make_random_shards import length_mix, random_samples

    mix = length_mix(5)
    mix = replace(mix, edges=tuple(edge * max_length // mix.edges[-1] for edge in mix.edges))
    rng = np.random.default_rng(0)
    for sub, n in (("train_varlength", train_samples), ("eval_varlength", eval_samples)):
        (out / sub).mkdir(parents=True, exist_ok=True)
        samples = random_samples(mix.sample(n, rng), rng)
        write_varlength_shard(out / sub / "part_00000.hdf5", [
            s._replace(input_ids=s.input_ids % VOCAB, masked_labels=s.masked_labels % VOCAB) for s in samples])
    micro_bert_config(out / "bert_config.json")
    return out


def micro_bert_config(out: Path) -> Path:
    """A one-layer BERT with hidden 32 and a vocabulary of VOCAB (the shards' ids are folded into it): a step is
    milliseconds even in fp16, for which the CPU has no fast GEMM. The syncs do not depend on the sizes."""
    out.write_text(json.dumps({"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "intermediate_size": 64}))
    return out


def config(data: Path, out: Path, settings: dict, max_steps: int, device: torch.device = CPU) -> TrainConfig:
    values = dict(input_dir=str(data / "train_varlength"), eval_dir=str(data / "eval_varlength"),
                  bert_config_path=str(data / "bert_config.json"),
                  attention="loop" if device.type == "cpu" else "auto", train_batch_size=4,
                  eval_batch_size=4, num_eval_examples=8, learning_rate=1e-3, max_steps=max_steps, warmup_steps=1,
                  output_dir=str(out), log_freq=LOG_FREQ, target_mlm_accuracy=0.999,
                  eval_iter_start_samples=10**9, eval_iter_samples=10**9, shuffle_buffer=16)
    cfg = from_flat(**{**values, **settings})
    cfg.validate()
    return cfg


def build(cfg: TrainConfig, device: torch.device = CPU) -> Run:
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="localhost", master_port=0)
    return build_run(cfg, env, device, MLPerfLog("", enabled=False))


def measure(case: Case, data: Path, out: Path, warmup: int, steps: int, device: torch.device = CPU) -> dict:
    """Syncs per steady-state step and per progress interval of `train()`."""
    # train_step leaves the step count alone, so train() starts at 0 and ends at max_steps: two intervals
    cfg = config(data, out, case.settings, max_steps=2 * LOG_FREQ, device=device)
    with contextlib.redirect_stdout(io.StringIO()):  # the progress lines
        run = build(cfg, device)
        return _measure(case, run, warmup, steps)


def _measure(case: Case, run: Run, warmup: int, steps: int) -> dict:
    on_cuda = run.schedule.lr.device.type == "cuda"
    try:
        batches = iter(run.loader)
        for _ in range(warmup):
            train_step(run, batches)
        with cuda_sync_warnings() if on_cuda else contextlib.nullcontext([]) as cuda, count_host_syncs() as in_steps:
            for _ in range(steps):
                train_step(run, batches)
        with count_host_syncs() as in_train:
            status = train(run)
        assert status == "aborted", status
    finally:
        run.loader.close()
        run.progress.close()
    row = {"case": case.name, "per_step": in_steps.count / steps, "per_interval": in_train.count / 2,
           "where": in_steps.report(), "where_train": in_train.report()}
    if on_cuda:
        row.update(cuda_per_step=len(cuda) / steps, cuda_where=[f"{n} x {m}" for m, n in Counter(cuda).most_common()])
    return row


def warmup_steps(device: str) -> int:
    """Steps before counting. Two on the CPU: DDP rebuilds its buckets in the second forward, with copies to the
    host. Twelve on a GPU: DDP also times its first ten forwards (and every hundredth) on CUDA events that the host
    waits for (its runtime stats; `cudaEventSynchronize`, which torch's sync debug mode does not report), so steps
    counted before the eleventh would carry waits that neither detector sees and the timed steps do not have."""
    return 12 if device == "cuda" else 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, help="steps before counting (default: warmup_steps(device))")
    p.add_argument("--steps", type=int, default=3, help="steps counted")
    p.add_argument("--only", nargs="*", help="cases whose name contains one of these")
    p.add_argument("--max-length", type=int, default=512,
                   help="the longest sequence, the phase-2 mix scaled to it (shorter: cheaper attention, same syncs)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "host_syncs.json")
    args = p.parse_args(argv)
    if not 32 <= args.max_length <= 512:  # the shortest stratum, a quarter of it, must hold 5-token samples
        p.error(f"--max-length must be in 32..512 (the phase-2 mix scaled down), got {args.max_length}")
    return args


def init_world_of_one(store: Path) -> None:
    """One process; on a GPU the CPU tensors (the stop agreement) go through gloo, the CUDA ones through NCCL."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    warmup = warmup_steps(args.device) if args.warmup is None else args.warmup
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init_world_of_one(Path(tmp) / "store")
        data = write_random_shards(Path(tmp) / "data", max_length=args.max_length)
        cuda = f" {'cuda':>8}" if device.type == "cuda" else ""
        print(f"{'case':<44} {'per_step':>8}{cuda} {'per_interval':>12}  where (per-step syncs)")
        for case in cases():
            if args.only and not any(s in case.name for s in args.only):
                continue
            row = measure(case, data, Path(tmp) / "run", warmup, args.steps, device)
            rows.append(row)
            where = "; ".join(row["where"] + row.get("cuda_where", [])) or "-"
            cuda = f" {row['cuda_per_step']:>8g}" if "cuda_per_step" in row else ""
            print(f"{row['case']:<44} {row['per_step']:>8g}{cuda} {row['per_interval']:>12g}  {where}", flush=True)
        dist.destroy_process_group()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    args.out.write_text(json.dumps({"machine": machine, "torch": torch.__version__, "warmup": warmup,
                                    "steps": args.steps, "log_freq": LOG_FREQ, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
