"""An H100 that is not there: inductor compiles for it on a host with no GPU, so a compile that fails on the GPU fails
here first, without device time (bench/gpu_compile.py).

Needs torch's CUDA build (PyPI's, as `bash scripts/test_torch.sh 2.11.0` installs it) and its Triton: the CPU wheel
cannot make even a fake CUDA tensor. The model and optimizer are built under a `FakeTensorMode` on device "cuda"
(shapes, dtypes and strides, no memory), dynamo traces them as on the GPU, and inductor lowers, schedules (its GPU
scheduler: Triton kernels, not the CPU's C++), generates and compiles every Triton kernel to sm_90 code with the
ptxas Triton ships. What needs the device is answered here instead:

- device properties: an H100 SXM's (132 SMs, compute capability 9.0, 3.35 TB/s);
- Triton's driver: a target of cuda/90, kernels "loaded" as handles of 0, launches that do nothing;
- inductor's static launcher (its own, in place of Triton's) loads and launches nothing;
- the constant folding that runs a graph's constant parts while compiling (`constant_fold_uniform_value`: a tensor
  of one value becomes a constant) runs them on the CPU: the values are the same, and the folded graph the GPU's;
- the compiled wrapper's buffers are fake tensors, so a graph "runs": its outputs have the right metadata and the next
  graph (the next layer, the heads) compiles from them as on the GPU. Nothing is computed: a library kernel the
  wrapper calls into a buffer (a cuBLAS GEMM, a scaled GEMM) is not called.

Backward: autograd's engine runs a CUDA tensor's backward on a thread of that device, and it asks the CUDA runtime how
many devices there are (none here) and the driver whether the device has a context, even for fake tensors; AOT
autograd's trace of a training graph runs that engine. `native_env` builds two stand-ins with the C compiler, a
library preloaded over four functions of the CUDA runtime (one device, which is current, and its stream priorities)
and a `libcuda.so.1` that answers the context query, and gives the environment a child process needs to load them
(a process cannot preload a library into itself). Under them `install` also keeps torch from making real CUDA
tensors where it would when a device is present (the fake mode's lifting of constants, its context initialisation,
dynamo's saving of the CUDA RNG state, inductor's pattern tracing), and answers inductor's padding benchmark
(`pad_mm`, which times padded and unpadded GEMMs on real tensors) with "no padding". Without them a model compiles in
inference (no_grad) only, and an update takes gradients made as zeros of the parameters' shapes.

Triton kernels are compiled in inductor's compile workers, as on the GPU machines: in a process started with the
stand-ins, `install` starts the workers without them, with their folder on the workers' PYTHONPATH, whose
`sitecustomize` gives them the fake's Triton driver, and waits for them before anything compiles. In this process, under
dynamo's frames, Triton's recursive-descent parse of a deep kernel (the per-tensor LAMB update's cast of ~125 tensors,
an if-elif each) overflowed Python's recursion limit, even on a thread of its own with a raised limit and stack; the
workers, which never ran dynamo, compile it. Without the stand-ins kernels are compiled in the process (compile_threads
= 1). What this cannot see: a kernel's numerics, its speed, a launch the GPU refuses (shared memory or registers beyond
the chip's, which ptxas does not check against a launch), and autotuning, whose timings are all equal.

Dynamo treats the fake mode's tensors, made outside the compile, as a tensor subclass and inlines a Tensor method
written in Python (`Tensor.unflatten`), which stops at its `super()` call: a graph break the GPU does not have. So the
model calls `torch.unflatten`, and the fake traces the GPU's graphs.

A compile cache for a real GPU (bench/gpu_cache.py): torch keys a compiled graph on the graph, its inputs, inductor's
settings, torch's and Triton's code, CUDA's version and the device's name, and bundles the Triton kernels' sm_90
binaries with it; the fake answers with the name a real card reports (`GPUS`) and keeps inductor's settings as they
are on the GPU (`install(count=False)`), the C++ compiler's name among them (`DEVICE_CXX`). Its autotuning
results (all timings equal) are never written (`autotune_local_cache` off, not part of the key): the GPU tunes on
a kernel's first launch as it would anyway.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

SMS, CC = 132, (9, 0)
# the device name each card reports (torch.cuda.get_device_name, nvidia-smi), its memory and L2 (both Hopper, 132 SMs)
GPUS = {"h100": ("NVIDIA H100 80GB HBM3", 80 << 30, 50 << 20), "h200": ("NVIDIA H200", 141 << 30, 60 << 20)}
# The C++ compiler the device machines name in CXX (seen on the H200, 2026-11-27). Inductor keys every graph on its
# setting `cpp.cxx` (CXX, else "g++"), used or not: a GPU graph compiles no C++, yet the caches made here with "g++"
# missed there, every graph (bench/gpu_cache.py --diff found it). So the fake keys its graphs as that machine does.
DEVICE_CXX = "/opt/gcc/bin/g++"
PROPS = types.SimpleNamespace(name=GPUS["h100"][0], major=CC[0], minor=CC[1], multi_processor_count=SMS,
                              total_memory=GPUS["h100"][1], regs_per_multiprocessor=65536,
                              max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
                              L2_cache_size=GPUS["h100"][2], shared_memory_per_block_optin=232448)


# The CUDA runtime's answers autograd's engine needs for device 0 (preloaded: the runtime's own say "no device").
RUNTIME_SHIM = r"""
static int current = 0;
int cudaGetDeviceCount(int *count) { *count = 1; return 0; }
int cudaGetDevice(int *device) { *device = current; return 0; }
int cudaSetDevice(int device) { current = device; return 0; }
int cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return 0;
}
"""
# The driver's, looked up by name in libcuda.so.1 when torch asks whether device 0 has a primary context.
DRIVER_STUB = r"""
int cuInit(unsigned int flags) { return 0; }
int cuDevicePrimaryCtxGetState(int device, unsigned int *flags, int *active) { *flags = 0; *active = 1; return 0; }
int cuGetErrorString(int error, const char **text) { *text = "the fake H100's libcuda (bench/fake_h100.py)"; return 0; }
"""


# The `sitecustomize` of inductor's compile workers (`_start_workers` puts the stand-ins' folder on their PYTHONPATH):
# fresh processes, they compile Triton kernels for the active driver, which must be the fake's there too.
# Loaded from its file, not by putting bench/ on sys.path, where its scripts would shadow modules of the same name.
SITE = """import importlib.util
import os
import sys

if os.environ.get("FAKE_H100_BENCH"):
    spec = importlib.util.spec_from_file_location("fake_h100", os.path.join(os.environ["FAKE_H100_BENCH"],
                                                                            "fake_h100.py"))
    fake_h100 = sys.modules["fake_h100"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake_h100)
    fake_h100.activate_triton_driver()
"""
WORKERS = "FAKE_H100_WORKERS"  # set to the stand-ins' folder: install starts the compile workers without them
HERE = Path(__file__).resolve().parent


@dataclasses.dataclass
class Launches:
    """What the fake GPU was asked to run since `reset` (nothing runs): Triton kernels, with inductor's estimate of the
    bytes each reads and writes (its `kernel_num_gb`, from the sizes of the kernel's buffers), and library kernels the
    compiled wrappers call (cuBLAS GEMMs, scaled GEMMs) by name."""

    triton: int = 0
    unestimated: int = 0  # Triton launches without an estimate (inductor makes none for a foreach kernel)
    library: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # aten ops run outside Triton kernels and library calls: a compiled graph's fallbacks (flash attention, a
    # foreach norm) and eager code's ops, by name (views and allocations, which launch nothing, left out)
    aten: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    aten_gb: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    gb_by_kernel: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # summed over launches
    launches_by_kernel: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # launches whose estimate is under TINY_GB: a kernel's fixed cost (a launch, a wave that barely fills) is then
    # most of its time, a few microseconds each on the GPU, CUDA graphs or not
    tiny: int = 0
    # our custom ops (`bert::`: flash attention, the fused residual LayerNorm), by name, with the bytes of every tensor
    # each takes or makes: what its kernel reads and writes, which inductor's estimate does not see
    ours: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ours_gb: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # launches of row kernels (reductions over rows) storing a tensor transposed: `strided_row_stores`
    strided: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # launches of kernels storing one value at one index through two pointers: `duplicate_stores`
    duplicate: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # launches of kernels computing a power (`libdevice.pow`): LAMB's bias corrections, inlined by inductor into the
    # update's kernels, computed two float64 pows per element (bert.optim.bias_correction); the model computes none
    pow: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    in_triton: bool = False

    @property
    def triton_gb(self) -> float:
        return sum(self.gb_by_kernel.values())

    def reset(self) -> None:
        self.__init__()


TINY_GB = 1e-3  # 1 MB: at 3.35 TB/s 0.3 us of bytes, less than a launch costs
LAUNCHES = Launches()


@dataclasses.dataclass
class CudaGraphs:
    """What inductor's CUDA graph trees (COMPILE=reduce-overhead) would make of the compiled graphs, which the fake
    cannot capture: each compiled graph's post-compile (`compiled`: its kind, its partitions, the reasons inductor
    found not to capture it), every graph inductor hands to `cudagraphify` (`graphs`: one per partition, the ops
    that cannot be captured left between them), and every skip (`skips`: what torch logs through
    `log_cudagraph_skip_and_bump_counter`, and the partition path's reasons, which it drops without a word). The
    trees' check at a call, that a graph mutates only its static inputs (parameters and buffers in a forward, the
    saved tensors in a backward) or tensors that captured graphs made, is torch's own here
    (`cudagraph_utils.check_for_mutation`), a tensor counted as made by a captured graph when its storage is one of
    their outputs'."""

    compiled: list = dataclasses.field(default_factory=list)  # one dict per compiled graph's post-compile
    graphs: list = dataclasses.field(default_factory=list)  # one dict per graph handed to cudagraphify
    skips: list = dataclasses.field(default_factory=list)  # each skip's message, as torch logs it
    made: set = dataclasses.field(default_factory=set)  # storages of the captured graphs' outputs

    def post_compile(self, real, partitioned: bool):
        """output_code's cudagraph_post_compile or cudagraph_partition_post_compile, recording what it is given."""

        def post(example_inputs, compiled_graph, cudagraphs, *args):
            kwargs = compiled_graph.fx_kwargs
            reasons = list(compiled_graph.cudagraph_info.cudagraph_fail_reasons)
            maps = compiled_graph.partition_maps
            self.compiled.append({"kind": "inference" if kwargs["is_inference"] else
                                  "backward" if kwargs["is_backward"] else "forward", "fail_reasons": reasons,
                                  "partitions": len(maps or ()) if partitioned else None})
            if partitioned and reasons:  # said nowhere by torch: the graph runs without CUDA graphs
                self.skips.append(f"skipping cudagraphs due to {reasons}")
            return real(example_inputs, compiled_graph, cudagraphs, *args)

        return post

    def cudagraphify(self, model, static_input_idxs=(), *, is_backward: bool, is_inference: bool,
                     placeholders=(), mutated_input_idxs=(), **_):
        """compile_fx.cudagraphify's stand-in: the graph runs as compiled (on the fake's tensors), checked at each
        call as the trees check it."""
        from torch._inductor.cudagraph_utils import check_for_mutation

        graph = {"kind": "inference" if is_inference else "backward" if is_backward else "forward",
                 "inputs": len(placeholders), "static_inputs": len(static_input_idxs),
                 "mutated_inputs": len(mutated_input_idxs), "calls": 0, "eager": False}
        self.graphs.append(graph)
        func = types.SimpleNamespace(mutated_input_idxs=mutated_input_idxs, static_input_idxs=static_input_idxs,
                                     placeholders=placeholders)  # what the trees' check reads of their function

        def run(inputs):
            why = check_for_mutation(func, inputs, lambda t: _storage(t) in self.made)
            if why and not graph["eager"]:  # the trees warn once per graph, and run it eagerly
                graph["eager"] = True
                self.skips.append(why)
            graph["calls"] += 1
            given = {_storage(t) for t in inputs if torch.is_tensor(t)}
            out = model(inputs)
            if not graph["eager"]:  # the trees' memory: what a captured graph made, not an input it handed back
                self.made.update(_storage(t) for t in torch.utils._pytree.tree_leaves(out)
                                 if torch.is_tensor(t) and _storage(t) not in given)
            return out

        return run


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


CUDA_GRAPHS = CudaGraphs()
# a store whose index steps along a reduction's row axis (r0_<n>, the lanes' own) by a stride other than 1
_ROW_STRIDED = re.compile(r"tl\.store\(\w+ \+ \(([^)]*)\)")


def strided_row_stores(source: str) -> int:
    """The stores of an inductor Triton kernel, a persistent reduction along rows (the whole row in one block, r0
    the fastest axis, a block one or a few rows), whose index takes r0 times a stride (`x0 + ks0*r0_1`): the
    lanes write elements a row apart, in runs of as many bytes as the block has rows, a 32-byte sector per element
    where it is a byte (float8). Delayed float8's transposed copies fused into its casts' row kernels were such
    stores: three kernels, 40 ms of an H200's 184 ms step (bert.model.fp8_transpose). A looped reduction is not
    counted: in its column-sum form (a bias's gradient over the tokens) a block spans many columns, and Triton lays
    a store out along the axis its index is contiguous in, so runs are long."""
    if "r0_index = tl.arange(0, R0_BLOCK)[None, :]" not in source:
        return 0
    return sum(bool(re.search(r"\w\*r0_\d+\b", index)) for index in _ROW_STRIDED.findall(source))


_STORE = re.compile(r"tl\.store\((\w+) \+ \((.*?)\), (\w+)[,)]")
_COMBO_PART = re.compile(r"^    (?:if|elif) pid\b.*$|^    else:$", re.M)  # a combo kernel's branch on the program id


def duplicate_stores(source: str) -> int:
    """The stores of an inductor Triton kernel that write a value already stored at the same index through another
    pointer: two buffers of one tensor, a pass's bytes written twice. Delayed float8's casts wrote each float8 copy
    so, one buffer for the scaled GEMM and one for the transpose op, whose default layout constraint (exact strides)
    made inductor realize its input apart (bert.model.fp8_transpose: 8.5 GB of BERT-large's step). A combo kernel's
    parts (COMBO_KERNELS: one branch on the program id each) are counted apart: two parts may store alike, each
    through its own pointer, into tensors of their own."""
    return sum(n - 1 for part in _COMBO_PART.split(source)
               for n in collections.Counter((index, value) for _, index, value in _STORE.findall(part)).values())


def computes_pow(source: str) -> bool:
    """Whether an inductor Triton kernel raises to a power (`libdevice.pow`, which inductor emits for aten.pow of
    floats): LAMB's bias corrections inlined into the update's kernels did, per element (bert.optim.bias_correction)."""
    return "libdevice.pow(" in source


NOT_LAUNCHED = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::detach",
                "aten::lift_fresh", "aten::lift_fresh_copy", "aten::_local_scalar_dense", "aten::set_", "aten::resize_",
                "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
                "aten::is_same_size", "aten::_unsafe_view", "aten::promote_types"}


def native_env(where: Path) -> dict[str, str]:
    """Build the runtime shim and the driver stub under `where` (cc) and return the variables a child process needs to
    load them; with those set, `install` compiles backward graphs too. Built in a directory of their own and renamed
    into place whole, so a process building beside another never sees half a build."""
    built = Path(where) / hashlib.sha256((RUNTIME_SHIM + DRIVER_STUB + SITE).encode()).hexdigest()[:12]
    libraries = {"libcudart_shim.so": RUNTIME_SHIM, "libcuda.so.1": DRIVER_STUB}

    def complete() -> bool:
        return all((built / name).exists() for name in (*libraries, "sitecustomize.py"))

    if not complete():
        Path(where).mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(dir=where))
        for name, source in libraries.items():
            (fresh / f"{name}.c").write_text(source)
            subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(fresh / name), str(fresh / f"{name}.c")],
                           check=True, capture_output=True, text=True)
        (fresh / "sitecustomize.py").write_text(SITE)
        try:
            fresh.rename(built)
        except OSError:  # another process's build is in place already (or a broken one: removed, ours taken)
            if not complete():
                shutil.rmtree(built, ignore_errors=True)
                fresh.rename(built)
            else:
                shutil.rmtree(fresh, ignore_errors=True)
    return {"LD_PRELOAD": " ".join(filter(None, [str(built / "libcudart_shim.so"), os.environ.get("LD_PRELOAD")])),
            "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(built), os.environ.get("LD_LIBRARY_PATH")])),
            WORKERS: str(built), "FAKE_H100_BENCH": str(HERE)}


def stand_ins() -> dict[str, str]:
    """`native_env` in this user's folder of the temporary directory, built once for every child; {} without a C
    compiler (a backward then fails, saying so)."""
    return native_env(Path(tempfile.gettempdir()) / f"fake_h100-{os.getuid()}") if shutil.which("cc") else {}


def run_cold(argv: list[str], env: dict[str, str], timeout: int) -> dict:
    """`argv`, a script's child mode that prints `ROW <json>`, in a process of its own with an empty inductor cache
    (a cold compile, as on a bare device machine); given the stand-ins, `install` starts inductor's compile workers
    there: its last row, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as cold:
        child = {**env, "TORCHINDUCTOR_CACHE_DIR": cold, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=child, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"over --timeout {timeout} s"}
    found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if not found:
        return {"error": f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-3000:]}"}
    return json.loads(found[-1])


def backward_ready() -> bool:
    """Whether this process was started with `native_env`'s stand-ins (the runtime says one device)."""
    return torch.version.cuda is not None and torch._C._cuda_getDeviceCount() == 1


def usable() -> str | None:
    """None when this torch can compile for the fake GPU, else why not."""
    import importlib.util

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build (the CPU wheel cannot make CUDA tensors, even fake)"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def install(gpu: str = "h100", count: bool = True) -> torch._subclasses.fake_tensor.FakeTensorMode:
    """Patch torch and Triton as the module doc says; returns the fake mode to build and run the model under. `gpu`:
    which card of `GPUS` the fake says it is. `count`: each kernel's estimate of its bytes for LAUNCHES (inductor's
    `benchmark_kernel`, a setting in the compile cache's key: off for a cache a GPU is to read)."""
    PROPS.name, PROPS.total_memory, PROPS.L2_cache_size = GPUS[gpu]
    from torch._dynamo import device_interface
    from torch._inductor import compile_fx, scheduler, select_algorithm
    from torch._inductor.fx_passes import joint_graph
    from torch._inductor.runtime import benchmarking, hints, static_triton_launcher, triton_heuristics
    from torch._subclasses.fake_tensor import FakeTensorMode

    class CountingFakeTensorMode(FakeTensorMode):
        """Counts what it runs in LAUNCHES.aten: this mode's ops only, not those of a compile's own fake mode."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = func.name()
            if func.is_view or LAUNCHES.in_triton or name.split(".")[0] in NOT_LAUNCHED:
                return out
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if torch.is_tensor(t)]
            if name.startswith(("aten::", "prims::")):
                LAUNCHES.aten[name] += 1
                LAUNCHES.aten_gb[name] += sum(t.nbytes for t in tensors) / 1e9  # each tensor it takes or makes
            elif name.startswith("bert::"):
                LAUNCHES.ours[name] += 1
                LAUNCHES.ours_gb[name] += sum(t.nbytes for t in tensors) / 1e9
            return out

    mode = CountingFakeTensorMode(allow_non_fake_inputs=True)
    h100 = hints.DeviceProperties(type="cuda", index=0, multi_processor_count=SMS, cc=CC[0] * 10 + CC[1], major=CC[0],
                                  regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                                  max_threads_per_block=1024, warp_size=32)
    hints.DeviceProperties.create = classmethod(lambda cls, device: h100 if device.type == "cuda"
                                                else h100._replace(type=device.type))
    for name, value in {"get_device_properties": lambda *a, **k: PROPS,
                        "get_device_capability": lambda *a, **k: CC, "current_device": lambda: 0,
                        "device_count": lambda: 1, "set_device": lambda *a, **k: None,
                        "get_device_name": lambda *a, **k: PROPS.name, "synchronize": lambda *a, **k: None}.items():
        setattr(torch.cuda, name, value)
    device_interface.CudaInterface.get_device_properties = staticmethod(lambda *a, **k: PROPS)
    device_interface.CudaInterface.get_compute_capability = staticmethod(lambda *a, **k: CC[0] * 10 + CC[1])
    device_interface.CudaInterface.exchange_device = staticmethod(lambda device: 0)
    device_interface.CudaInterface.current_device = staticmethod(lambda: 0)
    device_interface.CudaInterface.get_raw_stream = staticmethod(lambda index: 0)
    device_interface.CudaInterface.maybe_exchange_device = staticmethod(lambda device: 0)
    torch.cuda._DeviceGuard.__enter__ = lambda self: None
    torch.cuda._DeviceGuard.__exit__ = lambda self, *exc: False
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    # the compiled wrapper allocates its buffers with this (bound when the wrapper module loads): fake ones
    def empty_strided_cuda(size, stride, dtype) -> torch.Tensor:
        with mode:
            return torch.empty_strided(size, stride, dtype=dtype, device="cuda")

    def reinterpret_tensor(tensor: torch.Tensor, size, stride, offset: int = 0) -> torch.Tensor:
        with mode:  # torch's own (C++) would view the fake tensor's meta storage: a meta tensor
            return torch.as_strided(tensor, size, stride, tensor.storage_offset() + offset)

    torch._C._dynamo.guards._empty_strided_cuda = empty_strided_cuda
    torch._C._dynamo.guards._reinterpret_tensor = reinterpret_tensor
    # the wrapper's calls of library kernels (cuBLAS GEMMs, scaled GEMMs) write into a buffer it made: nothing runs,
    # the buffer already has the output's metadata (and some `out=` overloads, _scaled_mm's, have no fake kernel)
    real_kernel = select_algorithm.KernelNamespace.__getattribute__

    def kernel(namespace, name: str):
        fn = real_kernel(namespace, name)
        if name.startswith("__") or not callable(fn):
            return fn

        def call(*args, out=None, **kwargs):
            LAUNCHES.library[name] += 1
            return out if out is not None else fn(*args, **kwargs)

        return call

    select_algorithm.KernelNamespace.__getattribute__ = kernel
    compile_fx._check_triton_bf16_support = lambda graph: None
    real_to = torch.nn.Module.to

    def to(module: torch.nn.Module, *args, **kwargs) -> torch.nn.Module:
        # a move to where every tensor already is changes nothing on the GPU; on fake tensors torch would swap each
        # parameter, which fails for the tied word embeddings (two modules hold one Parameter)
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        here = [t.device for t in (*module.parameters(), *module.buffers())]
        if dtype is None and device is not None and all(d.type == device.type and d.index == (device.index or 0)
                                                        for d in here):
            return module
        return real_to(module, *args, **kwargs)

    torch.nn.Module.to = to
    scheduler.has_triton = lambda: True
    real_fold = joint_graph.constant_fold_uniform_value  # looked up as the module's global by joint_graph_passes

    def fold_on_the_cpu(gm: torch.fx.GraphModule) -> None:  # the folder's __init__ makes tensors too (x * 0's zero)
        with _OnTheCpu():
            return real_fold(gm)

    joint_graph.constant_fold_uniform_value = fold_on_the_cpu
    if backward_ready():
        _quiet_device(torch)
    torch._inductor.config.autotune_local_cache = False  # the fake's timings are all equal: never keep a choice
    torch._inductor.config.cpp.cxx = (None, DEVICE_CXX)  # a part of every key, no compiler run by a GPU graph
    torch._inductor.config.benchmark_kernel = count  # each kernel's kernel_num_gb, for LAUNCHES

    def load_kernel(kernel, device: int) -> None:  # the static launcher's: a module and function of 0, as Triton's
        kernel.function, kernel.n_regs, kernel.n_spills = 0, 32, 0

    static_triton_launcher.StaticallyLaunchedCudaKernel.load_kernel = load_kernel
    static_triton_launcher.StaticallyLaunchedCudaKernel.run = lambda kernel, *args: None
    real_run = triton_heuristics.CachingAutotuner.run

    def run(autotuner, *args, stream, benchmark_run=False, **kwargs):
        if not benchmark_run:
            gb = autotuner.inductor_meta.get("kernel_num_gb")
            LAUNCHES.triton += 1
            source = getattr(autotuner.fn, "src", "")
            if strided_row_stores(source):
                LAUNCHES.strided[autotuner.fn.__name__] += 1
            if computes_pow(source):
                LAUNCHES.pow[autotuner.fn.__name__] += 1
            if duplicate_stores(source):
                LAUNCHES.duplicate[autotuner.fn.__name__] += 1
            LAUNCHES.unestimated += gb is None
            LAUNCHES.gb_by_kernel[autotuner.fn.__name__] += gb or 0.0
            LAUNCHES.launches_by_kernel[autotuner.fn.__name__] += 1
            LAUNCHES.tiny += gb is not None and gb < TINY_GB
        LAUNCHES.in_triton = True  # a first launch autotunes: its copies of the mutated arguments are not the step's
        try:
            return real_run(autotuner, *args, stream=stream, benchmark_run=benchmark_run, **kwargs)
        finally:
            LAUNCHES.in_triton = False

    triton_heuristics.CachingAutotuner.run = run
    # CUDA graphs (reduce-overhead): recorded, not captured (CudaGraphs)
    from torch._inductor import cudagraph_trees, cudagraph_utils, output_code

    real_skip = cudagraph_utils.log_cudagraph_skip_and_bump_counter

    def skip(msg: str) -> None:
        CUDA_GRAPHS.skips.append(msg)
        real_skip(msg)

    for module in (cudagraph_utils, compile_fx, output_code, cudagraph_trees):
        module.log_cudagraph_skip_and_bump_counter = skip
    compile_fx.cudagraphify = CUDA_GRAPHS.cudagraphify
    output_code.cudagraph_post_compile = CUDA_GRAPHS.post_compile(output_code.cudagraph_post_compile, False)
    output_code.cudagraph_partition_post_compile = CUDA_GRAPHS.post_compile(
        output_code.cudagraph_partition_post_compile, True)
    benchmarking.benchmarker.benchmark_gpu = lambda *a, **k: 1.0

    activate_triton_driver()
    if os.environ.get(WORKERS):
        _start_workers()
    else:  # a compile worker would not have these patches
        torch._inductor.config.compile_threads = 1
    return mode


def _start_workers() -> None:
    """Inductor's compile workers, started now and waited for: a kernel compiled before they are ready is compiled in
    this process, where a deep one overflows Python's recursion limit. They start without the stand-ins (a libcuda
    of three functions fails Triton's import there): this process loaded them at its start, and the dynamic loader
    reads LD_PRELOAD and LD_LIBRARY_PATH only then."""
    from torch._inductor.async_compile import AsyncCompile

    stand_in = os.environ[WORKERS]
    for name in ("LD_PRELOAD", "LD_LIBRARY_PATH"):
        kept = [p for p in os.environ.get(name, "").replace(" ", os.pathsep).split(os.pathsep)
                if p and not p.startswith(stand_in)]
        os.environ[name] = os.pathsep.join(kept)
    # inductor gives the workers this process's sys.path as their PYTHONPATH: last, its only module is `SITE`
    sys.path.append(stand_in)
    torch._inductor.config.compile_threads = 2
    AsyncCompile.use_process_pool()  # submits the pool's first job, which says when it is ready
    try:
        AsyncCompile.wait_pool_ready(timeout=300)
    except TimeoutError:
        raise RuntimeError("the fake H100's compile workers did not start in 300 s (their log: "
                           f"{torch._inductor.config.get_worker_log_path()})") from None


def activate_triton_driver() -> None:
    """Triton's driver for the fake: a target of cuda/90, kernels "loaded" as handles of 0, launches that do nothing.
    Run in the compile workers too (`SITE`), where Triton compiles a kernel for the active driver's target."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import ty_to_cpp
    from triton.runtime import driver as active_driver

    class Utils:
        def get_device_properties(self, device: int) -> dict:
            return {"max_shared_mem": PROPS.shared_memory_per_block_optin, "multiprocessor_count": SMS,
                    "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
                    "mem_bus_width": 5120}

        def load_binary(self, name, kernel, shared, device) -> tuple:
            return 0, 0, 32, 0, 1024  # module, function, registers, spills, threads: nothing is loaded

    class Launcher:
        def __init__(self, src, metadata) -> None:
            pass

        def __call__(self, *args, **kwargs) -> None:
            pass  # nothing runs: the outputs are fake tensors already

    class Driver:
        utils, launcher_cls = Utils(), Launcher
        is_active = staticmethod(lambda: True)
        get_current_target = staticmethod(lambda: GPUTarget("cuda", CC[0] * 10 + CC[1], 32))
        get_current_device = staticmethod(lambda: 0)
        set_current_device = staticmethod(lambda device: None)
        get_current_stream = staticmethod(lambda index=None: 0)
        get_device_capability = staticmethod(lambda device=None: CC)
        get_active_torch_device = staticmethod(lambda: torch.device("cuda", 0))
        get_device_interface = staticmethod(lambda: torch.cuda)
        map_python_to_cpp_type = staticmethod(ty_to_cpp)
        get_benchmarker = staticmethod(lambda: lambda *a, **k: [1.0, 1.0, 1.0])

    import triton.backends

    # inductor's kernels look the GPU driver up among Triton's backends, by class
    triton.backends.backends["nvidia"] = dataclasses.replace(triton.backends.backends["nvidia"], driver=Driver)
    active_driver.set_active(Driver())
    active_driver._default = active_driver._active


class _OnTheCpu(torch.overrides.TorchFunctionMode):
    """Tensors a call would make on the GPU are made on the CPU (the constant folding's: real tensors, not fake)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


def _quiet_device(torch) -> None:
    """With the stand-ins torch believes a device is there: keep it from making real CUDA tensors."""
    from torch._inductor.fx_passes import joint_graph, pad_mm
    from torch._subclasses import fake_tensor

    fake_tensor.init_gpu_context = lambda device: None  # an empty(1) on the device, for autograd's sake
    # torch.tensor(data, device="cuda") is made on the CPU and lifted, as the fake mode does on a host without one
    fake_tensor.FakeTensorMode.avoid_device_init = property(lambda self: True)
    torch.cuda._lazy_init = lambda: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)  # dynamo saves and restores it
    torch.cuda.set_rng_state = lambda state, device="cuda": None
    real_init = joint_graph.lazy_init

    def lazy_init(input_device=None) -> None:  # inductor traces its patterns on real tensors of the device it sees
        available = torch.cuda.is_available
        torch.cuda.is_available = lambda: False
        try:
            real_init(torch.device("cpu"))
        finally:
            torch.cuda.is_available = available

    joint_graph.lazy_init = lazy_init
    pad_mm.get_cached_should_pad = lambda key: False  # its benchmark runs real GEMMs: answered "no padding"
