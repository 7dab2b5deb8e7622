"""bench/cuda_session.sh, dry: every command a device-tool call would run is accepted here, on a CPU.

Device time is short (30 minutes a session, when there is a GPU at all), so a misspelt flag, variant or driver
setting must fail here rather than there. The script's DRY_RUN=1 prints each step's command; each is checked
against the program that would receive it:
  bench/model.py      its argument parser, and every --variants name among those it builds on CUDA with these
                      settings (`variant_names`; an unknown name also stops model.py itself);
  bench/train_gpu.py  its argument parser, then the driver environment it would hand run_and_time.sh, parsed
                      by the driver's own config parser (a bad value raises ConfigError), and the bench/model.py
                      variant its comparison step would time;
  pytest              every named test file (and test function) exists;
  the shard maker     its argument parser;
  bench/host_syncs.py and bench/fp8_linear.py  their argument parsers.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from script_modules import ROOT, load_script

from bert.config import from_env_and_args
from bert.model.attention import resolve_backend
from bert.model.compile import COMPILE_MODES, check_compile
from bert.model.fp8 import check_fp8

sys.path.insert(0, str(ROOT / "bench"))  # train_gpu.py imports bench/model.py
sys.path.insert(0, str(ROOT / "data"))
model_bench = load_script("bench/model.py")
train_gpu = load_script("bench/train_gpu.py")
shards = load_script("data/make_random_shards.py")
host_syncs = load_script("bench/host_syncs.py")
fp8_linear = load_script("bench/fp8_linear.py")
attention_tiles = load_script("bench/attention_tiles.py")

SCRIPT = ROOT / "bench" / "cuda_session.sh"
STEPS = ["setup", "shards", "tests", "tests-fp8", "model", "model-compiled", "model-ours", "model-attention",
         "attention-tiles", "model-graphs", "model-optimizer", "host-syncs", "fp8-linear"]


def brought_back(out: Path) -> dict[str, bytes]:
    """The compile caches a call brings back in `out`: its parts joined, the archive's files by name."""
    joined = io.BytesIO(b"".join(p.read_bytes() for p in sorted(out.glob("compile_cache.tgz.part-*"))))
    with tarfile.open(fileobj=joined) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def driver_names() -> list[str]:
    """The keys of the script's DRIVERS table."""
    table = SCRIPT.read_text().split("declare -A DRIVERS=(", 1)[1].split("\n)", 1)[0]
    return re.findall(r"^\s*\[([\w-]+)\]=", table, flags=re.M)


def driver_flags(name: str) -> str:
    """The DRIVERS table's line for `name`."""
    return SCRIPT.read_text().split(f"[{name}]=", 1)[1].split("\n", 1)[0]


def run_dry(tmp_path, *steps: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "WORK": str(tmp_path / "work"), **env_vars}
    return subprocess.run(["bash", str(SCRIPT), *steps], cwd=ROOT, env=env, capture_output=True, text=True)


def dry_run(tmp_path, steps: list[str]) -> list[tuple[str, list[str]]]:
    """(step name, command words) of every step, as DRY_RUN=1 prints them."""
    out = run_dry(tmp_path, *steps)
    assert out.returncode == 0, out.stderr
    lines = [shlex.split(line) for line in out.stdout.splitlines() if line.startswith("DRY ")]
    return [(words[1], words[3:]) for words in lines]


def test_the_table_lists_every_driver_run_the_readme_names():
    names = driver_names()
    assert {"bf16", "autocast", "compiled", "compiled-opt", "graphs", "graphs-opt", "fp8"} <= set(names)
    # the README and the journal of measurements that moved out of it (docs/journal.md)
    readme = "\n".join((ROOT / path).read_text() for path in ("README.md", "docs/journal.md"))
    for step in set(re.findall(r"cuda_session\.sh setup [\w -]+", readme)):
        for name in step.split()[1:]:
            assert name in STEPS or name.removeprefix("driver-") in names, f"README/journal names a step {name!r}"


def test_every_step_is_accepted_by_the_program_it_runs(tmp_path, random_shards):
    steps = STEPS + [f"driver-{name}" for name in driver_names()]
    commands = dry_run(tmp_path, steps)
    assert [name for name, _ in commands] == steps
    for name, words in commands:
        if words[:2] == ["python3", "bench/model.py"]:
            args = model_bench.parse_args(words[2:])
            assert args.device == "cuda" and args.compile in COMPILE_MODES, name
            known = model_bench.variant_names("cuda", args.compile, args.static_tokens, args.precision == "fp8")
            assert args.variants and set(args.variants) <= set(known), (name, set(args.variants) - set(known))
        elif words[:2] == ["python3", "bench/train_gpu.py"]:
            argv = words[2:]
            argv[argv.index("--data") + 1] = str(random_shards)
            argv[argv.index("--keep") + 1] = str(tmp_path / name)
            args = train_gpu.parse_args(argv)
            env = train_gpu.driver_env(args, tmp_path / name)
            cfg = from_env_and_args([], environ=env)  # what the driver will parse: ConfigError on a bad value
            assert cfg.model.compile in COMPILE_MODES, name
            # a compiled driver keeps its graphs for the next session, in a file of its own
            cache = f"/.compile_cache/cpu/{name.removeprefix('driver-')}.bin.gz"
            assert cfg.model.compile_cache.endswith(cache) if cfg.model.compile != "off" else not \
                cfg.model.compile_cache, name
            if not args.bench_repeats:  # driver only: no bench/model.py row to match
                continue
            backend = resolve_backend(cfg.model.attention, "cuda")
            variant = train_gpu.bench_variant(backend, "cuda", cfg.model.compile, cfg.model.static_tokens,
                                              cfg.model.precision)
            assert variant in model_bench.variant_names("cuda", cfg.model.compile, cfg.model.static_tokens,
                                                        cfg.model.precision == "fp8"), name
        elif words[:3] == ["python3", "-m", "pytest"]:
            files = [w for w in words if w.startswith("tests/")]
            assert files and all((ROOT / f.split("::")[0]).is_file() for f in files), name
            for f in files:  # a node id: the test function is in its file
                path, _, test = f.partition("::")
                assert not test or f"def {test}(" in (ROOT / path).read_text(), f
        elif words[:2] == ["python3", "data/make_random_shards.py"]:
            shards.parse_args(words[2:])
        elif words[:2] == ["python3", "bench/host_syncs.py"]:
            assert host_syncs.parse_args(words[2:]).device == "cuda", name
        elif words[:2] == ["python3", "bench/fp8_linear.py"]:
            assert fp8_linear.parse_args(words[2:]).compile == "default", name
        elif words[:2] == ["python3", "bench/attention_tiles.py"]:
            assert attention_tiles.parse_args(words[2:]).device == "cuda", name
        else:
            assert name == "setup" and words[:2] == ["bash", "-c"], name


def test_an_unknown_step_or_driver_setting_stops_the_script_before_any_step_runs(tmp_path):
    """Named after valid steps, a typo still stops the call before the first of them spends device time (a
    `driver-compiled-expseg` named in the README before its row existed would have, after setup and shards)."""
    for step, words in (("modle", "unknown step modle"), ("driver-bf61", "no driver setting named bf61")):
        out = run_dry(tmp_path, "setup", "shards", "driver-bf16", step)
        assert out.returncode == 2 and words in out.stderr
        assert "DRY " not in out.stdout and "==" not in out.stdout
    script_steps = re.search(r"^STEPS=\((.*)\)$", SCRIPT.read_text(), flags=re.M).group(1).split()
    assert sorted(script_steps) == sorted(STEPS)


def test_bench_model_refuses_a_variant_it_would_not_build(capsys):
    assert model_bench.main(["--variants", "unpadded/loop", "unpadded/varlen"]) == 2  # varlen is CUDA's
    err = capsys.readouterr().err
    assert "no variant unpadded/varlen" in err and "unpadded/loop" in err


def test_a_rehearsal_runs_the_bf16_drivers_on_the_cpu_at_tiny_size(tmp_path, random_shards):
    """REHEARSE=1: the shards and every driver but torchao's float8 and cuDNN's, on the CPU (BERT tiny, 8 sequences,
    the CPU's attention given last so it wins, but where the row runs our Triton attention, whose torch path the
    CPU runs); every other step is skipped, and the driver's own parser accepts each rehearsal for the CPU, delayed
    float8 rows included."""
    drivers = driver_names()
    out = run_dry(tmp_path, *STEPS, *[f"driver-{name}" for name in drivers], REHEARSE="1")
    assert out.returncode == 0, out.stderr
    ran = [shlex.split(line)[1:] for line in out.stdout.splitlines() if line.startswith("DRY ")]
    skipped = re.findall(r"^== (\S+): skipped", out.stdout, flags=re.M)
    gpu_only = {name for name in drivers if re.search(r"--attention cudnn", driver_flags(name))
                or ("--precision fp8" in driver_flags(name) and "FP8_RECIPE=delayed" not in driver_flags(name))}
    candidate = "fp8-delayed-lean-norm-triton-biasgelu-combo-graphs"
    assert {"fp8", "cudnn", "graphs-opt", candidate} & set(drivers) == {"fp8", "cudnn", "graphs-opt", candidate}
    assert {"fp8", "cudnn"} <= gpu_only and candidate not in gpu_only
    assert skipped == [s for s in STEPS if s != "shards"] + [f"driver-{n}" for n in drivers if n in gpu_only]
    assert [r[0] for r in ran] == ["shards"] + [f"driver-{n}" for n in drivers if n not in gpu_only]
    assert ran[0][2:] == ["python3", "data/make_random_shards.py", "--out", "/tmp/shards", "--samples", "4000",
                          "--shards", "4", "--eval-samples", "500"]
    for name, limit, *words in ran[1:]:
        argv = words[2:]
        argv[argv.index("--data") + 1] = str(random_shards)
        args = train_gpu.parse_args(argv)
        flags = driver_flags(name.removeprefix("driver-"))
        attention = "triton" if "--attention triton" in flags else "loop"
        assert (limit, args.device, args.bert_config, args.batchsize, args.attention) == ("900", "cpu", "tiny", "8",
                                                                                           attention), name
        assert args.json.name == f"train_gpu_cpu_{name.removeprefix('driver-')}.json"
        cfg = from_env_and_args([], environ=train_gpu.driver_env(args, tmp_path / name))
        assert resolve_backend(cfg.model.attention, "cpu") == attention, name
        check_fp8(cfg.model.precision, torch.device("cpu"), cfg.model.fp8_recipe)  # only FP8_RECIPE=delayed gets here
        check_compile(cfg.model.compile, torch.device("cpu"))  # CUDA graphs' reduce-overhead is COMPILE=default here
        if "--compile reduce-overhead" in driver_flags(name.removeprefix("driver-")):
            assert cfg.model.compile == "default", name


def test_a_failing_fp8_linear_variant_costs_its_row_not_the_table():
    """bench/fp8_linear.py's float8 variants never ran on a GPU: one raising at its first call (a compiler or kernel
    error) is taken out of the timing with its error line, and the others run."""
    calls = []

    def fails():
        raise RuntimeError("Triton compilation failed\nlong traceback")

    steps = {("qkv", "bf16"): lambda: calls.append("bf16"), ("qkv", "fp8-rowwise compiled"): fails}
    assert fp8_linear.first_calls(steps) == {("qkv", "fp8-rowwise compiled"): "RuntimeError: Triton compilation failed"}
    assert list(steps) == [("qkv", "bf16")] and calls == ["bf16"]


@pytest.mark.slow
def test_a_step_is_cut_to_the_time_the_call_has_left_and_its_log_comes_back(tmp_path):
    """The device tool ends a call at its limit and loses what the running step wrote: a step's limit (shards: 300 s)
    is cut to the DEADLINE less 15 s to pack, and a step with under 30 s left is skipped."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "SHARDS": str(tmp_path / "s"),
           "DEADLINE": "46", "CACHES": str(tmp_path / "caches"), "SHARD_SAMPLES": "20000"}
    # a compile cache carried in (older than the call) and one a driver of this call wrote (newer): only the new one
    # comes back, in parts of at most 15 MiB
    caches = tmp_path / "caches" / "NVIDIA_H200"
    caches.mkdir(parents=True)
    (caches / "old.bin").write_bytes(b"o" * 100)
    (caches / "new.bin").write_bytes(os.urandom(16 * 2**20))  # incompressible: two parts
    # and the gzip'd one of a driver of this call, beside the temporary file of one stopped while saving
    (caches / "row.bin.gz").write_bytes(b"g" * 100)
    (caches / ".row.bin.gz.tmp-123").write_bytes(b"t" * 100)
    (caches / "row.keys.json").write_text("{}")  # the keys its graphs had there (bench/gpu_cache.py --diff)
    os.utime(caches / "old.bin", (1, 1))
    for name in ("new.bin", "row.bin.gz", ".row.bin.gz.tmp-123", "row.keys.json"):
        os.utime(caches / name, (2**31, 2**31))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # python3: the venv's, as the device machine's own
    (tmp_path / "out").mkdir()
    out = subprocess.run(["bash", str(SCRIPT), "shards", "fp8-linear"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    # 46 less 15 to pack, less what the script took to reach the step: bash's SECONDS counts whole seconds of the
    # clock, so a start just before a second's turn reads 1 at once, and a busy machine adds more
    limit = re.search(r"== shards \(limit (\d+) s\)", out.stdout)
    assert limit and 25 <= int(limit[1]) <= 31, out.stdout
    # 20,000 samples take seconds, so under 30 are left (below 0 where the shards ran to their limit on a busy machine)
    assert re.search(r"== fp8-linear: skipped \(-?\d+ s left before DEADLINE=46\)", out.stdout), out.stdout
    steps = (tmp_path / "work" / "steps.txt").read_text().splitlines()
    assert steps[0].startswith("shards exit=") and steps[1] == "fp8-linear skipped", steps
    with tarfile.open(tmp_path / "out" / "cuda_session.tgz") as archive:
        assert "./shards.log" in archive.getnames()
    parts = sorted((tmp_path / "out").glob("compile_cache.tgz.part-*"))
    assert [p.name for p in parts] == ["compile_cache.tgz.part-00", "compile_cache.tgz.part-01"]
    assert parts[0].stat().st_size == 15 * 2**20
    assert brought_back(tmp_path / "out") == {"./NVIDIA_H200/new.bin": (caches / "new.bin").read_bytes(),
                                              "./NVIDIA_H200/row.bin.gz": b"g" * 100,
                                              "./NVIDIA_H200/row.keys.json": b"{}"}
    # caches over CACHE_LIMIT_MIB would come back cut (the tool returns 64 MiB in all): said, and left behind
    (tmp_path / "out2").mkdir()
    out = subprocess.run(["bash", str(SCRIPT), "shards"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**env, "OUT": str(tmp_path / "out2"), "CACHE_LIMIT_MIB": "10", "SHARD_SAMPLES": "200"})
    assert "== compile caches: 16 MiB packed, over the 10 MiB that can come back (CACHE_LIMIT_MIB=10): not brought " \
        "back" in out.stdout, out.stdout
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["cuda_session.tgz"]  # no part, no folder


@pytest.mark.slow
def test_a_second_run_in_the_same_call_brings_back_what_both_runs_compiled(tmp_path):
    """Two runs of the script in one device call (one $OUT): the second's parts replace the first's, so they must
    hold the caches compiled since the call's start, not since the second run's; a new call (an empty $OUT) starts
    afresh and sends none of them again; a rehearsal (REHEARSE=1) always starts afresh."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "SHARDS": str(tmp_path / "s"),
           "CACHES": str(tmp_path / "caches"), "SHARD_SAMPLES": "200",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    caches = tmp_path / "caches" / "NVIDIA_H100"
    caches.mkdir(parents=True)
    (tmp_path / "out").mkdir()

    def run(out: str, **more: str) -> None:
        done = subprocess.run(["bash", str(SCRIPT), "shards"], cwd=ROOT,
                              env={**env, "OUT": str(tmp_path / out), **more}, capture_output=True, text=True,
                              timeout=120)
        assert "== shards: exit 0" in done.stdout, done.stdout + done.stderr

    run("out")
    start = (tmp_path / "work" / ".call_start").stat().st_mtime - 10  # the call started 10 s ago
    os.utime(tmp_path / "work" / ".call_start", (start, start))
    (caches / "first.bin").write_bytes(b"f" * 100)  # as the first run's driver wrote it, 5 s after the call started
    os.utime(caches / "first.bin", (start + 5, start + 5))
    run("out")  # a restarted call start (now) would leave first.bin out
    assert list((tmp_path / "out").glob("compile_cache.tgz.part-*")), "the first run's cache did not come back"
    assert list(brought_back(tmp_path / "out")) == ["./NVIDIA_H100/first.bin"]
    (tmp_path / "out2").mkdir()
    run("out2")
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["cuda_session.tgz"]
    # a rehearsal's $OUT is never emptied, so it would always look like a second run: each rehearsal starts afresh
    os.utime(tmp_path / "work" / ".call_start", (start, start))
    run("out2", REHEARSE="1")
    assert (tmp_path / "work" / ".call_start").stat().st_mtime > start + 5
