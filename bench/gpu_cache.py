"""Compile a device session's driver rows for a real H100 or H200 on this CPU, into the compile caches they load.

Why: a driver step of bench/cuda_session.sh compiles BERT-large before run_start, on a machine that starts bare. From
an empty cache one H200 spent 81 s on the bf16 graphs and 160 s on the compiled LAMB update, and 202 s on the float8
model alone, of a session's 900 s of device time; a float8 driver never reached its window.

How: for each row, cuda_session.sh's dry run (DRY_RUN=1, CACHE_GPU=the card's name) gives the bench/train_gpu.py
command the session will run, and train_gpu's `driver_env` the driver's environment: the config sourced, the row's
settings, COMPILE_CACHE=.compile_cache/<GPU>/<row>.bin.gz. A process with the fake H100's stand-ins
(bench/fake_h100.py: `install(gpu, count=False)`, the name the card reports, inductor's settings as on the GPU)
and a cold inductor cache builds what the driver builds from that environment (`from_env_and_args`, `build_model`,
`build_optimizer`, `compile_step`, the eval set) and runs the driver's own compile
(`bert.train.warmup.compile_before_run`), which writes the file. A second process with another cold cache loads it
and compiles again: the row passes when inductor took every graph from the file and compiled none.

Carried to the device (carry [".whl", ".compile_cache"]), a driver step then loads the graphs and the kernels' sm_90
binaries instead of generating them, AOT autograd's graphs too (the float8 rows' since bert.model.compile_keys). It
still traces with dynamo (never cached) and autotunes each kernel at its first launch (the fake's timings are never
kept). The GPU misses when its torch or Triton is not this venv's
(torch keys on a hash of its own files), its name is not `fake_h100.GPUS`'s, or a setting differs; `--key` prints
the key's parts, and the session's setup step prints them there. A miss costs the carried bytes only: the row
compiles as it would have. What the driver printed (`compile cache: inductor took N graphs from its caches...`)
says which happened.

Every row of the session's plan compiles here, the per-tensor compiled update (COMPILE_OPTIMIZER=1 with
OPTIMIZER_LAYOUT=tensors: compiled-opt) and the float8 model as one graph (fp8-delayed) included: their deepest
Triton kernels overflowed Python's recursion limit when compiled in this process, and are compiled in inductor's
compile workers now, as on the GPU (bench/fake_h100.py).

    .venv-torch2.11.0-py3.12/bin/python bench/gpu_cache.py --gpus h100 h200   # the rows of the session's plan

Needs torch's CUDA build (`bash scripts/test_torch.sh 2.11.0`: the GPU machines' 2.11.0) and a C compiler.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # fake_h100, train_gpu

CACHES = ROOT / ".compile_cache"
MADE_FOR = "made_for.json"  # in the caches' folder: the key parts each file was made with
# what the fake cannot compile as the GPU does: collectives need a group, and a compile that times its choices (GEMM
# templates, the C++ wrapper's first pass) would keep the fake's equal timings. COMPILE=reduce-overhead compiles
# (its graphs are inductor's, keyed with CUDA graphs on; the trees record them on the GPU, from the cached graphs:
# fake_h100.CudaGraphs stands in for them here)
REFUSED = {"COMPILE": ("max-autotune", "max-autotune-no-cudagraphs"), "OPTIMIZER_SHARDING": ("1",),
           "TORCHINDUCTOR_CPP_WRAPPER": ("1",), "TORCHINDUCTOR_MAX_AUTOTUNE": ("1",),
           "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": ("1",), "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": ("1",)}


def key_parts() -> dict:
    """What torch keys every cached graph on besides the graph: a hash of its own files, and the device's name and
    CUDA's and Triton's versions (inductor's `CacheBase.get_system`, hashed whole: equal hashes, equal systems); and
    the settings the driver gives torch's caches (`compile_keys`: our custom ops' source hashes among them)."""
    import torch
    from torch._inductor.codecache import CacheBase, torch_key

    from bert.model import compile_keys  # its fingerprint imports every custom op's module (OP_MODULES)

    system = CacheBase.get_system()
    try:  # the float8 rows built on it trace its code, which torch's key does not cover
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = None
    return {"torch": torch.__version__, "torch_key": torch_key().hex()[:16], "device": system.get("device"),
            "cuda": system.get("version", {}).get("cuda"), "system_hash": system["hash"][:16], "torchao": torchao,
            "compile_keys": compile_keys.fingerprint(), "cxx": torch._inductor.config.cpp.cxx[1]}


# the parts that must be equal for a carried file to serve (compile_keys: an edit of a custom op's module since;
# cxx: inductor's C++ compiler, from CXX, keyed though a GPU graph runs none: fake_h100.DEVICE_CXX)
KEYED = ("torch_key", "system_hash", "torchao", "compile_keys", "cxx")


def key_lines(path: Path) -> dict[str, list[list[str]]]:
    """Each graph's cache key, part by part ("[hash] part: value"), by kind, from a row's COMPILE_CACHE file and the
    keys recorded beside it (bert.train.compile_cache.recording_keys), or from either alone. Inductor's come from
    the file (torch keeps them with each graph, `_fx_graph_cache_debug_lines`: every graph the run used, where the
    record has only those whose key it computed), AOT autograd's from the record only."""
    import pickle

    from torch.compiler._cache import CacheArtifactManager

    from bert.train.compile_cache import keys_path, unpacked

    record = path if path.name.endswith(".keys.json") else keys_path(str(path))
    found = {kind: list(keys.values()) for kind, keys in json.loads(record.read_text()).items()} \
        if record.is_file() else {}
    if path != record:
        artifacts = CacheArtifactManager.deserialize(unpacked(path)) or {}
        found["inductor"] = [pickle.loads(a.content)._fx_graph_cache_debug_lines
                             for a in artifacts.get("inductor", [])]
    return found


def key_differences(ours: Path, theirs: Path) -> list[str]:
    """Why the graphs of `ours` (made here) missed on the machine that wrote `theirs` (the same row, as a device
    session brings it back): each part of the key that differs, by kind, with each side's value and in how many
    graphs. Each of our graphs is paired with the one of theirs whose key differs from it in the fewest parts; a
    part's hash says whether it differs, the value is shown cut."""
    def parts(lines: list[str]) -> dict[str, str]:
        return {line.split("] ", 1)[-1].split(": ", 1)[0]: line for line in lines}

    def hashes(found: dict[str, str]) -> set[tuple[str, str]]:  # a value's repr can hold an address: not compared
        return {(name, line.split("] ", 1)[0]) for name, line in found.items()}

    def value(line: str | None) -> str:
        return "(none)" if line is None else line.split("] ", 1)[-1].split(": ", 1)[-1][:80]

    mine, others, said = key_lines(ours), key_lines(theirs), []
    for kind in sorted(set(mine) & set(others)):
        if not mine[kind] or not others[kind]:
            said.append(f"{kind}: no graphs in {ours if not mine[kind] else theirs}")
            continue
        counts: dict[tuple[str, str, str], int] = {}
        for lines in map(parts, mine[kind]):
            other = min(map(parts, others[kind]), key=lambda o: len(hashes(lines) ^ hashes(o)))
            differ = {name for name, _ in hashes(lines) ^ hashes(other)}
            for name in sorted(differ):
                key = (name, value(lines.get(name)), value(other.get(name)))
                counts[key] = counts.get(key, 0) + 1
        said += [f"{kind}: {name}, in {n} of {len(mine[kind])} graphs: ours {a!r}, theirs {b!r}"
                 for (name, a, b), n in sorted(counts.items(), key=lambda kv: -kv[1])] or \
            [f"{kind}: the {len(mine[kind])} graphs of {ours} have keys equal to graphs of {theirs}"]
    return said or [f"no kind of key in both {ours} and {theirs}"]


def card_folder(name: str) -> str:
    """The folder of a card's caches, as cuda_session.sh names it from nvidia-smi's name."""
    return re.sub(r"[^A-Za-z0-9]", "_", name)


def compare_with_caches(caches: Path, here: dict) -> str:
    """One line: whether this card's files in `caches` were made (`MADE_FOR`) with this machine's key parts. Whether
    the code is still the code they were made from, it cannot say: a graph that changed misses."""
    name = (here.get("device") or {}).get("name")
    made = json.loads((caches / MADE_FOR).read_text()) if (caches / MADE_FOR).is_file() else {}
    mine = {f: key for f, key in made.items() if name and f.startswith(card_folder(name) + "/") and
            (caches / f).is_file()}
    if not mine:
        return f"compile caches: none made for {name or 'this machine (no CUDA device)'} in {caches}"
    differ = {f: [f"{k} {key.get(k)} there, {here.get(k)} here" for k in KEYED
                  if key.get(k) != here.get(k)] for f, key in mine.items()}
    missing = sorted(f for f, why in differ.items() if why)
    if missing:
        return (f"compile caches for {name}: {len(missing)} of {len(mine)} files made with other key parts "
                f"({missing[0]}: {'; '.join(differ[missing[0]])}): those will miss")
    return (f"compile caches for {name}: {len(mine)} files made with this torch, Triton, CUDA, torchao, card and "
            "custom ops: they should serve, unless the model's code changed since")


def driver_argv(row: str, gpu_name: str, caches: Path) -> list[str]:
    """bench/train_gpu.py's arguments for driver `row`, as cuda_session.sh would run it on the card `gpu_name`."""
    with tempfile.TemporaryDirectory() as out:
        dry = subprocess.run(["bash", str(ROOT / "bench" / "cuda_session.sh"), f"driver-{row}"], cwd=ROOT, text=True,
                             capture_output=True, env={**os.environ, "DRY_RUN": "1", "OUT": out,
                                                       "CACHE_GPU": gpu_name, "CACHES": str(caches)})
    if dry.returncode:
        raise ValueError(dry.stderr.strip() or f"cuda_session.sh: exit {dry.returncode}")
    words = shlex.split(next(line for line in dry.stdout.splitlines() if line.startswith("DRY ")))
    return words[words.index("bench/train_gpu.py") + 1:]


def driver_environment(row: str, gpu_name: str, caches: Path, data: Path, out: Path,
                       flags: list[str] = ()) -> dict[str, str]:
    """The environment the session's driver would run in (train_gpu.driver_env), on shards `data` made as the
    session makes them (the eval set's size is what decides the eval's shapes); `flags`: more of train_gpu's, last."""
    import torch
    import train_gpu

    argv = driver_argv(row, gpu_name, caches) + ["--data", str(data), *flags]  # the later --data wins
    at = argv.index("--config") + 1
    argv[at] = str(ROOT / argv[at])  # relative to the repository, as the session runs it, wherever this runs
    with mock.patch.object(torch.cuda, "is_available", return_value=True):  # its defaults for a CUDA run
        try:
            args = train_gpu.parse_args(argv)
        except SystemExit as e:  # argparse said why on stderr
            raise ValueError(f"driver-{row}: bench/train_gpu.py refuses {shlex.join(argv)}") from e
    env = train_gpu.driver_env(args, out)
    for name, values in REFUSED.items():
        if env.get(name) in values:
            raise ValueError(f"driver-{row}: {name}={env[name]} is not compiled here (collectives need a GPU, and "
                             "autotuning would keep the fake's timings)")
    if env.get("COMPILE", "off") == "off":
        raise ValueError(f"driver-{row}: COMPILE=off compiles nothing")
    return env


def compile_as_the_driver(gpu: str) -> dict:
    """In a process started with the stand-ins and the driver's environment: build and compile as the driver does,
    which loads COMPILE_CACHE first and writes it after; the counters of what was compiled and what came from a
    cache."""
    import fake_h100

    mode = fake_h100.install(gpu, count=False)
    import torch
    from torch._dynamo.utils import counters

    from bert.config import from_env_and_args
    from bert.data.index import LengthIndex
    from bert.dist.env import read_env
    from bert.model.precision import compute_dtype
    from bert.optim import build_optimizer, build_schedule
    from bert.optim.compiled import compile_step
    from bert.train.build import autocast_for, build_eval_set, build_model, sample_limits, seed_everything
    from bert.train.loop import Run
    from bert.train.mlperf_log import MLPerfLog
    from bert.train.warmup import compile_before_run

    cfg, env, device = from_env_and_args([]), read_env(), torch.device("cuda", 0)
    log = MLPerfLog("", False)
    start = time.perf_counter()
    with mode, device:  # built on the device (the fake mode cannot move the tied embeddings there afterwards)
        seed_everything(cfg.run.seed)
        model = build_model(cfg.model, device)
        optimizer = build_optimizer(model, cfg.optim, compute_dtype(cfg.model.precision))
        if cfg.optim.compile_optimizer:
            compile_step(optimizer, cfg.model.compile)
    with mode:  # compiled as the driver compiles, with no default device: its batches are made on the host
        build_schedule(optimizer, cfg.optim)  # the LR as the schedule's device tensor, an input of the update's graph
        eval_set = build_eval_set(cfg, env, device, sample_limits(model.config, cfg.data.max_seq_length))
        # what compile_before_run reads of a run: no DDP (one rank compiles the bare model) or clipping, and of the
        # loader the training set's lengths (under CUDA graphs the warm-up runs each token bucket they will fill)
        loader = types.SimpleNamespace(sample_lengths=LengthIndex.scan(cfg.data.input_dir).lengths)
        run = Run(cfg, env, types.SimpleNamespace(module=model), None, optimizer, None, None, loader, eval_set,
                  autocast_for(cfg.model.precision, device, cfg.optim.master_weights), log, None, None,
                  eval_samples=eval_set.num_examples)
        compile_before_run(run, log, device)
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    from torch._inductor.async_compile import AsyncCompile

    return {"seconds": round(time.perf_counter() - start, 1),
            "compile_workers": torch._inductor.config.compile_threads if AsyncCompile.use_process_pool() else 0,
            "graphs_compiled": inductor["fxgraph_cache_miss"],
            "graphs_from_cache": inductor["fxgraph_cache_hit"], "aot_from_cache": aot["autograd_cache_hit"],
            "aot_traced": aot["autograd_cache_miss"], "aot_uncacheable": aot["autograd_cache_bypass"],
            # under CUDA graphs: the graphs inductor handed to the trees (by kind) and the skips it logged
            "cudagraphs": {kind: sum(g["kind"] == kind for g in fake_h100.CUDA_GRAPHS.graphs)
                           for kind in ("forward", "backward", "inference")},
            "cudagraph_skips": fake_h100.CUDA_GRAPHS.skips, "key": key_parts()}


def run_child(gpu: str, env: dict[str, str], native: dict[str, str], timeout: int) -> dict:
    """`compile_as_the_driver` in a process of its own with a cold inductor cache; its row, or the error."""
    import fake_h100

    return fake_h100.run_cold([sys.executable, __file__, "--one", gpu], {**env, **native, "PYTHONPATH": str(ROOT)},
                              timeout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", nargs="+", default=["h100"], choices=["h100", "h200"])
    p.add_argument("--rows", nargs="+", default=["compiled-flat", "fp8-delayed-layers-flat", "compiled-opt",
                                                 "compiled-opt-norm", "compiled-opt-triton", "fp8-delayed",
                                                 "compiled-layers", "fp8-delayed-layers"],
                   help="cuda_session.sh driver rows (driver-<row>)")
    p.add_argument("--caches", type=Path, default=CACHES, help="where the session's COMPILE_CACHE files live")
    p.add_argument("--flags", default="", help="bench/train_gpu.py flags after the row's (a test: --bert-config tiny)")
    p.add_argument("--timeout", type=int, default=2400, help="seconds per compile")
    p.add_argument("--json", type=Path, default=ROOT / "results" / "bench" / "gpu_cache.json")
    p.add_argument("--key", action="store_true",
                   help="print the parts of torch's cache key here, whether --caches were made with them, and stop")
    p.add_argument("--diff", nargs=2, type=Path, metavar=("OURS", "THEIRS"),
                   help="why the graphs of a file made here missed on the machine that wrote THEIRS: the key parts "
                        "that differ, and stop")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child: compile for this card
    args = p.parse_args()
    if args.diff:
        print("\n".join(key_differences(*args.diff)))
        return 0
    if args.key:
        here = key_parts()
        print("inductor cache key:", json.dumps(here))
        print(compare_with_caches(args.caches, here))
        return 0
    if args.one:
        print("ROW " + json.dumps(compile_as_the_driver(args.one)), flush=True)
        return 0
    import fake_h100

    why = fake_h100.usable() or (None if shutil.which("cc") else "no C compiler (cc) for the backward's stand-ins")
    if why:
        print(f"gpu_cache: {why}; run it with torch's CUDA build (bash scripts/test_torch.sh 2.11.0 makes one)")
        return 2
    native = fake_h100.stand_ins()
    from bert.train.compile_cache import keys_path

    rows, made, work = [], {}, Path(tempfile.mkdtemp(prefix="gpu_cache-"))
    try:
        data = work / "shards"  # the session's shards (its eval set's 10,000 samples); a few training samples
        subprocess.run([sys.executable, str(ROOT / "data" / "make_random_shards.py"), "--out", str(data),
                        "--samples", "2000", "--shards", "2"], check=True, capture_output=True)
        for gpu in args.gpus:
            name = fake_h100.GPUS[gpu][0]
            for row in args.rows:
                report = {"gpu": name, "row": row}
                try:
                    env = driver_environment(row, name, args.caches, data, work / row, shlex.split(args.flags))
                except ValueError as e:
                    rows.append({**report, "error": str(e)})
                    print(f"{name:22} {row:26} {e}")
                    continue
                file = Path(env["COMPILE_CACHE"])
                file.unlink(missing_ok=True)  # written afresh: for the code as it is now
                first = run_child(gpu, env, native, args.timeout)
                keys = keys_path(str(file))  # the first run's: every graph's key (the check computes few)
                recorded = keys.read_bytes() if keys.is_file() else None
                check = run_child(gpu, env, native, args.timeout) if "error" not in first else {}
                if recorded is not None:
                    keys.write_bytes(recorded)
                # served: inductor compiled nothing, and AOT autograd could cache every graph (compile_keys)
                ok = "error" not in first and "error" not in check and check["graphs_compiled"] == 0 and \
                    check["graphs_from_cache"] > 0 and check["aot_uncacheable"] == 0
                report.update(file=str(file.relative_to(ROOT) if file.is_relative_to(ROOT) else file),
                              bytes=file.stat().st_size if file.exists() else 0, compile=first, from_file=check,
                              served=ok)
                rows.append(report)
                made[str(file.relative_to(args.caches))] = first["key"] if ok else None  # None: not a cache
                print(f"{name:22} {row:26} " + (
                    f"{first['graphs_compiled']:2} graphs in {first['seconds']:6.1f} s; from the file: "
                    f"{check.get('graphs_from_cache', '-')} taken, {check.get('graphs_compiled', '-')} compiled "
                    f"(AOT autograd {check.get('aot_from_cache', '-')} taken, {check.get('aot_uncacheable', '-')} "
                    f"uncacheable), {check.get('seconds', '-')} s; {report['bytes'] / 2**20:5.1f} MiB "
                    f"{'ok' if ok else 'NOT SERVED'}" if "error" not in first else f"FAILED {first['error']}"))
                if check.get("error"):
                    print(f"{'':49} from the file: FAILED {check['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if made:  # for the session's setup step (`--key`) to compare with the machine's
        file = args.caches / MADE_FOR
        file.parent.mkdir(parents=True, exist_ok=True)  # every row may have failed before writing its file
        made = {**(json.loads(file.read_text()) if file.is_file() else {}), **made}
        file.write_text(json.dumps({f: key for f, key in made.items() if key}, indent=1) + "\n")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(), "rows": rows},
                                    indent=1) + "\n")
    return 0 if rows and all(r.get("served") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
