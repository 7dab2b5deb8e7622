"""Where a training step's time goes: torch.profiler over a window of optimizer steps, kernels sorted by kind.

`PROFILE_FROM=S` (with `PROFILE_STEPS=N`, default 5) profiles steps S..S+N-1 of the driver as it runs them,
progress line and any evaluation in between included. Each rank writes `<output_dir>/profile/rank<R>.json`
(the table below, as data) and `rank<R>.trace.json.gz` (the whole timeline, for Perfetto or
chrome://tracing); rank 0 prints the table when the window closes. On a GPU the rows are the device's
kernels (CUPTI, kernels inside CUDA graphs included), on a CPU the training thread's operators by their self
time. Beside them: the wall time per step and the share of it the device was busy with compute, so a
host-bound step (busy well under 100 %) tells itself apart from a slow kernel. On a GPU it also says where the
idle time is: the gaps between kernels by length (launch-sized gaps against stalls), the longest stalls by the
kernels on either side, and the host's waits for the device (synchronizing calls) inside the window. Under COMPILE
the summary also says what torch.compile did: graphs, graph breaks with their reasons, and anything it compiled or
counted inside the window (a steady run compiles nothing there: a recompile or a new CUDA-graph shape in the timed
steps shows up).

Kinds are told apart by name (`KINDS`, first match wins): what inductor fused is one kind whatever it holds,
since a fused kernel's name lists every op it absorbed. Communication runs on its own stream, overlapping
compute, so it is reported but left out of the busy time.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType

KINDS: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|gloo|all_?reduce|reduce_?scatter|all_?gather|broadcast"),
    ("attention", r"flash|fmha|attention|sdpa|_attn"),
    # cuBLAS (nvjet and xmma on Hopper), CUTLASS (torch._scaled_mm's float8), inductor's GEMM templates; aten on CPU
    ("gemm", r"gemm|nvjet|xmma|cutlass|cublas|triton_tem|aten::(add|b|baddb|_scaled_)?mm\b|aten::_?addmm"),
    ("optimizer / foreach", r"multi_tensor|foreach|lamb(?!da)|adam"),  # not C++ "lambda"
    ("compiled fusions", r"^triton_|cpp_fused|compiled"),
    ("layer norm", r"layer_?norm|gammabeta"),
    ("dropout", r"dropout|bernoulli"),
    ("softmax / loss", r"softmax|cross_entropy|nll_loss"),
    ("embedding / index", r"embedding|index|gather|scatter"),
    ("copy / cast", r"copy|memcpy|cat_|catarray|clone|contiguous"),
    ("fill", r"fill|memset|zero"),
    ("elementwise", r"elementwise|aten::(add|mul|sub|div|neg|gelu|tanh|where|pow|sqrt|rsqrt|exp)"),
    ("reduction", r"reduce|aten::(sum|mean|norm|max|min|amax|linalg)"),
)
_PATTERNS = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KINDS)
OTHER = "other"
COMMUNICATION = "communication"
TOP = 15  # kernels listed by name
CPU = torch.device("cpu")
WINDOW = "bert.train.profile step"  # the record_function around each profiled step: marks the training thread


def kind_of(name: str) -> str:
    """The kind of a kernel or operator, by its name (`KINDS`)."""
    return next((kind for kind, pattern in _PATTERNS if pattern.search(name)), OTHER)


def short_name(name: str, width: int = 110) -> str:
    """A kernel name without its C++ return type, namespaces and template arguments, cut to `width`."""
    name = re.sub(r"^void\s+", "", name)
    if "<" in name:
        name = name[:name.index("<")]
    name = re.sub(r"^(\w+::|\(anonymous namespace\)::)+", "", name)
    return name[:width]


@dataclass(frozen=True)
class Timed:
    name: str
    us: float  # microseconds on the device (a kernel's duration), or an operator's own CPU time
    start_us: float | None = None  # a kernel's start on the device's clock; None for a CPU operator's self time


def covered_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# Gap lengths (microseconds) the idle time is binned by: under 10 us is a launch's latency between kernels queued
# back to back; longer ones are the device waiting for the host (a slow launch path, a sync, a copy).
GAP_CLASSES: tuple[tuple[float, str], ...] = ((10.0, "under 10 us"), (100.0, "10-100 us"), (1000.0, "0.1-1 ms"),
                                              (float("inf"), "1 ms and over"))
STALL_US = 10.0  # a gap at least this long is a stall: its neighbours are listed
WAITS = 5  # neighbour pairs listed
# The host's calls that wait for the device: a stream's, the device's or an event's synchronize, a synchronous copy,
# and `.item()` (aten's _local_scalar_dense, a copy and a synchronize of its own)
HOST_WAITS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$|^aten::_local_scalar_dense$")


def idle_gaps(spans: Iterable[tuple[float, float, str]], steps: int) -> dict:
    """The device's idle time between its first kernel's start and its last kernel's end, from (start, end, name)
    spans in microseconds (kernels on several streams may overlap: a gap is where none runs). Per step: the gaps'
    time and count in all and by length (`GAP_CLASSES`), and the stalls' time (gaps of `STALL_US` and longer) by
    the kernels on either side: the one whose end began the gap (the latest to end so far) and the one whose start
    ended it."""
    ordered = sorted(spans)
    classes = [[0.0, 0] for _ in GAP_CLASSES]
    waits: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    end, before = float("-inf"), ""
    for start, stop, name in ordered:
        if start > end > float("-inf"):
            gap = start - end
            entry = classes[next(i for i, (limit, _) in enumerate(GAP_CLASSES) if gap < limit)]
            entry[0] += gap
            entry[1] += 1
            if gap >= STALL_US:
                wait = waits[(short_name(before), short_name(name))]
                wait[0] += gap
                wait[1] += 1
        if stop > end:
            end, before = stop, name
    total_us, count = sum(us for us, _ in classes), sum(n for _, n in classes)
    return {"ms_per_step": total_us / 1e3 / steps, "gaps_per_step": count / steps,
            "by_length": [{"length": label, "ms_per_step": us / 1e3 / steps, "gaps_per_step": n / steps}
                          for (_, label), (us, n) in zip(GAP_CLASSES, classes, strict=True)],
            "stalls": [{"after": a, "before": b, "ms_per_step": us / 1e3 / steps, "gaps_per_step": n / steps}
                       for (a, b), (us, n) in sorted(waits.items(), key=lambda kv: -kv[1][0])[:WAITS]]}


def host_waits(events: Iterable, steps: int) -> dict[str, dict[str, float]]:
    """The host's calls that wait for the device (`HOST_WAITS`) inside the profiled steps (the step marker's
    ranges: the window's own synchronizes at its edges left out), on any thread, per step: calls and time."""
    events = list(events)
    steps_at = [(e.time_range.start, e.time_range.end) for e in events
                if e.name == WINDOW and e.device_type == DeviceType.CPU]
    found: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.device_type == DeviceType.CPU and HOST_WAITS.match(e.name) and any(
                a <= e.time_range.start <= b for a, b in steps_at):
            found[e.name][0] += e.time_range.elapsed_us()
            found[e.name][1] += 1
    return {name: {"calls_per_step": n / steps, "ms_per_step": us / 1e3 / steps}
            for name, (us, n) in sorted(found.items(), key=lambda kv: -kv[1][0])}


def summarize(records: Iterable[Timed], steps: int, wall_s: float) -> dict:
    """The window's time per kind and its top kernels, per step; `busy_share` is compute (communication left
    out: it overlaps on its own stream) over wall time, where compute is the union of the kernels' intervals when
    they have a start (on a GPU: streams overlap), else the sum of the times (one CPU thread's self times).
    Each kind's `share` is of the summed compute time."""
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans: list[tuple[float, float, str]] = []
    timed = True  # every compute record has a start
    for r in records:
        kind = kind_of(r.name)
        for table, key in ((by_kind, kind), (by_name, (short_name(r.name), kind))):
            table[key][0] += r.us
            table[key][1] += 1
        if kind != COMMUNICATION:
            timed = timed and r.start_us is not None
            if timed:
                spans.append((r.start_us, r.start_us + r.us, r.name))
    summed_ms = sum(us for kind, (us, _) in by_kind.items() if kind != COMMUNICATION) / 1e3 / steps
    busy_ms = covered_us((a, b) for a, b, _ in spans) / 1e3 / steps if timed else summed_ms
    wall_ms = wall_s * 1e3 / steps
    kinds = [{"kind": kind, "ms_per_step": us / 1e3 / steps, "calls_per_step": n / steps,
              "share": us / 1e3 / steps / summed_ms if summed_ms else 0.0}
             for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])]
    top = [{"name": name, "kind": kind, "ms_per_step": us / 1e3 / steps, "calls_per_step": n / steps}
           for (name, kind), (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]]
    return {"steps": steps, "wall_ms_per_step": wall_ms, "busy_ms_per_step": busy_ms, "kernel_ms_per_step": summed_ms,
            "busy_share": busy_ms / wall_ms if wall_ms else 0.0, "kinds": kinds, "top": top,
            "idle": idle_gaps(spans, steps) if timed and spans else None}


def device_records(events: Iterable, device: torch.device, thread: int | None) -> Iterator[Timed]:
    """On a GPU every kernel, copy and memset the device ran; on a CPU the operators of the training thread
    (`thread`), each by its self time (a parent's time is its children's, counted there)."""
    for e in events:
        if device.type == "cuda":  # kernels, copies and memsets; not record_function ranges mirrored on the device
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
                yield Timed(e.name, e.time_range.elapsed_us(), e.time_range.start)
        elif e.device_type == DeviceType.CPU and not e.is_async and e.thread == thread and e.name != WINDOW:
            yield Timed(e.name, e.self_cpu_time_total)


def compile_counters() -> dict[str, dict[str, int]] | None:
    """torch.compile's counters (dynamo's frames, graphs, graph breaks, recompiles; inductor's), or None when
    nothing was compiled in this process (torch._dynamo never imported: importing it costs a second)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return None if utils is None else {group: dict(c) for group, c in utils.counters.items()}


def compile_report(before: dict | None, after: dict | None) -> dict | None:
    """Graphs and graph breaks so far (reasons by their first line), the graphs inductor left out of CUDA graphs (under
    reduce-overhead: a skip in the warm-up would make a "graphs" run eager, and say nothing else; its reason is in
    TORCH_LOGS=cudagraphs), and the counters that moved in the window."""
    if after is None:
        return None
    def named(counts: dict[str, int]) -> dict[str, int]:  # graph-break reasons are paragraphs: their first line
        return {str(k).splitlines()[0][:100]: v for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if v}

    breaks = after.get("graph_break", {})
    moved = {group: named({k: v - (before or {}).get(group, {}).get(k, 0) for k, v in counts.items()})
             for group, counts in after.items()}
    return {"unique_graphs": after.get("stats", {}).get("unique_graphs", 0), "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": named(breaks),
            "cudagraph_skips": after.get("inductor", {}).get("cudagraph_skips", 0),
            "in_window": {g: c for g, c in moved.items() if c}}


# The caching allocator's calls to the driver, counted over the window: a steady step reuses its blocks and makes none.
# Token counts change every step, so blocks may not fit: a cudaMalloc that fails makes the allocator free its cache,
# synchronizing the device, and retry. One of those per step would leave the GPU idle while the host waits.
# (Under expandable segments the first two count its cuMemMap / cuMemUnmap calls.)
ALLOCATOR_COUNTS = {"num_device_alloc": "device allocations", "num_device_free": "device frees",
                    "num_alloc_retries": "retries (cache freed, device synchronized)"}


def allocator_counts(stats: dict) -> dict[str, int]:
    """ALLOCATOR_COUNTS' counters from `torch.cuda.memory_stats()` (0 where this torch lacks one)."""
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTS}


def allocator_line(moved: dict[str, int]) -> str:
    """What the allocator did in the window, as one line of the table."""
    counts = ", ".join(f"{moved[key]} {name}" for key, name in ALLOCATOR_COUNTS.items())
    return f"  allocator in the window: {counts}"


def format_table(summary: dict) -> str:
    lines = [f"profile: steps {summary['first']}-{summary['last']} on {summary['device']}: "
             f"{summary['wall_ms_per_step']:.1f} ms per step, device busy {summary['busy_ms_per_step']:.1f} ms "
             f"({summary['busy_share']:.0%})" + overlap_note(summary)
             + (f", peak memory {summary['peak_memory_gib']:.1f} GiB" if summary.get("peak_memory_gib") else "")
             + (f" ({summary['reserved_memory_gib']:.1f} GiB reserved)" if summary.get("reserved_memory_gib") else ""),
             f"  {'kind':<22}{'ms/step':>9}{'share':>8}{'calls/step':>12}"]
    lines += [f"  {k['kind']:<22}{k['ms_per_step']:>9.2f}{k['share']:>8.1%}{k['calls_per_step']:>12.0f}"
              for k in summary["kinds"]]
    lines += [f"  top: {t['ms_per_step']:7.2f} ms x{t['calls_per_step']:<5.0f} {t['kind']:<20} {t['name']}"
              for t in summary["top"]]
    lines += idle_lines(summary.get("idle"), summary.get("host_waits"))
    if summary.get("allocator") is not None:
        lines.append(allocator_line(summary["allocator"]))
    compiled = summary.get("compile")
    if compiled and (compiled["unique_graphs"] or compiled["graph_breaks"] or compiled["in_window"]):
        skips = compiled.get("cudagraph_skips", 0)
        lines.append(f"  compile: {compiled['unique_graphs']} graphs, {compiled['graph_breaks']} graph breaks"
                     + (f", {skips} left out of CUDA graphs (TORCH_LOGS=cudagraphs says why)" if skips else "")
                     + "".join(f"; {n} x {reason}" for reason, n in list(compiled["graph_break_reasons"].items())[:3]))
        lines.append("  compile in the window: " + moved_counters(compiled["in_window"]))
    return "\n".join(lines)


def idle_lines(idle: dict | None, waits: dict | None) -> list[str]:
    """The table's lines on the idle device: the gaps by length, the longest stalls' neighbours, the host's waits."""
    if not idle:
        return []
    lengths = "; ".join(f"{c['length']}: {c['gaps_per_step']:.1f} gaps, {c['ms_per_step']:.2f} ms"
                        for c in idle["by_length"] if c["gaps_per_step"])
    lines = [f"  idle between kernels: {idle['ms_per_step']:.2f} ms per step in {idle['gaps_per_step']:.0f} gaps"
             + (f" ({lengths})" if lengths else "")]
    lines += [f"  stall: {w['ms_per_step']:7.2f} ms x{w['gaps_per_step']:<5.1f} after {w['after']} before {w['before']}"
              for w in idle["stalls"]]
    if waits is not None:
        lines.append("  host waits for the device in the steps: " + ("none" if not waits else "; ".join(
            f"{name} x{w['calls_per_step']:.1f} ({w['ms_per_step']:.2f} ms)" for name, w in waits.items())))
    return lines


def overlap_note(summary: dict) -> str:
    """The summed kernel time where kernels overlapped (streams), beside the busy time that counts them once."""
    summed = summary.get("kernel_ms_per_step", 0.0)
    return f", kernels {summed:.1f} ms overlapping" if summed > 1.01 * summary["busy_ms_per_step"] else ""


def moved_counters(moved: dict[str, dict[str, int]]) -> str:
    """`compile_report`'s counters that moved, as one line ("nothing" when none did)."""
    return "nothing" if not moved else "; ".join(
        f"{group} " + ", ".join(f"{k} +{v}" for k, v in counts.items()) for group, counts in moved.items())


class StepProfiler:
    """Profiles optimizer steps first..first+steps-1 (none when `first` is 0): `train()` runs each step inside
    `step(n)`, and `close()` ends a window the run stopped inside."""

    def __init__(self, first: int = 0, steps: int = 5, out_dir: Path | str = ".", rank: int = 0,
                 device: torch.device = CPU, announce: bool = False):
        self.first, self.last = first, first + steps - 1
        self.out_dir, self.rank, self.device, self.announce = Path(out_dir) / "profile", rank, device, announce
        self._prof: torch.profiler.profile | None = None
        self._started = 0.0
        self._done = 0
        self._counters: dict | None = None
        self._allocations: dict[str, int] = {}  # the allocator's counters at the window's start (CUDA)

    @contextmanager
    def step(self, number: int) -> Iterator[None]:
        if not self.first or not self.first <= number <= self.last:
            yield
            return
        if self._prof is None:
            self._start()
        with torch.profiler.record_function(WINDOW):
            yield
        self._done += 1
        if number == self.last:
            self.close()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # the window's peak, not the warm-up's or the compile's
            self._allocations = allocator_counts(torch.cuda.memory_stats(self.device))
        self._counters = compile_counters()
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self._started = time.perf_counter()

    def close(self) -> dict | None:
        """End the window (if one is open) and write its summary and trace; returns the summary."""
        if self._prof is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._started
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        events = prof.events()
        thread = next((e.thread for e in events if e.name == WINDOW), None)
        summary = summarize(device_records(events, self.device, thread), max(self._done, 1), wall)
        summary.update(first=self.first, last=self.first + self._done - 1, device=device_label(self.device),
                       compile=compile_report(self._counters, compile_counters()))
        if self.device.type == "cuda":
            summary["host_waits"] = host_waits(events, max(self._done, 1))
            summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            # a CUDA graph's replay allocates nothing: its pool shows in what the allocator holds, not in the peak
            summary["reserved_memory_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            after = allocator_counts(torch.cuda.memory_stats(self.device))
            summary["allocator"] = {k: after[k] - self._allocations[k] for k in after}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(summary, indent=1) + "\n")
        prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.trace.json.gz"))
        if self.announce:
            print(format_table(summary), flush=True)
        return summary


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
