"""COMPILE_CACHE (bert.train.compile_cache): a later process loads what an earlier one compiled, so inductor generates
no code; the reference is torch's own cache counters (misses in the first process, hits and no miss in the second)
and the compiled function's values, equal in both. Each process has its own empty local inductor cache, as a fresh
container or a bare device machine has."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

from bert.train.compile_cache import keys_path

ROOT = Path(__file__).resolve().parents[1]

# One process of a run: the cache loaded, a small forward and backward compiled by inductor (dynamic, as the driver
# compiles), the cache written; its report lines, torch's cache counters and the values, as JSON on the last line.
# GEMMs alone: inductor still generates, keys and caches both graphs' code (a wrapper calling the GEMMs), and
# compiles no C++, which with its empty cache (CPU ISA probes included) took a process 16 s instead of 6; so no
# C++ compiler is needed (it ran with CXX=/nonexistent/g++), and CXX is a name in the key, nothing more.
SCRIPT = """
import json, sys, torch
from torch._dynamo.utils import counters
from bert.train.compile_cache import load_compile_cache, recording_keys, save_compile_cache, save_keys, served
from bert.train.profile import compile_counters
path = sys.argv[1]
lines = [load_compile_cache(path)]
before = compile_counters()
def f(x, w):
    return x @ w
torch.manual_seed(0)
x, w = torch.randn(7, 16), torch.randn(16, 8, requires_grad=True)
with recording_keys() as keys:
    y = torch.compile(f, dynamic=True)(x, w)
    y.sum().backward()
lines.append(served(before, compile_counters()))
lines.append(save_compile_cache(path))
lines.append(save_keys(path, keys))
print(json.dumps({"lines": lines, "inductor": dict(counters["inductor"]), "y": y.tolist(), "grad": w.grad.tolist()}))
"""


def one_process(tmp_path: Path, name: str, cache: Path, **env: str) -> dict:
    """SCRIPT in a fresh interpreter with an empty local inductor cache of its own (and `env`); its JSON, its stderr
    as "stderr" and the inductor keys it recorded beside the cache as "inductor_keys"."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"), PYTHONPATH=str(ROOT), **env)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads(keys_path(str(cache)).read_text())
    return {**json.loads(done.stdout.splitlines()[-1]), "stderr": done.stderr,
            "inductor_keys": sorted(recorded["inductor"])}


def artifacts(data: bytes) -> dict[str, list]:
    """The file's artifacts by kind, read without loading them anywhere."""
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.deserialize(data)


def artifact_counts(data: bytes) -> dict[str, int]:
    return {kind: len(found) for kind, found in artifacts(data).items()}


def contents(cache: Path) -> bytes:
    """The file's artifacts, gunzipped for a `.gz` (and then gzip's, not torch's, bytes on disk)."""
    raw = cache.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == (cache.suffix == ".gz")
    return gzip.decompress(raw) if cache.suffix == ".gz" else raw


@pytest.mark.parametrize("name", ["bert.bin", "bert.bin.gz"])
def test_a_later_process_takes_the_compiled_graphs_from_the_file(tmp_path, name):
    cache = tmp_path / "cache" / name  # its folder does not exist yet: the first run makes it
    first = one_process(tmp_path, "first", cache)
    assert "does not exist yet" in first["lines"][0] and first["lines"][2].startswith("compile cache: wrote ")
    compiled = first["inductor"].get("fxgraph_cache_miss", 0)
    assert compiled >= 2 and not first["inductor"].get("fxgraph_cache_hit")
    assert first["lines"][1].startswith(f"compile cache: inductor took 0 graphs from its caches and compiled "
                                        f"{compiled};")
    written = artifact_counts(contents(cache))
    assert written["inductor"] == compiled

    second = one_process(tmp_path, "second", cache)
    assert second["lines"][0].startswith("compile cache: loaded ") and " inductor" in second["lines"][0]
    # every graph the first process compiled (forward and backward) now comes from the file: no code generated
    assert second["inductor"].get("fxgraph_cache_hit") == compiled
    assert not second["inductor"].get("fxgraph_cache_miss")
    assert second["lines"][1].startswith(f"compile cache: inductor took {compiled} graphs from its caches and "
                                         "compiled 0;")
    assert second["y"] == first["y"] and second["grad"] == first["grad"]
    # what it loaded is what it used, written back whole: the same artifacts
    assert artifact_counts(contents(cache)) == written
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".")]  # no temporary file left
    # beside it, the keys each run looked up: the first's, inductor's keys those of the file's graphs; the second
    # took the first's AOT autograd graph, which names inductor's graphs (no key of theirs computed)
    assert first["lines"][3] == f"compile cache: the keys of the graphs looked up ({compiled} inductor, 1 " \
        f"aot_autograd) in {keys_path(str(cache))}"
    assert first["inductor_keys"] == sorted(a.key for a in artifacts(contents(cache))["inductor"])
    assert second["lines"][3].startswith("compile cache: the keys of the graphs looked up (0 inductor, 1 aot")
    assert "FX graph cache hash details" not in first["stderr"] + second["stderr"]  # torch's DEBUG, not printed


def test_a_file_made_under_another_cxx_misses_and_gpu_cache_diff_names_it(tmp_path):
    """What happened to the caches made on the CPU for an H200 (2026-11-27): the GPU machine sets CXX, inductor
    keys every graph on its value, used or not, and every graph missed. Here the same compiler by two names: the
    second process, loading the first's file, compiles everything again, and bench/gpu_cache.py --diff, given the
    two runs' keys, names the setting, inductor's keys and AOT autograd's, in every graph."""
    gpu_cache = load_script("bench/gpu_cache.py")
    ours, theirs = tmp_path / "ours.bin.gz", tmp_path / "theirs.bin.gz"
    first = one_process(tmp_path, "ours", ours, CXX="g++")
    theirs.write_bytes(ours.read_bytes())
    second = one_process(tmp_path, "theirs", theirs, CXX="c++")
    assert second["lines"][0].startswith("compile cache: loaded ")
    compiled = first["inductor"]["fxgraph_cache_miss"]
    assert second["inductor"].get("fxgraph_cache_miss") == compiled and not second["inductor"].get("fxgraph_cache_hit")
    said = gpu_cache.key_differences(keys_path(str(ours)), keys_path(str(theirs)))
    assert said == ["aot_autograd: inductor_config[cpp.cxx], in 1 of 1 graphs: ours \"(None, 'g++')\", theirs "
                    "\"(None, 'c++')\"",
                    f"inductor: inductor_config[cpp.cxx], in {compiled} of {compiled} graphs: ours \"(None, 'g++')\", "
                    f"theirs \"(None, 'c++')\""]
    # a row's file is read with the keys beside it: inductor's parts from the file (the same as the record's here),
    # AOT autograd's from the record
    assert gpu_cache.key_differences(ours, keys_path(str(ours))) == [
        f"aot_autograd: the 1 graphs of {ours} have keys equal to graphs of {keys_path(str(ours))}",
        f"inductor: the {compiled} graphs of {ours} have keys equal to graphs of {keys_path(str(ours))}"]


def test_a_file_torch_cannot_read_is_named_and_left_for_the_run_to_replace(tmp_path):
    from bert.train.compile_cache import load_compile_cache

    damaged = tmp_path / "bert.bin"
    damaged.write_bytes(b"not a cache at all")
    line = load_compile_cache(str(damaged))
    assert f"{damaged} (18 bytes) is not one torch" in line and "compiling from scratch and replacing it" in line
    assert "does not exist yet" in load_compile_cache(str(tmp_path / "none.bin"))
    # compressed: not gzip at all, and gzip's stream cut short
    (tmp_path / "plain.bin.gz").write_bytes(b"not a cache at all")
    cut = tmp_path / "cut.bin.gz"
    cut.write_bytes(gzip.compress(b"artifacts" * 1000)[:40])
    for file in (tmp_path / "plain.bin.gz", cut):
        line = load_compile_cache(str(file))
        assert f"{file} ({file.stat().st_size} bytes) is not one torch" in line and "replacing it" in line


def test_a_cache_that_cannot_be_written_or_read_is_named_and_the_run_goes_on(tmp_path, monkeypatch):
    """Only rank 0 writes the file, after the warm-up: an error raised there would leave the other ranks waiting at
    run_start until the collective timeout. So a read-only or full disk is one line, and the run continues."""
    import torch

    from bert.train.compile_cache import load_compile_cache, save_compile_cache

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache's folder should be")
    line = save_compile_cache(str(blocked / "bert.bin"))
    assert line.startswith(f"compile cache: cannot write {blocked / 'bert.bin'} (") and "the run goes on" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no temporary file left either
    unreadable = tmp_path / "folder.bin"
    unreadable.mkdir()  # exists, but reading it fails
    assert load_compile_cache(str(unreadable)).startswith(f"compile cache: cannot read {unreadable} or fill")


def test_a_cache_with_nothing_compiled_is_refused_in_one_line():
    from bert.config import ConfigError, from_flat

    def cfg(**kw):
        return from_flat(input_dir="d", eval_dir="e", train_batch_size=16, bert_config_path="tiny", max_steps=10,
                         learning_rate=1e-3, compile_cache="/tmp/cache.bin", **kw)

    with pytest.raises(ConfigError, match=r"COMPILE_CACHE.*nothing to keep with COMPILE=off") as e:
        cfg(compile="off").validate()
    assert "\n" not in str(e.value)
    cfg(compile="default").validate()


def test_recording_keys_takes_the_key_records_and_passes_on_what_was_asked_for():
    """Inside, torch's key-detail records (DEBUG) are kept and not printed; a record at or above the level the
    logger had before still reaches torch's handlers (an INFO asked for with TORCH_LOGS, say), one below it does not;
    after, each logger's level and propagation are as they were, also when the block raises."""
    import logging

    from bert.train.compile_cache import recording_keys

    name = "torch._inductor.codecache"
    logger, seen = logging.getLogger(name), []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    watch = Seen(logging.DEBUG)
    logger.parent.addHandler(watch)
    before = (logger.level, logger.propagate)
    logger.setLevel(logging.INFO)
    try:
        with pytest.raises(RuntimeError), recording_keys() as keys:
            logger.debug("FX graph cache hash details for key fabc:\n[h1] gm: graph\n  more of it\n[h2] cxx: g++")
            logger.info("Bypassing FX Graph Cache because ...")
            logging.getLogger(name + ".child").debug("a child's debug")
            raise RuntimeError("the compile failed")
        assert keys["inductor"] == {"fabc": ["[h1] gm: graph", "[h2] cxx: g++"]} and keys["aot_autograd"] == {}
        assert seen == ["Bypassing FX Graph Cache because ..."]
        assert (logger.level, logger.propagate) == (logging.INFO, before[1])
        assert not [h for h in logger.handlers if type(h).__name__ == "_KeyParts"]
    finally:
        logger.parent.removeHandler(watch)
        logger.setLevel(before[0])


def test_each_key_is_on_disk_as_it_comes_so_a_compile_that_never_ends_leaves_them(tmp_path):
    """A driver's compile stopped by a step's deadline (the one-graph float8 model on an H200, 2026-11-27) or by an
    error never reaches save_keys: the keys it looked up must already be beside the cache, each as it came, in a
    folder the cache has not made yet."""
    import logging

    from bert.train.compile_cache import recording_keys

    cache = tmp_path / "not-yet" / "bert.bin.gz"
    inductor = logging.getLogger("torch._inductor.codecache")
    aot = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    with pytest.raises(RuntimeError), recording_keys(to=str(cache)):
        aot.debug("Autograd graph cache hash details for key a1:\n[h0] gm: dynamo's graph")
        assert json.loads(keys_path(str(cache)).read_text())["aot_autograd"] == {"a1": ["[h0] gm: dynamo's graph"]}
        inductor.debug("FX graph cache hash details for key f1:\n[h1] gm: graph\n[h2] cxx: g++")
        raise RuntimeError("the step's deadline")
    assert json.loads(keys_path(str(cache)).read_text()) == {
        "inductor": {"f1": ["[h1] gm: graph", "[h2] cxx: g++"]}, "aot_autograd": {"a1": ["[h0] gm: dynamo's graph"]}}
    assert sorted(p.name for p in cache.parent.iterdir()) == ["bert.keys.json"]  # no temporary file, no cache
