"""What open shards cost a reader: resident memory and CPU per sample, by the HDF5 metadata cache each file gets.

Balancing makes every rank read sequences from other ranks' shards, so over a run a reader holds all of them open
(bert.data.reader: 4,320 for phase 2) and reads a row or two from each at a time. This writes random-token shards
with the phase-2 length mix (data/make_random_shards.py), then, in a fresh process per variant, opens them all,
reads single rows from random shards (the training loader's pattern) and then whole shards in order (the eval
set's), and reports the process's resident memory after each phase and the CPU time per sample:

    .venv/bin/python bench/reader_memory.py                         # 400 shards of 1,000 samples, ~0.4 GB of disk
    .venv/bin/python bench/reader_memory.py --shards 40 --reads 800  # a quick look

Variants: `hdf5-default` (HDF5's adaptive cache: 2 MiB, growing to 32 MiB per file) and `fixed-64k`
(`bert.data.format.METADATA_CACHE_BYTES`, what the readers use). Writes results/bench/reader_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"hdf5-default": None, "fixed-64k": 64 * 1024}


def rss_mib() -> float:
    """This process's resident memory (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(data: Path, cache: int | None, reads: int, seed: int) -> dict:
    """One variant, in this process: resident MiB after opening, random reads and in-order reads; CPU ms a sample."""
    import bert.data.format as fmt

    fmt.METADATA_CACHE_BYTES = cache
    paths = sorted((data / "train_varlength").glob("*.hdf5"))
    start = rss_mib()
    shards = [fmt.VarlenShard(p) for p in paths]
    opened = rss_mib()
    rng = np.random.default_rng(seed)
    cpu = time.process_time()
    for s in rng.integers(0, len(shards), reads):
        shards[s].read([int(rng.integers(0, len(shards[s])))])
    random_ms = (time.process_time() - cpu) / reads * 1e3
    after_random = rss_mib()
    cpu, in_order = time.process_time(), 0
    for shard in shards[: max(1, len(shards) // 10)]:
        in_order += len(shard.read(np.arange(len(shard))))
    order_ms = (time.process_time() - cpu) / in_order * 1e3
    return {"shards": len(paths), "cache_bytes": cache, "rss_start_mib": round(start), "rss_open_mib": round(opened),
            "rss_after_random_mib": round(after_random), "rss_after_in_order_mib": round(rss_mib()),
            "random_reads": reads, "random_cpu_ms_per_sample": round(random_ms, 3),
            "in_order_samples": in_order, "in_order_cpu_ms_per_sample": round(order_ms, 4)}


def run_variant(name: str, data: Path, reads: int, seed: int) -> dict:
    """`measure` in a fresh interpreter, so each variant's memory starts from the same place."""
    out = subprocess.run([sys.executable, __file__, "--child", name, "--data", str(data), "--reads", str(reads),
                          "--seed", str(seed)], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr.strip()[-2000:]}")
    return {"variant": name, **json.loads(out.stdout.splitlines()[-1])}


def table(rows: list[dict]) -> str:
    lines = [f"{'variant':<14}{'shards':>7}{'open MiB':>10}{'+ random':>10}{'+ in order':>12}"
             f"{'random ms/sample':>18}{'in order ms/sample':>20}"]
    for r in rows:
        lines.append(f"{r['variant']:<14}{r['shards']:>7}{r['rss_open_mib'] - r['rss_start_mib']:>10}"
                     f"{r['rss_after_random_mib'] - r['rss_open_mib']:>10}"
                     f"{r['rss_after_in_order_mib'] - r['rss_after_random_mib']:>12}"
                     f"{r['random_cpu_ms_per_sample']:>18.3f}{r['in_order_cpu_ms_per_sample']:>20.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=400)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--reads", type=int, default=6144, help="single-row reads from random shards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, help="shards already written (train_varlength/); else written to a temp dir")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--json", type=Path, default=ROOT / "results" / "bench" / "reader_memory.json")
    p.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.data, VARIANTS[args.child], args.reads, args.seed)))
        return 0
    with tempfile.TemporaryDirectory(prefix="reader_memory_") as tmp:
        data = args.data
        if data is None:
            sys.path.insert(0, str(ROOT / "data"))
            from make_random_shards import length_mix, write_shards

            data = Path(tmp)
            write_shards(data, args.shards * args.samples_per_shard, args.shards, 10, length_mix(5), args.seed)
        rows = [run_variant(name, data, args.reads, args.seed) for name in args.variants]
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(),
                                     "load_average": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
