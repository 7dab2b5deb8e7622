"""The step profiler (bert.train.profile): kernels sorted into the right kinds, a window of known work measured as
that work, and the driver's PROFILE_FROM window written without changing what the run computes."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from script_modules import load_script
from torch.autograd import DeviceType

from bert.train.loop import train
from bert.train.profile import (
    COMMUNICATION,
    WINDOW,
    StepProfiler,
    Timed,
    allocator_counts,
    covered_us,
    device_records,
    format_table,
    host_waits,
    idle_gaps,
    kind_of,
    short_name,
    summarize,
)

hs = load_script("bench/host_syncs.py")

# Kernel names as an H100 profile of the driver lists them (torch 2.11, CUDA 13), and CPU operator names.
KNOWN = {
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopB_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__"
    "5x_cublas": "gemm",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GemmShape<>>>(...)": "gemm",
    "triton_tem_fused_addmm_0": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>, true, false>(Flash_fwd_params)":
        "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(Flash_bwd_params)": "attention",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": COMMUNICATION,
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 4, 2, 0>>": (
        "optimizer / foreach"),
    "triton_red_fused_native_dropout_native_layer_norm_3": "compiled fusions",
    "triton_poi_fused_gelu_1": "compiled fusions",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)": "layer norm",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<c10::BFloat16, float>(...)":
        "layer norm",
    "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float, unsigned int, 1, 4, "
    "bool>(...)": "dropout",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
    "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "softmax / loss",
    "void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(...)": "embedding / index",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(float)#1}, ...>": "copy / cast",
    "Memcpy HtoD (Pinned -> Device)": "copy / cast",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
    "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)": "fill",
    "Memset (Device)": "fill",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>":
        "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<...>>>":
        "reduction",
    "aten::addmm": "gemm",
    "aten::mm": "gemm",
    "aten::bmm": "gemm",
    "aten::native_layer_norm_backward": "layer norm",
    "## Call CompiledFxGraph fabc123 ##": "compiled fusions",
    "aten::_log_softmax": "softmax / loss",
    "aten::add_": "elementwise",
    "aten::sum": "reduction",
    "aten::empty": "other",
}


@pytest.mark.parametrize("name", KNOWN)
def test_kernels_and_operators_fall_into_their_kind(name):
    assert kind_of(name) == KNOWN[name]


def test_short_names_drop_return_type_namespaces_and_templates():
    assert short_name("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>(x)") == \
        "vectorized_layer_norm_kernel"
    assert short_name("nvjet_tst_256x128_64x4_1x2_h_bz_coopB_NNT") == "nvjet_tst_256x128_64x4_1x2_h_bz_coopB_NNT"


def test_summary_is_per_step_and_leaves_overlapping_communication_out_of_the_busy_time():
    records = [Timed("nvjet_a", 3000), Timed("nvjet_a", 3000), Timed("flash_fwd_kernel<x>", 2000),
               Timed("ncclDevKernel_AllReduce", 5000)]
    s = summarize(records, steps=2, wall_s=0.008)
    kinds = {k["kind"]: k for k in s["kinds"]}
    assert s["busy_ms_per_step"] == pytest.approx(4.0) and s["wall_ms_per_step"] == pytest.approx(4.0)
    assert s["busy_share"] == pytest.approx(1.0)
    assert kinds["gemm"]["ms_per_step"] == pytest.approx(3.0) and kinds["gemm"]["share"] == pytest.approx(0.75)
    assert kinds["gemm"]["calls_per_step"] == 1 and kinds[COMMUNICATION]["ms_per_step"] == pytest.approx(2.5)
    assert [t["name"] for t in s["top"]][:2] == ["nvjet_a", "ncclDevKernel_AllReduce"]


def test_kernels_overlapping_on_streams_count_once_in_the_busy_time():
    """Busy time is the union of the kernels' intervals (grouped attention's streams overlap on a GPU); the kinds'
    shares stay of the summed kernel time, and communication stays out of both."""
    records = [Timed("nvjet_a", 3000, start_us=0), Timed("flash_fwd_kernel", 2000, start_us=1000),  # 1-3 ms overlap
               Timed("flash_fwd_kernel", 500, start_us=1500),  # inside both
               Timed("ncclDevKernel_AllReduce", 5000, start_us=3000),  # would fill the gap if counted
               Timed("nvjet_a", 1000, start_us=6000)]
    s = summarize(records, steps=1, wall_s=0.008)
    assert s["busy_ms_per_step"] == pytest.approx(4.0) and s["kernel_ms_per_step"] == pytest.approx(6.5)
    assert s["busy_share"] == pytest.approx(0.5)
    assert {k["kind"]: k["share"] for k in s["kinds"]}["gemm"] == pytest.approx(4 / 6.5)
    assert "kernels 6.5 ms overlapping" in format_table({**s, "first": 1, "last": 1, "device": "cuda"})
    assert covered_us([(5, 6), (0, 2), (1, 3), (2.5, 2.7)]) == pytest.approx(4.0)
    assert covered_us([]) == 0.0


def test_idle_gaps_match_a_count_on_a_microsecond_grid():
    """Random kernels on three streams (overlapping), in whole microseconds: the gaps' time, count and length classes
    equal a count of the idle microseconds on a grid between the first start and the last end."""
    rng = random.Random(7)
    spans = []
    for stream in range(3):
        t = rng.randrange(50)
        for i in range(60):
            t += rng.choice([0, 0, 1, 3, 8, 15, 40, 300, 1500])
            length = rng.randrange(1, 30)
            spans.append((t, t + length, f"k{stream}_{i}"))
            t += length
    busy = bytearray(max(b for _, b, _ in spans) + 1)
    for a, b, _ in spans:
        busy[a:b] = b"\x01" * (b - a)
    runs, run = [], 0  # idle runs between the first start and the last end
    for cell in busy[min(a for a, _, _ in spans):max(b for _, b, _ in spans)]:
        if cell:
            if run:
                runs.append(run)
            run = 0
        else:
            run += 1
    got = idle_gaps(spans, steps=2)
    assert got["ms_per_step"] == pytest.approx(sum(runs) / 1e3 / 2)
    assert got["gaps_per_step"] == pytest.approx(len(runs) / 2)
    classes = {c["length"]: c for c in got["by_length"]}
    for label, low, high in (("under 10 us", 0, 10), ("10-100 us", 10, 100), ("0.1-1 ms", 100, 1000),
                             ("1 ms and over", 1000, 10**9)):
        these = [r for r in runs if low <= r < high]
        assert classes[label]["gaps_per_step"] == pytest.approx(len(these) / 2), label
        assert classes[label]["ms_per_step"] == pytest.approx(sum(these) / 1e3 / 2), label
    assert sum(s["ms_per_step"] for s in got["stalls"]) <= got["ms_per_step"]


def test_stalls_are_named_by_the_kernels_on_either_side():
    """A stall (a gap of 10 us or more) is listed under the kernel that ended last before it and the one that ended
    it, longest first; a launch-sized gap is binned but not listed; overlapping kernels leave no gap."""
    spans = [(0, 100, "void ns::A<int>(x)"), (50, 120, "B"), (150, 160, "C"), (162, 1300, "D"), (2500, 2600, "E"),
             (3100, 3200, "D2"), (3250, 3300, "C")]
    got = idle_gaps(spans, steps=1)
    assert got["ms_per_step"] == pytest.approx((30 + 2 + 1200 + 500 + 50) / 1e3)
    assert [(s["after"], s["before"], s["ms_per_step"]) for s in got["stalls"]] == [
        ("D", "E", pytest.approx(1.2)), ("E", "D2", pytest.approx(0.5)), ("D2", "C", pytest.approx(0.05)),
        ("B", "C", pytest.approx(0.03))]
    assert {c["length"]: c["gaps_per_step"] for c in got["by_length"]} == {
        "under 10 us": 1, "10-100 us": 2, "0.1-1 ms": 1, "1 ms and over": 1}
    s = summarize([Timed(n, b - a, start_us=a) for a, b, n in spans], steps=1, wall_s=0.004)
    s.update(first=1, last=1, device="cuda", host_waits={"cudaStreamSynchronize": {"calls_per_step": 1.0,
                                                                                   "ms_per_step": 1.1}})
    table = format_table(s)
    assert "idle between kernels: 1.78 ms per step in 5 gaps" in table
    assert "stall:    1.20 ms x1.0   after D before E" in table
    assert "host waits for the device in the steps: cudaStreamSynchronize x1.0 (1.10 ms)" in table
    # a short kernel inside a long one on another stream: the gap after them follows the long one
    inside = idle_gaps([(0, 500, "long"), (100, 200, "short"), (600, 700, "next")], steps=1)
    assert [(s["after"], s["before"]) for s in inside["stalls"]] == [("long", "next")]
    assert summarize([Timed("aten::mm", 40)], steps=1, wall_s=0.001)["idle"] is None  # a CPU's operators: no timeline


def test_host_waits_are_the_synchronizing_calls_inside_the_steps():
    """The host's waits for the device are counted inside the step marker's ranges only (the window's own
    synchronizes before and after are not the step's), on any thread; a launch is not a wait."""
    def event(name, start, us, device=DeviceType.CPU, thread=1):
        return SimpleNamespace(name=name, device_type=device, thread=thread,
                               time_range=SimpleNamespace(start=start, end=start + us, elapsed_us=lambda: us))

    events = [event(WINDOW, 0, 100), event(WINDOW, 200, 100),
              event("cudaStreamSynchronize", 50, 30), event("cudaStreamSynchronize", 150, 10),
              event("aten::_local_scalar_dense", 250, 40, thread=2), event("cudaLaunchKernel", 60, 5),
              event("cudaDeviceSynchronize", 310, 900), event("cudaMemcpy", 210, 20),
              event("cudaStreamSynchronize", 220, 10, device=DeviceType.CUDA)]
    assert host_waits(events, steps=2) == {
        "aten::_local_scalar_dense": {"calls_per_step": 0.5, "ms_per_step": 0.02},
        "cudaStreamSynchronize": {"calls_per_step": 0.5, "ms_per_step": 0.015},
        "cudaMemcpy": {"calls_per_step": 0.5, "ms_per_step": 0.01}}
    assert host_waits(events[:2], steps=2) == {}


def test_the_table_gives_what_the_allocator_holds_beside_the_peak():
    """Under CUDA graphs the window's peak misses the graphs' pool (a replay allocates nothing: 7.5 GiB against
    28.9 without graphs on the H200, 2026-11-26); what the allocator holds is printed beside it."""
    s = summarize([Timed("nvjet_a", 1000, start_us=0)], steps=1, wall_s=0.001)
    s.update(first=1, last=1, device="cuda", peak_memory_gib=7.5, reserved_memory_gib=30.25)
    assert "peak memory 7.5 GiB (30.2 GiB reserved)" in format_table(s)


def test_the_table_gives_the_allocators_calls_to_the_driver_in_the_window():
    """A retry (a failed cudaMalloc: the cache freed, the device synchronized) would idle the GPU: the table counts
    the window's cudaMalloc, cudaFree and retries from the allocator's counters, which an older torch may lack."""
    stats = {"num_device_alloc": 7, "num_device_free": 2, "num_alloc_retries": 1, "allocated_bytes.all.peak": 9}
    assert allocator_counts(stats) == {"num_device_alloc": 7, "num_device_free": 2, "num_alloc_retries": 1}
    assert allocator_counts({}) == dict.fromkeys(("num_device_alloc", "num_device_free", "num_alloc_retries"), 0)
    s = summarize([Timed("nvjet_a", 1000, start_us=0)], steps=1, wall_s=0.001)
    s.update(first=1, last=1, device="cuda", allocator={"num_device_alloc": 3, "num_device_free": 0,
                                                         "num_alloc_retries": 2})
    assert ("allocator in the window: 3 device allocations, 0 device frees, 2 retries (cache freed, device "
            "synchronized)" in format_table(s))
    s.pop("allocator")
    assert "allocator" not in format_table(s)  # the CPU's windows count nothing


def test_a_window_of_matmuls_and_a_layer_norm_is_measured_as_that_work(tmp_path, one_thread):
    """Known work on the CPU: the summary attributes it to its kinds, counts the calls, and the busy time stays
    within the wall time it was measured in."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    x = torch.randn(64, 1024)
    prof = StepProfiler(first=2, steps=3, out_dir=tmp_path, device=torch.device("cpu"))
    for n in range(1, 6):
        with prof.step(n):
            for _ in range(4):
                a @ b
            F.layer_norm(x, (1024,))
    s = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    kinds = {k["kind"]: k for k in s["kinds"]}
    assert (s["first"], s["last"], s["steps"]) == (2, 4, 3)
    assert kinds["gemm"]["calls_per_step"] == 4 and kinds["layer norm"]["calls_per_step"] >= 1
    assert kinds["gemm"]["share"] > 0.5  # 4 x 113 MFLOP against one pass over 256 KiB
    assert 0 < s["busy_ms_per_step"] <= s["wall_ms_per_step"]
    with gzip.open(tmp_path / "profile" / "rank0.trace.json.gz") as f:
        assert json.load(f)["traceEvents"]


def test_device_records_are_the_training_threads_operators_or_the_devices_kernels():
    """What `device_records` keeps of a profile's events, on hand-made events: on the CPU the training thread's
    synchronous operators by self time (the step marker, other threads and async spans left out: a prefetch thread's
    collation would count a second core as busy); on a GPU the device's kernels by duration, and no host operator
    and no annotation range (torch's own device totals leave those out: profiler_util.py, pytorch/pytorch#130732)."""
    def event(name, device, thread=1, is_async=False, self_us=0.0, us=0.0, annotation=False):
        return SimpleNamespace(name=name, device_type=device, thread=thread, is_async=is_async,
                               self_cpu_time_total=self_us,
                               time_range=SimpleNamespace(elapsed_us=lambda: us, start=100.0 * len(name)),
                               is_user_annotation=annotation)

    events = [event(WINDOW, DeviceType.CPU, self_us=5), event("aten::mm", DeviceType.CPU, self_us=40),
              event("aten::cat", DeviceType.CPU, thread=2, self_us=30), event("aten::mm", DeviceType.CPU, self_us=2),
              event("gloo:all_reduce", DeviceType.CPU, is_async=True, self_us=9),
              event("nvjet_x", DeviceType.CUDA, thread=0, us=7.5), event("Memset (Device)", DeviceType.CUDA, us=0.5),
              # a record_function range (the step marker, Optimizer.step#..., a compiled region) also arrives as a CUDA
              # event spanning the kernels it launched (is_user_annotation): counted, the busy time came out doubled
              event(WINDOW, DeviceType.CUDA, us=9.0, annotation=True),
              event("Optimizer.step#Lamb.step", DeviceType.CUDA, us=3.0, annotation=True)]
    assert list(device_records(events, torch.device("cpu"), thread=1)) == [Timed("aten::mm", 40), Timed("aten::mm", 2)]
    assert list(device_records(events, torch.device("cuda"), thread=1)) == [Timed("nvjet_x", 7.5, 700.0),
                                                                            Timed("Memset (Device)", 0.5, 1500.0)]


@pytest.fixture(scope="module")
def data(world_of_one, one_thread, tmp_path_factory):
    return hs.write_random_shards(tmp_path_factory.mktemp("data"))


def run_driver(data, out, **settings) -> list[dict]:
    cfg = hs.config(data, out, {"optimizer": "lamb", **settings}, max_steps=6)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        run = hs.build(cfg)
        try:
            assert train(run) == "aborted"
        finally:
            run.loader.close()
            run.progress.close()
    return printed.getvalue(), [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_driver_profiles_its_window_and_trains_the_same(data, tmp_path):
    printed, profiled = run_driver(data, tmp_path / "profiled", profile_from=2, profile_steps=2)
    _, plain = run_driver(data, tmp_path / "plain")
    s = json.loads((tmp_path / "profiled" / "profile" / "rank0.json").read_text())
    assert (s["first"], s["last"], s["steps"]) == (2, 3, 2)
    assert {"gemm", "layer norm", "optimizer / foreach"} <= {k["kind"] for k in s["kinds"]}
    assert "profile: steps 2-3 on cpu" in printed
    assert [r["loss"] for r in profiled] == [r["loss"] for r in plain]  # profiling changes nothing it computes
    assert not (tmp_path / "plain" / "profile").exists()


def test_a_run_ending_inside_the_window_writes_what_it_profiled(data, tmp_path):
    run_driver(data, tmp_path, profile_from=5, profile_steps=10)  # max_steps=6
    s = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert (s["first"], s["last"], s["steps"]) == (5, 6, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_of_a_bert_layer_fall_into_their_kinds(tmp_path):
    """On a GPU the rows are kernels, named by cuBLAS, flash attention and aten: a bf16 GEMM, flash varlen
    attention with dropout, a layer norm and a foreach update each land in their own kind, none in 'other'."""
    from bert.batch import SeqLayout
    from bert.model.cuda_varlen import flash_varlen

    cuda = torch.device("cuda")
    x = torch.randn(4096, 1024, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3072, 1024, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    attend = flash_varlen(SeqLayout.from_lengths([512] * 8, device=cuda))
    params = [torch.randn(1024, device=cuda) for _ in range(8)]
    prof = StepProfiler(first=1, steps=2, out_dir=tmp_path, device=cuda)
    for n in (1, 2):
        with prof.step(n):
            qkv = (x @ w.t()).view(4096, 3, 16, 64)
            out = F.layer_norm(attend(qkv, 0.1).reshape(4096, 1024), (1024,))
            out.float().square().mean().backward()
            torch._foreach_add_(params, params, alpha=0.5)
    s = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    kinds = {k["kind"]: k["ms_per_step"] for k in s["kinds"]}
    assert {"gemm", "attention", "layer norm", "optimizer / foreach"} <= set(kinds), s["top"]
    assert kinds["gemm"] > kinds.get("other", 0.0), s["top"]
    assert s["peak_memory_gib"] > 0 and 0 < s["busy_share"] <= 1.05
    assert s["reserved_memory_gib"] >= s["peak_memory_gib"]
    assert set(s["allocator"]) == {"num_device_alloc", "num_device_free", "num_alloc_retries"}
    assert all(n >= 0 for n in s["allocator"].values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_idle_time_is_found_between_the_kernels_and_the_hosts_wait_named(tmp_path):
    """On a GPU: each step reads a value back (`.item()`, the host waits) and then sleeps 3 ms before its next
    launch, so the device idles 3 ms a step between a GEMM and the next kernel, and the table names both."""
    cuda = torch.device("cuda")
    x = torch.randn(2048, 2048, device=cuda, dtype=torch.bfloat16)
    prof = StepProfiler(first=1, steps=3, out_dir=tmp_path, device=cuda)
    for n in (1, 2, 3):
        with prof.step(n):
            y = x @ x
            y.float().sum().item()
            time.sleep(0.003)
            torch.mul(y, 2)
    s = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    idle = s["idle"]
    assert idle["ms_per_step"] >= 2.5, idle
    longest = {c["length"]: c for c in idle["by_length"]}["1 ms and over"]
    assert longest["gaps_per_step"] >= 1, idle
    assert idle["stalls"] and idle["ms_per_step"] <= s["wall_ms_per_step"]
    assert any(name in s["host_waits"] for name in ("aten::_local_scalar_dense", "cudaStreamSynchronize",
                                                    "cudaMemcpy")), s["host_waits"]


def test_compile_activity_inside_the_window_is_reported(tmp_path, one_thread):
    """A compiled function with a graph break: the window of its first calls reports the graphs it compiled and
    the break's reason; a later window of the same shapes reports nothing compiled."""
    def f(x):
        x = torch.sin(x) * 2
        torch._dynamo.graph_break()
        return x + 1

    g = torch.compile(f, backend="aot_eager", dynamic=True)
    x = torch.randn(8)
    prof = StepProfiler(first=1, steps=2, out_dir=tmp_path / "first")
    for n in (1, 2):
        with prof.step(n):
            g(x)
    first = json.loads((tmp_path / "first" / "profile" / "rank0.json").read_text())["compile"]
    prof = StepProfiler(first=1, steps=2, out_dir=tmp_path / "later", announce=True)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        for n in (1, 2):
            with prof.step(n):
                g(x)
    later = json.loads((tmp_path / "later" / "profile" / "rank0.json").read_text())["compile"]
    assert first["in_window"]["stats"]["unique_graphs"] >= 2 and first["graph_breaks"] >= 1
    assert any("graph_break()" in reason for reason in first["graph_break_reasons"])
    assert later["in_window"] == {} and later["unique_graphs"] >= 2
    assert "compile in the window: nothing" in printed.getvalue()


def test_bench_model_profiles_each_variant(tmp_path, one_thread, capsys, monkeypatch):
    """bench/model.py --profile: one more step of each variant under the profiler, its kernel kinds in the JSON."""
    from script_modules import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = load_script("bench/model.py")
    out = tmp_path / "model.json"
    assert bench.main(["--config", "tiny", "--layers", "1", "--batch-size", "4", "--repeats", "1", "--candidates", "5",
                       "--variants", "padded", "unpadded/loop", "--profile", "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    for row in rows.values():
        kinds = {k["kind"] for k in row["profile"]["kinds"]}
        assert {"gemm", "optimizer / foreach"} <= kinds and row["profile"]["busy_ms_per_step"] > 0
    assert "unpadded/loop: " in capsys.readouterr().out


def test_graphs_left_out_of_cuda_graphs_are_reported():
    """Under reduce-overhead inductor may run a graph without CUDA graphs (a CPU tensor in it, a mutated input) and
    says so only in a log that is off by default: the report counts those skips, so a "graphs" run that never
    replayed one does not pass for a slow graphs run."""
    from bert.train.profile import compile_report, format_table

    after = {"stats": {"unique_graphs": 3}, "inductor": {"cudagraph_skips": 2}}
    report = compile_report(after, after)
    assert report["cudagraph_skips"] == 2 and report["in_window"] == {}
    summary = {"first": 1, "last": 2, "device": "cuda", "wall_ms_per_step": 1.0, "busy_ms_per_step": 1.0,
               "busy_share": 1.0, "kinds": [], "top": [], "compile": report}
    assert "3 graphs, 0 graph breaks, 2 left out of CUDA graphs" in format_table(summary)
    assert compile_report(None, {"stats": {"unique_graphs": 1}})["cudagraph_skips"] == 0
