"""`COMPILE_CACHE=FILE`: what torch.compile built, kept in one file between runs (torch's portable "mega-cache").

Why: the driver compiles before run_start, in the rules' untimed initialisation, but that time is still spent. On
one H200 (2026-11-26) BERT-large's graphs took 81 s and the compiled LAMB update 160 s from an empty inductor cache,
and 32 s and 16 s when the same machine had compiled them before. A submission's ten runs, each in a fresh
container, or on nodes whose local caches never saw the graphs, pay the cold figure every time; so does each call
of a device session, on a machine that starts bare.

So the first run writes inductor's compiled graphs (the GPU kernels' binaries inside them: torch bundles Triton's
output into its graph cache), AOT autograd's entries and any autotuning results to FILE, and a later run loads
them into its local caches before it compiles: its compile is then the tracing alone. torch records the
artifacts a run loads as well as those it builds, so the file rewritten after a run holds exactly what that run
used (a cache that grew stale goes with the next run). Dynamo's tracing is not cached, and nothing is trusted
blindly: torch keys every artifact on the graph, its inputs, the compile settings and torch's version, so a file
from other code or another torch just misses, and the run compiles as it would have.

Loaded by every rank (each fills its own local caches), written by rank 0 alone, through a temporary file renamed
into place, after the warm-up (`bert.train.warmup`): all of it before run_start. A FILE ending `.gz` is gzip's: the
Triton kernels' sources, intermediate forms and binaries shrink about 6x (BERT-large's bf16 graphs with the flat
LAMB update: 17.4 MB, 2.7 MB compressed in 0.4 s), which counts where the file travels (a device session carries
64 MiB). After the warm-up `served` says how many graphs the caches gave and how many were compiled.

Beside FILE, `<name>.keys.json` keeps each graph's cache key part by part, as torch computed it in this run
(`recording_keys`): where a file made on another machine missed, bench/gpu_cache.py --diff compares the two
machines' parts and names those that differ (the CPU-made caches missed on an H200 by the C++ compiler's name,
2026-11-27). Inductor keeps its parts inside its artifacts too; AOT autograd does not.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from bert.data.format import atomic_output

KINDS = ("inductor", "aot_autograd", "autotune")  # the artifact kinds counted in the report lines


def _counts(info) -> str:
    """'4 inductor, 2 aot_autograd' from torch's CacheInfo (kinds with none left out)."""
    counts = {kind: len(getattr(info, f"{kind}_artifacts", [])) for kind in KINDS}
    return ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "no artifacts"


def unpacked(file: Path, raw: bytes | None = None) -> bytes:
    """A cache file's artifacts as torch wrote them: gunzipped for a `.gz`."""
    raw = file.read_bytes() if raw is None else raw
    return gzip.decompress(raw) if file.suffix == ".gz" else raw


def load_compile_cache(path: str) -> str:
    """Fill this process's torch.compile caches from `path` before anything compiles; a one-line report. A missing
    file is a first run. A file torch cannot read (damaged, or written by another torch) is said so and ignored:
    the run compiles from scratch and `save_compile_cache` replaces it."""
    file = Path(path)
    try:
        if not file.exists():
            return (f"compile cache: {path} does not exist yet; compiling from scratch and writing it after the "
                    "warm-up")
        raw = file.read_bytes()
        info = torch.compiler.load_cache_artifacts(unpacked(file, raw))  # writes them into this machine's local caches
    except (gzip.BadGzipFile, EOFError, zlib.error):  # a damaged .gz (before OSError, BadGzipFile's base): replaced,
        info = None  # as a file torch cannot read
    except OSError as e:  # a cache is optional: the run compiles without it
        return f"compile cache: cannot read {path} or fill the local caches from it ({e.strerror or e}); " \
            "compiling from scratch"
    if info is None:
        return (f"compile cache: {path} ({len(raw):,} bytes) is not one torch {torch.__version__} can read; "
                "compiling from scratch and replacing it after the warm-up")
    return f"compile cache: loaded {_counts(info)} ({len(raw):,} bytes) from {path}"


def save_compile_cache(path: str) -> str:
    """Write what this process's compiles built or loaded to `path` (atomically); a one-line report."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:  # COMPILE=debug (dynamo and AOT autograd run eagerly), or torch could not pickle them
        return (f"compile cache: nothing to write (nothing cacheable was compiled, or torch could not serialize it: "
                f"see its warning above); {path} left as it was")
    data, info = saved
    if Path(path).suffix == ".gz":
        data = gzip.compress(data, compresslevel=6, mtime=0)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            tmp.write_bytes(data)
    except OSError as e:  # only rank 0 writes: raising here would leave the others waiting at run_start
        return f"compile cache: cannot write {path} ({e.strerror or e}); the run goes on, the next one compiles again"
    return f"compile cache: wrote {_counts(info)} ({len(data):,} bytes) to {path}"


def served(before: dict | None, after: dict | None) -> str:
    """One line from torch.compile's counters (`bert.train.profile.compile_counters`) before and after a warm-up: the
    graphs inductor took from its caches and those it compiled, and AOT autograd's (a graph it cannot cache is
    traced again, its inductor graph still taken from the cache; bert.model.compile_keys says which it can)."""
    def moved(group: str, key: str) -> int:
        return (after or {}).get(group, {}).get(key, 0) - (before or {}).get(group, {}).get(key, 0)

    hits, misses = moved("inductor", "fxgraph_cache_hit"), moved("inductor", "fxgraph_cache_miss")
    aot = [moved("aot_autograd", f"autograd_cache_{k}") for k in ("hit", "miss", "bypass")]
    return (f"compile cache: inductor took {hits} graphs from its caches and compiled {misses}; AOT autograd took "
            f"{aot[0]}, traced {aot[1]} and {aot[2]} it cannot cache")


# torch logs each graph's cache key, part by part, at DEBUG: inductor's and AOT autograd's (torch 2.11 and 2.13)
KEY_LOGS = {"torch._inductor.codecache": ("inductor", "FX graph cache hash details for key "),
            "torch._functorch._aot_autograd.autograd_cache": ("aot_autograd",
                                                              "Autograd graph cache hash details for key ")}
PREVIEW = 200  # characters of a part's value kept: its hash, kept whole, is what compares


def keys_path(path: str) -> Path:
    """Where `recording_keys`'s record of a run with COMPILE_CACHE=`path` goes: `x.bin.gz` -> `x.keys.json`."""
    file = Path(path)
    return file.with_name(file.name.removesuffix(".gz").removesuffix(".bin") + ".keys.json")


class _KeyParts(logging.Handler):
    """Takes torch's key-detail records ("[hash] part: value" lines under "... for key K:") into `keys`, by kind and
    key; anything else those loggers say at the level they had before (`levels`) goes on to torch's handlers, as it
    would have."""

    def __init__(self, loggers: dict[str, logging.Logger], levels: dict[str, int], to: str | None = None):
        super().__init__(logging.DEBUG)
        self.loggers, self.levels, self.to = loggers, levels, to
        self.keys = {kind: {} for kind, _ in KEY_LOGS.values()}

    def emit(self, record: logging.LogRecord) -> None:
        kind, prefix = KEY_LOGS[record.name] if record.name in KEY_LOGS else (None, None)
        text = record.getMessage() if kind else ""
        if kind and text.startswith(prefix):
            key, _, lines = text[len(prefix):].partition(":\n")
            self.keys[kind][key] = [line[:PREVIEW] for line in lines.splitlines() if line.startswith("[")]
            if self.to:  # at once: a compile killed by a deadline or failing still leaves the keys it looked up
                with contextlib.suppress(OSError):  # said by save_keys at the end, if the run gets there
                    write_keys(self.to, self.keys)
        else:  # theirs or a child logger's, which stops here too
            attached = next(n for n in self.loggers if record.name == n or record.name.startswith(n + "."))
            if record.levelno >= self.levels[attached]:
                self.loggers[attached].parent.handle(record)


@contextlib.contextmanager
def recording_keys(enabled: bool = True, to: str | None = None) -> Iterator[dict]:
    """While inside, each graph's cache key parts that torch logs (`KEY_LOGS`), collected into the dict yielded
    ({"inductor": {key: lines}, "aot_autograd": {...}}); torch's own handlers print none of those DEBUG records.
    With `to` (a COMPILE_CACHE path), the record is also written to `keys_path(to)` as each key comes: on an H200
    (2026-11-27) the one-graph float8 model's compile outlasted its step's deadline, and the keys kept only at its
    end would have gone with it."""
    if not enabled:
        yield {}
        return
    loggers = {name: logging.getLogger(name) for name in KEY_LOGS}
    before = {name: (logger.level, logger.propagate) for name, logger in loggers.items()}
    handler = _KeyParts(loggers, {name: logger.getEffectiveLevel() for name, logger in loggers.items()}, to)
    for logger in loggers.values():
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # their DEBUG records would reach torch's handlers, which print DEBUG
        logger.addHandler(handler)
    try:
        yield handler.keys
    finally:
        for name, logger in loggers.items():
            logger.removeHandler(handler)
            logger.setLevel(before[name][0])
            logger.propagate = before[name][1]


def write_keys(path: str, keys: dict) -> Path:
    """`keys` (recording_keys's) into `keys_path(path)`, atomically (a reader never sees half a file)."""
    file = keys_path(path)
    file.parent.mkdir(parents=True, exist_ok=True)  # a first run's keys come before its cache makes the folder
    with atomic_output(file) as tmp:
        tmp.write_text(json.dumps(keys, indent=0) + "\n")
    return file


def save_keys(path: str, keys: dict) -> str:
    """`write_keys`, reported in one line, an error too."""
    try:
        file = write_keys(path, keys)
    except OSError as e:
        return f"compile cache: cannot write {keys_path(path)} ({e.strerror or e})"
    counts = ", ".join(f"{len(found)} {kind}" for kind, found in keys.items())
    return f"compile cache: the keys of the graphs looked up ({counts}) in {file}"
